-- storyjobs schema, version 24: the overview's day read from the rollup.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.
--
-- Why: the console's overview, its writers and `storyjobs stats` counted the
-- last day from the jobs and the ledger at every look, so each look cost
-- what a day's volume is (35-140 ms at 33,000 jobs a day, ten times that at
-- 330,000). The sweeper already recounts every minute into minute_rollup;
-- with the columns below the overview sums the day's minutes up to the
-- sweeper's last pass (at most 1,440 rows) and reads the jobs and the ledger
-- only for what the rollup cannot hold yet (console.sql, ops_overview).
--
-- Rows written before this version hold zeros here, and so would the day
-- the overview sums: until a pass has written the newest row with
-- jobs_from_id, the overview reads the whole day as before, and the first
-- pass that finds the newest row without it recounts the last 25 hours
-- (sweeper.sql, rollup_last_minute).

ALTER TABLE minute_rollup
    -- jobs that failed in the minute after a billed call (a story paid for
    -- and not delivered), and what those calls are charged
    ADD COLUMN undelivered         integer NOT NULL DEFAULT 0,
    ADD COLUMN undelivered_usd     numeric(14, 6) NOT NULL DEFAULT 0,
    -- the ledger's requests started in the minute whose job had ended before
    -- the minute of the pass that counted them (or is gone): such a row no
    -- longer changes. The requests of live jobs, and of jobs that ended
    -- since, are the overview's to read from the ledger itself. Counted as
    -- ops_overview counts them: billed requests (an open one is billed until
    -- it ends otherwise), the charge of the ended ones, billed tokens, 429s
    -- and 529s.
    ADD COLUMN ended_billed_calls  integer NOT NULL DEFAULT 0,
    ADD COLUMN ended_spend_usd     numeric(14, 6) NOT NULL DEFAULT 0,
    ADD COLUMN ended_input_tokens  bigint NOT NULL DEFAULT 0,
    ADD COLUMN ended_output_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN ended_rate_limited  integer NOT NULL DEFAULT 0,
    ADD COLUMN ended_overloaded    integer NOT NULL DEFAULT 0,
    -- the writers (the ledger's provider) of the requests started in the minute
    ADD COLUMN providers           text[] NOT NULL DEFAULT '{}',
    -- in the current minute's row: an id at or below every job that can end
    -- after the pass (job_id_bounds for the oldest creation time of a job
    -- that can still end; the least of the minute's passes), NULL in a row
    -- written before this version. The overview reads the jobs from there,
    -- not from a day back.
    ADD COLUMN jobs_from_id        bigint;

-- The batch lane's finished jobs by when they finished. The rollup and the
-- overview find the jobs that finished in a window on the primary key from
-- the first id a job created the longest an interactive job lives before it
-- can have; a batch job waits for a batch and then for its results, for
-- days at most, so those ids miss it. Only batch jobs are in it, each once
-- it has finished: the interactive lane's writes never touch it. Built here
-- with a lock that holds the jobs' writes while it builds; on a large table
-- build it first (docs/operations.md):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS story_jobs_batch_finished_idx ON story_jobs (completed_at)
--       WHERE lane = 'batch' AND completed_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS story_jobs_batch_finished_idx ON story_jobs (completed_at)
    WHERE lane = 'batch' AND completed_at IS NOT NULL;


-- The console overview's last day and hour (whole minutes: from the start of the
-- minute a day, an hour, before now's), and the minute from which it reads
-- the jobs and the ledger themselves (read_from): the rollup's newest
-- minute, the sweeper's last pass, when that pass wrote jobs_from_id
-- (this migration) within the day; else the day's start, and jobs_from_id
-- NULL. On the rollup's primary key, one entry.
-- (ops_overview and ops_writers_recent read it.)
CREATE VIEW ops_day_pass AS
SELECT date_trunc('minute', now()) - interval '1 day' AS day_from,
       date_trunc('minute', now()) - interval '1 hour' AS hour_from,
       CASE WHEN r.jobs_from_id IS NOT NULL AND r.minute > date_trunc('minute', now()) - interval '1 day'
            THEN r.minute ELSE date_trunc('minute', now()) - interval '1 day' END AS read_from,
       CASE WHEN r.minute > date_trunc('minute', now()) - interval '1 day' THEN r.jobs_from_id END
           AS jobs_from_id
FROM (SELECT NULL) one
LEFT JOIN LATERAL (SELECT minute, jobs_from_id FROM minute_rollup ORDER BY minute DESC LIMIT 1) r ON true;
