-- storyjobs schema, version 33: an end locks the row of every job it is
-- given before it closes their calls, not only of those still its caller's.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.
--
-- A worker's end (job_settle, job_fail_running) closes the calls of every
-- job it lists, also of a job a cancel ended meanwhile: the call was made and
-- may have been billed. That close moves the ended job's charge, and the
-- ledger's trigger (migration 028) writes the job's row. jobs_end locked only
-- the rows of the jobs still running under the worker, so the trigger took the
-- cancelled job's row after them, out of the ascending id order every other
-- statement keeps. A draft write that held the cancelled job's row (a row
-- locked on a recheck stays locked when the recheck finds the job ended) and
-- then waited for a higher job the end held deadlocked with it
-- (tests/integration/test_lock_order.py). The status and holder guard stays
-- on the update that ends the jobs; only the lock is wider.
CREATE OR REPLACE FUNCTION jobs_end(ends job_end[], expected job_status[], by_worker text, by_batch bigint,
                                    ended_at timestamptz DEFAULT NULL, calls llm_call_close[] DEFAULT NULL)
RETURNS SETOF job_ended
LANGUAGE plpgsql
AS $$
DECLARE
    done job_ended[];
BEGIN
    -- the jobs' rows first, as every statement that writes a job and its
    -- ledger locks them (a cancel or a sweep locks the job, then closes its
    -- open call): every job given, whatever its status and holder, since
    -- closing a call of a job that ended meanwhile moves its charge, and the
    -- ledger's trigger writes that job's row (see the top of this file);
    -- then the calls, so that the end reads them closed; then the end, a
    -- statement of its own whose snapshot is taken once the rows are ours,
    -- so that the charge counts a retry's row a worker opened while this
    -- end waited for the lock
    PERFORM FROM story_jobs j
    WHERE j.id = ANY (ARRAY(SELECT (x).job_id FROM unnest(ends) x))
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
