-- The batch lane's named queries (worker/batch/store.py runs them): the
-- submitter's lease, a batch's intent and what its create call answered,
-- the reconciliation of a lost answer, and the ingestion of results. The
-- lane's promise and its protocol are in docs/batches.md; the conventions
-- in common.sql.
--
-- A batch job is owned by its batch (story_jobs.batch_id), never by a
-- process: every transition below names the batch it expects, so a results
-- stream read twice changes nothing. Every statement the holder runs that
-- changes what others read (intents, sends, strays, losses, results) checks
-- in the same statement that the submitter's lease is still its own under
-- its token (batch_lease_held, migration 019, which also holds the lease's
-- row until the transaction ends, so that no new holder takes it meanwhile):
-- a holder paused past its lease changes nothing, whatever it read before
-- the pause. A job ends through jobs_end (migration 019), guarded by its
-- batch, and is charged what its ledger says.


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
-- owned by it). Its items and ledger rows follow in the same transaction
-- (batch_intent_items). From its commit on the provider may bill them;
-- nothing may make them pending again. No row: no lease, or no job waiting.
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
moved AS (
    UPDATE story_jobs j
    SET status = 'running', batch_id = b.id, batch_ready_at = NULL, worker_id = 'batch-' || b.id,
        started_at = coalesce(j.started_at, now()), heartbeat_at = now()
    FROM batch b
    WHERE j.id = ANY (ARRAY(SELECT id FROM ready)) AND j.batch_ready_at IS NOT NULL AND j.lane = 'batch'
      AND j.status IN ('pending', 'running')
    RETURNING j.id
)
SELECT b.id, b.fence_at, coalesce((SELECT array_agg(id ORDER BY id) FROM moved), '{}') AS job_ids
FROM batch b;

-- name: batch_intent_items
-- The second statement of an intent, in its transaction: each job the
-- batch now owns (%(job_ids)s, as batch_intent_create answered them) gets
-- its item (custom_id, attempt) and its ledger row, at
-- the job's worst case. A statement of its own so that its snapshot, taken
-- once batch_intent_create holds the jobs' rows, sees every attempt an
-- earlier intent recorded for them: an attempt number read from an older
-- snapshot could be one a concurrent intent had just used. Answers every
-- item of the batch (an item already written is not written again).
WITH lease AS MATERIALIZED (
    SELECT batch_lease_held(%(holder)s, %(token)s) AS held
),
owned AS MATERIALIZED (
    SELECT j.id, j.request, j.max_tokens, j.model, j.trace_context, j.worst_case_usd,
           (SELECT coalesce(max(c.attempt), 0) + 1 FROM llm_calls c WHERE c.job_id = j.id) AS attempt
    FROM story_jobs j, lease
    WHERE lease.held AND j.id = ANY (%(job_ids)s::bigint[]) AND j.batch_id = %(batch_id)s AND j.status = 'running'
      AND j.batch_ready_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM message_batch_items i WHERE i.batch_id = %(batch_id)s AND i.job_id = j.id)
      AND EXISTS (SELECT 1 FROM message_batches b WHERE b.id = %(batch_id)s AND b.state = 'intent')
    ORDER BY j.id
),
items AS (
    INSERT INTO message_batch_items (batch_id, custom_id, job_id, attempt)
    SELECT %(batch_id)s, 'sj-' || %(batch_id)s || '-' || id || '-' || attempt, id, attempt FROM owned
    RETURNING custom_id, job_id, attempt
),
ledger AS (
    INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, batch_id, worst_case_usd)
    SELECT id, attempt, %(holder)s, %(provider)s, coalesce(model, %(model)s), %(batch_id)s, worst_case_usd FROM owned
)
SELECT coalesce(json_agg(json_build_object(
           'custom_id', i.custom_id, 'job_id', i.job_id, 'attempt', i.attempt, 'request', j.request,
           'max_tokens', j.max_tokens, 'model', j.model, 'trace_context', j.trace_context)
           ORDER BY i.job_id), '[]')::text AS items
FROM (SELECT custom_id, job_id, attempt FROM items
      UNION ALL
      SELECT custom_id, job_id, attempt FROM message_batch_items WHERE batch_id = %(batch_id)s) i
