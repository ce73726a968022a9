-- The api's named queries (api/store.py runs them): admission, a client's
-- jobs and stories, cancellation, the pacing hint, and a client's webhook
-- endpoints. The conventions are in common.sql.


-- name: job_get_by_idempotency_key_for_key
-- First step of POST /stories/generate, one round trip: authenticate the key
-- and find a job already made with this Idempotency-Key. A replay answers from
-- here without taking the admission lock.
SELECT k.client_id, k.key_hash, k.revoked_at IS NOT NULL AS revoked,
       j.public_id, j.status, j.request_fingerprint, j.created_at
FROM api_keys k
LEFT JOIN job_idempotency_keys i
       ON i.client_id = k.client_id AND i.idempotency_key = %(idempotency_key)s
LEFT JOIN story_jobs j ON j.id = i.job_id
WHERE k.key_prefix = %(key_prefix)s;

-- name: job_admission_lock
-- Serialises admissions, so that the counts in job_insert_if_admitted are
-- exact. It must be its own statement: under READ COMMITTED a statement's
-- snapshot is taken before it waits for a lock, so a statement that both
-- locked and counted could count stale rows and overshoot.
--
-- It also fixes, for this transaction only (and so behind a transaction
-- pooler too), what the admission statements' plans must not take from the
-- statistics. Their estimated cost follows the pending count ANALYZE last
-- saw, times the 100 rows the planner assumes for jsonb_to_recordset: with
-- statistics taken while 2,000 jobs waited it passed jit_above_cost (302,000
-- against 100,000) long after the queue had drained, and every admission
-- spent ~300 ms compiling a 15 ms statement. jit = off removes that, even on
-- a database that lost its own jit = off. enable_seqscan = off keeps each
-- count on a partial index of live jobs whatever share of the table
-- ANALYZE saw pending: a sequential scan is the one plan whose cost grows
-- with the history rather than the queue. plan_cache_mode =
-- force_generic_plan takes from the statistics the choice between planning
-- each admission anew and reusing the connection's plan: left to the cost
-- estimates, Postgres plans the first five executions anew, and later ones
-- whenever the statistics make the kept plan look dearer. Planned anew, an
-- admission took 3.1 ms, on the kept plan 1.4-1.8 ms (3M finished jobs,
-- docs/performance.md). A plan is then made once per connection, and again
-- after each ANALYZE of the tables it reads. (A cancellation, under this
-- lock too, finds its jobs by id or on the pending jobs' index, which a
-- generic plan does as well.)
SELECT pg_advisory_xact_lock(%(lock_key)s), set_config('jit', 'off', true),
       set_config('enable_seqscan', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true);

