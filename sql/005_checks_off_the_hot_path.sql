-- storyjobs schema, version 5: the same rules, checked where a value is set
-- rather than on every update of a job or a ledger row.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.
--
-- Why: Postgres checks every CHECK constraint of a table on each row a
-- statement updates, and rebuilds each one from its stored text once per
-- statement and table; it does the same with a trigger's WHEN clause. The
-- worker's round statement updates story_jobs twice and writes llm_calls
-- twice, so the long value lists, the single-column checks and the budget
-- trigger's WHEN were parsed and compiled on every round, for columns the
-- round does not set: by an instruction count of the round (callgrind,
-- tests/bench/statement_cost.py), a sixth of the database's work per job. A domain's check runs only where a
-- value is assigned to the column, and Postgres sends a domain's values as
-- its base type, so clients see no change.
--
-- Each column first becomes a domain without a constraint (a relabelling:
-- no table rewrite), then the domain gets its constraint (one scan that
-- validates the rows already there), then the table's CHECK goes.

CREATE DOMAIN error_code AS text;
CREATE DOMAIN llm_outcome AS text;
-- money, as the ledger and the budgets count it
CREATE DOMAIN usd AS numeric(14, 6);
CREATE DOMAIN token_count AS integer;
CREATE DOMAIN max_tokens AS integer;

-- the trigger's WHEN names columns whose type changes: it is recreated below
DROP TRIGGER story_jobs_budget_settled ON story_jobs;

ALTER TABLE story_jobs
    DROP CONSTRAINT story_jobs_error_code_known,
    DROP CONSTRAINT story_jobs_max_tokens_check,
    DROP CONSTRAINT story_jobs_input_tokens_estimate_check,
    DROP CONSTRAINT story_jobs_reserved_usd_check,
    DROP CONSTRAINT story_jobs_charged_usd_check,
    ALTER COLUMN error_code TYPE error_code,
    ALTER COLUMN max_tokens TYPE max_tokens,
    ALTER COLUMN input_tokens_estimate TYPE token_count,
    ALTER COLUMN reserved_usd TYPE usd,
    ALTER COLUMN charged_usd TYPE usd;
ALTER TABLE llm_calls
    DROP CONSTRAINT llm_calls_outcome_known,
    ALTER COLUMN outcome TYPE llm_outcome;

-- The values mirror shared.status.ErrorCode and LlmOutcome
-- (tests/integration/test_schema.py keeps them in step). Adding a value
-- later: drop the constraint and add it again with the longer list.
ALTER DOMAIN error_code ADD CONSTRAINT error_code_known CHECK (VALUE IN (
    'interrupted', 'timed_out', 'queue_timeout', 'cancelled', 'llm_error', 'llm_rejected',
    'llm_unavailable', 'invalid_request', 'internal_error'));
ALTER DOMAIN llm_outcome ADD CONSTRAINT llm_outcome_known CHECK (VALUE IN (
    'started', 'succeeded', 'stopped', 'rate_limited', 'overloaded', 'connect_failed', 'not_sent',
    'rejected', 'failed', 'interrupted'));
ALTER DOMAIN usd ADD CONSTRAINT usd_not_negative CHECK (VALUE >= 0);
ALTER DOMAIN token_count ADD CONSTRAINT token_count_not_negative CHECK (VALUE >= 0);
ALTER DOMAIN max_tokens ADD CONSTRAINT max_tokens_positive CHECK (VALUE > 0);

-- The budget trigger fires only for jobs that hold a reservation (none
-- while no budget is configured); which of their updates settle is decided
-- in the function, where it costs nothing to the jobs without one.
CREATE OR REPLACE FUNCTION story_jobs_settle_budget() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- an end (pending or running -> completed or failed), or a later
    -- correction of an ended job's charge; nothing else settles
    IF NEW.status NOT IN ('completed', 'failed')
       OR (OLD.status IN ('completed', 'failed') AND OLD.charged_usd IS NOT DISTINCT FROM NEW.charged_usd) THEN
        RETURN NULL;
    END IF;
    -- the all-clients row first (the primary key's order), in every
    -- transaction, so that two settling transactions never wait on each
    -- other in opposite orders
    UPDATE budget_days
    SET reserved_usd = reserved_usd
            - CASE WHEN OLD.status IN ('pending', 'running') THEN NEW.reserved_usd ELSE 0 END,
        spent_usd = spent_usd + coalesce(NEW.charged_usd, NEW.reserved_usd)
            - CASE WHEN OLD.status IN ('pending', 'running') THEN 0
                   ELSE coalesce(OLD.charged_usd, OLD.reserved_usd) END
    WHERE client_id IN (0, NEW.client_id) AND day = (NEW.created_at AT TIME ZONE 'UTC')::date;
    RETURN NULL;
END
$$;

CREATE TRIGGER story_jobs_budget_settled
    AFTER UPDATE OF status, charged_usd ON story_jobs
    FOR EACH ROW
    WHEN (NEW.reserved_usd > 0)
    EXECUTE FUNCTION story_jobs_settle_budget();
