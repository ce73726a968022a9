-- 019: a job's charge follows from its ledger, in one place; a job's end is
-- written by one function, whatever ends it; a lost batch intent's items are
-- closed when it is declared lost. docs/limits-and-budgets.md says why.
--
-- A job's charged_usd used to be written by each statement that ended a job
-- or closed a ledger row, each with its own CASE: eleven of them, and a new
-- way to end a job had to get it right again (the batch lane's did not: a
-- request its result said was never billed stayed charged its worst case).
-- Now it is the sum of what its ledger rows say, derived by the database:
--
--   llm_call_charge   what one ledger row costs: 0 when it was certainly not
--                     billed; its worst case while its outcome is unknown
--                     (open, interrupted, a lost batch's); otherwise what it
--                     reported (cost_usd)
--   job_charges       the sum over a job's rows (a view); 0 for a job without one
--   jobs_end          (below) the one function that ends jobs: it sets each
--                     ended job's charged_usd to that sum, in the write that
--                     ends it, after the job's row is locked
--   llm_calls_charge_followed (AFTER UPDATE on llm_calls) brings an ended
--                     job's charge to its ledger when a row's charge changes
--                     later (a stopped stream's real cost, a batch's result
--                     read after its job was cancelled or swept)
--
-- No other statement writes charged_usd (tests/unit/test_named_queries.py
-- reads every statement for it). The end sets it in jobs_end rather than in
-- a BEFORE trigger on story_jobs: a row trigger costs a function call per
-- ended job, a third of the worker's round (tests/bench/statement_cost.py),
-- and every end already goes through jobs_end. The ledger's later changes
-- come from several places (a worker closing a stopped stream, a batch's
-- results, a lost batch's stray): a trigger there cannot be forgotten by the
-- next one.

-- The day's spent_usd follows charged_usd, down as well as up, through the
-- budget trigger (migration 008), unchanged.

-- What a call can cost at most, on the job from its admission (budget or
-- not: reserved_usd is 0 where no budget applies) and on each ledger row
-- from when it is opened, at its lane's price (a batch job's prices are the
-- batch prices it was admitted at). A row whose outcome is unknown costs it.
ALTER TABLE story_jobs ADD COLUMN worst_case_usd usd NOT NULL DEFAULT 0;
ALTER TABLE llm_calls ADD COLUMN worst_case_usd usd NOT NULL DEFAULT 0;

-- Jobs admitted before this version: their reservation where a budget
-- applied (what admission computed); else the same bound from the terms they
-- were admitted with. Admission bounds a request's input tokens by its UTF-8
-- bytes, and input_tokens_estimate is those bytes over 3, rounded up (shared/
-- prompt.py), so 3 bytes a token is never below the bound. Rounded up to the
-- micro-dollar, as shared.pricing.Price.worst_case rounds. Jobs from before
-- jobs carried their terms (migration 008) have no prices: 0.
UPDATE story_jobs
SET worst_case_usd = greatest(reserved_usd, coalesce(
    ceil((input_tokens_estimate::numeric * 3 * input_usd_per_mtok
          + max_tokens::numeric * output_usd_per_mtok)) / 1000000, 0))
WHERE reserved_usd > 0 OR (input_usd_per_mtok IS NOT NULL AND output_usd_per_mtok IS NOT NULL
                           AND input_tokens_estimate IS NOT NULL AND max_tokens IS NOT NULL);

-- Ledger rows opened before this version: their job's worst case; a row
-- whose job was pruned keeps what it recorded (its job has no charge left).
UPDATE llm_calls c SET worst_case_usd = j.worst_case_usd
FROM story_jobs j WHERE j.id = c.job_id AND j.worst_case_usd > 0;
UPDATE llm_calls SET worst_case_usd = cost_usd
WHERE worst_case_usd = 0 AND cost_usd > 0 AND outcome IN ('started', 'interrupted');

-- What one ledger row costs. Inlined by the planner (one expression, no
-- FROM), so it costs what the CASE written out would.
CREATE FUNCTION llm_call_charge(billed boolean, outcome text, cost_usd numeric, worst_case_usd numeric)
RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN NOT billed THEN 0
                WHEN outcome IN ('started', 'interrupted') THEN worst_case_usd
                ELSE cost_usd END
$$;

-- What a job costs: the sum of its ledger rows' charges (a job without one
-- costs 0: coalesce where it is read). A view, so that a statement reading
-- one job's charge plans it inline, through llm_calls' primary key, with no
-- function call per job.
CREATE VIEW job_charges AS
SELECT c.job_id, sum(llm_call_charge(c.billed, c.outcome, c.cost_usd, c.worst_case_usd)) AS charge_usd
FROM llm_calls c
GROUP BY c.job_id;

