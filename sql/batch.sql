-- The batch lane's named queries (worker/batch/store.py runs them): the
-- submitter's lease, a batch's intent and what its create call answered,
-- the reconciliation of a lost answer, and the ingestion of results. The
-- lane's promise and its protocol are in docs/batches.md; the conventions
-- in common.sql.
--
-- A batch job is owned by its batch (story_jobs.batch_id), never by a
-- process: every transition below names the batch it expects, so a holder
-- that lost the lease, or a results stream read twice, changes nothing.


-- name: batch_lease_take
-- The submitter's lease, taken for %(lease_s)s when it is free, ours, or ran
-- out; a new token whenever it was not ours and alive, so that a holder
-- that lost it can never renew it. No row: another worker holds it.
UPDATE batch_leases
SET holder = %(holder)s, until = now() + make_interval(secs => %(lease_s)s::float8),
    token = CASE WHEN holder = %(holder)s AND until > now() THEN token ELSE token + 1 END
WHERE name = 'submitter' AND (holder IS NULL OR holder = %(holder)s OR until <= now())
RETURNING token, extract(epoch FROM until - now())::float8 AS lease_s;

-- name: batch_lease_release
-- A stopping holder gives the lease up, so that another worker takes it at
-- its next tick instead of when it runs out.
UPDATE batch_leases SET until = now()
WHERE name = 'submitter' AND holder = %(holder)s AND token = %(token)s AND until > now();

-- name: batch_ready_summary
-- Whether a batch is due: how many jobs wait for one (counted up to
-- %(max_requests)s) and how long the oldest has waited, on
-- story_jobs_batch_ready_idx. Every transition that ends a job clears its
-- batch_ready_at; the status is checked too, so that a row one of them
-- missed can never be counted into a batch.
SELECT (SELECT count(*) FROM (
            SELECT 1 FROM story_jobs
            WHERE batch_ready_at IS NOT NULL AND status IN ('pending', 'running')
            ORDER BY batch_ready_at, id LIMIT %(max_requests)s) q) AS ready,
       coalesce(extract(epoch FROM now() - (
            SELECT batch_ready_at FROM story_jobs
            WHERE batch_ready_at IS NOT NULL AND status IN ('pending', 'running')
            ORDER BY batch_ready_at, id LIMIT 1)), 0)::float8 AS oldest_s;

-- name: batch_intent_create
-- A batch's intent, committed before its create call: the lease checked
-- and renewed (a holder whose lease ran out makes nothing, and so sends
-- nothing), up to %(max_requests)s waiting jobs locked in the order they
-- became ready and moved into the new batch (pending or waiting -> running,
-- owned by it), each with its item (custom_id, attempt) and its ledger row.
-- From this commit on the provider may bill them; nothing may make them
-- pending again. No row: no lease, or no job waiting.
WITH lease AS MATERIALIZED (
    UPDATE batch_leases SET until = now() + make_interval(secs => %(lease_s)s::float8)
    WHERE name = 'submitter' AND holder = %(holder)s AND token = %(token)s AND until > now()
    RETURNING token
),
ready AS MATERIALIZED (
    SELECT j.id FROM story_jobs j
    WHERE j.batch_ready_at IS NOT NULL AND j.status IN ('pending', 'running')
      AND EXISTS (SELECT 1 FROM lease)
    ORDER BY j.batch_ready_at, j.id
    LIMIT %(max_requests)s
    FOR NO KEY UPDATE SKIP LOCKED
),
batch AS MATERIALIZED (
    INSERT INTO message_batches (model, request_count, holder)
    SELECT %(model)s, count(*), %(holder)s FROM ready HAVING count(*) > 0
    RETURNING id, fence_at
),
moved AS MATERIALIZED (
    UPDATE story_jobs j
    SET status = 'running', batch_id = b.id, batch_ready_at = NULL, worker_id = 'batch-' || b.id,
        started_at = coalesce(j.started_at, now()), heartbeat_at = now()
    FROM batch b
    WHERE j.id = ANY (ARRAY(SELECT id FROM ready)) AND j.batch_ready_at IS NOT NULL AND j.lane = 'batch'
      AND j.status IN ('pending', 'running')
    RETURNING j.id, j.request, j.max_tokens, j.model, j.trace_context, b.id AS batch_id,
              (SELECT coalesce(max(c.attempt), 0) + 1 FROM llm_calls c WHERE c.job_id = j.id) AS attempt
),
items AS (
    INSERT INTO message_batch_items (batch_id, custom_id, job_id, attempt)
    SELECT batch_id, 'sj-' || batch_id || '-' || id || '-' || attempt, id, attempt FROM moved
),
ledger AS (
    INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, batch_id)
    SELECT id, attempt, %(holder)s, %(provider)s, coalesce(model, %(model)s), batch_id FROM moved
)
SELECT b.id, b.fence_at,
       (SELECT json_agg(json_build_object(
            'custom_id', 'sj-' || m.batch_id || '-' || m.id || '-' || m.attempt, 'job_id', m.id,
            'attempt', m.attempt, 'request', m.request, 'max_tokens', m.max_tokens, 'model', m.model,
            'trace_context', m.trace_context)
            ORDER BY m.id)
        FROM moved m)::text AS items
