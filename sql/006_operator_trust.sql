-- storyjobs schema, version 6: budget rows locked in one order whatever the
-- plan; what a job's reservation assumed, carried by the job; a record of
-- what operators did.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

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
    reserved_back numeric;
    spent_more numeric;
BEGIN
    -- an end (pending or running -> completed or failed), or a later
    -- correction of an ended job's charge; nothing else settles
    IF NEW.status NOT IN ('completed', 'failed')
       OR (OLD.status IN ('completed', 'failed') AND OLD.charged_usd IS NOT DISTINCT FROM NEW.charged_usd) THEN
        RETURN NULL;
    END IF;
    reserved_back := CASE WHEN OLD.status IN ('pending', 'running') THEN NEW.reserved_usd ELSE 0 END;
    spent_more := coalesce(NEW.charged_usd, NEW.reserved_usd)
        - CASE WHEN OLD.status IN ('pending', 'running') THEN 0
               ELSE coalesce(OLD.charged_usd, OLD.reserved_usd) END;
    UPDATE budget_days
    SET reserved_usd = reserved_usd - reserved_back, spent_usd = spent_usd + spent_more
    WHERE client_id = 0 AND day = budget_day;
    UPDATE budget_days
    SET reserved_usd = reserved_usd - reserved_back, spent_usd = spent_usd + spent_more
    WHERE client_id = NEW.client_id AND day = budget_day;
    RETURN NULL;
END
$$;
