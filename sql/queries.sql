-- Every runtime query of storyjobs, by name. shared/queries.py parses this
-- file once; shared/store.py is the only module that runs these.
--
-- A block starts with `-- name: <table>_<verb>_<condition>`, then comment
-- lines saying what it does and why, then one statement with %(named)s
-- parameters. Every status change names the status it expects in its WHERE
-- clause: zero rows means the caller lost a race.
--
-- Time is the database's: `coalesce(%(now)s::timestamptz, now())` lets a
-- test pass its own "now" instead of sleeping.


-- name: schema_migrations_create
-- The migration ledger. Created outside any numbered migration so that the
-- version check works on an empty database.
CREATE TABLE IF NOT EXISTS schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- name: schema_migrations_lock
-- Held for the whole migration run, so two replicas starting at once migrate
-- one after the other (the second then finds nothing to do).
SELECT pg_advisory_lock(%(lock_key)s);

-- name: schema_migrations_unlock
SELECT pg_advisory_unlock(%(lock_key)s);

-- name: schema_migrations_applied
SELECT version FROM schema_migrations ORDER BY version;

-- name: schema_migrations_record
INSERT INTO schema_migrations (version, name) VALUES (%(version)s, %(name)s);

-- name: schema_version_get
-- NULL when the database was never migrated.
SELECT CASE WHEN to_regclass('schema_migrations') IS NULL THEN NULL
            ELSE (SELECT coalesce(max(version), 0) FROM schema_migrations) END AS version;

-- name: job_status_enum_values
-- The SQL side of the status enum, for the test that keeps it in sync with
-- shared.status.JobStatus.
SELECT unnest(enum_range(NULL::job_status))::text AS value;


-- name: api_client_upsert
-- `storyjobs keys create NAME`: a new client, or the existing one of that
-- name (creating a second key for a client is how keys are rotated).
WITH inserted AS (
    INSERT INTO api_clients (name) VALUES (%(name)s)
    ON CONFLICT (name) DO NOTHING
    RETURNING id
)
SELECT id FROM inserted
UNION ALL
SELECT id FROM api_clients WHERE name = %(name)s
LIMIT 1;

-- name: api_client_budget_set
-- `storyjobs keys create NAME --budget-usd-per-day X`: the client's own spend
-- budget per UTC day, in place of CLIENT_BUDGET_USD_PER_DAY.
UPDATE api_clients SET budget_usd_per_day = %(budget_usd_per_day)s WHERE id = %(client_id)s;