JOIN story_jobs j ON j.id = i.job_id;

-- name: batch_sent
-- The create call answered: the intent becomes a batch in flight, with the
-- provider's id (or, reconciled after a lost answer, the id found). Guarded
-- by the intent's state (adopted once) and by the lease. A provider batch id
-- that a row of ours already records is answered (known_as: that row), not
-- raised: the intent stays as it is, for reconciliation.
WITH lease AS MATERIALIZED (
    SELECT batch_lease_held(%(holder)s, %(token)s) AS held
),
known AS MATERIALIZED (
    SELECT id, state FROM message_batches WHERE provider_batch_id = %(provider_batch_id)s
),
sent AS (
    UPDATE message_batches b
    SET state = 'sent', provider_batch_id = %(provider_batch_id)s, sent_at = now(),
        expires_at = %(expires_at)s, processing_status = %(processing_status)s
    FROM lease
    WHERE lease.held AND b.id = %(batch_id)s AND b.state = 'intent' AND NOT EXISTS (SELECT 1 FROM known)
    RETURNING b.id
)
SELECT EXISTS (SELECT 1 FROM sent) AS sent, (SELECT id FROM known) AS known_as,
       (SELECT state FROM known) AS known_state, (SELECT held FROM lease) AS lease_held;

-- name: batch_refused
-- The create call was refused before anything was made (a 4xx, a refused
-- connection): nothing was billed. The intent is refused, its requests read
-- as errored, and its jobs wait for a later batch, or fail unbilled
-- (%(error_code)s) once they have had %(max_attempts)s attempts
-- (batch_attempts_unbilled, migration 019).
--
-- Fenced by the lease, but for one write: the holder that made an intent
-- closes it as never sent (%(outcome)s 'not_sent') with or without the
-- lease. What it knows about its own create cannot be stale, and the
-- intent's state is the fence (a loss the next holder declared, or a batch
-- it adopted, moved it first); otherwise a holder whose lease ran out
-- before its create would leave the intent to be declared lost, its jobs
-- failed at their worst case for a batch that was never sent.
WITH lease AS MATERIALIZED (
    SELECT batch_lease_held(%(holder)s, %(token)s) AS held
),
refused AS MATERIALIZED (
    UPDATE message_batches b SET state = 'refused', ended_at = now()
    FROM lease
    WHERE (lease.held OR (%(outcome)s = 'not_sent' AND b.holder = %(holder)s))
      AND b.id = %(batch_id)s AND b.state = 'intent'
    RETURNING b.id
),
items_read AS MATERIALIZED (
    UPDATE message_batch_items i SET result = 'errored', read_at = now()
    FROM refused r
    WHERE i.batch_id = r.id AND i.result IS NULL
    RETURNING i.job_id, i.attempt
),
ended AS MATERIALIZED (
    SELECT u.* FROM batch_attempts_unbilled(%(batch_id)s, ARRAY(
        SELECT ROW(job_id, attempt, %(outcome)s, %(error_text)s, attempt >= %(max_attempts)s,
                   %(error_code)s)::batch_attempt_unbilled
        FROM items_read ORDER BY job_id)) u
)
SELECT (SELECT count(*) FROM refused) AS refused, ended.failed, ended.waiting FROM ended;