FROM batch b;

-- name: batch_sent
-- The create call answered: the intent becomes a batch in flight, with the
-- provider's id (or, reconciled after a lost answer, the id found). Guarded
-- by the intent's state: adopted once.
UPDATE message_batches
SET state = 'sent', provider_batch_id = %(provider_batch_id)s, sent_at = now(),
    expires_at = %(expires_at)s, processing_status = %(processing_status)s
WHERE id = %(batch_id)s AND state = 'intent'
RETURNING id;

-- name: batch_attempt_ended_ctes
-- How a batch's attempt ends for jobs that billed nothing, shared by a
-- refused create (batch_refused) and the ingestion of results that billed
-- nothing (batch_results_ingest): from `unbilled` (job_id, attempt, outcome,
-- error_text, final: the job fails instead of waiting again, error_code),
-- the ledger rows closed unbilled, and each job still running under this
-- batch either failed unbilled or put back to wait for a later batch.
unbilled_closed AS (
    UPDATE llm_calls c
    SET finished_at = now(), outcome = u.outcome, billed = false, error_text = u.error_text
    FROM unbilled u
    WHERE c.job_id = ANY (ARRAY(SELECT job_id FROM unbilled)) AND c.job_id = u.job_id AND c.attempt = u.attempt
      AND c.outcome IN ('started', 'interrupted')
),
unbilled_failed AS (
    UPDATE story_jobs j
    SET status = 'failed', completed_at = now(), error_code = u.error_code, error_text = u.error_text,
        charged_usd = 0
    FROM unbilled u
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM unbilled WHERE final)) AND j.id = u.job_id
      AND j.status = 'running' AND j.batch_id = %(batch_id)s
    RETURNING j.id
),
waiting_again AS (
    UPDATE story_jobs j
    SET batch_ready_at = now()
    FROM unbilled u
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM unbilled WHERE NOT final)) AND j.id = u.job_id
      AND j.status = 'running' AND j.batch_id = %(batch_id)s AND j.batch_ready_at IS NULL
    RETURNING j.id
)

-- name: batch_refused
-- The create call was refused before anything was made (a 4xx, a refused
-- connection): nothing was billed. The intent is refused, and its jobs wait
-- for a later batch, or fail unbilled (%(error_code)s) once they have had
-- %(max_attempts)s attempts.
WITH refused AS MATERIALIZED (
    UPDATE message_batches SET state = 'refused', ended_at = now()
    WHERE id = %(batch_id)s AND state = 'intent'
    RETURNING id
),
unbilled AS MATERIALIZED (
    SELECT i.job_id, i.attempt, %(outcome)s::text AS outcome, %(error_text)s::text AS error_text,
           i.attempt >= %(max_attempts)s AS final, %(error_code)s::text AS error_code
    FROM message_batch_items i
    WHERE i.batch_id = %(batch_id)s AND EXISTS (SELECT 1 FROM refused)
    ORDER BY i.job_id
),
items_read AS (
    UPDATE message_batch_items SET result = 'errored', read_at = now()
    WHERE batch_id = %(batch_id)s AND result IS NULL AND EXISTS (SELECT 1 FROM refused)
),
-- include: batch_attempt_ended_ctes
SELECT (SELECT count(*) FROM refused) AS refused, (SELECT count(*) FROM unbilled_failed) AS failed,
       (SELECT count(*) FROM waiting_again) AS waiting;