-- name: api_client_weight_set
-- `storyjobs keys create NAME --weight N`: the client's share of the workers
-- (N jobs to a weight-1 client's one), taken by the jobs it sends from now on.
UPDATE api_clients SET weight = %(weight)s WHERE id = %(client_id)s;

-- name: api_key_insert
INSERT INTO api_keys (client_id, key_prefix, key_hash)
VALUES (%(client_id)s, %(key_prefix)s, %(key_hash)s);

-- name: api_key_list
SELECT k.key_prefix, c.name AS client_name, k.created_at, k.revoked_at
FROM api_keys k JOIN api_clients c ON c.id = k.client_id
ORDER BY k.id;

-- name: api_key_revoke
UPDATE api_keys SET revoked_at = now()
WHERE key_prefix = %(key_prefix)s AND revoked_at IS NULL
RETURNING key_prefix;

-- name: api_key_get
-- Authentication only: the api compares key_hash in constant time.
SELECT k.client_id, k.key_hash, k.revoked_at IS NOT NULL AS revoked
FROM api_keys k
WHERE k.key_prefix = %(key_prefix)s;


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
SELECT pg_advisory_xact_lock(%(lock_key)s);

-- name: job_insert_if_admitted
-- Admits a batch of new jobs (the POSTs an api process received while its
-- previous batch was being written): one admission lock, one statement, one
-- commit for all of them. Runs under the admission lock (job_admission_lock),
-- which makes the bounds exact. Requests are taken in order: a request whose
-- key was used meanwhile answers the existing job; the others are admitted
-- while their client's queue (CLIENT_QUEUE_MAX), then the whole queue
-- (QUEUE_MAX), then their client's spend budget and the day's budget have
-- room, and refused otherwise. Each check admits the longest run of the batch
-- that fits, in order.
--
-- job_admission keeps, per queue, a number never below its pending count:
-- every admission adds to it, and claims, cancellations and the sweeper only
-- ever lower the true count. While that bound leaves room for the batch, no
-- counting is done. Otherwise the pending jobs are counted, stopping at the
-- maximum (a count never costs more than QUEUE_MAX index entries), and the
-- bound is reset to the truth. Admissions therefore cost O(1), not O(queue).
--
-- A request carries its worst-case cost; where a budget applies (the day's,
-- %(budget_usd)s, or its client's: its own or %(client_budget_usd)s), it is
-- admitted only if today's spent + reserved + the batch's worst cases so far
-- stay within the budget, and its worst case is then reserved. Nothing but
-- admission adds to spent + reserved (a job's end replaces its reservation by
-- its cost, which is never more), so a budget holds across every replica.
--
-- The NOTIFY is delivered at commit and wakes an idle worker at once.
WITH req AS MATERIALIZED (
    SELECT * FROM jsonb_to_recordset(%(requests)s::jsonb) AS r(
        ord int, client_id bigint, idempotency_key text, request_fingerprint text, request jsonb,
        max_tokens int, input_tokens_estimate int, worst_case_usd numeric,
        model text, input_usd_per_mtok numeric, output_usd_per_mtok numeric)
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
    SELECT r.*, row_number() OVER (PARTITION BY r.client_id ORDER BY r.ord) AS client_rank
    FROM req r
    WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.ord = r.ord)
),
-- For each queue: `kept` is the bound job_admission keeps (NULL if its row is
-- missing), and `counted` the pending jobs counted up to the maximum, only
-- when the kept bound does not leave room for the batch (NULL otherwise).
client_depth AS MATERIALIZED (
    SELECT c.client_id, a.pending_at_most AS kept, a.last_turn,
           CASE WHEN a.pending_at_most + c.asks <= %(client_queue_max)s THEN NULL
                ELSE (SELECT count(*) FROM (
                          SELECT 1 FROM story_jobs s
                          WHERE s.status = 'pending' AND s.client_id = c.client_id
                          ORDER BY s.created_at, s.id LIMIT %(client_queue_max)s) q)
           END AS counted
    FROM (SELECT client_id, count(*) AS asks FROM fresh GROUP BY client_id) c
    LEFT JOIN job_admission a ON a.client_id = c.client_id
),
client_ok AS MATERIALIZED (
    SELECT f.*, row_number() OVER (ORDER BY f.ord) AS queue_rank
    FROM fresh f JOIN client_depth d ON d.client_id = f.client_id
    WHERE coalesce(d.counted, d.kept) + f.client_rank <= %(client_queue_max)s
),
queue AS MATERIALIZED (
    SELECT a.pending_at_most AS kept,
           CASE WHEN a.pending_at_most + (SELECT count(*) FROM client_ok) <= %(queue_max)s THEN NULL
                ELSE (SELECT count(*) FROM (
                          SELECT 1 FROM story_jobs WHERE status = 'pending'
                          ORDER BY created_at, id LIMIT %(queue_max)s) q)
           END AS counted
    FROM (SELECT 1) one LEFT JOIN job_admission a ON a.client_id = 0
),
queue_ok AS MATERIALIZED (
    SELECT c.* FROM client_ok c, queue
    WHERE coalesce(queue.counted, queue.kept) + c.queue_rank <= %(queue_max)s
),
-- Today's spend of all clients (client_id 0) and of each client asking, and
-- the budget that applies to it (NULL: none).
spend AS MATERIALIZED (
    SELECT s.client_id, coalesce(b.spent_usd + b.reserved_usd, 0) AS used,
           CASE WHEN s.client_id = 0 THEN %(budget_usd)s::numeric
                ELSE coalesce(c.budget_usd_per_day, %(client_budget_usd)s::numeric) END AS budget
    FROM (SELECT 0::bigint AS client_id UNION SELECT client_id FROM queue_ok) s
    LEFT JOIN budget_days b ON b.client_id = s.client_id AND b.day = (now() AT TIME ZONE 'UTC')::date
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
-- Each admitted job's turn in the claim's round robin (sql/009_fair_share.sql):
-- the turn being served now (the smallest pending one; with none pending,
-- the end of the last turn given), or the end of its client's last turn if
-- later; a job lasts 1 / the client's weight. A client whose pending jobs
-- were counted and found gone starts afresh.
serving AS MATERIALIZED (
    SELECT coalesce((SELECT turn FROM story_jobs WHERE status = 'pending' ORDER BY turn, id LIMIT 1),
                    (SELECT last_turn FROM job_admission WHERE client_id = 0), 0) AS turn
),
turns AS MATERIALIZED (
    SELECT t.ord, t.client_id, t.start + (t.n - 1) / t.weight AS turn, t.start + t.n / t.weight AS turn_end
    FROM (
        SELECT a.ord, a.client_id, coalesce(c.weight, 1)::float8 AS weight,
               greatest(s.turn, CASE WHEN d.counted = 0 THEN s.turn ELSE coalesce(d.last_turn, s.turn) END) AS start,
               (row_number() OVER (PARTITION BY a.client_id ORDER BY a.ord))::float8 AS n
        FROM admitted a
        CROSS JOIN serving s
        JOIN client_depth d ON d.client_id = a.client_id
        LEFT JOIN api_clients c ON c.id = a.client_id
    ) t
),
inserted AS (
    INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request,
                            max_tokens, input_tokens_estimate, reserved_usd,
                            model, input_usd_per_mtok, output_usd_per_mtok, turn)
    SELECT a.client_id, a.idempotency_key, decode(a.request_fingerprint, 'hex'), a.request,
           a.max_tokens, a.input_tokens_estimate, a.reserved_usd,
           a.model, a.input_usd_per_mtok, a.output_usd_per_mtok, t.turn
    FROM admitted a JOIN turns t ON t.ord = a.ord ORDER BY a.ord
    RETURNING id, client_id, idempotency_key, public_id, status, request_fingerprint, created_at
),
keys_recorded AS (
    INSERT INTO job_idempotency_keys (client_id, idempotency_key, job_id)
    SELECT client_id, idempotency_key, id FROM inserted
),
-- The new bound of each queue, never below its pending count: the kept bound
-- plus what was admitted; or an exact count (below this replica's maximum)
-- plus what was admitted; or, when the count stopped at this replica's
-- maximum, the truth may be higher (a replica with a larger maximum admitted
-- more), so the kept bound stays as it is, and a missing one stays missing.
new_bounds AS (
    SELECT 0::bigint AS client_id, q.kept,
           CASE WHEN q.counted IS NULL THEN q.kept + n.admitted
                WHEN q.counted < %(queue_max)s THEN q.counted + n.admitted
                ELSE q.kept END AS bound,
           n.last_turn
    FROM queue q, (SELECT count(*) AS admitted, coalesce(max(turn_end), 0) AS last_turn FROM turns) n
    UNION ALL
    SELECT d.client_id, d.kept,
           CASE WHEN d.counted IS NULL THEN d.kept + n.admitted
                WHEN d.counted < %(client_queue_max)s THEN d.counted + n.admitted
                ELSE d.kept END,
           n.last_turn
    FROM client_depth d
    CROSS JOIN LATERAL (SELECT count(*) AS admitted, coalesce(max(turn_end), 0) AS last_turn
                        FROM turns t WHERE t.client_id = d.client_id) n
),
-- (a queue admitting anything always gets a new bound, so its last turn is
-- written with it)
bounds_kept AS (
    INSERT INTO job_admission (client_id, pending_at_most, last_turn)
    SELECT client_id, bound, last_turn FROM new_bounds
    WHERE bound IS NOT NULL AND bound IS DISTINCT FROM kept
    ON CONFLICT (client_id) DO UPDATE SET pending_at_most = excluded.pending_at_most,
        last_turn = greatest(job_admission.last_turn, excluded.last_turn)
),
-- the reservations, on today's rows of all clients and of each client, the
-- all-clients row first (see story_jobs_settle_budget)
reservations_kept AS (
    INSERT INTO budget_days (client_id, day, reserved_usd)
    SELECT client_id, (now() AT TIME ZONE 'UTC')::date, sum(reserved_usd) FROM (
        SELECT 0::bigint AS client_id, reserved_usd FROM admitted
        UNION ALL
        SELECT client_id, reserved_usd FROM admitted
    ) r
    GROUP BY client_id HAVING sum(reserved_usd) > 0
    ORDER BY client_id
    ON CONFLICT (client_id, day) DO UPDATE SET reserved_usd = budget_days.reserved_usd + excluded.reserved_usd
),
notified AS (
    SELECT pg_notify('storyjobs_pending', '') WHERE EXISTS (SELECT 1 FROM admitted)
)
SELECT r.ord,
       CASE WHEN i.id IS NOT NULL THEN 'inserted'
            WHEN e.ord IS NOT NULL THEN 'existing'
            WHEN c.ord IS NULL THEN 'client_queue_full'
            WHEN q.ord IS NULL THEN 'queue_full'
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
-- the job (if it is this client's) with its queue position or story.
-- queue_position counts pending jobs ahead of this one in the claim's order
-- (turns: the client's share), on the claim's index.
SELECT k.client_id, k.key_hash, k.revoked_at IS NOT NULL AS revoked,
       j.public_id, j.status, j.error_code, j.error_text, j.progress,
       j.created_at, j.started_at, j.completed_at,
       CASE WHEN j.status = 'pending' THEN
           (SELECT count(*) + 1 FROM story_jobs p
            WHERE p.status = 'pending' AND (p.turn, p.id) < (j.turn, j.id))
       END AS queue_position,
       -- one shape for a story, here and in story_get_for_key (cost as text: exact)
       CASE WHEN s.id IS NOT NULL THEN json_build_object(
           'story_id', s.id, 'job_id', j.public_id, 'title', s.title, 'body', s.body, 'model', s.model,
           'prompt_version', s.prompt_version, 'input_tokens', s.input_tokens,
           'output_tokens', s.output_tokens, 'cost_usd', s.cost_usd::text, 'created_at', s.created_at) END AS story,
       -- how far along a running job is: its progress against what its length allows
       j.max_tokens,
       -- the database's clock, which started_at was written by
       now() AS now
FROM api_keys k
LEFT JOIN story_jobs j ON j.client_id = k.client_id AND j.public_id = %(job_id)s
LEFT JOIN stories s ON s.id = j.story_id AND j.status = 'completed'
WHERE k.key_prefix = %(key_prefix)s;

-- name: job_cancel
-- DELETE /stories/jobs/{job_id}: pending or running -> failed (cancelled).
-- A running job's worker sees the change at its next heartbeat and closes
-- its stream. The snapshot row tells the caller why nothing changed.
WITH job AS (
    SELECT id, status FROM story_jobs
    WHERE public_id = %(job_id)s AND client_id = %(client_id)s
),
cancelled AS (
    UPDATE story_jobs j
    SET status = 'failed', error_code = 'cancelled',
        error_text = 'cancelled by the client', completed_at = now(),
        -- a running job's call may have cost up to its worst case; its worker
        -- brings the charge down to the real cost when it closes the stream
        charged_usd = CASE WHEN j.status = 'running' THEN j.reserved_usd ELSE 0 END
    FROM job
    WHERE j.id = job.id AND j.status IN ('pending', 'running')
    RETURNING j.id
)
SELECT job.status AS previous_status, EXISTS (SELECT 1 FROM cancelled) AS cancelled
FROM job;

-- name: llm_call_close_for_cancelled_job
-- Second statement of a cancellation (a client's, or an operator's with no
-- client_id), in its transaction: closes the ledger
-- row of a call that was open when the job was cancelled, as interrupted
-- (assumed billed; a live worker overwrites it with what it knows when it
-- closes the stream). A statement of its own, because its snapshot must see
-- a retry's row opened while the cancellation waited for the job's row lock
-- (llm_call_start holds it while it opens one).
UPDATE llm_calls c
SET finished_at = now(), outcome = 'interrupted',
    error_text = 'the job was cancelled while this call was open'
FROM story_jobs j
WHERE j.public_id = %(job_id)s AND j.status = 'failed'
  AND (%(client_id)s::bigint IS NULL OR j.client_id = %(client_id)s::bigint)
  AND c.job_id = j.id AND c.outcome = 'started';

-- name: story_get_for_key
SELECT k.client_id, k.key_hash, k.revoked_at IS NOT NULL AS revoked,
       CASE WHEN s.id IS NOT NULL THEN json_build_object(
           'story_id', s.id, 'job_id', j.public_id, 'title', s.title, 'body', s.body, 'model', s.model,
           'prompt_version', s.prompt_version, 'input_tokens', s.input_tokens,
           'output_tokens', s.output_tokens, 'cost_usd', s.cost_usd::text, 'created_at', s.created_at) END AS story
FROM api_keys k
LEFT JOIN stories s ON s.client_id = k.client_id AND s.id = %(story_id)s
LEFT JOIN story_jobs j ON j.id = s.job_id
WHERE k.key_prefix = %(key_prefix)s;

-- name: job_drain_stats
-- How fast the queue drains, from the last finished jobs (newest first on
-- the primary key, so the cost does not grow with history), and how long the
-- shared rate limiter holds every claim (a 429's pause): feeds Retry-After
-- and the time-remaining estimate. The longest-running job's age and
-- claimed_last_minute say how soon the queue takes its next job; the claims
-- are counted among the newest jobs, and only when those reach back a whole
-- minute (a burst of claims when workers start is no rate).
SELECT (SELECT count(*) FROM story_jobs WHERE status = 'pending') AS pending,
       (SELECT count(*) FROM story_jobs WHERE status = 'running') AS running,
       recent.avg_run_seconds, recent.avg_output_tokens,
       coalesce((SELECT greatest(extract(epoch FROM greatest(paused_until, now()) - now()), 0) FROM llm_rate_buckets
                 WHERE model = %(model)s), 0)::float8 AS limiter_paused_s,
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
) recent;


-- name: job_settle_ctes
-- The first half of the worker's round statement (job_settle_and_claim and
-- job_settle_and_claim_limited include it): complete the jobs whose stories
-- are written (story insert, ledger update and running -> completed, guarded
-- by status and worker_id).
--
-- A story is inserted even when its job lost the race to the sweeper: it was
-- paid for. ON CONFLICT makes a retry after an ambiguous commit harmless.
--
-- The written stories arrive as one JSON array: one parameter to encode,
-- however many stories the round carries. Rows are reached by id through
-- `id = ANY (ARRAY(...))`, an index lookup whatever the planner guesses of
-- how many there are: the statement is prepared once and runs on a generic
-- plan, and a guess of "10 % of the table" must not turn a lookup into a scan.
-- `done` is sorted by job id: every statement that waits for several job
-- rows (this one, job_fail_running, job_heartbeat, the console's bulk cancel)
-- locks them in ascending id order, so that two of them (a worker's heartbeat
-- and its round, on two pooled connections) queue instead of deadlocking.
done AS MATERIALIZED (
    SELECT * FROM jsonb_to_recordset(%(completions)s::jsonb) AS d(
        job_id bigint, client_id bigint, attempt smallint, title text, body text, model text,
        prompt_version text, input_tokens int, output_tokens int, cost_usd numeric, request_id text)
    ORDER BY job_id
),
stories_inserted AS (
    INSERT INTO stories (job_id, client_id, title, body, model, prompt_version,
                         input_tokens, output_tokens, cost_usd)
    SELECT job_id, client_id, title, body, model, prompt_version,
           input_tokens, output_tokens, cost_usd
    FROM done
    ON CONFLICT (job_id) DO NOTHING
    RETURNING id, job_id
),
calls_finished AS (
    UPDATE llm_calls c
    SET finished_at = now(), outcome = 'succeeded',
        input_tokens = done.input_tokens, output_tokens = done.output_tokens,
        cost_usd = done.cost_usd, request_id = done.request_id
    FROM done
    WHERE c.job_id = ANY (ARRAY(SELECT job_id FROM done))
      AND c.job_id = done.job_id AND c.attempt = done.attempt
),
completed AS (
    UPDATE story_jobs j
    SET status = 'completed', completed_at = now(), story_id = s.id,
        progress = done.output_tokens, charged_usd = done.cost_usd
    FROM done JOIN stories_inserted s ON s.job_id = done.job_id
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM done)) AND j.id = done.job_id
      AND j.status = 'running' AND j.worker_id = %(worker_id)s
    RETURNING j.id,
              -- what the claim reserved and the call did not use, given back
              coalesce(j.input_tokens_estimate, 0) - done.input_tokens AS input_tokens_back,
              coalesce(j.max_tokens, 0) - done.output_tokens AS output_tokens_back
)

-- name: job_claim_ctes
-- The claim of the round statement: the jobs in `chosen` (locked by the
-- including statement) go pending -> running, and each gets its first ledger
-- row before its LLM call can start.
claimed AS (
    UPDATE story_jobs j
    SET status = 'running', started_at = now(), heartbeat_at = now(),
        worker_id = %(worker_id)s
    WHERE j.id = ANY (ARRAY(SELECT id FROM chosen)) AND j.status = 'pending'
    RETURNING j.id, j.public_id, j.client_id, j.request, j.created_at, j.started_at,
              j.max_tokens, j.input_tokens_estimate, j.model, j.input_usd_per_mtok, j.output_usd_per_mtok
),
first_calls AS (
    INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model)
    SELECT id, 1, %(worker_id)s, %(provider)s, %(model)s FROM claimed
    RETURNING job_id
)

-- name: job_settle_and_claim_answer
-- What the round statement answers, before its limiter column. The claim
-- comes first: evaluated first, it locks its jobs as soon after the
-- statement's snapshot as it can, so that fewer of the rows it reaches have
-- been claimed by another worker since (each such row costs a recheck).
coalesce((
    SELECT json_agg(json_build_object(
        'id', c.id, 'public_id', c.public_id, 'client_id', c.client_id, 'request', c.request,
        'created_at', c.created_at, 'started_at', c.started_at, 'max_tokens', c.max_tokens,
        'input_tokens_estimate', c.input_tokens_estimate, 'model', c.model,
        -- as text: exact
        'input_usd_per_mtok', c.input_usd_per_mtok::text, 'output_usd_per_mtok', c.output_usd_per_mtok::text)
        ORDER BY c.id)
    FROM claimed c JOIN first_calls f ON f.job_id = c.id
)::text, '[]') AS claimed,
-- done jobs: completed now, or (after an ambiguous commit) already completed
-- by this worker; the caller treats every other done job as a lost race
coalesce((SELECT array_agg(id) FROM completed), '{}') AS completed_ids,
coalesce((
    SELECT array_agg(j.id) FROM story_jobs j
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM done))
      AND j.status = 'completed' AND j.worker_id = %(worker_id)s
), '{}') AS already_completed_ids

