-- What operators read and do, from the console at /ops/ (api/ops/,
-- its webhooks screen in api/ops/webhooks.py) and from the `storyjobs` command
-- (tools/cli.py): both run these through shared/console_store.py (a
-- method per query, named as it, in shared/console_*.py). The
-- conventions are in common.sql.
--
-- The console reads history without an index of its own: every index on
-- story_jobs costs each status change a write, so lists walk the primary key
-- newest first (id DESC) with their filters, each request over a bounded
-- range of ids, and times are turned into id bounds by job_id_bounds
-- (common.sql).


-- name: api_key_revoke
UPDATE api_keys SET revoked_at = now()
WHERE key_prefix = %(key_prefix)s AND revoked_at IS NULL
RETURNING key_prefix;

-- name: llm_rate_bucket_list
-- The shared rate buckets, refilled to now as a claim refills them at the
-- rates the caller knows (bucket_held_now, migration 017; NULL rate: as
-- stored): the console's overview, `storyjobs stats`.
SELECT model,
       bucket_held_now(requests, %(requests_rate)s::float8, %(requests_capacity)s::float8, refilled_at)
           AS requests,
       bucket_held_now(input_tokens, %(input_tokens_rate)s::float8, %(input_tokens_capacity)s::float8, refilled_at)
           AS input_tokens,
       bucket_held_now(output_tokens, %(output_tokens_rate)s::float8, %(output_tokens_capacity)s::float8,
                       refilled_at) AS output_tokens,
       bucket_paused_s(paused_until) AS paused_s
FROM llm_rate_buckets ORDER BY model;

-- name: llm_call_list_for_job
SELECT attempt, worker_id, provider, model, started_at, finished_at, outcome, billed,
       input_tokens, output_tokens, cost_usd, request_id, error_text
FROM llm_calls WHERE job_id = %(job_id)s ORDER BY attempt;

-- name: operator_key_get
-- Every /ops request: the api compares key_hash in constant time. Only
-- operator_keys is read, so a client's key is not found here.
SELECT key_hash, revoked_at IS NOT NULL AS revoked, name, id AS key_id
FROM operator_keys
WHERE key_prefix = %(key_prefix)s;

-- name: operator_key_list
SELECT key_prefix, name, created_at, revoked_at FROM operator_keys ORDER BY id;

-- name: operator_key_revoke
UPDATE operator_keys SET revoked_at = now()
WHERE key_prefix = %(key_prefix)s AND revoked_at IS NULL
RETURNING key_prefix;

-- name: ops_job_list
-- The console's jobs list, newest first, by one of two walks that
-- %(live)s chooses; only the chosen one runs (the other's branch is planned
-- away when the parameters are known, or skipped by its one-time filter in a
-- generic plan). Filters that are NULL are off. No OFFSET, no count.
-- History (NOT %(live)s): a walk down the primary key from %(before_id)s,
-- stopping at %(floor_id)s or when %(limit)s rows matched, whichever comes
-- first. The console keeps the range to a bounded number of ids, so a
-- request costs the same whether the filters match every row or none, and
-- however deep the page (`storyjobs jobs list` walks every id).
-- Live (%(live)s): the jobs of one live status (pending or running) by
-- (created_at, id) below the cursor (%(before_created_at)s, %(before_id)s;
-- NULL: from the newest): the order of the live-jobs index, read backwards,
-- so the answer costs what the queue holds, never the history.
-- For the rows of the page only: each job's client's name and what its
-- ended calls cost, read from its own ledger rows by their primary key (as
-- the ledger charges them, migration 019: an unknown outcome at its worst
-- case).
WITH page AS MATERIALIZED (
    (SELECT j.id, j.public_id, j.client_id, j.status, j.lane, j.error_code, j.worker_id, j.progress,
            j.created_at, j.started_at, j.completed_at
     FROM story_jobs j
     WHERE NOT %(live)s::boolean
       AND j.id < %(before_id)s::bigint AND j.id >= %(floor_id)s::bigint
       AND (%(status)s::job_status IS NULL OR j.status = %(status)s::job_status)
       AND (%(client_id)s::bigint IS NULL OR j.client_id = %(client_id)s::bigint)
       AND (%(error_code)s::text IS NULL OR j.error_code = %(error_code)s::text)
       AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
       AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
     ORDER BY j.id DESC
     LIMIT %(limit)s)
    UNION ALL
    (SELECT j.id, j.public_id, j.client_id, j.status, j.lane, j.error_code, j.worker_id, j.progress,
            j.created_at, j.started_at, j.completed_at
     FROM story_jobs j
     WHERE %(live)s::boolean
       AND j.status = %(status)s::job_status AND j.status IN ('pending', 'running')
       AND (j.created_at, j.id) < (coalesce(%(before_created_at)s::timestamptz, 'infinity'),
                                   coalesce(%(before_id)s::bigint, 9223372036854775807))
       AND (%(client_id)s::bigint IS NULL OR j.client_id = %(client_id)s::bigint)
       AND (%(error_code)s::text IS NULL OR j.error_code = %(error_code)s::text)
       AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
       AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
     ORDER BY j.created_at DESC, j.id DESC
     LIMIT %(limit)s)
)
SELECT p.id, p.public_id, p.client_id, coalesce(c.name, '') AS client_name, p.status::text AS status,
       p.lane::text AS lane, p.error_code, p.worker_id, p.progress, p.created_at, p.started_at, p.completed_at,
       cost.calls, cost.billed_calls, cost.cost_usd