-- name: batch_lost
-- No batch of this intent appeared within BATCH_RECONCILE_GRACE_S: its
-- create may still have been made, so every request of it may be billed.
-- Its requests are read as lost (a batch of it found later, a stray, may
-- overwrite that once with its real result), each ledger row is closed as
-- interrupted (an unknown outcome: it costs its worst case), and its jobs
-- fail as calls of unknown outcome (llm_error), each charged that. A stray
-- found later brings each charge to what its result really cost, through
-- the ledger.
WITH lease AS MATERIALIZED (
    SELECT batch_lease_held(%(holder)s, %(token)s) AS held
),
lost AS MATERIALIZED (
    UPDATE message_batches b SET state = 'lost', ended_at = now()
    FROM lease
    WHERE lease.held AND b.id = %(batch_id)s AND b.state = 'intent'
    RETURNING b.id
),
items_read AS MATERIALIZED (
    UPDATE message_batch_items i SET result = 'lost', read_at = now()
    FROM lost
    WHERE i.batch_id = lost.id AND i.result IS NULL
    RETURNING i.job_id, i.attempt
),
calls_closed AS MATERIALIZED (
    UPDATE llm_calls c
    SET finished_at = now(), outcome = 'interrupted', billed = true,
        error_text = 'the batch was created or not: its create call was not answered and no batch of it was found'
    FROM items_read i
    WHERE c.job_id = ANY (ARRAY(SELECT job_id FROM items_read)) AND c.job_id = i.job_id AND c.attempt = i.attempt
      AND c.outcome IN ('started', 'interrupted')
    RETURNING c.job_id
),
-- (once the ledger rows are closed: `closed` is read by the argument)
failed AS MATERIALIZED (
    SELECT e.* FROM (SELECT count(*) FROM calls_closed) closed, jobs_end(
        ARRAY(SELECT ROW(job_id, 'failed', 'llm_error',
                         'the batch was sent and its answer was lost; no batch of it was found within '
                         || 'BATCH_RECONCILE_GRACE_S, so the request may have been billed and is not sent again',
                         NULL, NULL)::job_end
              FROM items_read WHERE closed.count >= 0 ORDER BY job_id),
        '{running}', NULL, %(batch_id)s) e
)
SELECT (SELECT count(*) FROM lost) AS lost, (SELECT count(*) FROM failed) AS failed;

-- name: batch_stray_record
-- A batch of the workspace that no row of ours knows, found while a lost
-- intent (%(lost_batch_id)s) may still have made one: kept, so that it is
-- cancelled and its results charged by custom_id. Known already, or the
-- lease no longer ours: nothing.
INSERT INTO message_batches (state, provider_batch_id, model, request_count, fence_at, sent_at, expires_at,
                             processing_status, lost_batch_id)
SELECT 'stray', %(provider_batch_id)s, %(model)s, %(request_count)s, %(created_at)s, now(), %(expires_at)s,
       %(processing_status)s, %(lost_batch_id)s
WHERE batch_lease_held(%(holder)s, %(token)s)
ON CONFLICT (provider_batch_id) DO NOTHING
RETURNING id;

-- name: batch_live_list
-- The batches the holder looks after: intents (to reconcile), batches in
-- flight and strays (to collect), and intents lost in the last 24 hours
-- (while their batch may still turn up), oldest first. A day from the loss,
-- not from the fence: an intent lost long after its fence (no holder for a
-- day) may still see its batch made by a holder that was paused before its
-- create call.
SELECT b.id, b.state, b.provider_batch_id, b.model, b.request_count, b.fence_at, b.expires_at,
       b.processing_status, b.cancel_asked_at, b.lost_batch_id,
       extract(epoch FROM now() - b.fence_at)::float8 AS age_s,
       -- every job of it ended elsewhere (cancelled, swept): worth cancelling
       NOT EXISTS (SELECT 1 FROM message_batch_items i JOIN story_jobs j ON j.id = i.job_id
                   WHERE i.batch_id = b.id AND j.status = 'running' AND j.batch_id = b.id) AS abandoned
FROM message_batches b
WHERE b.state IN ('intent', 'sent', 'stray')
   OR (b.state = 'lost' AND coalesce(b.ended_at, b.fence_at) > now() - interval '24 hours')
ORDER BY b.id;

-- name: batch_known
-- Which of these provider batch ids a row of ours knows.
SELECT provider_batch_id FROM message_batches WHERE provider_batch_id = ANY (%(provider_batch_ids)s::text[]);

-- name: batch_seen
-- What the provider last said of a batch in flight, while the lease is ours.
UPDATE message_batches
SET processing_status = %(processing_status)s, request_counts = %(request_counts)s::jsonb,
    expires_at = coalesce(%(expires_at)s, expires_at),
    ended_at = CASE WHEN %(processing_status)s = 'ended' THEN coalesce(ended_at, now()) ELSE ended_at END
