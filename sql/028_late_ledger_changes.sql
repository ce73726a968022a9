-- storyjobs schema, version 28: a ledger row that changes after its job
-- ended has the minute it started recounted by the sweeper's next rollup.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- The rollup (sweeper.sql rollup_minutes) recounts the minutes where the
-- calls of the jobs that ended since its last pass started (late_minutes):
-- a worker closes its calls before its job ends, so a job's calls are final
-- by then. Not every one: a batch request stays open until its result is
-- read, which can be hours after its job was cancelled or swept, and a
-- stream stopped by a cancel is closed by its worker after the cancel ended
-- the job. Such a change was never recounted: the history, and the
-- overview's day, kept the request as it was when the job ended (an open
-- request spends nothing), short of its charge.
--
-- The ledger's trigger (migration 019), which already brings an ended job's
-- charge to such a change, now also marks the minutes the changed rows
-- started when it moved a charge; the next pass recounts each marked minute
-- and takes its mark away. A minute is marked once however many of its
-- rows change (its primary key). A change made in the transaction that ends
-- the job (a settle, a batch's result read for a live job) marks nothing:
-- the job's end has its minutes recounted already, and its end set its
-- charge, so the worker's round runs no second statement here (measured
-- with tests/bench/statement_cost.py: 2,345 k instructions a job against
-- 2,343 k before; 2,446 k when every change asked). A late change that
-- moves no charge at all (tokens alone) is not marked.
CREATE TABLE minute_rollup_stale (
    minute timestamptz PRIMARY KEY
);

CREATE OR REPLACE FUNCTION llm_calls_charge_followed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    recharged bigint;
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
    -- a change that moved an ended job's charge: the rows' minutes are
    -- marked where the job ended in an earlier transaction (asked only
    -- then: see above)
    GET DIAGNOSTICS recharged = ROW_COUNT;
    IF recharged = 0 THEN
        RETURN NULL;
    END IF;
    -- what the rollup counts of a row (llm_call_tallies, migration 027)
    -- changed after its job's end, in a later transaction than the end
    INSERT INTO minute_rollup_stale (minute)
    SELECT DISTINCT date_trunc('minute', n.started_at)
    FROM changed_rows n
    JOIN rows_before o ON o.job_id = n.job_id AND o.attempt = n.attempt
    JOIN story_jobs j ON j.id = n.job_id
    WHERE (n.billed, n.outcome, n.input_tokens, n.output_tokens, n.cost_usd, n.worst_case_usd)
          IS DISTINCT FROM (o.billed, o.outcome, o.input_tokens, o.output_tokens, o.cost_usd, o.worst_case_usd)
      AND j.status IN ('completed', 'failed') AND j.completed_at < now()
    ORDER BY 1
    ON CONFLICT (minute) DO NOTHING;
    RETURN NULL;
END
$$;
