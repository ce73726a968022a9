-- storyjobs schema, version 4: the provider's rate limits, shared by every
-- worker through one bucket row per model, and spend budgets per UTC day.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- What a job may cost, fixed when it is accepted, so that the api's
-- reservation and the worker's call agree. NULL for jobs accepted before this
-- version (the worker then computes them as it did).
ALTER TABLE story_jobs
    -- the call's max_tokens
    ADD COLUMN max_tokens integer CHECK (max_tokens > 0),
    -- a likely count of the call's input tokens, which the rate limiter reserves
    ADD COLUMN input_tokens_estimate integer CHECK (input_tokens_estimate >= 0),
    -- the job's worst case, held against the spend budgets of the UTC day it
    -- was accepted until it ends (0 when no budget applied to it)
    ADD COLUMN reserved_usd numeric(14, 6) NOT NULL DEFAULT 0 CHECK (reserved_usd >= 0),
    -- what the job counts against the budgets once it has ended: its calls'
    -- cost, or its worst case when it ended with a call nobody knows the end
    -- of. Left NULL by a path that does not say, it counts as the worst case.
    ADD COLUMN charged_usd numeric(14, 6) CHECK (charged_usd >= 0);

-- A client's own budget, overriding CLIENT_BUDGET_USD_PER_DAY.
ALTER TABLE api_clients ADD COLUMN budget_usd_per_day numeric(14, 6) CHECK (budget_usd_per_day > 0);

-- Per UTC day, all clients (client_id 0) and each client: what the jobs
-- accepted that day have cost (spent) and what the unfinished ones hold
-- (reserved). Admission adds reservations under the admission lock; a job's
-- end moves its reservation to spent (trigger below), never adding more than
-- it reserved, so spent + reserved never passes a budget.
CREATE TABLE budget_days (
    client_id     bigint NOT NULL,
    day           date NOT NULL,
    spent_usd     numeric(14, 6) NOT NULL DEFAULT 0 CHECK (spent_usd >= 0),
    reserved_usd  numeric(14, 6) NOT NULL DEFAULT 0 CHECK (reserved_usd >= 0),
    PRIMARY KEY (client_id, day)
)
-- updated at every admission and every end of a budgeted job: room on the
-- page keeps those updates HOT
WITH (fillfactor = 50);

-- A job's end settles its reservation wherever it ends (worker, sweeper,
-- cancellation, an operator's action), exactly once since the transition to
-- an end is guarded, and a later correction of its charge (a stopped stream
-- reporting what it really cost) is applied too. A trigger rather than a
-- clause in each statement: no path that ends a job can forget it, and one
-- that does not say what to charge charges the worst case.
CREATE FUNCTION story_jobs_settle_budget() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
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
    WHEN (NEW.reserved_usd > 0 AND NEW.status IN ('completed', 'failed')
          AND (OLD.status IN ('pending', 'running') OR OLD.charged_usd IS DISTINCT FROM NEW.charged_usd))
    EXECUTE FUNCTION story_jobs_settle_budget();

-- One row per model: the provider account's limits as one continuously
-- refilling bucket per kind, shared by every worker. Each claim takes one
-- request, the job's estimated input tokens and its max_tokens from it, in the
-- claim statement itself; the end of a call gives back what it did not use.
CREATE TABLE llm_rate_buckets (
    model          text PRIMARY KEY,
    -- available as of refilled_at; NULL where no limit is configured. Below
    -- zero is a debt (a retry's request, a call that used more than estimated)
    requests       double precision,
    input_tokens   double precision,
    output_tokens  double precision,
    refilled_at    timestamptz NOT NULL DEFAULT now(),
    -- no claim, and no retry, before this: a 429's retry-after, or the reset
    -- the provider gave when its headers said nothing was left
    paused_until   timestamptz NOT NULL DEFAULT '-infinity'
)
-- written by every claim round while a limit is configured: HOT updates
WITH (fillfactor = 20);
