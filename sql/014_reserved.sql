-- 014: reserved for another branch's migration, which replaces this file
-- when both are merged (the migrations must be numbered without gaps).
SELECT 1;