-- name: job_settle_and_claim
-- The worker's one statement per round while no rate limit is configured:
-- complete the written stories and claim up to %(claim_limit)s pending jobs,
-- one commit per round however many jobs it carries.
--
-- The model's bucket row is only read, for a pause (a 429's retry-after, or
-- the provider's headers saying nothing is left), during which nothing is
-- claimed; a pause the headers announce (%(provider_pause_s)s, a duration:
-- every time the limiter keeps is the database's) is written
-- there for every worker. Without the limiter's arithmetic the statement
-- costs the database about a quarter less (tests/bench/statement_cost.py).
WITH
-- include: job_settle_ctes
,
-- The pause, and the limits other workers pace the bucket by: a worker that
-- has not heard them yet claims nothing, learns them from the answer and
-- claims with the limiter from its next round.
paused AS MATERIALIZED (
    SELECT greatest(b.paused_until, now() + make_interval(secs => %(provider_pause_s)s::float8)) AS until,
           b.requests_per_minute, b.input_tokens_per_minute, b.output_tokens_per_minute,
           coalesce(b.requests_per_minute, b.input_tokens_per_minute, b.output_tokens_per_minute) IS NOT NULL
               AS paced
    FROM (SELECT 1) one LEFT JOIN llm_rate_buckets b ON b.model = %(model)s
),
claimable AS MATERIALIZED (
    SELECT id FROM story_jobs
    WHERE status = 'pending'
    ORDER BY turn, id
    LIMIT (SELECT CASE WHEN coalesce(until > now(), false) OR paced THEN 0 ELSE %(claim_limit)s END FROM paused)
    FOR NO KEY UPDATE SKIP LOCKED
),
chosen AS (SELECT id FROM claimable),
-- include: job_claim_ctes
,
pause_shared AS (
    INSERT INTO llm_rate_buckets AS b (model, paused_until)
    SELECT %(model)s, now() + make_interval(secs => %(provider_pause_s)s::float8)
    WHERE %(provider_pause_s)s::float8 > 0
    ON CONFLICT (model) DO UPDATE SET paused_until = greatest(b.paused_until, excluded.paused_until)
)
SELECT
-- include: job_settle_and_claim_answer
,
-- (greatest() first: a row a limited round wrote holds '-infinity', which
-- no interval can be taken from)
(SELECT json_build_object('paused_s', greatest(coalesce(extract(epoch FROM greatest(until, now()) - now()), 0), 0),
                          'requests_per_minute', requests_per_minute,
                          'input_tokens_per_minute', input_tokens_per_minute,
                          'output_tokens_per_minute', output_tokens_per_minute,
                          -- held back until the limits are learned
                          'next_output_tokens', CASE WHEN paced AND %(claim_limit)s > 0 THEN 0 END)
 FROM paused)::text AS limiter;

-- name: job_settle_and_claim_limited
-- The worker's one statement per round while a rate limit is configured:
-- job_settle_and_claim with the shared rate limiter, so that it costs no
-- statement of its own. The model's bucket row is locked, refilled to now,
-- given back what the completed calls did not use, capped by what the
-- provider's headers last said was left, and a job is claimed only while the
-- bucket covers one request, its estimated input tokens and its max_tokens;
-- a job it does not cover stays pending without holding back the jobs behind
-- it that it covers (until it is owed the bucket: see `held`). A pause (a 429's retry-after, or the
-- provider saying nothing is left) claims nothing.
WITH
-- include: job_settle_ctes
,
-- What the completed calls did not use, given back below.
given_back AS MATERIALIZED (
    SELECT coalesce(sum(input_tokens_back), 0)::float8 AS input_tokens,
           coalesce(sum(output_tokens_back), 0)::float8 AS output_tokens
    FROM completed
),
-- The bucket as it stands now, one row (a missing row covers nothing this
-- round and is recreated below). Locked after the completed jobs, as every
-- statement takes it after the job rows it waits for: a statement holding
-- the bucket never waits for a job row, so the bucket joins no deadlock.
bucket AS MATERIALIZED (
    SELECT b.* FROM llm_rate_buckets b, given_back
    WHERE b.model = %(model)s
    FOR NO KEY UPDATE OF b
),
bucket_now AS MATERIALIZED (
    SELECT
        -- greatest() passes over NULLs: no row, no pause. A kind the row
        -- holds nothing for (a pause wrote it before its rate was known)
        -- was empty when written: the provider had just said so.
        greatest(b.paused_until, now() + make_interval(secs => %(provider_pause_s)s::float8)) AS paused_until,
        CASE WHEN %(requests_rate)s::float8 IS NULL THEN NULL
             WHEN b.model IS NULL THEN 0
             ELSE least(%(requests_capacity)s::float8, coalesce(b.requests, 0) + %(requests_rate)s::float8 * r.elapsed,
                        coalesce(%(provider_requests)s::float8, 'infinity')) END AS requests,
        CASE WHEN %(input_tokens_rate)s::float8 IS NULL THEN NULL
             WHEN b.model IS NULL THEN 0
             ELSE least(%(input_tokens_capacity)s::float8,
                        coalesce(b.input_tokens, 0) + %(input_tokens_rate)s::float8 * r.elapsed + g.input_tokens,
                        coalesce(%(provider_input_tokens)s::float8, 'infinity')) END AS input_tokens,
        CASE WHEN %(output_tokens_rate)s::float8 IS NULL THEN NULL
             WHEN b.model IS NULL THEN 0
             ELSE least(%(output_tokens_capacity)s::float8,
                        coalesce(b.output_tokens, 0) + %(output_tokens_rate)s::float8 * r.elapsed + g.output_tokens,
                        coalesce(%(provider_output_tokens)s::float8, 'infinity')) END AS output_tokens
    FROM given_back g
    LEFT JOIN bucket b ON true
    CROSS JOIN LATERAL (SELECT greatest(extract(epoch FROM now() - b.refilled_at), 0)::float8 AS elapsed) r
),
-- The next pending jobs in turn order, twice the slots to fill: a job the
-- bucket does not cover now lets the ones behind it that it does cover go
-- first (below). (Each row looked at is locked: a longer look costs every
-- round.)
claimable AS MATERIALIZED (
    SELECT id, turn,
           coalesce(input_tokens_estimate, 0) AS input_tokens_need,
           coalesce(max_tokens, %(default_max_tokens)s) AS output_tokens_need
    FROM story_jobs
    WHERE status = 'pending'
    ORDER BY turn, id
    LIMIT (SELECT CASE WHEN coalesce(paused_until > now(), false) THEN 0 ELSE 2 * %(claim_limit)s END
           FROM bucket_now)
    FOR NO KEY UPDATE SKIP LOCKED
),
-- Whether the bucket covers each job on its own.
covered AS MATERIALIZED (
    SELECT c.*, (b.requests IS NULL OR b.requests >= 1)
                AND (b.input_tokens IS NULL OR c.input_tokens_need <= b.input_tokens)
                AND (b.output_tokens IS NULL OR c.output_tokens_need <= b.output_tokens) AS fits
    FROM claimable c, bucket_now b
),
-- The first job the bucket does not cover. Once it has waited for the
-- bucket LLM_RATE_BURST_S (%(burst_s)s: about what the bucket takes to fill),
-- the jobs behind it stop passing it, so that it is never starved: the
-- bucket fills for it, and it goes first.
held AS MATERIALIZED (
    SELECT h.id, h.turn,
           coalesce(h.id = b.held_job_id AND b.held_since < now() - make_interval(secs => %(burst_s)s::float8),
                    false) AS reserving,
           CASE WHEN h.id = b.held_job_id THEN b.held_since ELSE now() END AS since
    FROM (SELECT id, turn FROM covered WHERE NOT fits ORDER BY turn, id LIMIT 1) h
    LEFT JOIN bucket b ON true
),
-- the jobs the bucket covers, in turn order, up to the free slots, passing
-- those it does not cover (unless one of them is owed the bucket)
chosen AS MATERIALIZED (
    SELECT c.id, c.input_tokens_need, c.output_tokens_need FROM (
        SELECT c.*, row_number() OVER w AS n, sum(c.input_tokens_need) OVER w AS input_tokens_cum,
               sum(c.output_tokens_need) OVER w AS output_tokens_cum
        FROM covered c
        WHERE c.fits AND NOT EXISTS (
            SELECT 1 FROM held h WHERE h.reserving AND (h.turn, h.id) < (c.turn, c.id))
        WINDOW w AS (ORDER BY c.turn, c.id)
    ) c, bucket_now b
    WHERE c.n <= %(claim_limit)s
      AND (b.requests IS NULL OR c.n <= b.requests)
      AND (b.input_tokens IS NULL OR c.input_tokens_cum <= b.input_tokens)
      AND (b.output_tokens IS NULL OR c.output_tokens_cum <= b.output_tokens)
),
-- include: job_claim_ctes
,
taken AS MATERIALIZED (
    SELECT count(*)::float8 AS requests, coalesce(sum(c.input_tokens_need), 0)::float8 AS input_tokens,
           coalesce(sum(c.output_tokens_need), 0)::float8 AS output_tokens
    FROM chosen c JOIN claimed USING (id)
),
bucket_left AS MATERIALIZED (
    SELECT b.paused_until, b.requests - t.requests AS requests, b.input_tokens - t.input_tokens AS input_tokens,
           b.output_tokens - t.output_tokens AS output_tokens,
           -- held back (paused, or a job looked at and not chosen) with a
           -- slot still free: this worker would wake for the bucket
           %(claim_limit)s > t.requests
           AND (coalesce(b.paused_until > now(), false)
                OR EXISTS (SELECT 1 FROM claimable c WHERE c.id <> ALL (ARRAY(SELECT id FROM chosen))))
               AS would_wake
    FROM bucket_now b, taken t
),
bucket_written AS (
    INSERT INTO llm_rate_buckets AS b (model, requests, input_tokens, output_tokens, refilled_at, paused_until,
                                       held_job_id, held_since, requests_per_minute, input_tokens_per_minute,
                                       output_tokens_per_minute, waker, waker_until)
    SELECT %(model)s, l.requests, l.input_tokens, l.output_tokens, now(), coalesce(l.paused_until, '-infinity'),
           h.id, h.since, %(requests_rate)s::float8 * 60, %(input_tokens_rate)s::float8 * 60,
           %(output_tokens_rate)s::float8 * 60,
           CASE WHEN l.would_wake THEN %(worker_id)s END,
           CASE WHEN l.would_wake
                THEN greatest(l.paused_until, now()) + make_interval(secs => %(burst_s)s::float8) END
    FROM bucket_left l LEFT JOIN held h ON true
    ON CONFLICT (model) DO UPDATE
    SET requests = excluded.requests, input_tokens = excluded.input_tokens,
        output_tokens = excluded.output_tokens,
        refilled_at = greatest(b.refilled_at, excluded.refilled_at),
        paused_until = greatest(b.paused_until, excluded.paused_until),
        requests_per_minute = excluded.requests_per_minute, input_tokens_per_minute = excluded.input_tokens_per_minute,
        output_tokens_per_minute = excluded.output_tokens_per_minute,
        -- a round that looked at no job (paused, or no slot) leaves them as they are
        held_job_id = CASE WHEN EXISTS (SELECT 1 FROM claimable) THEN excluded.held_job_id ELSE b.held_job_id END,
        held_since = CASE WHEN EXISTS (SELECT 1 FROM claimable) THEN excluded.held_since ELSE b.held_since END,
        -- the role is taken when it is free, ours or overdue, and given up
        -- by its holder when it no longer would wake
        waker = CASE WHEN b.waker IS NULL OR b.waker = %(worker_id)s OR b.waker_until <= now()
                     THEN excluded.waker ELSE b.waker END,
        waker_until = CASE WHEN b.waker IS NULL OR b.waker = %(worker_id)s OR b.waker_until <= now()
                           THEN excluded.waker_until ELSE b.waker_until END
    RETURNING b.waker, b.waker_until
)
SELECT
-- include: job_settle_and_claim_answer
,
-- the bucket after this round, and the needs of the first job it held back
(SELECT json_build_object(
    'paused_s', greatest(coalesce(extract(epoch FROM greatest(l.paused_until, now()) - now()), 0), 0),
    'requests', l.requests, 'input_tokens', l.input_tokens, 'output_tokens', l.output_tokens,
    'next_input_tokens', n.input_tokens_need, 'next_output_tokens', n.output_tokens_need,
    -- whether this worker wakes for the bucket, and else when the waker's
    -- role ends: until then another worker wakes for it
    'waker', coalesce(w.waker = %(worker_id)s, false),
    'waker_in_s', greatest(coalesce(extract(epoch FROM w.waker_until - now()), 0), 0))
 FROM bucket_left l
 CROSS JOIN bucket_written w
 LEFT JOIN LATERAL (
     SELECT c.input_tokens_need, c.output_tokens_need FROM claimable c
     WHERE c.id <> ALL (ARRAY(SELECT id FROM chosen))
     ORDER BY c.turn, c.id LIMIT 1
 ) n ON true)::text AS limiter;

-- name: job_fail_running
-- The worker gives up on jobs it owns (LLM error, rejected request): running ->
-- failed, guarded by status and worker_id, with the ledger row closed in the
-- same statement, the job charged what its billed call cost, and the rate
-- bucket given back what the claim reserved and the call did not use.
-- Returns the jobs that were still ours. Rows are reached by id as in
-- job_settle_and_claim, to keep a good generic plan, and locked in ascending
-- id order like theirs.
WITH failing AS MATERIALIZED (
    SELECT * FROM jsonb_to_recordset(%(failures)s::jsonb) AS f(
        job_id bigint, attempt smallint, error_code text, error_text text, call_outcome text,
        billed boolean, input_tokens int, output_tokens int, cost_usd numeric, request_id text)
    ORDER BY job_id
),
-- The attempt named is the last one the worker could have sent (it sends an
-- attempt only once its row is open): a later row, opened by a retry whose
-- answer was lost, is closed as not sent.
calls_finished AS (
    UPDATE llm_calls c
    SET finished_at = now(),
        outcome = CASE WHEN c.attempt = failing.attempt THEN failing.call_outcome ELSE 'not_sent' END,
        billed = c.attempt = failing.attempt AND failing.billed,
        input_tokens = CASE WHEN c.attempt = failing.attempt THEN failing.input_tokens ELSE 0 END,
        output_tokens = CASE WHEN c.attempt = failing.attempt THEN failing.output_tokens ELSE 0 END,
        cost_usd = CASE WHEN c.attempt = failing.attempt THEN failing.cost_usd ELSE 0 END,
        request_id = CASE WHEN c.attempt = failing.attempt THEN coalesce(failing.request_id, c.request_id) END,
        error_text = failing.error_text
    FROM failing
    WHERE c.job_id = ANY (ARRAY(SELECT job_id FROM failing))
      AND c.job_id = failing.job_id
      AND (c.attempt = failing.attempt OR (c.attempt > failing.attempt AND c.outcome IN ('started', 'interrupted')))
),
failed AS (
    UPDATE story_jobs j
    SET status = 'failed', completed_at = now(), error_code = failing.error_code,
        error_text = failing.error_text, progress = failing.output_tokens,
        charged_usd = CASE WHEN failing.billed THEN failing.cost_usd ELSE 0 END
    FROM failing
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM failing)) AND j.id = failing.job_id
      AND j.status = 'running' AND j.worker_id = %(worker_id)s
    RETURNING j.id,
              coalesce(j.input_tokens_estimate, 0) - failing.input_tokens AS input_tokens_back,
              coalesce(j.max_tokens, 0) - failing.output_tokens AS output_tokens_back
),
bucket_given_back AS (
    UPDATE llm_rate_buckets b
    SET input_tokens = b.input_tokens + (SELECT sum(input_tokens_back) FROM failed),
        output_tokens = b.output_tokens + (SELECT sum(output_tokens_back) FROM failed)
    WHERE b.model = %(model)s AND %(limited)s AND EXISTS (SELECT 1 FROM failed)
)
SELECT coalesce((SELECT array_agg(id) FROM failed), '{}') AS failed_ids;

