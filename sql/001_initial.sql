-- storyjobs schema, version 1.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

CREATE TYPE job_status AS ENUM ('pending', 'running', 'completed', 'failed');
COMMENT ON TYPE job_status IS
    'pending: accepted, waiting for a worker. '
    'running: claimed by one worker, whose LLM call may have started. '
    'completed: the story is stored (terminal). '
    'failed: error_code says why (terminal; never re-run).';

-- One customer of the API. Keys belong to a client so that a key can be
-- rotated (create a new one, revoke the old) without losing the client's jobs.
CREATE TABLE api_clients (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        text NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 100),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- API keys are stored as SHA-256 hashes: they are long random secrets, so a
-- slow password hash would add nothing. key_prefix is not secret: it finds the
-- row and names the key in logs and `storyjobs keys list`.
CREATE TABLE api_keys (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    client_id   bigint NOT NULL REFERENCES api_clients (id),
    key_prefix  text NOT NULL UNIQUE,
    key_hash    bytea NOT NULL CHECK (length(key_hash) = 32),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

CREATE TABLE story_jobs (
    id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    public_id            uuid NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    -- no foreign key: it would cost every admission a lookup and a row lock
    -- on the client; client_id comes from the key that authenticated the
    -- request, and clients are never deleted
    client_id            bigint NOT NULL,
    idempotency_key      text NOT NULL,
    request_fingerprint  bytea NOT NULL,
    request              jsonb NOT NULL,
    status               job_status NOT NULL DEFAULT 'pending',
    error_code           text,
    error_text           text,
    story_id             uuid,
    worker_id            text,
    progress             integer NOT NULL DEFAULT 0,
    created_at           timestamptz NOT NULL DEFAULT now(),
    started_at           timestamptz,
    heartbeat_at         timestamptz,
    -- when the job reached a terminal state, completed or failed
    completed_at         timestamptz,
    CONSTRAINT story_jobs_terminal_has_completed_at
        CHECK ((status IN ('completed', 'failed')) = (completed_at IS NOT NULL)),
    CONSTRAINT story_jobs_failed_has_error_code
        CHECK ((status = 'failed') = (error_code IS NOT NULL)),
    CONSTRAINT story_jobs_completed_has_story
        CHECK (status <> 'completed' OR story_id IS NOT NULL),
    CONSTRAINT story_jobs_claimed_has_worker
        CHECK (status <> 'running' OR (worker_id IS NOT NULL AND started_at IS NOT NULL))
)
-- Heartbeats rewrite the row every few seconds: free space on each page lets
-- them be HOT updates that touch no index. A queue table churns: analyze and
-- vacuum it after a fixed number of changes rather than a fraction of a table
-- that grows with history, so plans and the live-jobs index stay fresh.
WITH (
    fillfactor = 70,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 1000,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 5000
);

-- The one index on live jobs: its size follows the queue, not history. It
-- serves the claim (status = 'pending' ORDER BY created_at, id), the queue
-- position, the admission count and the sweeper (status = 'running'; pending
-- by created_at). Every status change rewrites an entry in every index of this
-- table, so there is deliberately no second partial index.
--
-- The claim orders by (created_at, id) rather than id alone so that the
-- primary key can never serve it: with statistics taken when every row was
-- pending (in the middle of a drain, say) the planner would otherwise walk the
-- primary key from the oldest row, skipping every finished job at each claim.
CREATE INDEX story_jobs_active_idx ON story_jobs (status, created_at, id)
    WHERE status IN ('pending', 'running');

-- UNIQUE (client_id, idempotency_key) of story_jobs, kept in a table of its
-- own: every status change of a job rewrites an entry in every index of
-- story_jobs, and this wide one is only needed when a job is created. Only
-- the api inserts here, under the admission lock, after looking the key up;
-- the primary key is the backstop that makes a second job for one key an
-- error, never a second bill.
CREATE TABLE job_idempotency_keys (
    client_id        bigint NOT NULL,
    idempotency_key  text NOT NULL,
    job_id           bigint NOT NULL,
    PRIMARY KEY (client_id, idempotency_key)
);

-- For each queue (client_id 0: all clients), a number never below its count
-- of pending jobs, so that admissions need not count the queue each time;
-- written only by job_insert_if_admitted, under the admission lock.
CREATE TABLE job_admission (
    client_id        bigint PRIMARY KEY,
    pending_at_most  integer NOT NULL CHECK (pending_at_most >= 0)
)
WITH (fillfactor = 50);

CREATE TABLE stories (
    id              uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    -- a story whose job lost a race to the sweeper is kept (it was paid for),
    -- but its job stays failed: see "story orphaned" in the worker
    -- no foreign key: its check would cost every completion a lookup and a
    -- row lock; the only writer (job_settle_and_claim) reads the job it
    -- completes, and pruning deletes a job's story with it
    job_id          bigint NOT NULL UNIQUE,
    client_id       bigint NOT NULL,
    title           text NOT NULL,
    body            text NOT NULL,
    model           text NOT NULL,
    prompt_version  text NOT NULL,
    input_tokens    integer NOT NULL,
    output_tokens   integer NOT NULL,
    cost_usd        numeric(14, 6) NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- The billing ledger: one row per request sent to the provider, written
-- before the request leaves and completed when it ends. It deliberately has no
-- foreign key to story_jobs, so that pruning old jobs keeps the money trail.
CREATE TABLE llm_calls (
    job_id         bigint NOT NULL,
    attempt        smallint NOT NULL CHECK (attempt >= 1),
    worker_id      text NOT NULL,
    provider       text NOT NULL,
    model          text NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    -- started (in flight, or its worker died), succeeded, stopped (we closed
    -- the stream), or the error class; see shared/status.py LlmOutcome
    outcome        text NOT NULL DEFAULT 'started',
    -- false only when the provider certainly did not bill (429, 529, refused)
    billed         boolean NOT NULL DEFAULT true,
    input_tokens   integer NOT NULL DEFAULT 0,
    output_tokens  integer NOT NULL DEFAULT 0,
    cost_usd       numeric(14, 6) NOT NULL DEFAULT 0,
    request_id     text,
    error_text     text,
    PRIMARY KEY (job_id, attempt)
)
-- each row is written before its request and updated once after it: room on
-- the page makes that update HOT
WITH (fillfactor = 70);

-- `storyjobs stats` reads the last hour of the ledger. Rows arrive in time
-- order, so a BRIN index is enough, and it costs inserts next to nothing.
CREATE INDEX llm_calls_started_at_brin ON llm_calls USING brin (started_at);
