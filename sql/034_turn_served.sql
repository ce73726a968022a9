-- storyjobs schema, version 34: the turn being served, read in one place.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.
--
-- Admission gives turns from the turn being served now (job_insert_if_admitted's
-- serving), and the sweeper raises the claim's floor to it
-- (job_claim_floor_advance). Both wrote the same read, and a floor raised past
-- what admission gives from would leave jobs below the floor, which no claim
-- walks to (migration 030): one view, which each statement's plan takes in as
-- its own subquery, keeps the two one read.
--
-- The smallest pending interactive turn, walked from the claim's floor on
-- the claim's index; with none pending, where the last turn given ends
-- (job_admission's client 0, which never moves back); NULL before any turn
-- was given.
CREATE VIEW job_turn_served AS
SELECT coalesce((SELECT j.turn FROM story_jobs j
                 WHERE j.status = 'pending' AND j.lane = 'interactive'
                   AND j.turn >= (SELECT f.turn FROM job_claim_floor f)
                 ORDER BY j.turn, j.id LIMIT 1),
                (SELECT a.last_turn FROM job_admission a WHERE a.client_id = 0)) AS turn;
