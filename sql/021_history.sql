-- storyjobs schema, version 21: history that stays cheap to read.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- The ledger by time: a btree on started_at instead of the BRIN index of
-- migration 001. BRIN narrows a range to the pages whose rows' times fall in
-- it, which holds only while rows arrive in time order on new pages. Once the
-- table has free space in old pages (fillfactor 70, a VACUUM after the
-- prune, updates that move rows), new rows land there: 16,977 new rows spread
-- over 540 of 693 ranges, and "the last hour" read 69,045 of 88,591 pages. A
-- btree reads what the range holds, whatever page a row sits on; the insert
-- it costs is one entry on the rightmost leaf.
--
-- Built here with a lock that holds the ledger's writes while it builds (a
-- few seconds per million rows). On a large ledger build it first, without
-- that lock, and this migration then keeps it (docs/operations.md):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS llm_calls_started_at_idx ON llm_calls (started_at);
CREATE INDEX IF NOT EXISTS llm_calls_started_at_idx ON llm_calls (started_at);
DROP INDEX IF EXISTS llm_calls_started_at_brin;
