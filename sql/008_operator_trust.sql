-- storyjobs schema, version 8: budget rows locked in one order whatever the
-- plan; what a job's reservation assumed, carried by the job; a record of
-- what operators did.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- What a job's reservation assumed, fixed when it is accepted: the model and
-- its prices (USD per million input and output tokens), beside max_tokens
-- (migration 004). The worker runs the job with exactly these, whatever its
-- own LLM_MODEL, LLM_PRICES and LLM_MAX_TOKENS say, so a rolling deploy
-- that changes them cannot run a job on terms it was not reserved for.
-- NULL for jobs accepted before this version (the worker's own then apply).
ALTER TABLE story_jobs
    ADD COLUMN model text,
    ADD COLUMN input_usd_per_mtok numeric,
    ADD COLUMN output_usd_per_mtok numeric;

-- What the charges of the day's jobs passed their reservations by: only the
-- provider's reported usage can (more input tokens than admission's bound);
-- the sweeper exports it as storyjobs_budget_over_reservation_usd_total.
ALTER TABLE budget_days ADD COLUMN over_reservation_usd numeric(14, 6) NOT NULL DEFAULT 0;

-- A job's end settles its reservation on the day's all-clients row, then on
-- its client's row, in two statements of one row each. One statement naming
-- both rows (`client_id IN (0, x)`, migrations 004-005) locked them in the
-- order its plan visited them: once ANALYZE makes budget_days a sequential
-- scan, that is page order, and after a HOT update the all-clients row sits
-- after the client's, while an admission locks the all-clients row first
-- (job_insert_if_admitted): the two deadlocked. Every transaction that
-- touches budget rows now takes the all-clients row first, so they queue on
-- it instead (tests/integration/test_budget_lock_order.py).
CREATE OR REPLACE FUNCTION story_jobs_settle_budget() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    budget_day date := (NEW.created_at AT TIME ZONE 'UTC')::date;
    charged numeric := coalesce(NEW.charged_usd, NEW.reserved_usd);
    charged_before numeric := CASE WHEN OLD.status IN ('pending', 'running') THEN 0
                                   ELSE coalesce(OLD.charged_usd, OLD.reserved_usd) END;
    reserved_back numeric := CASE WHEN OLD.status IN ('pending', 'running') THEN NEW.reserved_usd ELSE 0 END;
    over numeric;
BEGIN
    -- an end (pending or running -> completed or failed), or a later
    -- correction of an ended job's charge; nothing else settles
    IF NEW.status NOT IN ('completed', 'failed')
       OR (OLD.status IN ('completed', 'failed') AND OLD.charged_usd IS NOT DISTINCT FROM NEW.charged_usd) THEN
        RETURN NULL;
    END IF;
    -- spent counts what the job really cost; what that passes its
    -- reservation by is counted apart, for the alert
    over := greatest(charged - NEW.reserved_usd, 0) - greatest(charged_before - NEW.reserved_usd, 0);
    UPDATE budget_days
    SET reserved_usd = reserved_usd - reserved_back, spent_usd = spent_usd + charged - charged_before,
        over_reservation_usd = over_reservation_usd + over
    WHERE client_id = 0 AND day = budget_day;
    UPDATE budget_days
    SET reserved_usd = reserved_usd - reserved_back, spent_usd = spent_usd + charged - charged_before,
        over_reservation_usd = over_reservation_usd + over
    WHERE client_id = NEW.client_id AND day = budget_day;
    RETURN NULL;
END
$$;

-- What operators did from the console (/ops/): one row per action, written
-- in the action's own transaction, so the database says who cancelled a job
-- or revoked a key, and what the action matched and touched.
CREATE TABLE operator_actions (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- whose key did it (operator_keys keeps revoked keys: the name stays)
    operator_key_id  bigint NOT NULL REFERENCES operator_keys (id),
    action           text NOT NULL CHECK (action IN ('job_cancel', 'pending_cancel', 'client_keys_revoke',
                                                     'key_revoke')),
    -- the job of a job_cancel
    job_id           uuid,
    -- what the other actions matched, as the request gave it: the
    -- cancel-by-filter's client_id, created_after, created_before and through;
    -- a revocation's client_id or key_prefix
    filter           jsonb,
    -- how many jobs or keys it changed (0: it found nothing left to change)
    touched          integer NOT NULL CHECK (touched >= 0),
    acted_at         timestamptz NOT NULL DEFAULT now()
);