WHERE id = %(batch_id)s AND state IN ('sent', 'stray') AND batch_lease_held(%(holder)s, %(token)s);

-- name: batch_cancel_asked
UPDATE message_batches SET cancel_asked_at = coalesce(cancel_asked_at, now())
WHERE id = %(batch_id)s AND state IN ('sent', 'stray') AND batch_lease_held(%(holder)s, %(token)s);

-- name: batch_results_ingest
-- A chunk of an ended batch's results, by custom_id, in one transaction,
-- while the lease is ours. Idempotent: an item already read is skipped, so
-- a stream cut halfway and read again from its start changes nothing (a
-- lost intent's item, read as lost, is read once more, from its stray).
-- Each result:
--   succeeded: the story stored, the ledger row closed billed at the job's
--              (batch) prices; the job completed if still running under this
--              batch, else (cancelled, swept, lost) its story kept unseen;
--   unknown:   it may have billed (its line could not be read, or there was
--              none): the ledger row closed as interrupted (its worst case),
--              the job failed as llm_error;
--   errored, expired, canceled: billed nothing (batch_attempts_unbilled): a
--              refused request (%(rejected)s) fails its job as llm_rejected;
--              any other waits for a later batch until its
--              %(max_attempts)s-th attempt, then fails as llm_unavailable.
-- Whatever the job's state, its charge follows its ledger rows (migration
-- 019): a result read after its job ended elsewhere brings the charge to
-- what the result says was billed, down as well as up.
WITH lease AS MATERIALIZED (
    SELECT batch_lease_held(%(holder)s, %(token)s) AS held
),
got AS MATERIALIZED (
    SELECT g.*, i.job_id, i.attempt
    FROM jsonb_to_recordset(%(results)s::jsonb) AS g(
        custom_id text, result text, rejected boolean, story_id uuid, title text, body text, model text,
        prompt_version text, input_tokens int, output_tokens int, request_id text, error_text text)
    JOIN message_batch_items i ON i.batch_id = %(batch_id)s AND i.custom_id = g.custom_id
                               AND (i.result IS NULL OR i.result = 'lost')
    WHERE (SELECT held FROM lease)
    ORDER BY i.job_id
),
items_read AS (
    UPDATE message_batch_items i SET result = g.result, read_at = now()
    FROM got g
    WHERE i.batch_id = %(batch_id)s AND i.custom_id = g.custom_id AND (i.result IS NULL OR i.result = 'lost')
),
-- the jobs' rows locked in ascending id order, as every statement that
-- waits for several job rows locks them (jobs_end, migration 019), before
-- their ledger rows
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
billed_closed AS MATERIALIZED (
    UPDATE llm_calls c
    SET finished_at = now(), outcome = CASE b.result WHEN 'succeeded' THEN 'succeeded' ELSE 'interrupted' END,
        billed = true, input_tokens = b.input_tokens, output_tokens = b.output_tokens, cost_usd = b.cost_usd,
        request_id = b.request_id, error_text = b.error_text
    FROM billed b
    WHERE c.job_id = ANY (ARRAY(SELECT job_id FROM billed)) AND c.job_id = b.job_id AND c.attempt = b.attempt
      AND c.outcome IN ('started', 'interrupted')
    RETURNING c.job_id
),
-- ours ends once its ledger row is closed (`closed` is read by the
-- argument), so that it is charged what the row says in the write that ends
-- it
ended AS MATERIALIZED (
    SELECT e.* FROM (SELECT count(*) FROM billed_closed) closed, jobs_end(
        ARRAY(SELECT ROW(b.job_id, CASE b.result WHEN 'succeeded' THEN 'completed' ELSE 'failed' END::job_status,
                         CASE WHEN b.result = 'unknown' THEN 'llm_error' END,
                         CASE WHEN b.result = 'unknown' THEN b.error_text END,
                         CASE WHEN b.result = 'succeeded' THEN b.story_id END,
                         CASE WHEN b.result = 'succeeded' THEN b.output_tokens END)::job_end
              FROM billed b WHERE b.ours AND closed.count >= 0 ORDER BY b.job_id),
        '{running}', NULL, %(batch_id)s) e
),
-- (after the jobs' rows are locked: `locked` is read by the argument)
unbilled AS MATERIALIZED (
    SELECT u.* FROM (SELECT count(*) FROM job) locked, batch_attempts_unbilled(%(batch_id)s, ARRAY(
        SELECT ROW(g.job_id, g.attempt, CASE WHEN g.rejected THEN 'rejected' ELSE g.result END, g.error_text,
                   g.rejected OR g.attempt >= %(max_attempts)s,
                   CASE WHEN g.rejected THEN 'llm_rejected' ELSE 'llm_unavailable' END)::batch_attempt_unbilled
        FROM got g WHERE g.result NOT IN ('succeeded', 'unknown') AND locked.count >= 0 ORDER BY g.job_id)) u
)
SELECT (SELECT count(*) FROM got) AS read,
       (SELECT count(*) FROM ended WHERE error_code IS NULL) AS completed,
       (SELECT count(*) FROM billed WHERE NOT ours) AS billed_unseen,
       coalesce((SELECT failed FROM unbilled), 0) + (SELECT count(*) FROM ended WHERE error_code IS NOT NULL) AS failed,
       coalesce((SELECT waiting FROM unbilled), 0) AS waiting,
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
  AND batch_lease_held(%(holder)s, %(token)s)
RETURNING b.id;

-- name: batch_items_of
-- A batch's requests not read yet (for a lost intent, whose stray may still
-- answer them: those read as lost), with what each job was admitted with:
-- the request (its input tokens' bound), max_tokens, model and prices, from
-- which a worst case and a cost are reckoned.
SELECT i.custom_id, i.job_id, i.attempt, j.request, j.max_tokens, j.model, j.input_usd_per_mtok,
       j.output_usd_per_mtok, j.trace_context
FROM message_batch_items i JOIN story_jobs j ON j.id = i.job_id
WHERE i.batch_id = %(batch_id)s AND (i.result IS NULL OR i.result = 'lost')
ORDER BY i.custom_id;

-- name: batch_stray_read
-- A stray batch's results have all been read (those that were ours charged).
UPDATE message_batches SET state = 'ended', results_read_at = now(), ended_at = coalesce(ended_at, now())
WHERE id = %(batch_id)s AND state = 'stray' AND batch_lease_held(%(holder)s, %(token)s)
RETURNING id;

-- name: batch_items_drop
-- Before its create call, requests of an intent that cannot be sent (a
-- stored request that no longer validates): their items gone, so that the
-- batch created is the intent's, request for request, their ledger rows
-- closed as not sent, and their jobs failed (invalid_request) through
-- jobs_end, which charges them nothing.
WITH lease AS MATERIALIZED (
    SELECT batch_lease_held(%(holder)s, %(token)s) AS held
),
dropped AS MATERIALIZED (
    DELETE FROM message_batch_items i
    USING message_batches b, lease
    WHERE lease.held AND i.batch_id = %(batch_id)s AND b.id = i.batch_id AND b.state = 'intent'
      AND i.job_id = ANY (%(job_ids)s::bigint[])
    RETURNING i.job_id, i.attempt
),
counted AS (
    UPDATE message_batches SET request_count = request_count - (SELECT count(*) FROM dropped)
    WHERE id = %(batch_id)s AND state = 'intent' AND EXISTS (SELECT 1 FROM dropped)
),
closed AS MATERIALIZED (
    UPDATE llm_calls c SET finished_at = now(), outcome = 'not_sent', billed = false, error_text = %(error_text)s
    FROM dropped d WHERE c.job_id = d.job_id AND c.attempt = d.attempt AND c.outcome = 'started'
    RETURNING c.job_id
)
-- (once the ledger rows are closed: `k` is read by the argument)
SELECT e.id FROM (SELECT count(*) FROM closed) k, jobs_end(
    ARRAY(SELECT ROW(job_id, 'failed', 'invalid_request', %(error_text)s, NULL, NULL)::job_end
          FROM dropped WHERE k.count >= 0 ORDER BY job_id),
    '{running}', NULL, %(batch_id)s) e;
