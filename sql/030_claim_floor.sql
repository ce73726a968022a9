-- storyjobs schema, version 30: where the claim's walk starts, so that a
-- snapshot held open does not make every claim slower than the last.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.
--
-- The claim takes pending jobs in turn order from story_jobs_turn_idx, and a
-- claimed job leaves its entry there, dead, until VACUUM or a later scan
-- removes it. While any snapshot older than the claim is open (a long
-- report, an idle transaction, a replica's feedback), neither can: each
-- claim, each admission's turn and each poll's queue position walked every
-- entry claimed since, a heap page a few of them. With one snapshot held
-- 90 s, a claim read 1,700 pages at its end, against 70-100 before.
--
-- The floor is a turn no pending interactive job is below, so a walk may
-- start there. The sweeper raises it each pass to the smallest pending
-- turn, under the admission lock (sweeper.sql, job_claim_floor_advance);
-- nothing else writes it, so the row has one version a pass, however many
-- claims and admissions there are. It stays a floor because no turn given
-- or moved after it is below it:
--   * an admission gives turns from the smallest pending turn, or with none
--     pending from where the last turn given ends (job_admission's client 0,
--     which never moves back), and the advance holds the admission lock, so
--     it sees every admission that came before it;
--   * a claim that rolls back returns a job its snapshot saw pending;
--   * a cancelled job's turn given back moves its client's later jobs down
--     to that job's turn at most, and that job was pending.
-- A walk that starts at an old floor is still right, only longer.
CREATE TABLE job_claim_floor (
    one  boolean PRIMARY KEY DEFAULT true CHECK (one),
    turn double precision NOT NULL
);

-- Turns below any given so far: the first advance raises it.
INSERT INTO job_claim_floor (turn) VALUES ('-Infinity');

-- A walk from the floor skips a NULL turn (`turn >= floor` is never true for
-- one), so a pending interactive job always has one: admission gives it,
-- and migration 009 numbered those before. Should one have none, it is
-- given where the last turn ends, read through the claim's index. NOT VALID:
-- the table is not read here; every write from now on is checked.
UPDATE story_jobs SET turn = coalesce((SELECT last_turn FROM job_admission WHERE client_id = 0), 0)
WHERE status = 'pending' AND lane = 'interactive' AND turn IS NULL;

ALTER TABLE story_jobs ADD CONSTRAINT story_jobs_pending_has_turn
    CHECK (status <> 'pending' OR lane <> 'interactive' OR turn IS NOT NULL) NOT VALID;