-- name: job_heartbeat
-- Every few seconds, one statement for all jobs a worker process holds:
-- refresh heartbeat_at and progress where the job is still ours. It touches no
-- indexed column, so it is a HOT update. A job missing from alive_ids was
-- failed by the sweeper or cancelled: its worker stops paying for the stream.
-- Rows are locked in ascending id order, as job_settle_and_claim locks them.
WITH beat AS MATERIALIZED (
    SELECT * FROM jsonb_to_recordset(%(beats)s::jsonb) AS b(id bigint, progress int)
    ORDER BY id
),
refreshed AS (
    UPDATE story_jobs j
    SET heartbeat_at = now(), progress = beat.progress
    FROM beat
    WHERE j.id = ANY (ARRAY(SELECT id FROM beat)) AND j.id = beat.id
      AND j.status = 'running' AND j.worker_id = %(worker_id)s
    RETURNING j.id
)
SELECT j.id, j.status, j.error_code, EXISTS (SELECT 1 FROM refreshed r WHERE r.id = j.id) AS alive
FROM story_jobs j
WHERE j.id = ANY (ARRAY(SELECT id FROM beat));

-- name: job_listen_pending
-- The api's insert sends NOTIFY storyjobs_pending at commit: an idle worker
-- claims at once instead of at its next poll.
LISTEN storyjobs_pending;

-- name: job_adopt_lost_claims
-- After a claim statement failed without an answer (connection lost around
-- its commit), the claims it may have made belong to this worker but never
-- reached it: no LLM call was sent for them, so the worker runs them now.
-- Their heartbeat is refreshed in the same statement (the claim's may be as
-- old as the lost statement), so that the sweeper does not fail a job whose
-- call is about to start. Rows are locked in ascending id order, as the
-- heartbeat locks them. The same columns as the claim's answer: an adopted
-- job runs with the max_tokens, model and prices it was accepted with.
WITH lost AS MATERIALIZED (
    SELECT j.id
    FROM story_jobs j
    JOIN llm_calls c ON c.job_id = j.id AND c.attempt = 1 AND c.outcome = 'started'
    WHERE j.status = 'running' AND j.worker_id = %(worker_id)s
      AND NOT (j.id = ANY (%(known_ids)s::bigint[]))
      AND NOT EXISTS (SELECT 1 FROM llm_calls c2 WHERE c2.job_id = j.id AND c2.attempt > 1)
    ORDER BY j.id
)
UPDATE story_jobs j
SET heartbeat_at = now()
WHERE j.id = ANY (ARRAY(SELECT id FROM lost)) AND j.status = 'running' AND j.worker_id = %(worker_id)s
RETURNING j.id, j.public_id, j.client_id, j.request, j.created_at, j.started_at,
          j.max_tokens, j.input_tokens_estimate, j.model, j.input_usd_per_mtok, j.output_usd_per_mtok;