-- name: job_insert_if_admitted
-- Admits a batch of new jobs of both lanes (the POSTs an api process
-- received while its previous batch was being written; a single POST is a
-- batch of one): one admission lock, one statement, one commit for all of
-- them. Runs under the admission lock (job_admission_lock), which makes the
-- bounds exact. Requests are taken in order: a request whose key was used
-- meanwhile answers the existing job; the others are admitted while their
-- lane's queue has room (the interactive lane: their client's
-- CLIENT_QUEUE_MAX, then QUEUE_MAX; the batch lane, docs/batches.md: their
-- client's CLIENT_BATCH_QUEUE_MAX, then BATCH_QUEUE_MAX), then while their
-- client's spend budget and the day's budget have room, both lanes against
-- the same budgets, and refused otherwise. Each check admits the longest run
-- of the batch that fits, in order.
--
-- The interactive lane's bounds: job_admission keeps, per queue, a number
-- never below its pending count: every admission adds to it, and claims,
-- cancellations and the sweeper only ever lower the true count. While that
-- bound leaves room for the batch, no counting is done. Otherwise the pending
-- jobs are counted, stopping at the maximum (a count never costs more than
-- QUEUE_MAX index entries), and the bound is reset to the truth. Admissions
-- therefore cost O(1), not O(queue). The batch lane's live jobs (pending, or
-- running in or between batches) are counted, up to the maximum, on
-- story_jobs_batch_live_idx (batch_lane_live, migration 025), and only when
-- the batch asks for that lane: a batch admission costs O(BATCH_QUEUE_MAX)
-- index entries at most.
--
-- A request carries its worst-case cost (a batch job's at the batch price);
-- where a budget applies (the day's, %(budget_usd)s, or its client's: its own
-- or %(client_budget_usd)s), it is admitted only if today's spent + reserved
-- + the batch's worst cases so far stay within the budget, and its worst case
-- is then reserved. Nothing but admission adds to spent + reserved (a job's
-- end replaces its reservation by its cost, which is never more), so a budget
-- holds across every replica.
--
-- An interactive job gets a turn and a NOTIFY, delivered at commit, wakes an
-- idle worker at once; a batch job gets neither (the interactive claim never
-- takes it; the batch lane's holder collects what waits, every few seconds).
WITH
-- the requests, the jobs their keys made already, and the fresh ones ranked
-- within their lane and client
req AS MATERIALIZED (
    SELECT * FROM jsonb_to_recordset(%(requests)s::jsonb) AS r(
        ord int, lane job_lane, client_id bigint, idempotency_key text, request_fingerprint text, request jsonb,
        max_tokens int, input_tokens_estimate int, worst_case_usd numeric,
        model text, input_usd_per_mtok numeric, output_usd_per_mtok numeric, trace_context jsonb)
),
-- LATERAL: one primary-key lookup per request, never a join over the table
existing AS MATERIALIZED (
    SELECT r.ord, j.public_id, j.status, j.request_fingerprint, j.created_at
    FROM req r
    CROSS JOIN LATERAL (
        SELECT job_id FROM job_idempotency_keys i
        WHERE i.client_id = r.client_id AND i.idempotency_key = r.idempotency_key
    ) i
    CROSS JOIN LATERAL (
        SELECT public_id, status, request_fingerprint, created_at FROM story_jobs j WHERE j.id = i.job_id
    ) j
),
fresh AS MATERIALIZED (
    SELECT r.*, row_number() OVER (PARTITION BY r.lane, r.client_id ORDER BY r.ord) AS client_rank
    FROM req r
    WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.ord = r.ord)
),
-- Each client's queue in each lane the batch asks for. `kept` is the bound
-- job_admission keeps of a client's interactive queue (NULL if its row is
-- missing), and `counted` its pending jobs counted up to the maximum, only
-- when the kept bound does not leave room for the batch (NULL otherwise); a
-- client's live batch jobs are always counted, up to the maximum. A request
-- of the interactive lane is written `lane <> 'batch'` (the lane is never
-- NULL): the planner takes <> to keep most rows and = to keep few, so the
-- interactive lane keeps the estimates, and the plan, it had as a statement
-- of its own.
client_depth AS MATERIALIZED (
    SELECT c.lane, c.client_id, a.pending_at_most AS kept, a.last_turn,
           CASE WHEN c.lane = 'batch' THEN batch_lane_live(c.client_id, %(client_batch_queue_max)s)
                WHEN a.pending_at_most + c.asks <= %(client_queue_max)s THEN NULL
                ELSE (SELECT count(*) FROM (
                          SELECT 1 FROM story_jobs s
                          WHERE s.status = 'pending' AND s.lane = 'interactive' AND s.client_id = c.client_id
                          ORDER BY s.created_at, s.id LIMIT %(client_queue_max)s) q)
           END AS counted
    FROM (SELECT lane, client_id, count(*) AS asks FROM fresh GROUP BY lane, client_id) c
    LEFT JOIN job_admission a ON a.client_id = c.client_id AND c.lane <> 'batch'
),
client_ok AS MATERIALIZED (
    SELECT f.*, row_number() OVER (PARTITION BY f.lane ORDER BY f.ord) AS queue_rank
    FROM fresh f JOIN client_depth d ON d.client_id = f.client_id AND d.lane = f.lane
    WHERE coalesce(d.counted, d.kept) + f.client_rank
          <= CASE WHEN f.lane = 'batch' THEN %(client_batch_queue_max)s ELSE %(client_queue_max)s END
),
-- All clients' queues: the interactive lane's as its clients', the batch
-- lane's live jobs counted only when the batch asks for that lane.
queue AS MATERIALIZED (
    SELECT a.pending_at_most AS kept,
           CASE WHEN n.asks = 0 OR a.pending_at_most + n.asks <= %(queue_max)s THEN NULL
                ELSE (SELECT count(*) FROM (
                          SELECT 1 FROM story_jobs WHERE status = 'pending' AND lane = 'interactive'
                          ORDER BY created_at, id LIMIT %(queue_max)s) q)
           END AS counted,
           CASE WHEN EXISTS (SELECT 1 FROM client_ok WHERE lane = 'batch')
                THEN batch_lane_live(NULL, %(batch_queue_max)s) ELSE 0 END AS batch_counted
    FROM (SELECT count(*) AS asks FROM client_ok WHERE lane <> 'batch') n
    LEFT JOIN job_admission a ON a.client_id = 0
),
-- what each lane's queues admit
queue_ok AS MATERIALIZED (
    SELECT c.* FROM client_ok c, queue
    WHERE CASE WHEN c.lane = 'batch' THEN queue.batch_counted + c.queue_rank <= %(batch_queue_max)s
               ELSE coalesce(queue.counted, queue.kept) + c.queue_rank <= %(queue_max)s END
),
-- The spend budgets, for the requests the queues admit: `admitted`, those
-- whose worst cases today's budgets still hold, in order. Today's spend of
-- all clients (client_id 0) and of each client asking, and the budget that
-- applies to it (NULL: none).
spend AS MATERIALIZED (
    SELECT s.client_id, coalesce(b.spent_usd + b.reserved_usd, 0) AS used,
           CASE WHEN s.client_id = 0 THEN %(budget_usd)s::numeric
                ELSE coalesce(c.budget_usd_per_day, %(client_budget_usd)s::numeric) END AS budget
    FROM (SELECT 0::bigint AS client_id UNION SELECT client_id FROM queue_ok) s
    LEFT JOIN budget_days b ON b.client_id = s.client_id AND b.day = budget_day(now())
    LEFT JOIN api_clients c ON c.id = s.client_id AND s.client_id <> 0
),
-- what each request reserves: its worst case where any budget applies to it
reserving AS MATERIALIZED (
    SELECT q.*,
           CASE WHEN (SELECT budget FROM spend WHERE client_id = 0) IS NOT NULL OR s.budget IS NOT NULL
                THEN q.worst_case_usd ELSE 0 END AS reserved_usd
    FROM queue_ok q JOIN spend s ON s.client_id = q.client_id
),
client_budget_ok AS MATERIALIZED (
    SELECT r.* FROM (
        SELECT r.*, sum(r.reserved_usd) OVER (PARTITION BY r.client_id ORDER BY r.ord) AS client_cum
        FROM reserving r
    ) r JOIN spend s ON s.client_id = r.client_id
    WHERE s.budget IS NULL OR s.used + r.client_cum <= s.budget
),
admitted AS MATERIALIZED (
    SELECT c.* FROM (
        SELECT c.*, sum(c.reserved_usd) OVER (ORDER BY c.ord) AS cum FROM client_budget_ok c
    ) c, spend s
    WHERE s.client_id = 0 AND (s.budget IS NULL OR s.used + c.cum <= s.budget)
),
-- Each admitted interactive job's turn in the claim's round robin
-- (sql/009_fair_share.sql): the turn being served now (job_turn_served,
-- migration 034: the smallest pending one, found from the claim's floor;
-- with none pending, the end of the last turn given), or the end of its
-- client's last turn if later; a job lasts 1 / the client's weight. Where a
-- client's last turn ends is kept exact: written at every admission that
-- gives the client a turn (bounds_kept), moved back when a pending job is
-- cancelled (job_turns_given_back_ctes), and never dropped for a client found
-- with no pending job (one served in this round has had its turn).
serving AS MATERIALIZED (
    SELECT coalesce((SELECT turn FROM job_turn_served), 0) AS turn
),
turns AS MATERIALIZED (
    SELECT t.ord, t.client_id, t.start + (t.n - 1) / t.weight AS turn, t.start + t.n / t.weight AS turn_end
    FROM (
        SELECT a.ord, a.client_id, coalesce(c.weight, 1)::float8 AS weight,
               greatest(s.turn, coalesce(d.last_turn, s.turn)) AS start,
               (row_number() OVER (PARTITION BY a.client_id ORDER BY a.ord))::float8 AS n
        FROM admitted a
        CROSS JOIN serving s
        JOIN client_depth d ON d.client_id = a.client_id AND d.lane = a.lane
        LEFT JOIN api_clients c ON c.id = a.client_id
        WHERE a.lane <> 'batch'
    ) t
),
-- a batch job is ready to be collected from now (batch_ready_at), and has no turn
inserted AS (
    INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request,
                            max_tokens, input_tokens_estimate, worst_case_usd, reserved_usd,
                            model, input_usd_per_mtok, output_usd_per_mtok, turn, lane, batch_ready_at,
                            trace_context)
    SELECT a.client_id, a.idempotency_key, decode(a.request_fingerprint, 'hex'), a.request,
           a.max_tokens, a.input_tokens_estimate, a.worst_case_usd, a.reserved_usd,
           a.model, a.input_usd_per_mtok, a.output_usd_per_mtok, t.turn, a.lane,
           CASE WHEN a.lane = 'batch' THEN now() END, a.trace_context
    FROM admitted a LEFT JOIN turns t ON t.ord = a.ord ORDER BY a.ord
    RETURNING id, client_id, idempotency_key, public_id, status, request_fingerprint, created_at
),
keys_recorded AS (
    INSERT INTO job_idempotency_keys (client_id, idempotency_key, job_id)
    SELECT client_id, idempotency_key, id FROM inserted
),
-- the reservations, on today's rows of all clients and of each client, the
-- all-clients row first (see story_jobs_settle_budget)
reservations_kept AS (
    INSERT INTO budget_days (client_id, day, reserved_usd)
    SELECT client_id, budget_day(now()), sum(reserved_usd) FROM (
        SELECT 0::bigint AS client_id, reserved_usd FROM admitted
        UNION ALL
        SELECT client_id, reserved_usd FROM admitted
    ) r
    GROUP BY client_id HAVING sum(reserved_usd) > 0
    ORDER BY client_id
    ON CONFLICT (client_id, day) DO UPDATE SET reserved_usd = budget_days.reserved_usd + excluded.reserved_usd
),
-- The new bound of each interactive queue, never below its pending count:
-- the kept bound plus what was admitted; or an exact count (below this
-- replica's maximum) plus what was admitted; or, when the count stopped at
-- this replica's maximum, the truth may be higher (a replica with a larger
-- maximum admitted more), so the kept bound stays as it is, and a missing one
-- stays missing.
new_bounds AS (
    SELECT 0::bigint AS client_id, q.kept,
           CASE WHEN q.counted IS NULL THEN q.kept + n.admitted
                WHEN q.counted < %(queue_max)s THEN q.counted + n.admitted
                ELSE q.kept END AS bound,
           n.admitted, n.last_turn
    FROM queue q, (SELECT count(*) AS admitted, coalesce(max(turn_end), 0) AS last_turn FROM turns) n
    UNION ALL
    SELECT d.client_id, d.kept,
           CASE WHEN d.counted IS NULL THEN d.kept + n.admitted
                WHEN d.counted < %(client_queue_max)s THEN d.counted + n.admitted
                ELSE d.kept END,
           n.admitted, n.last_turn
    FROM client_depth d
    CROSS JOIN LATERAL (SELECT count(*) AS admitted, coalesce(max(turn_end), 0) AS last_turn
                        FROM turns t WHERE t.client_id = d.client_id) n
    WHERE d.lane <> 'batch'
),
-- Written when the bound changes or the queue was given turns: a client
-- that refills its full queue as a slot frees keeps its bound (counted + 1
-- = kept) but its last turn moves on, and a last turn left behind would
-- give each refill the turn being served, ahead of every other client.
-- (In the common case the bound changes anyway: no write is added.)
bounds_kept AS (
    INSERT INTO job_admission (client_id, pending_at_most, last_turn)
    SELECT client_id, bound, last_turn FROM new_bounds
    WHERE bound IS NOT NULL AND (bound IS DISTINCT FROM kept OR admitted > 0)
    ON CONFLICT (client_id) DO UPDATE SET pending_at_most = excluded.pending_at_most,
        last_turn = greatest(job_admission.last_turn, excluded.last_turn)
),
notified AS (
    SELECT pg_notify('storyjobs_pending', '') WHERE EXISTS (SELECT 1 FROM turns)
)
-- One result per request, in order; `notified`: whether a NOTIFY went out.
SELECT r.ord,
       CASE WHEN i.id IS NOT NULL THEN 'inserted'
            WHEN e.ord IS NOT NULL THEN 'existing'
            WHEN c.ord IS NULL THEN CASE r.lane WHEN 'batch' THEN 'client_batch_queue_full'
                                                ELSE 'client_queue_full' END
            WHEN q.ord IS NULL THEN CASE r.lane WHEN 'batch' THEN 'batch_queue_full' ELSE 'queue_full' END
            WHEN b.ord IS NULL THEN 'client_budget_exhausted'
            ELSE 'budget_exhausted'
       END AS outcome,
       coalesce(i.public_id, e.public_id) AS public_id,
       coalesce(i.status, e.status) AS status,
       coalesce(i.request_fingerprint, e.request_fingerprint) AS request_fingerprint,
       coalesce(i.created_at, e.created_at) AS created_at,
       (SELECT count(*) FROM notified) AS notified,
       -- until the UTC day of the spend budgets ends, by the database's clock
       extract(epoch FROM (date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day')
                          - (now() AT TIME ZONE 'UTC'))::float8 AS day_ends_in_s
FROM req r
LEFT JOIN existing e ON e.ord = r.ord
LEFT JOIN client_ok c ON c.ord = r.ord
LEFT JOIN queue_ok q ON q.ord = r.ord
LEFT JOIN client_budget_ok b ON b.ord = r.ord
LEFT JOIN inserted i ON i.client_id = r.client_id AND i.idempotency_key = r.idempotency_key
ORDER BY r.ord;

-- name: job_get_for_key
-- GET /stories/jobs/{job_id}, one round trip: authenticate the key and read
-- the job (if it is this client's) with its queue position, draft or story.
-- queue_position counts pending jobs ahead of this one in the claim's order
-- (turns: the client's share), on the claim's index, from the claim's floor
-- (migration 030).
--
-- The job comes as one JSON text, decoded by msgspec straight into its
-- Struct: psycopg sets up a loader for every column of a result, on every
-- statement, and with the job's dozen columns that was the largest part of
-- the poll's Python time (docs/performance.md). NULL: no such job for this
-- client.
SELECT k.client_id, k.key_hash, k.revoked_at IS NOT NULL AS revoked,
       CASE WHEN j.id IS NOT NULL THEN json_build_object(
           'public_id', j.public_id, 'status', j.status, 'error_code', j.error_code, 'error_text', j.error_text,
           'progress', j.progress, 'created_at', j.created_at, 'started_at', j.started_at,
           'completed_at', j.completed_at,
           'queue_position', CASE WHEN j.status = 'pending' AND j.lane = 'interactive' THEN
               (SELECT count(*) + 1 FROM story_jobs p
                WHERE p.status = 'pending' AND p.lane = 'interactive'
                  AND p.turn >= (SELECT turn FROM job_claim_floor) AND (p.turn, p.id) < (j.turn, j.id))
           END,
           -- a batch job's due time comes from these (api.jobs)
           'lane', j.lane, 'batch_ready_at', j.batch_ready_at,
           'batch_expires_at', (SELECT b.expires_at FROM message_batches b
                                WHERE b.id = j.batch_id AND j.batch_ready_at IS NULL),
           -- read only for a completed job, through story_json (migration
           -- 029): stories is not in this statement, so a poll of a live job
           -- locks none of its partitions
           'story', CASE WHEN j.status = 'completed' THEN story_json(j.id, j.story_id, j.public_id) END,
           -- how far along a running job is: its progress against what its length allows
           'max_tokens', j.max_tokens,
           -- a running job's draft (migration 020): its length and when it
           -- last grew (its last chunk, one step back on the key), and its
           -- text after character `since` (code points), from the chunk that
           -- holds that character on: a poll that asks for what is new reads
           -- only the new chunks, whatever the story's length
           'draft', CASE WHEN j.status = 'running' AND j.lane = 'interactive' THEN json_build_object(
               'chars', coalesce(d.from_char + d.chars, 0), 'updated_at', d.written_at,
               'text', coalesce((
                   SELECT substr(string_agg(c.text, '' ORDER BY c.from_char),
                                 %(since)s::integer + 1 - min(c.from_char))
                   FROM story_draft_chunks c
                   WHERE c.job_id = j.id AND c.from_char + c.chars > %(since)s::integer
                     AND c.from_char >= coalesce((SELECT max(h.from_char) FROM story_draft_chunks h
                                                  WHERE h.job_id = j.id AND h.from_char <= %(since)s::integer), 0)
               ), '')) END,
           -- the database's clock, which started_at was written by
           'now', now())::text END AS job
FROM api_keys k
LEFT JOIN story_jobs j ON j.client_id = k.client_id AND j.public_id = %(job_id)s
LEFT JOIN LATERAL (SELECT l.from_char, l.chars, l.written_at FROM story_draft_chunks l
                   WHERE l.job_id = j.id AND j.status = 'running'
                   ORDER BY l.from_char DESC LIMIT 1) d ON true
WHERE k.key_prefix = %(key_prefix)s;

-- name: story_get_for_key
-- A story by its id alone: each partition of stories is probed on its own
-- index of id (migration 029), a bounded number of them. Served while its
-- job is kept: a pruned job's story waits for its partition's drop unseen.
SELECT k.client_id, k.key_hash, k.revoked_at IS NOT NULL AS revoked,
       story_json(s.job_id, s.id, j.public_id) AS story
FROM api_keys k
LEFT JOIN (stories s JOIN story_jobs j ON j.id = s.job_id)
    ON s.client_id = k.client_id AND s.id = %(story_id)s
WHERE k.key_prefix = %(key_prefix)s;

-- name: job_drain_stats
-- How fast the queue drains, from the last finished jobs (newest first on
-- the primary key, so the cost does not grow with history), and how long the
-- shared rate limiter holds every claim (a 429's pause): feeds Retry-After
-- and the time-remaining estimate. The longest-running job's age and
-- claimed_last_minute say how soon the queue takes its next job; the claims
-- are counted among the newest jobs, and only when those reach back a whole
-- minute (a burst of claims when workers start is no rate).
SELECT queue.pending, queue.running,
       recent.avg_run_seconds, recent.avg_output_tokens,
       coalesce((SELECT bucket_paused_s(paused_until) FROM llm_rate_buckets WHERE model = %(model)s), 0)::float8
           AS limiter_paused_s,
       (SELECT CASE WHEN min(started_at) <= now() - interval '60 seconds'
                    THEN count(*) FILTER (WHERE started_at > now() - interval '60 seconds') ELSE 0 END
        FROM (SELECT started_at FROM story_jobs ORDER BY id DESC LIMIT 200) newest) AS claimed_last_minute,
       coalesce((SELECT extract(epoch FROM now() - min(started_at)) FROM story_jobs
                 WHERE status = 'running'), 0)::float8 AS longest_running_s
FROM (
    SELECT avg(extract(epoch FROM completed_at - started_at))::float8 AS avg_run_seconds,
           avg(progress)::float8 AS avg_output_tokens
    FROM (
        SELECT completed_at, started_at, progress FROM story_jobs
        WHERE status = 'completed'
        ORDER BY id DESC
        LIMIT 50
    ) last
) recent, job_queue_depth queue;

-- name: webhook_endpoint_insert_lock
-- Serialises a client's endpoint registrations, so that the count in
-- webhook_endpoint_insert is exact: the client's row, locked until the
-- transaction ends (NO KEY UPDATE: it does not wait on, nor block, the
-- foreign-key checks that share the row). It must be its own statement:
-- under READ COMMITTED a statement's snapshot is taken before it waits for a
-- lock, so a statement that both locked and counted could count stale rows.
SELECT id FROM api_clients WHERE id = %(client_id)s FOR NO KEY UPDATE;

-- name: webhook_endpoint_insert
-- POST /webhook-endpoints: a client's new endpoint, unless it has
-- %(max_per_client)s already (no row: refused). Runs after
-- webhook_endpoint_insert_lock in the same transaction, which makes the
-- count exact.
INSERT INTO webhook_endpoints (client_id, url, events, secret)
SELECT %(client_id)s, %(url)s, %(events)s::text[], %(secret)s
WHERE (SELECT count(*) FROM webhook_endpoints WHERE client_id = %(client_id)s) < %(max_per_client)s
RETURNING id, url, events, created_at, disabled_at, failing_since;

-- name: webhook_endpoint_list_for_client
-- GET /webhook-endpoints: the client's endpoints, without their secrets.
SELECT id, url, events, created_at, disabled_at, failing_since
FROM webhook_endpoints WHERE client_id = %(client_id)s
ORDER BY created_at, id;

-- name: webhook_endpoint_delete
-- DELETE /webhook-endpoints/{id}: another client's id finds nothing, as an
-- unknown one. Its deliveries go with it (ON DELETE CASCADE); one in flight
-- then finds its row gone and records nothing.
DELETE FROM webhook_endpoints WHERE id = %(endpoint_id)s AND client_id = %(client_id)s
RETURNING id;

-- name: webhook_endpoint_rotate_secret
-- POST /webhook-endpoints/{id}/rotate-secret: the new secret signs from now
-- on, and the current one beside it for %(overlap_s)s seconds, so that a
-- receiver can switch without refusing a delivery.
UPDATE webhook_endpoints
SET previous_secret = secret, previous_secret_expires_at = now() + make_interval(secs => %(overlap_s)s::float8),
    secret = %(secret)s
WHERE id = %(endpoint_id)s AND client_id = %(client_id)s
RETURNING id, url, events, created_at, disabled_at, failing_since;

-- name: server_ping
-- GET /readyz: the database answers a statement.
SELECT 1;
