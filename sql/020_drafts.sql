-- 020: the story as it is written. While a job runs, its worker appends the
-- text streamed so far to story_draft_chunks, at most once per
-- DRAFT_INTERVAL_S for all the jobs it holds (sql/worker.sql,
-- draft_append); the poll reads it (sql/api.sql, job_get_for_key); the
-- job's end deletes it (jobs_end, migration 019). docs/architecture.md,
-- "Drafts", says why it is built so.
--
-- UNLOGGED on purpose: a draft is a view of text the worker holds in memory
-- and the final story is stored in `stories` (logged) as before. An
-- unlogged table writes no WAL, so the drafts of every running job, every
-- second, cost no WAL volume, no replication traffic and no archive; what
-- that gives up: after a crash of Postgres the table is emptied (a worker
-- notices, the next write's answer says the draft is shorter than it sent,
-- and it sends the whole text again), and a replica has none (the poll reads
-- the primary, as it does for everything else).
--
-- Chunks appended, not one row rewritten: a long story (16 kB and more) is
-- not copied again every second; a chunk is the text of one interval. Its
-- key, (job_id, from_char), makes an append idempotent: sent again after
-- its answer was lost, it conflicts and changes nothing. `from_char` and
-- `chars` count Unicode code points, as the poll's `chars` and `?since=N` do.
--
-- No foreign key to story_jobs: a draft is written only while its job runs
-- under the writer (the write holds the job's row FOR SHARE, so an end
-- either waits for it and deletes what it wrote, or comes first and the
-- write finds the job ended), and deleted in the statement that ends the
-- job; a key would add a check to every append and to every job deleted.
CREATE UNLOGGED TABLE story_draft_chunks (
    job_id     bigint NOT NULL,
    from_char  integer NOT NULL CHECK (from_char >= 0),
    chars      integer NOT NULL CHECK (chars > 0),
    text       text NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, from_char)
);