-- name: llm_call_start
-- A retry's ledger row, written before its request is sent, and only while
-- the job is still running under this worker: no row (and so no request) for
-- a job that was cancelled or swept meanwhile. The previous attempt's row is
-- closed in the same statement either way (again, harmlessly, when the
-- statement is repeated). The job's row is locked while the new row is
-- written, so a cancellation or a sweep either happens first (and no row is
-- opened) or waits, and then closes the new row with a statement of its own
-- (llm_call_close_*). While the shared rate bucket is paused (another
-- worker's 429), or, where a limit is known, until it holds a whole request
-- (refilled to now, as a claim refills it), no row is opened either: the
-- answer says how long to wait before asking again. An opened retry takes
-- its request from the bucket like a new claim, so that the jobs waiting out
-- a 429 leave at the limit's pace, not all at once when the pause ends.
-- Idempotent: run again after its answer was lost, it finds the row it
-- opened (still started) and answers it, taking nothing more from the bucket.
WITH owned AS MATERIALIZED (
    SELECT id FROM story_jobs
    WHERE id = %(job_id)s AND status = 'running' AND worker_id = %(worker_id)s
    FOR SHARE
),
-- The bucket refilled to now (a kind without a known rate as stored),
-- locked after the job's row, as every statement takes them.
bucket AS MATERIALIZED (
    SELECT b.model,
           greatest(extract(epoch FROM greatest(b.paused_until, now()) - now()), 0)::float8 AS paused_s,
           -- a kind no limited claim has written yet (a row a pause wrote
           -- before its rate was known) was empty when written: the
           -- provider had just said nothing was left
           CASE WHEN %(requests_rate)s::float8 IS NULL THEN b.requests
                ELSE least(%(requests_capacity)s::float8, coalesce(b.requests, 0) + %(requests_rate)s::float8 * r.elapsed)
           END AS requests,
           CASE WHEN %(input_tokens_rate)s::float8 IS NULL THEN b.input_tokens
                ELSE least(%(input_tokens_capacity)s::float8,
                           coalesce(b.input_tokens, 0) + %(input_tokens_rate)s::float8 * r.elapsed) END AS input_tokens,
           CASE WHEN %(output_tokens_rate)s::float8 IS NULL THEN b.output_tokens
                ELSE least(%(output_tokens_capacity)s::float8,
                           coalesce(b.output_tokens, 0) + %(output_tokens_rate)s::float8 * r.elapsed) END AS output_tokens,
           -- the job's max_tokens, which the provider takes again from its
           -- own bucket when the retry arrives
           (SELECT coalesce(j.max_tokens, 0) FROM story_jobs j WHERE j.id = %(job_id)s)::float8
               AS output_tokens_need
    FROM llm_rate_buckets b
    CROSS JOIN (SELECT count(*) FROM owned) job_locked
    CROSS JOIN LATERAL (SELECT greatest(extract(epoch FROM now() - b.refilled_at), 0)::float8 AS elapsed) r
    WHERE b.model = %(model)s
    FOR NO KEY UPDATE OF b
),
-- How long until the retry may go: the pause, then a whole request and the
-- job's max_tokens in the bucket, where their rates are known.
paused AS MATERIALIZED (
    SELECT coalesce((
        SELECT greatest(paused_s,
                        CASE WHEN %(requests_rate)s::float8 IS NULL OR requests IS NULL THEN 0
                             ELSE greatest(1 - requests, 0) / %(requests_rate)s::float8 END,
                        CASE WHEN %(output_tokens_rate)s::float8 IS NULL OR output_tokens IS NULL THEN 0
                             ELSE greatest(output_tokens_need - output_tokens, 0) / %(output_tokens_rate)s::float8 END)
        FROM bucket), 0)::float8 AS paused_s
),
-- Joined to the job's lock (one row, ours or not), so that the job's row is
-- locked before this ledger row: a cancellation or a sweep locks the job's
-- row and then closes its open call, and the two must not wait in a cycle.
previous AS (
    UPDATE llm_calls c
    SET finished_at = coalesce(c.finished_at, now()), outcome = %(previous_outcome)s,
        billed = %(previous_billed)s, error_text = %(previous_error)s
    FROM (SELECT count(*) FROM owned) job_locked
    WHERE c.job_id = %(job_id)s AND c.attempt = %(previous_attempt)s
    RETURNING c.job_id, c.attempt, c.worker_id, c.provider, c.model
),
already AS MATERIALIZED (
    SELECT c.attempt, c.outcome FROM llm_calls c JOIN owned o ON o.id = c.job_id
    WHERE c.job_id = %(job_id)s AND c.attempt = %(previous_attempt)s + 1
),
opened AS (
    INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model)
    SELECT p.job_id, p.attempt + 1, p.worker_id, p.provider, p.model
    FROM previous p JOIN owned o ON o.id = p.job_id
    WHERE (SELECT paused_s FROM paused) = 0 AND NOT EXISTS (SELECT 1 FROM already)
    RETURNING attempt
),
request_taken AS (
    UPDATE llm_rate_buckets b
    -- (the claim's reservation of max_tokens is kept until the job ends:
    -- the bucket then counts the refused attempt's too, erring on the safe
    -- side for as long as it takes to refill it)
    SET requests = n.requests - 1, input_tokens = n.input_tokens,
        output_tokens = n.output_tokens - CASE WHEN %(output_tokens_rate)s::float8 IS NULL THEN 0
                                               ELSE n.output_tokens_need END,
        refilled_at = greatest(b.refilled_at, now())
    FROM bucket n
    WHERE b.model = n.model AND (n.requests IS NOT NULL OR n.output_tokens IS NOT NULL)
      AND EXISTS (SELECT 1 FROM opened)
)
SELECT coalesce((SELECT attempt FROM opened), (SELECT attempt FROM already WHERE outcome = 'started')) AS attempt,
       (SELECT paused_s FROM paused) AS paused_s, EXISTS (SELECT 1 FROM owned) AS owned;

-- name: llm_rate_bucket_pause
-- A 429: no worker claims, and no retry is sent, for the model until its
-- retry-after has passed, so that one 429 is not followed by one more from
-- each replica. Written as soon as the 429 arrives. Where the request rate
-- is known (%(requests_rate)s), the provider has just said nothing is left:
-- the bucket is lowered so that it holds one request when the pause ends,
-- and the requests waiting for it then leave one at a time at the limit's
-- pace (refilled_at is kept, so the other kinds lose no refill).
INSERT INTO llm_rate_buckets AS b (model, paused_until, requests)
VALUES (%(model)s, now() + make_interval(secs => %(pause_s)s::float8),
        1 - %(requests_rate)s::float8 * %(pause_s)s::float8)
ON CONFLICT (model) DO UPDATE
SET paused_until = greatest(b.paused_until, excluded.paused_until),
    requests = CASE WHEN %(requests_rate)s::float8 IS NULL THEN b.requests
                    ELSE least(coalesce(b.requests, 'infinity'),
                               1 - %(requests_rate)s::float8 * extract(epoch FROM excluded.paused_until - b.refilled_at))
               END;

-- name: llm_rate_bucket_ensure
-- At a worker's start, when a limit is configured: the model's bucket row,
-- full, unless it exists. A kind without a limit is NULL.
INSERT INTO llm_rate_buckets (model, requests, input_tokens, output_tokens)
VALUES (%(model)s, %(requests_capacity)s::float8, %(input_tokens_capacity)s::float8,
        %(output_tokens_capacity)s::float8)
ON CONFLICT (model) DO NOTHING;

-- name: llm_call_finish
-- Closes a ledger row outside a job transition: a stream stopped because the
-- job was no longer ours. Whoever ended the job charged it its worst case,
-- not knowing what the call cost; now that it is known, the charge comes down
-- to it (the budget follows), and the rate bucket gets back what the claim
-- reserved and the call did not use. A later attempt's row (a retry opened
-- by a statement whose answer was lost, never sent) is closed as not sent.
-- The job's row is locked first, as every statement that writes a job and
-- its ledger locks them. Run again after its answer was lost, it finds its
-- row as it left it and gives the bucket nothing twice.
WITH job_locked AS MATERIALIZED (
    SELECT id FROM story_jobs WHERE id = %(job_id)s FOR NO KEY UPDATE
),
closed AS (
    UPDATE llm_calls c
    SET finished_at = now(), outcome = %(outcome)s, billed = %(billed)s,
        input_tokens = %(input_tokens)s, output_tokens = %(output_tokens)s,
        cost_usd = %(cost_usd)s, error_text = %(error_text)s,
        request_id = coalesce(%(request_id)s, c.request_id)
    FROM (SELECT count(*) FROM job_locked) l
    WHERE c.job_id = %(job_id)s AND c.attempt = %(attempt)s
      AND (c.outcome, c.billed, c.cost_usd, c.error_text)
          IS DISTINCT FROM (%(outcome)s::text, %(billed)s::boolean, %(cost_usd)s::numeric, %(error_text)s::text)
    RETURNING c.job_id, c.model
),
never_sent AS (
    UPDATE llm_calls c
    SET finished_at = now(), outcome = 'not_sent', billed = false, error_text = %(error_text)s
    FROM (SELECT count(*) FROM job_locked) l
    WHERE c.job_id = %(job_id)s AND c.attempt > %(attempt)s AND c.outcome IN ('started', 'interrupted')
),
charged AS (
    UPDATE story_jobs j
    SET charged_usd = %(cost_usd)s::numeric
    FROM job_locked l
    WHERE j.id = l.id AND j.status = 'failed' AND j.charged_usd > %(cost_usd)s::numeric
    RETURNING j.id
),
reservation AS (
    SELECT coalesce(j.input_tokens_estimate, 0) - %(input_tokens)s AS input_tokens_back,
           coalesce(j.max_tokens, 0) - %(output_tokens)s AS output_tokens_back, c.model
    FROM closed c JOIN story_jobs j ON j.id = c.job_id
)
UPDATE llm_rate_buckets b
SET input_tokens = b.input_tokens + r.input_tokens_back, output_tokens = b.output_tokens + r.output_tokens_back
FROM reservation r
WHERE b.model = r.model AND (b.input_tokens IS NOT NULL OR b.output_tokens IS NOT NULL);

-- name: job_fail_stale
-- The sweeper's rules, in one guarded statement per batch: a running job
-- whose heartbeat stopped (interrupted), one running too long (timed_out),
-- one waiting too long (queue_timeout). SKIP LOCKED leaves a job whose
-- worker is completing it right now alone: the next pass sees it finished.
-- %(judge_running)s is false until the sweeper has seen the database writable
-- for a whole heartbeat timeout: while workers cannot write, neither their
-- heartbeats nor their finished stories can be judged.
-- Each rule's scan orders by (created_at, id), which only the active index
-- provides, so the plan cannot drift to a walk of the whole table.
WITH now_ AS (SELECT coalesce(%(now)s::timestamptz, now()) AS t),
stale_pending AS MATERIALIZED (
    SELECT j.id, 'queue_timeout' AS reason
    FROM story_jobs j, now_
    WHERE j.status = 'pending'
      AND j.created_at < now_.t - make_interval(secs => %(pending_timeout_s)s::float8)
    ORDER BY j.created_at, j.id
    LIMIT %(batch_size)s
    FOR NO KEY UPDATE OF j SKIP LOCKED
),
stale_running AS MATERIALIZED (
    SELECT j.id,
           CASE WHEN j.started_at < now_.t - make_interval(secs => %(job_timeout_s)s::float8)
                THEN 'timed_out' ELSE 'interrupted' END AS reason
    FROM story_jobs j, now_
    WHERE %(judge_running)s AND j.status = 'running'
      AND (j.started_at < now_.t - make_interval(secs => %(job_timeout_s)s::float8)
        OR j.heartbeat_at < now_.t - make_interval(secs => %(heartbeat_timeout_s)s::float8))
    ORDER BY j.created_at, j.id
    LIMIT %(batch_size)s
    FOR NO KEY UPDATE OF j SKIP LOCKED
),
stale AS (
    SELECT id, reason FROM stale_pending
    UNION ALL
    SELECT id, reason FROM stale_running
)
UPDATE story_jobs j
SET status = 'failed', error_code = stale.reason, completed_at = now_.t,
    -- a job that never ran cost nothing; one whose worker is gone or too slow
    -- may have been billed anything up to its worst case
    charged_usd = CASE stale.reason WHEN 'queue_timeout' THEN 0 ELSE j.reserved_usd END,
    error_text = CASE stale.reason
        WHEN 'queue_timeout' THEN 'no worker picked the job up in time'
        WHEN 'timed_out' THEN 'the story took longer than the job timeout'
        ELSE 'the worker stopped sending heartbeats'
    END