-- name: batch_lost
-- No batch of this intent appeared within BATCH_RECONCILE_GRACE_S: its
-- create may still have been made, so every request of it may be billed.
-- Its jobs fail as calls of unknown outcome (llm_error), each ledger row
-- closed billed at the job's worst case at the batch price (%(worst_cases)s,
-- computed by the lane as the interactive lane computes it), the job charged
-- it. A batch of it found later (state stray) brings each charge down to
-- what its result really cost.
WITH lost AS MATERIALIZED (
    UPDATE message_batches SET state = 'lost', ended_at = now()
    WHERE id = %(batch_id)s AND state = 'intent'
    RETURNING id
),
worst AS MATERIALIZED (
    SELECT w.job_id, w.attempt, w.cost_usd, w.input_tokens, w.output_tokens
    FROM jsonb_to_recordset(%(worst_cases)s::jsonb) AS w(job_id bigint, attempt smallint, cost_usd numeric,
                                                           input_tokens int, output_tokens int)
    WHERE EXISTS (SELECT 1 FROM lost)
    ORDER BY w.job_id
),
calls_closed AS (
    UPDATE llm_calls c
    SET finished_at = now(), outcome = 'interrupted', billed = true, cost_usd = w.cost_usd,
        input_tokens = w.input_tokens, output_tokens = w.output_tokens,
        error_text = 'the batch was created or not: its create call was not answered and no batch of it was found'
    FROM worst w
    WHERE c.job_id = ANY (ARRAY(SELECT job_id FROM worst)) AND c.job_id = w.job_id AND c.attempt = w.attempt
      AND c.outcome IN ('started', 'interrupted')
),
failed AS (
    UPDATE story_jobs j
    SET status = 'failed', completed_at = now(), error_code = 'llm_error',
        error_text = 'the batch was sent and its answer was lost; no batch of it was found within '
                     || 'BATCH_RECONCILE_GRACE_S, so the request may have been billed and is not sent again',
        charged_usd = w.cost_usd
    FROM worst w
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM worst)) AND j.id = w.job_id
      AND j.status = 'running' AND j.batch_id = %(batch_id)s
    RETURNING j.id
)
SELECT (SELECT count(*) FROM lost) AS lost, (SELECT count(*) FROM failed) AS failed;

-- name: batch_stray_record
-- A batch of the workspace that no row of ours knows, found while a lost
-- intent (%(lost_batch_id)s) may still have made one: kept, so that it is
-- cancelled and its results charged by custom_id. Known already: nothing.
INSERT INTO message_batches (state, provider_batch_id, model, request_count, fence_at, sent_at, expires_at,
                             processing_status, lost_batch_id)
VALUES ('stray', %(provider_batch_id)s, %(model)s, %(request_count)s, %(created_at)s, now(), %(expires_at)s,
        %(processing_status)s, %(lost_batch_id)s)
ON CONFLICT (provider_batch_id) DO NOTHING
RETURNING id;

-- name: batch_live_list
-- The batches the holder looks after: intents (to reconcile), batches in
-- flight and strays (to collect), and lost intents of the last 24 hours
-- (while their batch may still turn up), oldest first.
SELECT b.id, b.state, b.provider_batch_id, b.model, b.request_count, b.fence_at, b.expires_at,
       b.processing_status, b.cancel_asked_at, b.lost_batch_id,
       extract(epoch FROM now() - b.fence_at)::float8 AS age_s,
       -- every job of it ended elsewhere (cancelled, swept): worth cancelling
       NOT EXISTS (SELECT 1 FROM message_batch_items i JOIN story_jobs j ON j.id = i.job_id
                   WHERE i.batch_id = b.id AND j.status = 'running' AND j.batch_id = b.id) AS abandoned
FROM message_batches b
WHERE b.state IN ('intent', 'sent', 'stray') OR (b.state = 'lost' AND b.fence_at > now() - interval '24 hours')
ORDER BY b.id;

-- name: batch_known
-- Which of these provider batch ids a row of ours knows.
SELECT provider_batch_id FROM message_batches WHERE provider_batch_id = ANY (%(provider_batch_ids)s::text[]);

-- name: batch_seen
-- What the provider last said of a batch in flight.
UPDATE message_batches
SET processing_status = %(processing_status)s, request_counts = %(request_counts)s::jsonb,
    expires_at = coalesce(%(expires_at)s, expires_at),
    ended_at = CASE WHEN %(processing_status)s = 'ended' THEN coalesce(ended_at, now()) ELSE ended_at END
WHERE id = %(batch_id)s AND state IN ('sent', 'stray');

