-- storyjobs schema, version 14: the batch lane, half the price through the
-- provider's message batches. Applied by `storyjobs migrate` inside one
-- transaction; see shared/migrate.py and docs/batches.md.
--
-- A batch job is a story_jobs row like any: pending until it is put into a
-- batch, then running, owned by that batch (batch_id, never a worker id:
-- the submitter's lease passes between workers), then completed or failed.
-- It is put into a batch by the batch's intent (a message_batches row
-- committed before the create call), since from then on the provider may
-- bill it: a job that may be billed never looks pending.

-- The lane, once in SQL and once in Python (shared.status.Lane).
CREATE TYPE job_lane AS ENUM ('interactive', 'batch');
ALTER TABLE story_jobs
    -- a new column with a constant default: no table rewrite
    ADD COLUMN lane job_lane NOT NULL DEFAULT 'interactive',
    -- the batch that owns a running batch job (its last, for a job waiting
    -- for the next attempt); every transition of the job is guarded by it
    ADD COLUMN batch_id bigint,
    -- set while a batch job waits to be put into a batch: pending since it
    -- was admitted, or running since an attempt that billed nothing
    ADD COLUMN batch_ready_at timestamptz;

-- The interactive claim's index leaves the batch lane out: the claim, the
-- queue position, the turn being served and the interactive queue's counts
-- never read a batch job. Rebuilt here under this migration's lock; it
-- holds the pending jobs only.
DROP INDEX story_jobs_turn_idx;
CREATE INDEX story_jobs_turn_idx ON story_jobs (turn, id) WHERE status = 'pending' AND lane = 'interactive';

-- The jobs waiting for a batch, oldest first: what a collection takes.
CREATE INDEX story_jobs_batch_ready_idx ON story_jobs (batch_ready_at, id) WHERE batch_ready_at IS NOT NULL;

-- The batch queue's bounds (BATCH_QUEUE_MAX, CLIENT_BATCH_QUEUE_MAX) count
-- the live batch jobs, of all clients or of one.
CREATE INDEX story_jobs_batch_live_idx ON story_jobs (client_id)
    WHERE lane = 'batch' AND status IN ('pending', 'running');

-- One row per batch we made or found at the provider.
--   intent   committed before the create call; the provider's id not known
--   sent     the provider's id known (from the create's answer, or adopted
--            by reconciliation after a lost answer): in flight
--   ended    its results read, every item of it ingested
--   refused  the create was refused before anything was made: nothing billed
--   lost     no batch of it found within BATCH_RECONCILE_GRACE_S: its jobs
--            failed as calls of unknown outcome
--   stray    a batch of the workspace we did not know, found while a lost
--            one may still exist: cancelled, its results charged by custom_id
CREATE TABLE message_batches (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    state             text NOT NULL DEFAULT 'intent'
                      CHECK (state IN ('intent', 'sent', 'ended', 'refused', 'lost', 'stray')),
    provider_batch_id text UNIQUE,
    model             text NOT NULL,
    request_count     integer NOT NULL CHECK (request_count >= 0),
    -- the intent's commit, by the database's clock: the batch, if it was
    -- created, was created after it
    fence_at          timestamptz NOT NULL DEFAULT now(),
    created_at        timestamptz NOT NULL DEFAULT now(),
    -- who made the intent (the lease holder), for the console
    holder            text,
    sent_at           timestamptz,
    expires_at        timestamptz,
    ended_at          timestamptz,
    results_read_at   timestamptz,
    -- what the provider last said: processing_status and request_counts
    processing_status text,
    request_counts    jsonb,
    cancel_asked_at   timestamptz,
    -- a stray batch: the lost one it may be
    lost_batch_id     bigint REFERENCES message_batches (id),
    CHECK ((state IN ('intent', 'refused', 'lost')) OR provider_batch_id IS NOT NULL)
);
CREATE INDEX message_batches_live_idx ON message_batches (id) WHERE state IN ('intent', 'sent', 'stray', 'lost');

-- Each request of a batch: which job's which attempt, under which custom_id,
-- and, once ingested, how it ended. Ingesting an item is guarded by
-- result IS NULL: a results stream read twice changes nothing.
CREATE TABLE message_batch_items (
    batch_id  bigint NOT NULL REFERENCES message_batches (id),
    custom_id text NOT NULL CHECK (custom_id ~ '^[a-zA-Z0-9_-]{1,64}$'),
    job_id    bigint NOT NULL,
    attempt   smallint NOT NULL,
    -- how its request ended; unknown: its result could not be read (a line
    -- the provider sent that names no request, or none at all): it may
    -- have billed, and is charged its worst case
    result    text CHECK (result IN ('succeeded', 'errored', 'expired', 'canceled', 'unknown')),
    read_at   timestamptz,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE INDEX message_batch_items_job_idx ON message_batch_items (job_id);

-- The submitter's lease: one holder at a time creates batches, reconciles
-- and collects. A new token each time it changes hands, so that a holder
-- that lost it cannot renew it.
CREATE TABLE batch_leases (
    name   text PRIMARY KEY,
    holder text,
    until  timestamptz NOT NULL DEFAULT '-infinity',
    token  bigint NOT NULL DEFAULT 0
);
INSERT INTO batch_leases (name) VALUES ('submitter');

-- A batch attempt's ledger row names its batch.
ALTER TABLE llm_calls ADD COLUMN batch_id bigint;

-- A batch's request that expired, was canceled or errored (other than a
-- refusal of the request) billed nothing.
ALTER DOMAIN llm_outcome DROP CONSTRAINT llm_outcome_known;
ALTER DOMAIN llm_outcome ADD CONSTRAINT llm_outcome_known CHECK (VALUE IN (
    'started', 'succeeded', 'stopped', 'rate_limited', 'overloaded', 'connect_failed', 'not_sent',
    'rejected', 'failed', 'interrupted', 'expired', 'canceled', 'errored'));
