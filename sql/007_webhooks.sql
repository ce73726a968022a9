-- storyjobs schema, version 7: completion webhooks (Standard Webhooks), sent
-- from an outbox that every end of a job writes in its own statement.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- A client's receivers. The secret signs (HMAC-SHA256), so it is stored as
-- given, not hashed; after a rotation the previous one signs too until
-- previous_secret_expires_at, so a receiver can roll its configuration.
CREATE TABLE webhook_endpoints (
    id                          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    client_id                   bigint NOT NULL,
    url                         text NOT NULL CHECK (length(url) BETWEEN 1 AND 2000),
    -- job.completed, job.failed, job.cancelled (shared/webhooks.py EVENTS)
    events                      text[] NOT NULL CHECK (cardinality(events) >= 1),
    secret                      text NOT NULL,
    previous_secret             text,
    previous_secret_expires_at  timestamptz,
    created_at                  timestamptz NOT NULL DEFAULT now(),
    -- it answered 410 Gone: nothing more is written for it or sent to it
    disabled_at                 timestamptz,
    -- a delivery ran out of retries; the next success clears it
    failing_since               timestamptz
);
CREATE INDEX webhook_endpoints_client_idx ON webhook_endpoints (client_id);

-- The outbox: one row per event and endpoint, written by the trigger below in
-- the statement that ends the job, so there is no event without its
-- transition and no transition without its event. The row carries what the
-- body says, so that it can be sent after its job was pruned.
CREATE TABLE webhook_deliveries (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    endpoint_id       uuid NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    -- no foreign key, as for stories: deleted with the job by job_prune_finished
    job_id            bigint NOT NULL,
    job_public_id     uuid NOT NULL,
    job_status        job_status NOT NULL,
    error_code        text,
    story_id          uuid,
    occurred_at       timestamptz NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    -- pending (waiting, or in flight until next_attempt_at), delivered, dead
    state             text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts          smallint NOT NULL DEFAULT 0,
    -- when it is due; while an attempt is in flight, the end of its lease: a
    -- worker killed mid-delivery leaves it due again then
    next_attempt_at   timestamptz NOT NULL DEFAULT now(),
    last_attempt_at   timestamptz,
    last_status_code  smallint,
    last_error        text,
    delivered_at      timestamptz
)
-- each row is updated once per attempt: room on the page keeps that HOT when
-- it can be
WITH (fillfactor = 80);
-- the claim reads only the undelivered rows
CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (next_attempt_at, id) WHERE state = 'pending';
-- the prune, with the job
CREATE INDEX webhook_deliveries_job_idx ON webhook_deliveries (job_id);
-- an endpoint's last deliveries (console, CLI) and its deletion's cascade
CREATE INDEX webhook_deliveries_endpoint_idx ON webhook_deliveries (endpoint_id, id);

-- Every end of a job (worker's round, worker failure, client or operator
-- cancel, sweep) writes its events here, whatever statement ends it: a
-- trigger rather than a clause in each of those statements, so no path that
-- ends a job can forget it. For a client without endpoints it costs an index
-- probe that finds nothing, and claims return at the first test
-- (tests/bench/statement_cost.py measures it).
CREATE FUNCTION story_jobs_webhook_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status NOT IN ('completed', 'failed') OR OLD.status NOT IN ('pending', 'running') THEN
        RETURN NULL;
    END IF;
    INSERT INTO webhook_deliveries (endpoint_id, job_id, job_public_id, job_status, error_code, story_id,
                                    occurred_at)
    SELECT e.id, NEW.id, NEW.public_id, NEW.status, NEW.error_code, NEW.story_id, NEW.completed_at
    FROM webhook_endpoints e
    WHERE e.client_id = NEW.client_id AND e.disabled_at IS NULL
      AND (CASE WHEN NEW.status = 'completed' THEN 'job.completed'
                WHEN NEW.error_code = 'cancelled' THEN 'job.cancelled'
                ELSE 'job.failed' END) = ANY (e.events);
    RETURN NULL;
END
$$;

CREATE TRIGGER story_jobs_webhook_outbox
    AFTER UPDATE OF status ON story_jobs
    FOR EACH ROW
    EXECUTE FUNCTION story_jobs_webhook_outbox();