-- name: batch_cancel_asked
UPDATE message_batches SET cancel_asked_at = coalesce(cancel_asked_at, now())
WHERE id = %(batch_id)s AND state IN ('sent', 'stray');

-- name: batch_results_ingest
-- A chunk of an ended batch's results, by custom_id, in one transaction.
-- Idempotent: an item already read is skipped (result IS NULL), so a stream
-- cut halfway and read again from its start changes nothing. Each result:
--   succeeded: the story stored, the ledger row closed billed at the job's
--              (batch) prices; the job completed if still running under this
--              batch, else (cancelled, swept) its story kept unseen and its
--              charge brought down to the cost, never up;
--   unknown:   it may have billed (its line could not be read, or there was
--              none): the ledger row closed billed at the job's worst case
--              (the tokens the lane passes), the job failed as llm_error;
--   errored, expired, canceled: billed nothing (batch_attempt_ended_ctes):
--              a refused request (%(rejected)s) fails its job as
--              llm_rejected; any other waits for a later batch until its
--              %(max_attempts)s-th attempt, then fails as llm_unavailable.
WITH got AS MATERIALIZED (
    SELECT g.*, i.job_id, i.attempt
    FROM jsonb_to_recordset(%(results)s::jsonb) AS g(
        custom_id text, result text, rejected boolean, story_id uuid, title text, body text, model text,
        prompt_version text, input_tokens int, output_tokens int, request_id text, error_text text)
    JOIN message_batch_items i ON i.batch_id = %(batch_id)s AND i.custom_id = g.custom_id AND i.result IS NULL
    ORDER BY i.job_id
),
items_read AS (
    UPDATE message_batch_items i SET result = g.result, read_at = now()
    FROM got g
    WHERE i.batch_id = %(batch_id)s AND i.custom_id = g.custom_id AND i.result IS NULL
),
-- the jobs' rows locked in ascending id order, as every statement that
-- waits for several job rows locks them (sql/worker.sql, job_end_ctes)
job AS MATERIALIZED (
    SELECT j.id, j.client_id, j.status = 'running' AND j.batch_id = %(batch_id)s AS ours,
           j.input_usd_per_mtok, j.output_usd_per_mtok
    FROM story_jobs j
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM got))
    ORDER BY j.id
    FOR NO KEY UPDATE
),
billed AS MATERIALIZED (
    SELECT g.*, j.client_id, j.ours,
           -- as shared.pricing.Price.cost: to the micro-dollar, half up; the
           -- offline provider (%(free)s) bills nothing
           CASE WHEN %(free)s THEN 0
                ELSE round((g.input_tokens * coalesce(j.input_usd_per_mtok, 0)
                            + g.output_tokens * coalesce(j.output_usd_per_mtok, 0)) / 1000000, 6) END AS cost_usd
    FROM got g JOIN job j ON j.id = g.job_id
    WHERE g.result IN ('succeeded', 'unknown')
),
stories_inserted AS (
    INSERT INTO stories (id, job_id, client_id, title, body, model, prompt_version,
                         input_tokens, output_tokens, cost_usd)
    SELECT story_id, job_id, client_id, title, body, model, prompt_version, input_tokens, output_tokens, cost_usd
    FROM billed WHERE result = 'succeeded'
    ON CONFLICT (job_id) DO NOTHING
),
billed_closed AS (
    UPDATE llm_calls c
    SET finished_at = now(), outcome = CASE b.result WHEN 'succeeded' THEN 'succeeded' ELSE 'interrupted' END,
        billed = true, input_tokens = b.input_tokens, output_tokens = b.output_tokens, cost_usd = b.cost_usd,
        request_id = b.request_id, error_text = b.error_text
    FROM billed b
    WHERE c.job_id = ANY (ARRAY(SELECT job_id FROM billed)) AND c.job_id = b.job_id AND c.attempt = b.attempt
      AND c.outcome IN ('started', 'interrupted')
),
completed AS (
    UPDATE story_jobs j
    SET status = 'completed', completed_at = now(), story_id = b.story_id, progress = b.output_tokens,
        charged_usd = b.cost_usd
    FROM billed b
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM billed WHERE ours AND result = 'succeeded')) AND j.id = b.job_id
      AND j.status = 'running' AND j.batch_id = %(batch_id)s
    RETURNING j.id
),
unknown_failed AS (
    UPDATE story_jobs j
    SET status = 'failed', completed_at = now(), error_code = 'llm_error', error_text = b.error_text,
        charged_usd = b.cost_usd
    FROM billed b
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM billed WHERE ours AND result = 'unknown')) AND j.id = b.job_id
      AND j.status = 'running' AND j.batch_id = %(batch_id)s
    RETURNING j.id
),
charged_down AS (
    UPDATE story_jobs j
    SET charged_usd = b.cost_usd
    FROM billed b
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM billed WHERE NOT ours)) AND j.id = b.job_id
      AND j.status = 'failed' AND j.charged_usd > b.cost_usd
),
unbilled AS MATERIALIZED (
    SELECT g.job_id, g.attempt,
           CASE WHEN g.rejected THEN 'rejected' ELSE g.result END AS outcome, g.error_text,
           g.rejected OR g.attempt >= %(max_attempts)s AS final,
           CASE WHEN g.rejected THEN 'llm_rejected' ELSE 'llm_unavailable' END AS error_code
    FROM got g
    WHERE g.result NOT IN ('succeeded', 'unknown')
),
-- include: batch_attempt_ended_ctes
SELECT (SELECT count(*) FROM got) AS read, (SELECT count(*) FROM completed) AS completed,
       (SELECT count(*) FROM billed WHERE NOT ours) AS billed_unseen,
       (SELECT count(*) FROM unbilled_failed) + (SELECT count(*) FROM unknown_failed) AS failed,
       (SELECT count(*) FROM waiting_again) AS waiting,
       (SELECT coalesce(sum(cost_usd), 0) FROM billed) AS cost_usd;