FROM stale, now_
WHERE j.id = stale.id AND j.status IN ('pending', 'running')
RETURNING j.id, j.public_id, stale.reason, j.worker_id;

-- name: llm_call_close_for_swept_jobs
-- Second statement of a sweep batch, in its transaction: a call whose worker
-- died never reports how it ended, so close it as interrupted and keep
-- counting it as billed, since it may have been. A live worker that lost its
-- job this way overwrites this with what it knows. A statement of its own, so
-- that its snapshot sees a retry's row opened while the sweep waited.
UPDATE llm_calls c
SET finished_at = now(), outcome = 'interrupted',
    error_text = 'the job was failed by the sweeper (' || j.error_code || ') while this call was open'
FROM story_jobs j
WHERE j.id = ANY (%(job_ids)s::bigint[]) AND j.status = 'failed'
  AND c.job_id = j.id AND c.outcome = 'started';

-- name: transaction_lock_timeout_set
-- How long the statements of this transaction may wait for a lock before
-- they fail (SET LOCAL: nothing outlives the transaction, so this is safe on
-- a pooled connection).
SELECT set_config('lock_timeout', %(lock_timeout_ms)s::text, true);

-- name: sweeper_probe
-- Whether workers could write right now: the probe takes the table lock a
-- heartbeat takes (and fails as one would on a read-only database), touching
-- no row; it runs under a short lock timeout. A changed server start time
-- means the server restarted, and every worker lost its connection for a while.
WITH write_check AS (
    UPDATE story_jobs SET heartbeat_at = heartbeat_at WHERE id = 0 RETURNING id
)
SELECT pg_postmaster_start_time();

-- name: job_queue_gauges
-- Queue depth by live status and the oldest pending job's age: read from the
-- active index only.
SELECT (SELECT count(*) FROM story_jobs WHERE status = 'pending') AS pending,
       (SELECT count(*) FROM story_jobs WHERE status = 'running') AS running,
       coalesce(extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - (
           SELECT created_at FROM story_jobs WHERE status = 'pending' ORDER BY created_at, id LIMIT 1
       )), 0)::float8 AS oldest_pending_age_seconds;

-- name: budget_days_today
-- Today's (UTC) spend and reservations, all clients (scope 'all') and each
-- client with a row, with the client's own budget if it has one: the
-- sweeper's gauges and `storyjobs stats`.
SELECT CASE WHEN b.client_id = 0 THEN 'all' ELSE c.name END AS scope, b.client_id,
       b.spent_usd, b.reserved_usd, c.budget_usd_per_day AS client_budget_usd
FROM budget_days b LEFT JOIN api_clients c ON c.id = b.client_id
WHERE b.day = (coalesce(%(now)s::timestamptz, now()) AT TIME ZONE 'UTC')::date
ORDER BY b.client_id;

-- name: llm_rate_bucket_list
-- The shared rate buckets, refilled to now at the rates the caller knows
-- (NULL rate: shown as stored): `storyjobs stats`.
SELECT model, requests, input_tokens, output_tokens,
       greatest(extract(epoch FROM greatest(paused_until, now()) - now()), 0)::float8 AS paused_s,
       greatest(extract(epoch FROM now() - refilled_at), 0)::float8 AS since_refill_s
FROM llm_rate_buckets ORDER BY model;

-- name: job_prune_finished
-- Deletes finished jobs past retention, with their stories and idempotency
-- keys (a key can then be used again), looking only at the oldest rows of the
-- table: jobs finish within their timeouts, so the oldest ids are the first to
-- expire, and no index on completed_at is needed. The ledger is kept.
WITH oldest AS (
    SELECT id, status, completed_at FROM story_jobs ORDER BY id LIMIT %(batch_size)s
),
pruned AS (
    DELETE FROM story_jobs j
    USING oldest
    WHERE j.id = oldest.id
      AND oldest.status IN ('completed', 'failed')
      AND oldest.completed_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(retention_s)s::float8)
    RETURNING j.id, j.client_id, j.idempotency_key
),
stories_pruned AS (
    DELETE FROM stories s USING pruned WHERE s.job_id = pruned.id
),
keys_pruned AS (
    DELETE FROM job_idempotency_keys k USING pruned
    WHERE k.client_id = pruned.client_id AND k.idempotency_key = pruned.idempotency_key
),
-- a job's webhook deliveries go with it, sent or not
deliveries_pruned AS (
    DELETE FROM webhook_deliveries d USING pruned WHERE d.job_id = pruned.id
)
SELECT id FROM pruned;

-- name: budget_over_reservation_total
-- What the charges of every day's jobs have passed their reservations by
-- (only the provider's reported usage can), all clients: the sweeper's
-- storyjobs_budget_over_reservation_usd_total. budget_days keeps every day,
-- so the total only grows; one row per day is read.
SELECT coalesce(sum(over_reservation_usd), 0) FROM budget_days WHERE client_id = 0;


-- name: job_list
-- `storyjobs jobs list`, newest first.
SELECT j.public_id, c.name AS client_name, j.status, j.error_code, j.progress,
       j.created_at, j.started_at, j.completed_at, j.worker_id
FROM story_jobs j JOIN api_clients c ON c.id = j.client_id
WHERE (%(status)s::job_status IS NULL OR j.status = %(status)s::job_status)
ORDER BY j.id DESC
LIMIT %(limit)s;

-- name: job_get_admin
-- `storyjobs jobs show ID`.
SELECT j.id, j.public_id, c.name AS client_name, j.status, j.error_code, j.error_text,
       j.progress, j.worker_id, j.story_id, j.request, j.created_at, j.started_at,
       j.heartbeat_at, j.completed_at
FROM story_jobs j JOIN api_clients c ON c.id = j.client_id
WHERE j.public_id = %(job_id)s;

-- name: llm_call_list_for_job
SELECT attempt, worker_id, provider, model, started_at, finished_at, outcome, billed,
       input_tokens, output_tokens, cost_usd, request_id, error_text
FROM llm_calls WHERE job_id = %(job_id)s ORDER BY attempt;

-- name: stats_last_hour
-- `storyjobs stats`: queue depth, throughput and spend over the last hour.
-- The ledger is read by time; llm_calls_started_at_brin keeps that cheap.
SELECT (SELECT count(*) FROM story_jobs WHERE status = 'pending') AS pending,
       (SELECT count(*) FROM story_jobs WHERE status = 'running') AS running,
       count(*) FILTER (WHERE c.outcome = 'succeeded') AS succeeded_calls,
       count(*) FILTER (WHERE c.outcome NOT IN ('succeeded', 'started')) AS failed_calls,
       count(*) FILTER (WHERE c.billed) AS billed_calls,
       coalesce(sum(c.input_tokens), 0)::bigint AS input_tokens,
       coalesce(sum(c.output_tokens), 0)::bigint AS output_tokens,
       coalesce(sum(c.cost_usd), 0)::numeric(14, 6) AS cost_usd
FROM llm_calls c
WHERE c.started_at > now() - interval '1 hour';


-- ---------------------------------------------------------------------------
-- Operators: their keys, and the console at /ops/ (api/ops.py).
--
-- The console reads history without an index of its own: every index on
-- story_jobs costs each status change a write, so lists walk the primary key
-- newest first (id DESC) with their filters, each request over a bounded
-- range of ids, and times are turned into id bounds by job_id_bounds.

-- name: operator_key_insert
-- `storyjobs keys create NAME --operator`.
INSERT INTO operator_keys (name, key_prefix, key_hash)
VALUES (%(name)s, %(key_prefix)s, %(key_hash)s);

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

-- name: job_id_bounds
-- Turns a time range into a range of ids without an index on created_at:
-- lo_id is at or below the id of every job created at or after
-- %(created_after)s, hi_id above the id of every job created before
-- %(created_before)s (NULL: the first id, and one past the last). Each bound
-- is found by a binary search over the primary key, about log2(ids) lookups
-- of one row each.
--
-- It relies on ids growing with created_at: an id is taken at insert, and
-- created_at is the inserting transaction's start, so two jobs can disagree
-- by at most the length of an admission transaction, which its statement
-- timeout (at most 60 s) bounds. Each search aims 5 minutes wide of its
-- bound; callers still filter on created_at itself.
--
-- The search keeps lo <= hi with the last row below lo created before its
-- target and the first row at or above hi not; a probe reads the first row
-- at or above the middle, and the search ends when lo = hi.
WITH RECURSIVE ends AS MATERIALIZED (
    SELECT min(id) AS first_id, max(id) + 1 AS next_id FROM story_jobs
),
targets AS (
    SELECT 'lo' AS side, %(created_after)s::timestamptz - interval '5 minutes' AS target
    WHERE %(created_after)s::timestamptz IS NOT NULL
    UNION ALL
    SELECT 'hi', %(created_before)s::timestamptz + interval '5 minutes'
    WHERE %(created_before)s::timestamptz IS NOT NULL
),
search(side, target, lo, hi) AS (
    SELECT t.side, t.target, ends.first_id, ends.next_id FROM targets t, ends
  UNION ALL
    SELECT s.side, s.target,
           CASE WHEN probe.id < s.hi AND probe.created_at < s.target THEN probe.id + 1 ELSE s.lo END,
           CASE WHEN probe.id < s.hi AND probe.created_at < s.target THEN s.hi ELSE (s.lo + s.hi) / 2 END
    FROM search s
    LEFT JOIN LATERAL (
        SELECT j.id, j.created_at FROM story_jobs j
        WHERE j.id >= (s.lo + s.hi) / 2
        ORDER BY j.id
        LIMIT 1
    ) probe ON true
    WHERE s.lo < s.hi
)
SELECT coalesce((SELECT hi FROM search WHERE side = 'lo' AND lo >= hi), ends.first_id, 1) AS lo_id,
       coalesce((SELECT hi FROM search WHERE side = 'hi' AND lo >= hi), ends.next_id, 1) AS hi_id
FROM ends;

-- name: ops_job_list
-- The console's jobs list, newest first: a walk down the primary key from
-- %(before_id)s, stopping at %(floor_id)s or when %(limit)s rows matched,
-- whichever comes first. The caller keeps the range to a bounded number of
-- ids, so a request costs the same whether the filters match every row or
-- none, and however deep the page: no OFFSET, no count. Filters that are
-- NULL are off. Each row's cost is read from its own ledger rows (their
-- primary key), only for the rows of the page.
WITH page AS MATERIALIZED (
    SELECT j.id, j.public_id, j.client_id, j.status, j.error_code, j.worker_id, j.progress,
           j.created_at, j.started_at, j.completed_at
    FROM story_jobs j
    WHERE j.id < %(before_id)s AND j.id >= %(floor_id)s
      AND (%(status)s::job_status IS NULL OR j.status = %(status)s::job_status)
      AND (%(client_id)s::bigint IS NULL OR j.client_id = %(client_id)s::bigint)
      AND (%(error_code)s::text IS NULL OR j.error_code = %(error_code)s::text)
      AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
      AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
    ORDER BY j.id DESC
    LIMIT %(limit)s
)
-- include: ops_job_list_page
ORDER BY p.id DESC;