FROM page p
LEFT JOIN api_clients c ON c.id = p.client_id
CROSS JOIN LATERAL (
    SELECT count(*) AS calls, coalesce(sum(t.billed_calls), 0) AS billed_calls,
           coalesce(sum(t.spend_usd), 0)::numeric(14, 6) AS cost_usd
    FROM llm_call_tallies t WHERE t.job_id = p.id
) cost
-- history's rows have no created_at key here: by id alone
ORDER BY CASE WHEN %(live)s::boolean THEN p.created_at END DESC, p.id DESC;

-- name: ops_job_get
-- A job's page (and `storyjobs jobs show ID`): the job, its client and its
-- story (kept also when the job failed after the story was paid for), by
-- the public id's unique index; a running job's draft (migration 020), the
-- story as it is written so far; a batch job's batch (the one that owns it,
-- or its last, while it waits for the next) by that batch's primary key.
SELECT j.id, j.public_id, j.client_id, coalesce(c.name, '') AS client_name, j.status::text AS status,
       j.lane::text AS lane, j.error_code, j.error_text, j.worker_id, j.progress, j.request,
       j.created_at, j.started_at, j.heartbeat_at, j.completed_at, j.batch_ready_at,
       s.id AS story_id, s.title AS story_title, s.body AS story_body, s.model AS story_model,
       s.prompt_version AS story_prompt_version, s.input_tokens AS story_input_tokens,
       s.output_tokens AS story_output_tokens, s.cost_usd AS story_cost_usd,
       b.id AS batch_id, b.state AS batch_state, b.provider_batch_id AS batch_provider_id,
       b.processing_status AS batch_processing_status, b.expires_at AS batch_expires_at,
       d.text AS draft_text, d.chars AS draft_chars, d.updated_at AS draft_updated_at
FROM story_jobs j
LEFT JOIN api_clients c ON c.id = j.client_id
LEFT JOIN stories s ON s.job_id = j.id
LEFT JOIN message_batches b ON b.id = j.batch_id
LEFT JOIN LATERAL (
    SELECT coalesce(string_agg(k.text, '' ORDER BY k.from_char), '') AS text,
           coalesce(max(k.from_char + k.chars), 0) AS chars, max(k.written_at) AS updated_at
    FROM story_draft_chunks k WHERE k.job_id = j.id
) d ON j.status = 'running' AND j.lane = 'interactive'
WHERE j.public_id = %(job_id)s;