-- name: batch_results_read
-- Every item of an ended batch has been read: the batch is done with. An
-- item no results line named is read first as unknown (it may have billed),
-- by batch_results_ingest; this only closes the batch once none is left
-- unread.
UPDATE message_batches b
SET state = 'ended', results_read_at = now(), ended_at = coalesce(ended_at, now())
WHERE b.id = %(batch_id)s AND b.state IN ('sent', 'stray')
  AND NOT EXISTS (SELECT 1 FROM message_batch_items i WHERE i.batch_id = b.id AND i.result IS NULL)
RETURNING b.id;

-- name: batch_items_of
-- A batch's requests not read yet, with what each job was admitted with:
-- the request (its input tokens' bound), max_tokens, model and prices, from
-- which a worst case and a cost are reckoned. For a stray batch, those of
-- the lost intent it may be.
SELECT i.custom_id, i.job_id, i.attempt, j.request, j.max_tokens, j.model, j.input_usd_per_mtok,
       j.output_usd_per_mtok, j.trace_context
FROM message_batch_items i JOIN story_jobs j ON j.id = i.job_id
WHERE i.batch_id = %(batch_id)s AND i.result IS NULL
ORDER BY i.custom_id;

-- name: batch_stray_read
-- A stray batch's results have all been read (those that were ours charged).
UPDATE message_batches SET state = 'ended', results_read_at = now(), ended_at = coalesce(ended_at, now())
WHERE id = %(batch_id)s AND state = 'stray'
RETURNING id;

-- name: batch_items_drop
-- Before its create call, requests of an intent that cannot be sent (a
-- stored request that no longer validates): their jobs fail unbilled as
-- invalid_request, their ledger rows closed as not sent, their items gone,
-- so that the batch created is the intent's, request for request.
WITH dropped AS MATERIALIZED (
    DELETE FROM message_batch_items i
    USING message_batches b
    WHERE i.batch_id = %(batch_id)s AND b.id = i.batch_id AND b.state = 'intent'
      AND i.job_id = ANY (%(job_ids)s::bigint[])
    RETURNING i.job_id, i.attempt
),
counted AS (
    UPDATE message_batches SET request_count = request_count - (SELECT count(*) FROM dropped)
    WHERE id = %(batch_id)s AND state = 'intent'
),
closed AS (
    UPDATE llm_calls c SET finished_at = now(), outcome = 'not_sent', billed = false, error_text = %(error_text)s
    FROM dropped d WHERE c.job_id = d.job_id AND c.attempt = d.attempt AND c.outcome = 'started'
)
UPDATE story_jobs j
SET status = 'failed', completed_at = now(), error_code = 'invalid_request', error_text = %(error_text)s,
    charged_usd = 0
WHERE j.id = ANY (ARRAY(SELECT job_id FROM dropped)) AND j.status = 'running' AND j.batch_id = %(batch_id)s
RETURNING j.id;