-- name: ops_job_list_page
-- What both jobs lists answer for the rows of their `page`: each job with
-- its client's name and what its calls cost (billed calls only).
SELECT p.id, p.public_id, p.client_id, coalesce(c.name, '') AS client_name, p.status::text AS status,
       p.error_code, p.worker_id, p.progress, p.created_at, p.started_at, p.completed_at,
       cost.calls, cost.billed_calls, cost.cost_usd
FROM page p
LEFT JOIN api_clients c ON c.id = p.client_id
CROSS JOIN LATERAL (
    SELECT count(*) AS calls, count(*) FILTER (WHERE l.billed) AS billed_calls,
           coalesce(sum(l.cost_usd) FILTER (WHERE l.billed), 0)::numeric(14, 6) AS cost_usd
    FROM llm_calls l WHERE l.job_id = p.id
) cost

-- name: ops_job_list_live
-- The jobs list for one live status (pending or running), newest first by
-- (created_at, id) below the cursor: the order of the live-jobs index, read
-- backwards, so the answer costs what the queue holds, never the history.
WITH page AS MATERIALIZED (
    SELECT j.id, j.public_id, j.client_id, j.status, j.error_code, j.worker_id, j.progress,
           j.created_at, j.started_at, j.completed_at
    FROM story_jobs j
    WHERE j.status = %(status)s::job_status AND j.status IN ('pending', 'running')
      AND (j.created_at, j.id) < (coalesce(%(before_created_at)s::timestamptz, 'infinity'),
                                  coalesce(%(before_id)s::bigint, 9223372036854775807))
      AND (%(client_id)s::bigint IS NULL OR j.client_id = %(client_id)s::bigint)
      AND (%(error_code)s::text IS NULL OR j.error_code = %(error_code)s::text)
      AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
      AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
    ORDER BY j.created_at DESC, j.id DESC
    LIMIT %(limit)s
)
-- include: ops_job_list_page
ORDER BY p.created_at DESC, p.id DESC;

-- name: ops_job_get
-- A job's page: the job, its client and its story (kept also when the job
-- failed after the story was paid for), by the public id's unique index.
SELECT j.id, j.public_id, j.client_id, coalesce(c.name, '') AS client_name, j.status::text AS status,
       j.error_code, j.error_text, j.worker_id, j.progress, j.request,
       j.created_at, j.started_at, j.heartbeat_at, j.completed_at,
       s.id AS story_id, s.title AS story_title, s.body AS story_body, s.model AS story_model,
       s.prompt_version AS story_prompt_version, s.input_tokens AS story_input_tokens,
       s.output_tokens AS story_output_tokens, s.cost_usd AS story_cost_usd
FROM story_jobs j
LEFT JOIN api_clients c ON c.id = j.client_id
LEFT JOIN stories s ON s.job_id = j.id
WHERE j.public_id = %(job_id)s;

-- name: ops_job_cancel
-- An operator cancels one job, whoever's it is: pending or running ->
-- failed (cancelled), guarded like the client's DELETE. A running job's
-- worker sees the change at its next heartbeat and closes its stream. The
-- snapshot row tells the caller why nothing changed; no row: no such job.
WITH job AS (
    SELECT id, status FROM story_jobs WHERE public_id = %(job_id)s
),
cancelled AS (
    UPDATE story_jobs j
    SET status = 'failed', error_code = 'cancelled',
        error_text = 'cancelled by an operator', completed_at = now(),
        charged_usd = CASE WHEN j.status = 'running' THEN j.reserved_usd ELSE 0 END
    FROM job
    WHERE j.id = job.id AND j.status IN ('pending', 'running')
    RETURNING j.id
)
SELECT job.status::text AS previous_status, EXISTS (SELECT 1 FROM cancelled) AS cancelled
FROM job;

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
-- pending count, so job_admission's bounds stay bounds.
WITH matching AS MATERIALIZED (
    SELECT j.id FROM story_jobs j
    WHERE j.status = 'pending' AND j.id <= %(through_id)s
      AND (%(client_id)s::bigint IS NULL OR j.client_id = %(client_id)s::bigint)
      AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
      AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
    ORDER BY j.id
    FOR NO KEY UPDATE
),
cancelled AS (
    UPDATE story_jobs j
    SET status = 'failed', error_code = 'cancelled',
        error_text = 'cancelled by an operator', completed_at = now(), charged_usd = 0
    WHERE j.id = ANY (ARRAY(SELECT id FROM matching)) AND j.status = 'pending'
    RETURNING j.public_id
)
SELECT public_id FROM cancelled;

-- name: ops_client_list
-- The clients, for the console's filter and its keys screen.
SELECT c.id AS client_id, c.name, c.created_at, c.budget_usd_per_day,
       coalesce(json_agg(json_build_object(
           'key_prefix', k.key_prefix, 'created_at', k.created_at, 'revoked_at', k.revoked_at)
           ORDER BY k.id) FILTER (WHERE k.id IS NOT NULL), '[]') AS keys
FROM api_clients c
LEFT JOIN api_keys k ON k.client_id = c.id
GROUP BY c.id
ORDER BY c.name;

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
-- The console's overview in one statement. Live jobs come from the
-- live-jobs index. Finished jobs are counted by when they finished, among
-- the rows from %(day_from_id)s up: the caller takes that id from
-- job_id_bounds at a day plus the longest a job can wait and run before the
-- sweeper fails it, so no job finished in the window is left out (unless the
-- sweeper was stopped for longer). Spend and the provider's answers come
-- from the ledger, read by time on its BRIN index. A story billed but not
-- delivered is a failed job with billed calls. Each source is read once and
-- aggregated in one pass, the hour and the day side by side.
WITH finished AS MATERIALIZED (
    SELECT j.id, j.status, j.error_code, j.completed_at >= now() - interval '1 hour' AS last_hour
    FROM story_jobs j
    WHERE j.id >= %(day_from_id)s
      AND j.status IN ('completed', 'failed')
      AND j.completed_at >= now() - interval '1 day'
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
           coalesce(sum(billed.cost_usd) FILTER (WHERE f.last_hour), 0)::numeric(14, 6) AS hour_undelivered_usd,
           count(*) AS day_undelivered,
           coalesce(sum(billed.cost_usd), 0)::numeric(14, 6) AS day_undelivered_usd
    FROM finished f
    CROSS JOIN LATERAL (
        SELECT sum(l.cost_usd) AS cost_usd FROM llm_calls l
        WHERE l.job_id = f.id AND l.billed
        HAVING count(*) > 0
    ) billed
    WHERE f.status = 'failed'
),
calls AS (
    SELECT count(*) FILTER (WHERE last_hour AND billed) AS hour_billed_calls,
           coalesce(sum(cost_usd) FILTER (WHERE last_hour AND billed), 0)::numeric(14, 6) AS hour_spend_usd,
           coalesce(sum(input_tokens) FILTER (WHERE last_hour AND billed), 0)::bigint AS hour_input_tokens,
           coalesce(sum(output_tokens) FILTER (WHERE last_hour AND billed), 0)::bigint AS hour_output_tokens,
           count(*) FILTER (WHERE last_hour AND outcome = 'rate_limited') AS hour_rate_limited,
           count(*) FILTER (WHERE last_hour AND outcome = 'overloaded') AS hour_overloaded,
           count(*) FILTER (WHERE billed) AS day_billed_calls,
           coalesce(sum(cost_usd) FILTER (WHERE billed), 0)::numeric(14, 6) AS day_spend_usd,
           coalesce(sum(input_tokens) FILTER (WHERE billed), 0)::bigint AS day_input_tokens,
           coalesce(sum(output_tokens) FILTER (WHERE billed), 0)::bigint AS day_output_tokens,
           count(*) FILTER (WHERE outcome = 'rate_limited') AS day_rate_limited,
           count(*) FILTER (WHERE outcome = 'overloaded') AS day_overloaded
    FROM (
        SELECT l.started_at >= now() - interval '1 hour' AS last_hour, l.billed, l.outcome,
               l.input_tokens, l.output_tokens, l.cost_usd
        FROM llm_calls l
        WHERE l.started_at >= now() - interval '1 day'
    ) day
)
SELECT (SELECT count(*) FROM story_jobs WHERE status = 'pending') AS pending,
       (SELECT count(*) FROM story_jobs WHERE status = 'running') AS running,
       coalesce(extract(epoch FROM now() - (
           SELECT created_at FROM story_jobs WHERE status = 'pending' ORDER BY created_at, id LIMIT 1
       )), 0)::float8 AS oldest_pending_age_s,
       jobs.*, undelivered.*, calls.*
FROM jobs, undelivered, calls;