-- An ended job's charge brought to its ledger after one of its rows changed
-- what it costs. Once per statement, over the rows it changed (a batch's
-- results arrive a hundred at a time); the write only where the charge
-- differs, and only for ended jobs (a live job's charge is set when it
-- ends: a worker closes its calls just before its jobs end). Ledger rows are only ever inserted for live jobs (every insert is
-- guarded by its job's status), so an insert needs no trigger.
CREATE FUNCTION llm_calls_charge_followed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE story_jobs j SET charged_usd = d.charged_usd
    FROM (SELECT e.id, coalesce((SELECT g.charge_usd FROM job_charges g WHERE g.job_id = e.id), 0) AS charged_usd
          FROM story_jobs e
          WHERE e.id = ANY (ARRAY(
                    SELECT DISTINCT n.job_id
                    FROM changed_rows n JOIN rows_before o ON o.job_id = n.job_id AND o.attempt = n.attempt
                    WHERE llm_call_charge(n.billed, n.outcome, n.cost_usd, n.worst_case_usd)
                          IS DISTINCT FROM llm_call_charge(o.billed, o.outcome, o.cost_usd, o.worst_case_usd)))
            -- a live job's charge is derived when it ends: only ended jobs'
            -- sums are taken (a worker closes its calls before its jobs end)
            AND e.status IN ('completed', 'failed')) d
    WHERE j.id = d.id AND j.charged_usd IS DISTINCT FROM d.charged_usd;
    RETURN NULL;
END
$$;

CREATE TRIGGER llm_calls_charge_followed
    AFTER UPDATE ON llm_calls
    REFERENCING OLD TABLE AS rows_before NEW TABLE AS changed_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION llm_calls_charge_followed();

-- One end of one job, as every path that ends jobs passes it to jobs_end.
CREATE TYPE job_end AS (
    job_id     bigint,
    status     job_status,
    error_code text,
    error_text text,
    story_id   uuid,
    -- output tokens at the end (NULL: as the job's row has it)
    progress   integer
);

-- A job jobs_end ended, with what its callers go on with: a pending job's
-- turn (given back on a cancel), a worker's reservations (given back to the
-- rate bucket), the trace context (the sweeper's and the batch lane's spans
-- link to it).
CREATE TYPE job_ended AS (
    id                    bigint,
    public_id             uuid,
    client_id             bigint,
    error_code            text,
    worker_id             text,
    turn                  double precision,
    was_pending           boolean,
    input_tokens_estimate integer,
    max_tokens            integer,
    trace_context         jsonb
);

-- What a worker knows of one attempt of a job's call, as jobs_end and
-- llm_call_finish pass it to llm_calls_close.
CREATE TYPE llm_call_close AS (
    job_id        bigint,
    attempt       smallint,
    outcome       text,
    billed        boolean,
    input_tokens  integer,
    output_tokens integer,
    cost_usd      numeric,
    request_id    text,
    error_text    text
);

-- Closes the ledger rows of the calls a worker made: each attempt's row with
-- what the worker knows of it (also over `interrupted`, written by whoever
-- ended the job without knowing), and a later row (opened by a retry whose
-- answer was lost, so never sent) as not sent. A row that already says it
-- is left as it is, so that a statement run again after its answer was lost
-- changes nothing. Returns the attempts' rows it closed now.
CREATE FUNCTION llm_calls_close(calls llm_call_close[])
RETURNS TABLE (job_id bigint, attempt smallint, input_tokens integer, output_tokens integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE llm_calls c
    SET finished_at = now(),
        outcome = CASE WHEN c.attempt = k.attempt THEN k.outcome ELSE 'not_sent' END,
        billed = c.attempt = k.attempt AND k.billed,
        input_tokens = CASE WHEN c.attempt = k.attempt THEN k.input_tokens ELSE 0 END,
        output_tokens = CASE WHEN c.attempt = k.attempt THEN k.output_tokens ELSE 0 END,
        cost_usd = CASE WHEN c.attempt = k.attempt THEN k.cost_usd ELSE 0 END,
        request_id = CASE WHEN c.attempt = k.attempt THEN coalesce(k.request_id, c.request_id) END,
        error_text = k.error_text
    FROM unnest(calls) k
    WHERE c.job_id = ANY (ARRAY(SELECT (x).job_id FROM unnest(calls) x)) AND c.job_id = k.job_id
      AND ((c.attempt = k.attempt
            AND (c.outcome, c.billed, c.input_tokens, c.output_tokens, c.cost_usd, c.error_text)
                IS DISTINCT FROM (k.outcome, k.billed, k.input_tokens, k.output_tokens, k.cost_usd, k.error_text))
           OR (c.attempt > k.attempt AND c.outcome IN ('started', 'interrupted')))
    RETURNING c.job_id, c.attempt, c.input_tokens, c.output_tokens;
END
$$;

-- Ends jobs, whoever ends them: the worker's completions and failures, the
-- client's and the operator's cancels (one and in bulk), the sweeper's
-- rules, and the batch lane's results, refusals, dropped requests and lost
-- intents. The guard is the state machine's: the status the caller expects
-- (`expected`) and, where one holds the job, its holder (`by_worker`, the
-- worker_id of an interactive job; `by_batch`, the batch_id that owns a
-- batch job; NULL: whoever). Rows are reached by id through
-- `id = ANY (ARRAY(...))` (an index lookup whatever a generic plan guesses)
-- and locked in ascending id order, as every statement that waits for
-- several job rows locks them, so two of them queue instead of deadlocking.
--
-- `calls`: what the worker ending its jobs knows of their calls, closed
-- (llm_calls_close) once the jobs' rows are locked and before they end, so
-- that each is charged what they say in the one write that ends it; closed
-- whether or not the job is still the worker's: a ledger row records what
-- was sent. Each ended job then leaves the batch
-- lane's line and is charged what its ledger says (job_charges); a
-- call it left open (a job cancelled or swept mid-call) is closed as
-- interrupted: it may have been billed, and keeps counting as its worst case
-- until its worker, if it lives, writes what it knows. A batch's request is
-- closed by its result alone: it may still be billed however its job ended.
-- That close is a statement of its own, so that its snapshot sees a retry's
-- row opened while the end waited for the job's row lock. Returns the jobs
-- it ended.
CREATE FUNCTION jobs_end(ends job_end[], expected job_status[], by_worker text, by_batch bigint,
                         ended_at timestamptz DEFAULT NULL, calls llm_call_close[] DEFAULT NULL)
RETURNS SETOF job_ended
LANGUAGE plpgsql
AS $$
DECLARE
    done job_ended[];
BEGIN
    -- the jobs' rows first, as every statement that writes a job and its
    -- ledger locks them (a cancel or a sweep locks the job, then closes its
    -- open call); then the calls, so that the end reads them closed; then
    -- the end, a statement of its own whose snapshot is taken once the rows
    -- are ours, so that the charge counts a retry's row a worker opened while
    -- this end waited for the lock
    PERFORM FROM story_jobs j
    WHERE j.id = ANY (ARRAY(SELECT (x).job_id FROM unnest(ends) x)) AND j.status = ANY (expected)
      AND (by_worker IS NULL OR j.worker_id = by_worker) AND (by_batch IS NULL OR j.batch_id = by_batch)
    ORDER BY j.id
    FOR NO KEY UPDATE;
    IF calls IS NOT NULL THEN
        PERFORM llm_calls_close(calls);
    END IF;
    WITH ended AS (
        UPDATE story_jobs j
        SET status = e.status, completed_at = coalesce(ended_at, now()), error_code = e.error_code,
            error_text = e.error_text, story_id = e.story_id, progress = coalesce(e.progress, j.progress),
            batch_ready_at = NULL,
            -- what its ledger says (an open call left open below keeps its
            -- worst case as `interrupted`: the same charge)
            charged_usd = coalesce((SELECT g.charge_usd FROM job_charges g WHERE g.job_id = j.id), 0)
        FROM unnest(ends) e
        WHERE j.id = ANY (ARRAY(SELECT (x).job_id FROM unnest(ends) x)) AND j.id = e.job_id
          AND j.status = ANY (expected)
          AND (by_worker IS NULL OR j.worker_id = by_worker)
          AND (by_batch IS NULL OR j.batch_id = by_batch)
        -- (only a claim or a batch's intent sets started_at: none, it was pending)
        RETURNING ROW(j.id, j.public_id, j.client_id, j.error_code, j.worker_id, j.turn, j.started_at IS NULL,
                      j.input_tokens_estimate, j.max_tokens, j.trace_context)::job_ended AS job
    )
    SELECT array_agg(job ORDER BY (job).id) INTO done FROM ended;
    IF done IS NULL THEN
        RETURN;
    END IF;
    -- the ended jobs' drafts (story_draft_chunks, migration 020) go with the
    -- end, in its statement: a draft write holds its job's row FOR SHARE, so
    -- what it wrote is committed before this end's update and deleted here
    DELETE FROM story_draft_chunks c WHERE c.job_id = ANY (ARRAY(SELECT (x).id FROM unnest(done) x));
    -- a worker's end closed every call of its jobs above: none is left open
    IF calls IS NOT NULL THEN
        RETURN QUERY SELECT * FROM unnest(done);
        RETURN;
    END IF;
    UPDATE llm_calls c
    SET finished_at = now(), outcome = 'interrupted',
        error_text = CASE d.error_code WHEN 'cancelled' THEN 'the job was cancelled while this call was open'
                     ELSE 'the job was failed (' || d.error_code || ') while this call was open' END
    FROM unnest(done) d
    WHERE c.job_id = ANY (ARRAY(SELECT (x).id FROM unnest(done) x)) AND c.job_id = d.id
      AND c.outcome = 'started' AND c.batch_id IS NULL;
    RETURN QUERY SELECT * FROM unnest(done);
END
$$;

-- What a model's shared rate bucket gets back: what the claims of calls that
-- ended reserved (their input tokens' estimate, their max_tokens) and the
-- calls did not use. A kind without a limit (NULL) stays so. The one
-- definition for every statement that ends calls.
CREATE FUNCTION llm_rate_bucket_give_back(model text, input_tokens double precision,
                                          output_tokens double precision)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE llm_rate_buckets b
    SET input_tokens = b.input_tokens + llm_rate_bucket_give_back.input_tokens,
        output_tokens = b.output_tokens + llm_rate_bucket_give_back.output_tokens
    WHERE b.model = llm_rate_bucket_give_back.model AND (b.input_tokens IS NOT NULL OR b.output_tokens IS NOT NULL);
END
$$;

-- Whether the batch lane's submitter lease is `holder`'s under `token` now;
-- its row is then held (FOR SHARE) until the caller's transaction ends, so
-- that no new holder can take it before what the caller writes under it is
-- committed. Every statement of the holder that changes shared state checks
-- it (sql/batch.sql): a holder paused past its lease changes nothing.
CREATE FUNCTION batch_lease_held(holder text, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM FROM batch_leases l
    WHERE l.name = 'submitter' AND l.holder = batch_lease_held.holder AND l.token = batch_lease_held.token
      AND l.until > now()
    FOR SHARE;
    RETURN FOUND;
END
$$;

-- One attempt of a batch job that billed nothing (a refused create, an
-- expired, canceled or errored request): how it ended, and whether its job
-- fails now (final, with error_code) or waits for a later batch.
CREATE TYPE batch_attempt_unbilled AS (
    job_id     bigint,
    attempt    smallint,
    outcome    text,
    error_text text,
    final      boolean,
    error_code text
);

-- The end of batch attempts that billed nothing, for a refused create
-- (batch_refused) and for results that billed nothing (batch_results_ingest):
-- their ledger rows closed as not billed, then each job still running under
-- `batch` either failed (final) through jobs_end, charged what its ledger
-- says, or put back to wait for a later batch. Answers how many failed and
-- how many wait again.
CREATE FUNCTION batch_attempts_unbilled(batch bigint, attempts batch_attempt_unbilled[])
RETURNS TABLE (failed bigint, waiting bigint)
LANGUAGE plpgsql
AS $$
BEGIN
    -- the jobs' rows first, in id order, as every statement that writes a job
    -- and its ledger locks them: a cancel or a sweep ending one of them now
    -- commits before the ledger changes below, so that the ledger's trigger
    -- sees it ended and brings its charge to what the rows then say (without
    -- the lock, the end charged the worst case the row said before, and the
    -- trigger saw the job still running)
    PERFORM FROM story_jobs j
    WHERE j.id = ANY (ARRAY(SELECT (x).job_id FROM unnest(attempts) x))
    ORDER BY j.id
    FOR NO KEY UPDATE;
    UPDATE llm_calls c
    SET finished_at = now(), outcome = a.outcome, billed = false, cost_usd = 0, error_text = a.error_text
    FROM unnest(attempts) a
    WHERE c.job_id = ANY (ARRAY(SELECT (x).job_id FROM unnest(attempts) x)) AND c.job_id = a.job_id
      AND c.attempt = a.attempt AND c.outcome IN ('started', 'interrupted');
    SELECT count(*) INTO failed FROM jobs_end(
        ARRAY(SELECT ROW((a).job_id, 'failed', (a).error_code, (a).error_text, NULL, NULL)::job_end
              FROM unnest(attempts) a WHERE (a).final),
        '{running}', NULL, batch);
    UPDATE story_jobs j
    SET batch_ready_at = now()
    FROM unnest(attempts) a
    WHERE j.id = ANY (ARRAY(SELECT (x).job_id FROM unnest(attempts) x WHERE NOT (x).final)) AND j.id = a.job_id
      AND j.status = 'running' AND j.batch_id = batch AND j.batch_ready_at IS NULL;
    GET DIAGNOSTICS waiting = ROW_COUNT;
    RETURN NEXT;
END
$$;

-- A lost intent's requests are read as lost when it is declared lost (so that
-- nothing waits for them: the prune, the console), and a stray batch found
-- later that turns out to be it may overwrite that once with its real result.
ALTER TABLE message_batch_items DROP CONSTRAINT message_batch_items_result_check;
ALTER TABLE message_batch_items ADD CONSTRAINT message_batch_items_result_check
    CHECK (result IN ('succeeded', 'errored', 'expired', 'canceled', 'unknown', 'lost'));
UPDATE message_batch_items i SET result = 'lost', read_at = coalesce(b.ended_at, now())
FROM message_batches b
WHERE b.id = i.batch_id AND b.state = 'lost' AND i.result IS NULL;

-- Every ended job's charge brought to what its ledger says, and the changes
-- reported (`storyjobs migrate` prints them) by cause: the lane, how the job
-- ended, and which way its charge moved. Expected: a batch job cancelled,
-- swept or lost whose request was then canceled or expired goes down to 0;
-- a job swept or cancelled while running without a budget (charged 0 before)
-- goes up to its worst case.
DO $$
DECLARE
    cause record;
    total integer := 0;
BEGIN
    CREATE TEMPORARY TABLE charges_rederived ON COMMIT DROP AS
    SELECT j.id, j.lane::text AS lane,
           CASE WHEN j.status = 'completed' THEN 'completed' ELSE 'failed ' || j.error_code END AS ending,
           j.charged_usd AS was, coalesce(d.charge, 0)::numeric(14, 6) AS now
    FROM story_jobs j
    LEFT JOIN (SELECT g.job_id, g.charge_usd AS charge FROM job_charges g) d ON d.job_id = j.id
    WHERE j.status IN ('completed', 'failed')
      AND j.charged_usd IS DISTINCT FROM coalesce(d.charge, 0)::numeric(14, 6);
    FOR cause IN
        SELECT lane, ending, CASE WHEN now > coalesce(was, 0) THEN 'up' ELSE 'down' END AS way,
               count(*) AS jobs, sum(now - coalesce(was, 0)) AS usd
        FROM charges_rederived GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
    LOOP
        RAISE NOTICE 'charge re-derived from the ledger: % % jobs (%) % by % USD',
            cause.jobs, cause.lane, cause.ending, cause.way, abs(cause.usd);
        total := total + cause.jobs;
    END LOOP;
    RAISE NOTICE 'charges re-derived from the ledger: % jobs changed', total;
    UPDATE story_jobs j SET charged_usd = r.now FROM charges_rederived r WHERE j.id = r.id;
END
$$;