-- name: ops_job_count_pending
-- What cancelling the pending jobs matching a filter would cancel: how many,
-- and the highest id among them, which the operator's confirmation carries
-- back so that ops_job_cancel_pending cancels those jobs and none that
-- arrived since. Read on the live-jobs index: the cost follows the queue.
SELECT count(*) AS pending, max(j.id) AS through_id
FROM story_jobs j
WHERE j.status = 'pending'
  AND (%(client_id)s::bigint IS NULL OR j.client_id = %(client_id)s::bigint)
  AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
  AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz);

-- name: ops_job_cancel_pending
-- Cancels every pending job matching a filter, up to the id the operator
-- confirmed, in one statement: pending -> failed (cancelled), guarded by the
-- status like every transition. Rows are locked in id order, so two of these
-- at once cannot deadlock; a job a worker claims meanwhile is re-checked
-- after the lock, found running and left alone. Cancelling lowers the true
-- pending count, so job_admission's bounds stay bounds. The cancelled jobs'
-- turns are given back to their clients (job_turns_give_back, migration 022),
-- so the caller takes the admission lock first.
WITH matching AS MATERIALIZED (
    SELECT j.id FROM story_jobs j
    WHERE j.status = 'pending' AND j.id <= %(through_id)s
      AND (%(client_id)s::bigint IS NULL OR j.client_id = %(client_id)s::bigint)
      AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
      AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
    ORDER BY j.id
    FOR NO KEY UPDATE
),
-- ended through jobs_end (migration 019), which takes a batch job out of
-- the line and charges each what its ledger says (nothing: it never ran)
cancelled AS MATERIALIZED (
    SELECT c.* FROM jobs_end(
        ARRAY(SELECT ROW(id, 'failed', 'cancelled', 'cancelled by an operator', NULL, NULL)::job_end FROM matching),
        '{pending}', NULL, NULL) c
),
given_back AS MATERIALIZED (
    SELECT job_turns_give_back(ARRAY(SELECT ROW(id, client_id, turn)::job_turn FROM cancelled
                                     WHERE turn IS NOT NULL))
)
SELECT public_id FROM cancelled CROSS JOIN (SELECT count(*) FROM given_back) g;