-- name: rollup_minutes
-- The sweeper's history (minute_rollup): recounts every minute from
-- %(from_minute)s to the current one from the jobs (ids from %(from_id)s up,
-- which job_id_bounds found for the oldest job that could have been claimed
-- or finished since) and the ledger (by time, on its BRIN index), and
-- records the queue depth this pass saw in the current minute. A recount
-- replaces a minute's counts, so a job committed late lands in its minute at
-- the next pass; the depths only grow within a minute.
WITH minutes AS (
    SELECT generate_series(%(from_minute)s::timestamptz, date_trunc('minute', now()), interval '1 minute') AS minute
),
jobs AS MATERIALIZED (
    SELECT j.status, j.error_code, j.created_at, j.started_at, j.completed_at
    FROM story_jobs j
    WHERE j.id >= %(from_id)s
      AND (j.started_at >= %(from_minute)s OR j.completed_at >= %(from_minute)s)
),
finished AS (
    SELECT date_trunc('minute', completed_at) AS minute,
           count(*) FILTER (WHERE status = 'completed') AS completed,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE error_code = 'cancelled') AS cancelled
    FROM jobs
    WHERE completed_at >= %(from_minute)s AND status IN ('completed', 'failed')
    GROUP BY 1
),
buckets AS (
    SELECT generate_series(1, cardinality(%(bounds_s)s::float8[])) AS bucket
),
waited AS (
    SELECT date_trunc('minute', started_at) AS minute,
           width_bucket(extract(epoch FROM started_at - created_at)::float8, %(bounds_s)s::float8[]) AS bucket,
           count(*) AS n
    FROM jobs
    WHERE started_at >= %(from_minute)s
    GROUP BY 1, 2
),
ran AS (
    SELECT date_trunc('minute', completed_at) AS minute,
           width_bucket(extract(epoch FROM completed_at - started_at)::float8, %(bounds_s)s::float8[]) AS bucket,
           count(*) AS n
    FROM jobs
    WHERE completed_at >= %(from_minute)s AND status = 'completed'
    GROUP BY 1, 2
),
histograms AS (
    SELECT m.minute,
           array_agg(coalesce(w.n, 0)::integer ORDER BY b.bucket) AS wait_counts,
           array_agg(coalesce(r.n, 0)::integer ORDER BY b.bucket) AS run_counts
    FROM minutes m
    CROSS JOIN buckets b
    LEFT JOIN waited w ON w.minute = m.minute AND greatest(w.bucket, 1) = b.bucket
    LEFT JOIN ran r ON r.minute = m.minute AND greatest(r.bucket, 1) = b.bucket
    GROUP BY m.minute
),
calls AS (
    SELECT date_trunc('minute', l.started_at) AS minute,
           coalesce(sum(l.cost_usd) FILTER (WHERE l.billed), 0) AS spend_usd,
           count(*) FILTER (WHERE l.outcome = 'rate_limited') AS rate_limited
    FROM llm_calls l
    WHERE l.started_at >= %(from_minute)s
    GROUP BY 1
),
written AS (
    INSERT INTO minute_rollup AS r (minute, completed, failed, cancelled, spend_usd, rate_limited,
                                    pending_max, running_max, wait_counts, run_counts)
    SELECT m.minute, coalesce(f.completed, 0), coalesce(f.failed, 0), coalesce(f.cancelled, 0),
           coalesce(c.spend_usd, 0), coalesce(c.rate_limited, 0),
           CASE WHEN m.minute = date_trunc('minute', now()) THEN %(pending)s ELSE 0 END,
           CASE WHEN m.minute = date_trunc('minute', now()) THEN %(running)s ELSE 0 END,
           h.wait_counts, h.run_counts
    FROM minutes m
    JOIN histograms h ON h.minute = m.minute
    LEFT JOIN finished f ON f.minute = m.minute
    LEFT JOIN calls c ON c.minute = m.minute
    ON CONFLICT (minute) DO UPDATE SET
        completed = EXCLUDED.completed, failed = EXCLUDED.failed, cancelled = EXCLUDED.cancelled,
        spend_usd = EXCLUDED.spend_usd, rate_limited = EXCLUDED.rate_limited,
        pending_max = greatest(r.pending_max, EXCLUDED.pending_max),
        running_max = greatest(r.running_max, EXCLUDED.running_max),
        wait_counts = EXCLUDED.wait_counts, run_counts = EXCLUDED.run_counts
    RETURNING 1
)
SELECT count(*) AS minutes FROM written;

-- name: rollup_prune
-- The history's rows past what the console shows (a week) and a day more.
DELETE FROM minute_rollup WHERE minute < now() - interval '8 days';

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
-- built-in offline writer) sent requests in the last day, for the overview.
SELECT DISTINCT provider FROM llm_calls WHERE started_at >= now() - interval '1 day' ORDER BY provider;

-- name: ops_client_today
-- Each client's jobs created today (UTC), ids from %(from_id)s up, and its
-- failures among them (cancellations aside), for the clients screen.
SELECT client_id, count(*) AS jobs,
       count(*) FILTER (WHERE status = 'failed' AND error_code IS DISTINCT FROM 'cancelled') AS failed
FROM story_jobs
WHERE id >= %(from_id)s AND created_at >= %(day_start)s
GROUP BY client_id;

-- name: ops_workers
-- The workers seen in the last hour: those holding running jobs (with their
-- jobs' last heartbeat, on the live-jobs index) and those that sent a request
-- (the ledger, by time).
WITH busy AS (
    SELECT worker_id, count(*) AS running, max(heartbeat_at) AS last_heartbeat_at,
           array_agg(public_id ORDER BY id) AS job_ids
    FROM story_jobs
    WHERE status = 'running'
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


-- ---------------------------------------------------------------------------
-- Webhooks: a client's endpoints (api/webhooks.py), the outbox the trigger
-- story_jobs_webhook_outbox writes (sql/006), its delivery by the workers
-- (worker/webhooks.py), the sweeper's gauge, the console and the CLI.

-- name: webhook_endpoint_insert
-- POST /webhook-endpoints: a client's new endpoint, unless it has
-- %(max_per_client)s already (no row: refused). Two concurrent requests can
-- both pass the count; a client with one endpoint too many costs nothing.
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

-- name: webhook_delivery_claim
-- A worker takes up to %(limit)s due deliveries: each is counted as an
-- attempt and leased until now + %(lease_s)s (next_attempt_at), in a short
-- statement of its own, so no row lock is held during the HTTP call; a
-- worker killed mid-delivery leaves it due again when the lease ends.
-- SKIP LOCKED, as the job claim: workers never wait for each other here.
-- The endpoint's secrets come with it; the previous one while it still signs.
WITH due AS MATERIALIZED (
    SELECT d.id FROM webhook_deliveries d
    WHERE d.state = 'pending' AND d.next_attempt_at <= now()
    ORDER BY d.next_attempt_at, d.id
    LIMIT %(limit)s
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE webhook_deliveries d
SET attempts = d.attempts + 1, last_attempt_at = now(),
    next_attempt_at = now() + make_interval(secs => %(lease_s)s::float8)
FROM due, webhook_endpoints e
WHERE d.id = due.id AND d.state = 'pending' AND e.id = d.endpoint_id
RETURNING d.id, d.attempts, d.endpoint_id, e.url, e.secret,
          CASE WHEN e.previous_secret_expires_at > now() THEN e.previous_secret END AS previous_secret,
          e.disabled_at IS NOT NULL AS endpoint_disabled,
          d.job_public_id, d.job_status::text AS job_status, d.error_code, d.story_id, d.occurred_at,
          d.created_at;

-- name: webhook_delivery_finish
-- The end of one attempt, guarded by the attempt it was (a delivery whose
-- lease ran out and was claimed again belongs to the new attempt): delivered,
-- retry (due again in %(retry_in_s)s), dead (out of retries: its endpoint is
-- marked failing) or gone (410: the endpoint is disabled and its other
-- undelivered deliveries die with it). A success clears failing.
WITH finished AS (
    UPDATE webhook_deliveries d
    SET state = CASE %(outcome)s WHEN 'delivered' THEN 'delivered' WHEN 'retry' THEN 'pending' ELSE 'dead' END,
        next_attempt_at = CASE WHEN %(outcome)s = 'retry'
                               THEN now() + make_interval(secs => %(retry_in_s)s::float8)
                               ELSE d.next_attempt_at END,
        delivered_at = CASE WHEN %(outcome)s = 'delivered' THEN now() END,
        last_status_code = %(status_code)s, last_error = %(error)s
    WHERE d.id = %(delivery_id)s AND d.state = 'pending' AND d.attempts = %(attempt)s
    RETURNING d.endpoint_id, d.created_at
),
endpoint_marked AS (
    UPDATE webhook_endpoints e
    SET failing_since = CASE %(outcome)s WHEN 'delivered' THEN NULL ELSE coalesce(e.failing_since, now()) END,
        disabled_at = CASE WHEN %(outcome)s = 'gone' THEN coalesce(e.disabled_at, now()) ELSE e.disabled_at END
    FROM finished
    WHERE e.id = finished.endpoint_id
      AND (%(outcome)s IN ('dead', 'gone') OR (%(outcome)s = 'delivered' AND e.failing_since IS NOT NULL))
),
others_dropped AS (
    UPDATE webhook_deliveries d
    SET state = 'dead', last_error = 'the endpoint answered 410 Gone and was disabled'
    FROM finished
    WHERE %(outcome)s = 'gone' AND d.endpoint_id = finished.endpoint_id AND d.state = 'pending'
      AND d.id <> %(delivery_id)s
)
-- from the event to this attempt's end, by the database's clock; no row:
-- the attempt was no longer the delivery's
SELECT extract(epoch FROM now() - created_at)::float8 AS latency_s FROM finished;

-- name: webhook_delivery_gauges
-- The sweeper's gauges, read from the undelivered rows only: how many wait,
-- and the age of the oldest.
SELECT count(*) AS undelivered,
       coalesce(extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - min(created_at)), 0)::float8
           AS oldest_undelivered_age_seconds
FROM webhook_deliveries WHERE state = 'pending';

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
SELECT d.id, d.endpoint_id, e.url, d.job_public_id, d.job_status::text AS job_status, d.error_code,
       d.state, d.attempts, d.created_at, d.next_attempt_at, d.last_attempt_at, d.last_status_code,
       d.last_error, d.delivered_at
FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
WHERE (%(endpoint_id)s::uuid IS NULL OR d.endpoint_id = %(endpoint_id)s::uuid)
  AND (%(state)s::text IS NULL OR d.state = %(state)s::text)
ORDER BY d.id DESC
LIMIT %(limit)s;

-- name: webhook_delivery_retry
-- An operator sends a dead delivery again: dead -> pending, due now, with a
-- fresh schedule (its endpoint is enabled again unless it was deleted).
-- Guarded by the state it expects; no row: not a dead delivery.
WITH retried AS (
    UPDATE webhook_deliveries d
    SET state = 'pending', attempts = 0, next_attempt_at = now(), last_error = NULL
    WHERE d.id = %(delivery_id)s AND d.state = 'dead'
    RETURNING d.id, d.endpoint_id
),
enabled AS (
    UPDATE webhook_endpoints e SET disabled_at = NULL
    FROM retried WHERE e.id = retried.endpoint_id AND e.disabled_at IS NOT NULL
)
SELECT id FROM retried;

-- name: operator_action_insert
-- An operator's action, recorded in the action's own transaction (api/ops.py
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