-- name: ops_client_list
-- The clients, for the console's filter and its keys screen, and `storyjobs
-- keys list`, by name, each with its keys: one JSON document, decoded in one
-- pass (shared/console_clients.py). A row per client with its keys as JSON
-- cost a parse of each client's keys, the most of the clients screen's time
-- at 1,000 clients (docs/performance.md).
SELECT coalesce(json_agg(listed ORDER BY listed.name), '[]')::text AS clients
FROM (
    SELECT c.id AS client_id, c.name, c.created_at, c.budget_usd_per_day, c.weight,
           coalesce(json_agg(json_build_object(
               'key_prefix', k.key_prefix, 'created_at', k.created_at, 'revoked_at', k.revoked_at)
               ORDER BY k.id) FILTER (WHERE k.id IS NOT NULL), '[]') AS keys
    FROM api_clients c
    LEFT JOIN api_keys k ON k.client_id = c.id
    GROUP BY c.id
) listed;

-- name: api_key_revoke_for_client
-- Revokes every key of a client that is still active, effective from each
-- key's next request; answers the prefixes revoked now, and no row when
-- there is no such client.
WITH client AS (
    SELECT id FROM api_clients WHERE id = %(client_id)s
),
revoked AS (
    UPDATE api_keys k SET revoked_at = now()
    FROM client
    WHERE k.client_id = client.id AND k.revoked_at IS NULL
    RETURNING k.key_prefix
)
SELECT coalesce((SELECT array_agg(key_prefix ORDER BY key_prefix) FROM revoked), '{}') AS revoked
FROM client;

-- name: ops_overview
-- The console's overview (and `storyjobs stats`) in one statement. Live jobs come from the
-- live-jobs indexes: the interactive queue (what QUEUE_MAX bounds,
-- job_queue_depth, migration 017) apart from the batch lane's live jobs
-- (what BATCH_QUEUE_MAX bounds), which wait for a batch by design.
--
-- The last hour and the last day are whole minutes: from the start of the
-- minute an hour (a day) before now's. Finished jobs are counted by the
-- minute they finished, the ledger's requests by the minute they started. A
-- story billed but not delivered is a failed job with billed calls.
--
-- The minutes before the sweeper's last pass (the rollup's newest minute)
-- are summed from the rollup (migration 024: at most 1,440 rows); the rest
-- is read from the jobs and the ledger: the jobs that finished since that
-- minute (ids from the pass's jobs_from_id up), the requests started since
-- (on the ledger's started_at index), and the day's requests of the jobs
-- that are running or finished since (by their primary key): the rollup's
-- ended_* columns leave out exactly those, so each request is counted once,
-- as it is now. Without such a pass within the day (no sweeper, or none
-- since migration 024), the whole day is read that way, from
-- %(day_from_id)s: the caller takes that id from job_id_bounds at a day
-- plus the longest a job can wait and run before the sweeper fails it.
WITH
-- the day, the hour, and from where the tables are read (ops_day_pass,
-- migration 024)
pass AS MATERIALIZED (SELECT * FROM ops_day_pass),
rolled AS (
    SELECT coalesce(sum(r.completed) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_completed,
           coalesce(sum(r.failed) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_failed,
           coalesce(sum(r.cancelled) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_cancelled,
           coalesce(sum(r.completed), 0) AS day_completed,
           coalesce(sum(r.failed), 0) AS day_failed,
           coalesce(sum(r.cancelled), 0) AS day_cancelled,
           coalesce(sum(r.undelivered) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_undelivered,
           coalesce(sum(r.undelivered_usd) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_undelivered_usd,
           coalesce(sum(r.undelivered), 0) AS day_undelivered,
           coalesce(sum(r.undelivered_usd), 0) AS day_undelivered_usd,
           coalesce(sum(r.ended_billed_calls) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_billed_calls,
           coalesce(sum(r.ended_spend_usd) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_spend_usd,
           coalesce(sum(r.ended_input_tokens) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_input_tokens,
           coalesce(sum(r.ended_output_tokens) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_output_tokens,
           coalesce(sum(r.ended_rate_limited) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_rate_limited,
           coalesce(sum(r.ended_overloaded) FILTER (WHERE r.minute >= p.hour_from), 0) AS hour_overloaded,
           coalesce(sum(r.ended_billed_calls), 0) AS day_billed_calls,
           coalesce(sum(r.ended_spend_usd), 0) AS day_spend_usd,
           coalesce(sum(r.ended_input_tokens), 0) AS day_input_tokens,
           coalesce(sum(r.ended_output_tokens), 0) AS day_output_tokens,
           coalesce(sum(r.ended_rate_limited), 0) AS day_rate_limited,
           coalesce(sum(r.ended_overloaded), 0) AS day_overloaded
    FROM pass p
    JOIN minute_rollup r ON r.minute >= p.day_from AND r.minute < p.read_from
),
finished AS MATERIALIZED (
    SELECT j.id, j.status, j.error_code, j.completed_at >= p.hour_from AS last_hour
    FROM story_jobs j, pass p
    -- both bounds on the primary key: the day's, which the planner sees,
    -- and the pass's (greatest() passes over a NULL: without it, the day's)
    WHERE j.id >= %(day_from_id)s AND j.id >= (SELECT greatest(jobs_from_id, %(day_from_id)s) FROM pass)
      AND j.status IN ('completed', 'failed')
      AND j.completed_at >= p.read_from
  UNION
    -- a batch job can wait and run for days, longer than those ids assume:
    -- the batch lane's finished jobs on their own index (migration 024)
    SELECT j.id, j.status, j.error_code, j.completed_at >= p.hour_from AS last_hour
    FROM story_jobs j, pass p
    WHERE j.lane = 'batch' AND j.completed_at IS NOT NULL AND j.completed_at >= p.read_from
),
jobs AS (
    SELECT count(*) FILTER (WHERE last_hour AND status = 'completed') AS hour_completed,
           count(*) FILTER (WHERE last_hour AND status = 'failed') AS hour_failed,
           count(*) FILTER (WHERE last_hour AND error_code = 'cancelled') AS hour_cancelled,
           count(*) FILTER (WHERE status = 'completed') AS day_completed,
           count(*) FILTER (WHERE status = 'failed') AS day_failed,
           count(*) FILTER (WHERE error_code = 'cancelled') AS day_cancelled
    FROM finished
),
undelivered AS (
    SELECT count(*) FILTER (WHERE f.last_hour) AS hour_undelivered,
           coalesce(sum(billed.cost_usd) FILTER (WHERE f.last_hour), 0) AS hour_undelivered_usd,
           count(*) AS day_undelivered,
           coalesce(sum(billed.cost_usd), 0) AS day_undelivered_usd
    FROM finished f
    -- on the ledger's primary key (OFFSET 0 keeps the lookup per job:
    -- pulled up, the view's grouping would read the whole ledger)
    CROSS JOIN LATERAL (
        SELECT b.charge_usd AS cost_usd FROM job_charges b WHERE b.job_id = f.id AND b.billed_calls > 0
        OFFSET 0
    ) billed
    WHERE f.status = 'failed'
),
-- the requests the rollup leaves to this read: started since its last
-- pass, and the day's others of the jobs running or finished since
read_calls AS (
    SELECT l.* FROM llm_call_tallies l WHERE l.started_at >= (SELECT read_from FROM pass)
  UNION ALL
    SELECT l.*
    FROM (SELECT id FROM story_jobs WHERE status = 'running' UNION ALL SELECT id FROM finished) k
    -- each job's calls on the primary key (OFFSET 0 keeps it a lookup per
    -- job: the planner cannot know how few jobs these are and would scan
    -- the day's ledger instead)
    CROSS JOIN LATERAL (
        SELECT l.* FROM llm_call_tallies l, pass p
        WHERE l.job_id = k.id AND l.started_at >= p.day_from AND l.started_at < p.read_from
        OFFSET 0
    ) l
),
-- what a call counts for is llm_call_tallies' (migration 027), as in the
-- rollup's minutes summed above
calls AS (
    SELECT coalesce(sum(billed_calls) FILTER (WHERE last_hour), 0) AS hour_billed_calls,
           coalesce(sum(spend_usd) FILTER (WHERE last_hour), 0) AS hour_spend_usd,
           coalesce(sum(billed_input_tokens) FILTER (WHERE last_hour), 0) AS hour_input_tokens,
           coalesce(sum(billed_output_tokens) FILTER (WHERE last_hour), 0) AS hour_output_tokens,
           coalesce(sum(rate_limited) FILTER (WHERE last_hour), 0) AS hour_rate_limited,
           coalesce(sum(overloaded) FILTER (WHERE last_hour), 0) AS hour_overloaded,
           coalesce(sum(billed_calls), 0) AS day_billed_calls,
           coalesce(sum(spend_usd), 0) AS day_spend_usd,
           coalesce(sum(billed_input_tokens), 0) AS day_input_tokens,
           coalesce(sum(billed_output_tokens), 0) AS day_output_tokens,
           coalesce(sum(rate_limited), 0) AS day_rate_limited,
           coalesce(sum(overloaded), 0) AS day_overloaded
    FROM (SELECT c.*, c.started_at >= p.hour_from AS last_hour FROM read_calls c, pass p) day
)
SELECT queue.pending, queue.running,
       coalesce(extract(epoch FROM now() - queue.oldest_pending_created_at), 0)::float8 AS oldest_pending_age_s,
       (SELECT count(*) FROM story_jobs WHERE lane = 'batch' AND status IN ('pending', 'running')) AS batch_live,
       r.hour_completed + j.hour_completed AS hour_completed, r.hour_failed + j.hour_failed AS hour_failed,
       r.hour_cancelled + j.hour_cancelled AS hour_cancelled, r.day_completed + j.day_completed AS day_completed,
       r.day_failed + j.day_failed AS day_failed, r.day_cancelled + j.day_cancelled AS day_cancelled,
       r.hour_undelivered + u.hour_undelivered AS hour_undelivered,
       (r.hour_undelivered_usd + u.hour_undelivered_usd)::numeric(14, 6) AS hour_undelivered_usd,
       r.day_undelivered + u.day_undelivered AS day_undelivered,
       (r.day_undelivered_usd + u.day_undelivered_usd)::numeric(14, 6) AS day_undelivered_usd,
       r.hour_billed_calls + c.hour_billed_calls AS hour_billed_calls,
       (r.hour_spend_usd + c.hour_spend_usd)::numeric(14, 6) AS hour_spend_usd,
       (r.hour_input_tokens + c.hour_input_tokens)::bigint AS hour_input_tokens,
       (r.hour_output_tokens + c.hour_output_tokens)::bigint AS hour_output_tokens,
       r.hour_rate_limited + c.hour_rate_limited AS hour_rate_limited,
       r.hour_overloaded + c.hour_overloaded AS hour_overloaded,
       r.day_billed_calls + c.day_billed_calls AS day_billed_calls,
       (r.day_spend_usd + c.day_spend_usd)::numeric(14, 6) AS day_spend_usd,
       (r.day_input_tokens + c.day_input_tokens)::bigint AS day_input_tokens,
       (r.day_output_tokens + c.day_output_tokens)::bigint AS day_output_tokens,
       r.day_rate_limited + c.day_rate_limited AS day_rate_limited,
       r.day_overloaded + c.day_overloaded AS day_overloaded
FROM job_queue_depth queue, rolled r, jobs j, undelivered u, calls c;

-- name: ops_history
-- The console's history: the rollup's minutes from %(since)s (at most 10,080
-- rows for a week, on its primary key) summed into buckets of %(step)s
-- aligned on %(origin)s, oldest first. The wait and run histograms are
-- summed element by element, each of the 23 elements of ROLLUP_BOUNDS_S
-- (shared/rows.py) named: one pass of plain sums, where unnesting the arrays
-- took four times as long for a week (180 ms against 49 ms). A change of the
-- bounds changes this list (tests/unit/test_rollup.py checks that they agree).
SELECT date_bin(%(step)s::interval, minute, %(origin)s::timestamptz) AS minute,
       sum(completed)::integer AS completed, sum(failed)::integer AS failed,
       sum(cancelled)::integer AS cancelled, sum(spend_usd) AS spend_usd,
       sum(rate_limited)::integer AS rate_limited, max(pending_max) AS pending_max,
       max(running_max) AS running_max,
       ARRAY[sum(wait_counts[1]), sum(wait_counts[2]), sum(wait_counts[3]), sum(wait_counts[4]),
             sum(wait_counts[5]), sum(wait_counts[6]), sum(wait_counts[7]), sum(wait_counts[8]),
             sum(wait_counts[9]), sum(wait_counts[10]), sum(wait_counts[11]), sum(wait_counts[12]),
             sum(wait_counts[13]), sum(wait_counts[14]), sum(wait_counts[15]),
             sum(wait_counts[16]), sum(wait_counts[17]), sum(wait_counts[18]),
             sum(wait_counts[19]), sum(wait_counts[20]), sum(wait_counts[21]),
             sum(wait_counts[22]), sum(wait_counts[23])]::integer[] AS wait_counts,
       ARRAY[sum(run_counts[1]), sum(run_counts[2]), sum(run_counts[3]), sum(run_counts[4]),
             sum(run_counts[5]), sum(run_counts[6]), sum(run_counts[7]), sum(run_counts[8]),
             sum(run_counts[9]), sum(run_counts[10]), sum(run_counts[11]), sum(run_counts[12]),
             sum(run_counts[13]), sum(run_counts[14]), sum(run_counts[15]), sum(run_counts[16]),
             sum(run_counts[17]), sum(run_counts[18]), sum(run_counts[19]), sum(run_counts[20]),
             sum(run_counts[21]), sum(run_counts[22]), sum(run_counts[23])]::integer[] AS run_counts
FROM minute_rollup
WHERE minute >= %(since)s
GROUP BY 1
ORDER BY 1;

-- name: ops_writers_recent
-- Which writers (the ledger's provider: "anthropic", or "offline" for the
-- built-in offline writer) sent requests in the last day (whole minutes, as
-- the overview counts it), for the overview: the rollup's writers of each
-- minute before the sweeper's last pass (at most 1,440 rows), and the
-- ledger's from then on (its started_at index).
WITH
-- the day, the hour, and from where the tables are read (ops_day_pass,
-- migration 024)
pass AS MATERIALIZED (SELECT * FROM ops_day_pass),
writers AS (
    SELECT unnest(r.providers) AS provider
    FROM pass p
    JOIN minute_rollup r ON r.minute >= p.day_from AND r.minute < p.read_from
  UNION ALL
    SELECT l.provider FROM llm_calls l WHERE l.started_at >= (SELECT read_from FROM pass)
)
SELECT DISTINCT provider FROM writers ORDER BY provider;

-- name: ops_client_today
-- Each client's jobs created on the UTC day that starts at %(day_start)s, as
-- their inserts counted them (client_days, migration 026), and its failures
-- among them (cancellations aside), ids from %(from_id)s up, on the failed
-- jobs' own index: what is read is the day's failures, not the day's jobs.
-- The day's start comes from the api's clock: the failures are bounded to
-- the same day as the counts, and a client's failures are never dropped for
-- want of its count.
SELECT coalesce(d.client_id, f.client_id) AS client_id, coalesce(d.jobs, 0) AS jobs,
       coalesce(f.failed, 0) AS failed
FROM (SELECT client_id, jobs FROM client_days WHERE day = budget_day(%(day_start)s)) d
FULL JOIN (
    SELECT j.client_id, count(*) AS failed
    FROM story_jobs j
    WHERE j.status = 'failed' AND j.error_code IS DISTINCT FROM 'cancelled'
      AND j.id >= %(from_id)s AND j.created_at >= %(day_start)s
      AND j.created_at < %(day_start)s::timestamptz + interval '1 day'
    GROUP BY j.client_id
) f ON f.client_id = d.client_id;

-- name: ops_workers
-- The workers seen in the last hour: those holding running jobs (with their
-- jobs' last heartbeat, on the live-jobs index) and those that sent a request
-- (the ledger, by time). A running batch job is held by its batch, not by a
-- worker, and sends no heartbeat: it is on the batches screen instead; the
-- worker that sent its batch is seen by its ledger row.
WITH busy AS (
    SELECT worker_id, count(*) AS running, max(heartbeat_at) AS last_heartbeat_at,
           array_agg(public_id ORDER BY id) AS job_ids
    FROM story_jobs
    WHERE status = 'running' AND lane = 'interactive'
    GROUP BY worker_id
),
seen AS (
    SELECT worker_id, max(started_at) AS last_request_at
    FROM llm_calls
    WHERE started_at >= now() - interval '1 hour'
    GROUP BY worker_id
)
SELECT coalesce(b.worker_id, s.worker_id) AS worker_id, coalesce(b.running, 0)::integer AS running,
       b.last_heartbeat_at, extract(epoch FROM now() - b.last_heartbeat_at)::float8 AS heartbeat_age_s,
       s.last_request_at, coalesce(b.job_ids, '{}') AS job_ids
FROM busy b
FULL JOIN seen s ON s.worker_id = b.worker_id
ORDER BY 1;

-- name: webhook_endpoint_list
-- `storyjobs webhooks endpoints` and the console: every endpoint, its
-- client, and its deliveries by state.
SELECT e.id, e.client_id, coalesce(c.name, '') AS client_name, e.url, e.events, e.created_at,
       e.disabled_at, e.failing_since,
       (SELECT count(*) FROM webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'pending') AS pending,
       (SELECT count(*) FROM webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'dead') AS dead
FROM webhook_endpoints e LEFT JOIN api_clients c ON c.id = e.client_id
WHERE (%(client_id)s::bigint IS NULL OR e.client_id = %(client_id)s::bigint)
ORDER BY c.name, e.created_at, e.id;

-- name: webhook_delivery_list
-- `storyjobs webhooks deliveries` and the console: the last deliveries,
-- newest first, of one endpoint or all, in one state or any.
SELECT d.id, d.endpoint_id, e.url, d.job_public_id AS job_id, d.job_status::text AS job_status, d.error_code,
       d.state, d.attempts, d.created_at, d.next_attempt_at, d.last_attempt_at, d.last_status_code,
       d.last_error, d.delivered_at
FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
WHERE (%(endpoint_id)s::uuid IS NULL OR d.endpoint_id = %(endpoint_id)s::uuid)
  AND (%(state)s::text IS NULL OR d.state = %(state)s::text)
ORDER BY d.id DESC
LIMIT %(limit)s;

-- name: webhook_delivery_retry
-- An operator sends a dead delivery again: dead -> pending, due now, with a
-- fresh schedule (attempts from 0; its endpoint is enabled again unless it
-- was deleted). Its lease number goes up, never back: an attempt from before
-- the retry can never record its end onto the ones after it. Guarded by the
-- state it expects; no row: not a dead delivery. The job's public id comes
-- back for the audit record (operator_action_insert, same transaction).
WITH retried AS (
    UPDATE webhook_deliveries d
    SET state = 'pending', attempts = 0, lease = d.lease + 1, leased_until = NULL, next_attempt_at = now(),
        last_error = NULL
    WHERE d.id = %(delivery_id)s AND d.state = 'dead'
    RETURNING d.id, d.endpoint_id, d.job_public_id
),
enabled AS (
    UPDATE webhook_endpoints e SET disabled_at = NULL
    FROM retried WHERE e.id = retried.endpoint_id AND e.disabled_at IS NOT NULL
)
SELECT job_public_id FROM retried;

-- name: operator_action_insert
-- An operator's action, recorded in the action's own transaction (api/ops/
-- runs both in one): who (the key's id), what, on what, and how many jobs
-- or keys it changed.
INSERT INTO operator_actions (operator_key_id, action, job_id, filter, touched)
VALUES (%(operator_key_id)s, %(action)s, %(job_id)s, %(filter)s::jsonb, %(touched)s);

-- name: operator_action_list
-- The console's "Recent actions" and `storyjobs actions`, newest first,
-- before %(before_id)s when paging; the operator named by its key.
SELECT a.id, k.name AS operator, k.key_prefix AS operator_key_prefix, a.action, a.job_id,
       a.filter::text AS filter, a.touched, a.acted_at
FROM operator_actions a JOIN operator_keys k ON k.id = a.operator_key_id
WHERE %(before_id)s::bigint IS NULL OR a.id < %(before_id)s::bigint
ORDER BY a.id DESC
LIMIT %(limit)s;

-- name: ops_batch_list
-- The console's batches screen and `storyjobs batches`: message batches
-- newest first, below %(before_id)s when paging, on the primary key; each
-- with what its ledger rows cost (its items' rows, each found by its
-- primary key: a batch's cost is read in as many lookups as it has
-- requests, never by a scan of the ledger). A stray batch has no items of
-- its own: what it billed is charged to the rows of the lost intent it was
-- found for.
SELECT b.id, b.state, b.provider_batch_id, b.model, b.request_count, b.holder, b.created_at, b.sent_at,
       b.expires_at, b.ended_at, b.results_read_at, b.processing_status, b.request_counts, b.cancel_asked_at,
       b.lost_batch_id, extract(epoch FROM now() - b.created_at)::float8 AS age_s,
       ledger.billed_requests, ledger.cost_usd
FROM message_batches b
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE l.billed AND l.outcome <> 'started') AS billed_requests,
           coalesce(sum(llm_call_charge(l.billed, l.outcome, l.cost_usd, l.worst_case_usd))
                    FILTER (WHERE l.outcome <> 'started'), 0)::numeric(14, 6) AS cost_usd
    FROM message_batch_items i
    JOIN llm_calls l ON l.job_id = i.job_id AND l.attempt = i.attempt
    WHERE i.batch_id = b.id
) ledger
WHERE %(before_id)s::bigint IS NULL OR b.id < %(before_id)s::bigint
ORDER BY b.id DESC
LIMIT %(limit)s;
