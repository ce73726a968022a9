-- The worker's named queries (worker/store.py runs them): settling written
-- stories, claiming pending jobs (with and without the shared rate bucket),
-- failures, heartbeats, the LLM call ledger around each attempt, and the
-- rate bucket; and webhook deliveries (worker/delivery/store.py). The
-- conventions are in common.sql.


-- name: job_claim
-- A worker's claim: up to %(claim_limit)s pending jobs, in their clients'
-- turns, go pending -> running in one statement however many it takes, each
-- with its first ledger row before its LLM call can start (a failed insert
-- fails the whole statement, claim included). It follows the round's
-- written stories (job_settle) in one pipeline and one transaction
-- (worker/pg_store.py); when the server refuses it, the stories are sent
-- again alone, so that nothing the claim does wrong can touch a story that
-- was paid for.
--
-- The rate limit is a parameter (shared/ratelimit.py's claim_params):
-- %(limited)s when any rate is configured (%(requests_rate)s,
-- %(input_tokens_rate)s, %(output_tokens_rate)s; NULL: no limit of that
-- kind). With one, the model's bucket row is locked and refilled first
-- (llm_rate_bucket_hold, migration 023; what the settled calls did not use
-- was given back by job_settle), and the jobs it covers are chosen among the
-- claimable ones and what they take written back (llm_rate_bucket_take).
-- Without one, the bucket row is only read, never locked nor written but for
-- a pause, and neither function runs: claimers without a limit do not queue
-- on one row, nor start the limiter's plan. Either way a pause (a 429's
-- retry-after, or the provider's headers saying nothing is left:
-- %(provider_pause_s)s, a duration, as every time the limiter keeps is the
-- database's) claims nothing, and is written there for every worker.
WITH
-- Without a limit: the pause, and the limits other workers pace the bucket
-- by: a worker that has not heard them yet claims nothing, learns them from
-- the answer and claims with the limiter from its next round.
bucket_read AS MATERIALIZED (
    SELECT greatest(b.paused_until, now() + make_interval(secs => %(provider_pause_s)s::float8)) AS paused_until,
           b.requests_per_minute, b.input_tokens_per_minute, b.output_tokens_per_minute,
           coalesce(b.requests_per_minute, b.input_tokens_per_minute, b.output_tokens_per_minute) IS NOT NULL
               AS paced
    FROM (SELECT 1) one LEFT JOIN llm_rate_buckets b ON b.model = %(model)s
    WHERE NOT %(limited)s::boolean
),
-- With a limit: the bucket, locked before any job row
bucket_held AS MATERIALIZED (
    SELECT llm_rate_bucket_hold(%(model)s, %(provider_pause_s)s::float8,
                                %(requests_rate)s::float8, %(requests_capacity)s::float8,
                                %(input_tokens_rate)s::float8, %(input_tokens_capacity)s::float8,
                                %(output_tokens_rate)s::float8, %(output_tokens_capacity)s::float8,
                                %(provider_requests)s::float8, %(provider_input_tokens)s::float8,
                                %(provider_output_tokens)s::float8) AS bucket
    WHERE %(limited)s::boolean
),
-- The next pending jobs in turn order; with a limit, twice the slots to
-- fill: a job the bucket does not cover now lets the ones behind it that it
-- does cover go first. (Each row looked at is locked: a longer look costs
-- every round.) The walk starts at the floor (migration 030): no pending
-- job is below it, and the entries of the jobs claimed before it, which a
-- snapshot held open keeps, are not walked again by every claim.
claimable AS MATERIALIZED (
    SELECT id, turn,
           coalesce(input_tokens_estimate, 0) AS input_tokens_need,
           coalesce(max_tokens, %(default_max_tokens)s) AS output_tokens_need
    FROM story_jobs
    WHERE status = 'pending' AND lane = 'interactive' AND turn >= (SELECT turn FROM job_claim_floor)
    ORDER BY turn, id
    LIMIT (SELECT CASE WHEN coalesce(paused_until > now(), false) OR paced THEN 0 ELSE %(claim_limit)s END
           FROM bucket_read
           UNION ALL
           SELECT CASE WHEN coalesce((bucket).paused_until > now(), false) THEN 0 ELSE 2 * %(claim_limit)s END
           FROM bucket_held)
    FOR NO KEY UPDATE SKIP LOCKED
),
-- With a limit: the jobs the bucket covers, and the bucket as they leave it
taken AS MATERIALIZED (
    SELECT t.* FROM bucket_held h
    CROSS JOIN LATERAL llm_rate_bucket_take(
        %(model)s, %(worker_id)s, h.bucket,
        ARRAY(SELECT ROW(id, turn, input_tokens_need, output_tokens_need)::job_need FROM claimable ORDER BY turn, id),
        %(claim_limit)s, %(burst_s)s::float8, %(requests_rate)s::float8, %(input_tokens_rate)s::float8,
        %(output_tokens_rate)s::float8) t
),
chosen AS MATERIALIZED (
    SELECT id FROM claimable WHERE NOT %(limited)s::boolean
    UNION ALL
    SELECT unnest(chosen) FROM taken
),
claimed AS (
    UPDATE story_jobs j
    SET status = 'running', started_at = now(), heartbeat_at = now(),
        worker_id = %(worker_id)s
    WHERE j.id = ANY (ARRAY(SELECT id FROM chosen)) AND j.status = 'pending'
    RETURNING j.id, j.public_id, j.client_id, j.request, j.created_at, j.started_at,
              j.max_tokens, j.input_tokens_estimate, j.model, j.input_usd_per_mtok, j.output_usd_per_mtok,
              j.trace_context, j.worst_case_usd
),
-- Nothing reads first_calls: a data-modifying CTE runs to completion
-- whether it is read or not.
first_calls AS (
    INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, worst_case_usd)
    SELECT id, 1, %(worker_id)s, %(provider)s, %(model)s, worst_case_usd FROM claimed
),
-- Without a limit, only a pause the headers announce, for every worker.
pause_shared AS (
    INSERT INTO llm_rate_buckets AS b (model, paused_until)
    SELECT %(model)s, now() + make_interval(secs => %(provider_pause_s)s::float8)
    WHERE NOT %(limited)s::boolean AND %(provider_pause_s)s::float8 > 0
    ON CONFLICT (model) DO UPDATE SET paused_until = greatest(b.paused_until, excluded.paused_until)
)
SELECT
-- the jobs it claimed, as one JSON text
coalesce((
    SELECT json_agg(json_build_object(
        'id', c.id, 'public_id', c.public_id, 'client_id', c.client_id, 'request', c.request,
        'created_at', c.created_at, 'started_at', c.started_at, 'max_tokens', c.max_tokens,
        'input_tokens_estimate', c.input_tokens_estimate, 'model', c.model,
        -- as text: exact
        'input_usd_per_mtok', c.input_usd_per_mtok::text, 'output_usd_per_mtok', c.output_usd_per_mtok::text,
        'trace_context', c.trace_context)
        ORDER BY c.id)
    FROM claimed c
)::text, '[]') AS claimed,
-- what the limiter said (a row a limited claim wrote holds '-infinity':
-- bucket_paused_s reads it as no pause)
coalesce(
    -- with a limit: the bucket after this claim, the needs of the first job
    -- it held back, and whether this worker wakes for the bucket (else when
    -- the waker's role ends: until then another worker wakes for it)
    (SELECT json_build_object(
         'paused_s', bucket_paused_s(t.paused_until),
         'requests', t.requests, 'input_tokens', t.input_tokens, 'output_tokens', t.output_tokens,
         'next_input_tokens', t.next_input_tokens, 'next_output_tokens', t.next_output_tokens,
         'waker', t.waker, 'waker_in_s', t.waker_in_s)
     FROM taken t),
    -- without: the pause, and the limits others pace by (held back until
    -- they are learned); every worker wakes for itself
    (SELECT json_build_object(
         'paused_s', bucket_paused_s(r.paused_until),
         'requests_per_minute', r.requests_per_minute, 'input_tokens_per_minute', r.input_tokens_per_minute,
         'output_tokens_per_minute', r.output_tokens_per_minute,
         'next_output_tokens', CASE WHEN r.paced AND %(claim_limit)s > 0 THEN 0 END)
     FROM bucket_read r)
)::text AS limiter;

-- name: job_fail_running
-- The worker gives up on jobs it owns (LLM error, rejected request): the
-- ledger rows of their calls closed with what the worker knows, and the jobs
-- running -> failed where they are still its own (jobs_end, migration 019,
-- which charges each what its ledger says). With a rate limit
-- (%(limited)s), the model's bucket gets back what the ended jobs' claims
-- reserved and their calls did not use. Returns the jobs that were still
-- ours.
WITH ending AS MATERIALIZED (
    SELECT f.job_id, f.attempt, f.error_code, f.error_text, f.call_outcome, f.billed, f.input_tokens,
           f.output_tokens, f.cost_usd, f.request_id
    FROM jsonb_to_recordset(%(failures)s::jsonb) AS f(
        job_id bigint, attempt smallint, error_code text, error_text text, call_outcome text,
        billed boolean, input_tokens int, output_tokens int, cost_usd numeric, request_id text)
    ORDER BY f.job_id
),
ended AS MATERIALIZED (
    SELECT e.* FROM jobs_end(
        ARRAY(SELECT ROW(job_id, 'failed', error_code, error_text, NULL, output_tokens)::job_end FROM ending),
        '{running}', %(worker_id)s, NULL, NULL,
        ARRAY(SELECT ROW(job_id, attempt, call_outcome, billed, input_tokens, output_tokens, cost_usd, request_id,
                         error_text)::llm_call_close
              FROM ending)) e
),
given_back AS MATERIALIZED (
    SELECT llm_rate_bucket_give_back(%(model)s, sum(coalesce(e.input_tokens_estimate, 0) - f.input_tokens),
                                     sum(coalesce(e.max_tokens, 0) - f.output_tokens))
    FROM ended e JOIN ending f ON f.job_id = e.id
    WHERE %(limited)s
    HAVING count(*) > 0
)
SELECT coalesce((SELECT array_agg(id) FROM ended), '{}') AS failed_ids, (SELECT count(*) FROM given_back) AS given_back;

-- name: job_settle
-- A round's written stories, one commit however many the round carries,
-- with the claim that follows (worker/pg_store.py sends them again alone
-- when the server refuses the claim: nothing the claim does wrong is blamed
-- on a story, which was paid for):
-- each story inserted, its call's ledger row closed as billed at its cost,
-- and its job running -> completed where it is still ours (jobs_end). With a
-- rate limit (%(limited)s), the model's bucket gets back what their claims
-- reserved and their calls did not use.
--
-- A story is inserted even when its job lost the race to the sweeper: it was
-- paid for. ON CONFLICT makes a retry after an ambiguous commit harmless:
-- a story already there was inserted by the earlier commit of this
-- statement, which also ended its job (a job's story is written nowhere
-- else, and a job that is no longer running never runs again), so the job
-- is not running and jobs_end leaves it, and the id the worker made for the
-- story not inserted, as they are.
--
-- The written stories' small fields arrive as one JSON array, one
-- parameter however many stories the round carries; their titles and texts
-- as two text arrays sent in binary, and their ids as a uuid array, each
-- record naming its element (n). Postgres's JSON parser reads a string a
-- character at a time: a story's text sent inside the JSON was the largest
-- part of the round's cost, a text in a binary array is copied. The ids are
-- made by the worker, not by gen_random_uuid() here: the planner computes a
-- volatile column after the sort, which costs a second copy of every row.
--
-- Answers the jobs completed now, and those (after an ambiguous commit)
-- already completed by this worker; the caller takes every other one for a
-- lost race.
WITH ending AS MATERIALIZED (
    SELECT d.job_id, d.attempt, (%(story_ids)b::uuid[])[d.n] AS story_id, d.input_tokens, d.output_tokens,
           d.cost_usd, d.request_id, d.client_id,
           (%(titles)b::text[])[d.n] AS title, (%(bodies)b::text[])[d.n] AS body, d.model, d.prompt_version
    FROM jsonb_to_recordset(%(completions)s::jsonb) AS d(
        n int, job_id bigint, client_id bigint, attempt smallint, model text, prompt_version text,
        input_tokens int, output_tokens int, cost_usd numeric, request_id text)
    ORDER BY d.job_id
),
stories_inserted AS (
    INSERT INTO stories (id, job_id, client_id, title, body, model, prompt_version,
                         input_tokens, output_tokens, cost_usd)
    SELECT story_id, job_id, client_id, title, body, model, prompt_version,
           input_tokens, output_tokens, cost_usd
    FROM ending
    ON CONFLICT (job_id) DO NOTHING
),
ended AS MATERIALIZED (
    SELECT e.* FROM jobs_end(
        ARRAY(SELECT ROW(job_id, 'completed', NULL, NULL, story_id, output_tokens)::job_end FROM ending),
        '{running}', %(worker_id)s, NULL, NULL,
        ARRAY(SELECT ROW(job_id, attempt, 'succeeded', true, input_tokens, output_tokens, cost_usd, request_id,
                         NULL)::llm_call_close
              FROM ending)) e
),
given_back AS MATERIALIZED (
    SELECT llm_rate_bucket_give_back(%(model)s, sum(coalesce(e.input_tokens_estimate, 0) - f.input_tokens),
                                     sum(coalesce(e.max_tokens, 0) - f.output_tokens))
    FROM ended e JOIN ending f ON f.job_id = e.id
    WHERE %(limited)s
    HAVING count(*) > 0
)
SELECT coalesce((SELECT array_agg(id) FROM ended), '{}') AS completed_ids,
       coalesce((
           SELECT array_agg(j.id) FROM story_jobs j
           WHERE j.id = ANY (ARRAY(SELECT job_id FROM ending))
             AND j.status = 'completed' AND j.worker_id = %(worker_id)s
       ), '{}') AS already_completed_ids,
       (SELECT count(*) FROM given_back) AS given_back;

-- name: job_heartbeat
-- Every few seconds, one statement for all jobs a worker process holds:
-- refresh heartbeat_at and progress where the job is still ours. It touches no
-- indexed column, so it is a HOT update. A job missing from alive_ids was
-- failed by the sweeper or cancelled: its worker stops paying for the stream.
-- Rows are locked in ascending id order, as job_settle locks them.
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
          j.max_tokens, j.input_tokens_estimate, j.model, j.input_usd_per_mtok, j.output_usd_per_mtok,
          j.trace_context;

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
    SELECT id, worst_case_usd FROM story_jobs
    WHERE id = %(job_id)s AND status = 'running' AND worker_id = %(worker_id)s
    FOR SHARE
),
-- The bucket refilled to now (a kind without a known rate as stored),
-- locked after the job's row, as every statement takes them.
bucket AS MATERIALIZED (
    SELECT b.model,
           bucket_paused_s(b.paused_until) AS paused_s,
           -- refilled as a claim refills it (bucket_refilled, migration 012)
           bucket_held_now(b.requests, %(requests_rate)s::float8, %(requests_capacity)s::float8,
                           b.refilled_at) AS requests,
           bucket_held_now(b.input_tokens, %(input_tokens_rate)s::float8, %(input_tokens_capacity)s::float8,
                           b.refilled_at) AS input_tokens,
           bucket_held_now(b.output_tokens, %(output_tokens_rate)s::float8, %(output_tokens_capacity)s::float8,
                           b.refilled_at) AS output_tokens,
           -- the job's max_tokens, which the provider takes again from its
           -- own bucket when the retry arrives
           (SELECT coalesce(j.max_tokens, 0) FROM story_jobs j WHERE j.id = %(job_id)s)::float8
               AS output_tokens_need
    FROM llm_rate_buckets b
    CROSS JOIN (SELECT count(*) FROM owned) job_locked
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
    INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, worst_case_usd)
    SELECT p.job_id, p.attempt + 1, p.worker_id, p.provider, p.model, o.worst_case_usd
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
-- job was no longer ours (llm_calls_close, migration 019: the attempt's row
-- with what the worker knows, a later one as not sent). Whoever ended the
-- job charged it as its ledger then said, the call's outcome unknown; the
-- ledger's trigger now brings the charge to what the row says (the budget
-- follows), and the rate bucket gets back what the claim reserved and the
-- call did not use. The job's row is locked first (`job` is read by the
-- close's argument), as every statement that writes a job and its ledger
-- locks them. Run again after its answer was lost, it finds its row as it
-- left it and gives the bucket nothing twice.
WITH job AS MATERIALIZED (
    SELECT id, input_tokens_estimate, max_tokens FROM story_jobs WHERE id = %(job_id)s FOR NO KEY UPDATE
),
closed AS MATERIALIZED (
    SELECT c.* FROM (SELECT count(*) FROM job) locked,
    llm_calls_close(CASE WHEN locked.count >= 0 THEN
                        ARRAY[ROW(%(job_id)s, %(attempt)s, %(outcome)s, %(billed)s, %(input_tokens)s,
                                  %(output_tokens)s, %(cost_usd)s, %(request_id)s, %(error_text)s)::llm_call_close]
                    END) c
)
SELECT llm_rate_bucket_give_back(%(model)s, sum(coalesce(j.input_tokens_estimate, 0) - c.input_tokens),
                                 sum(coalesce(j.max_tokens, 0) - c.output_tokens))
FROM closed c JOIN job j ON j.id = c.job_id
WHERE c.attempt = %(attempt)s
HAVING count(*) > 0;

-- name: webhook_delivery_claim
-- A worker takes up to %(limit)s due deliveries: each is counted as an
-- attempt and leased until now + %(lease_s)s (leased_until, and
-- next_attempt_at with it) under a new lease number, in a short statement of
-- its own, so no row lock is held during the HTTP call; a worker killed
-- mid-delivery leaves it due again when the lease ends.
--
-- The slots are shared between clients, across all workers, by what the rows
-- say: a client's k-th due delivery takes the turn (its attempts in flight)
-- + k, lowest first, then the oldest due. So a client whose receivers hang
-- holds at most the slots nobody else wants: another client's event waits at
-- most for the first attempt in flight to end (one WEBHOOK_TIMEOUT_S). The
-- clients are found by a skip scan of webhook_deliveries_client_due_idx, and
-- each one's first %(limit)s due rows and its attempts in flight by index, so
-- the cost follows the clients waiting, never the history.
--
-- A delivery is never attempted past the schedule (%(max_attempts)s
-- attempts): one due again after its last attempt (whose worker died before
-- recording it) is dead instead, and its endpoint marked failing, as
-- webhook_delivery_finish does for a last attempt that failed.
-- SKIP LOCKED, as the job claim: workers never wait for each other here.
-- The endpoint's secrets come with it; the previous one while it still signs.
WITH RECURSIVE clients AS (
    (SELECT d.client_id FROM webhook_deliveries d WHERE d.state = 'pending' ORDER BY d.client_id LIMIT 1)
    UNION ALL
    SELECT (SELECT d.client_id FROM webhook_deliveries d
            WHERE d.state = 'pending' AND d.client_id > c.client_id ORDER BY d.client_id LIMIT 1)
    FROM clients c
    WHERE c.client_id IS NOT NULL
),
ranked AS MATERIALIZED (
    SELECT first_due.id, first_due.next_attempt_at, in_flight.n + first_due.k AS turn
    FROM clients c
    CROSS JOIN LATERAL (
        SELECT count(*) AS n FROM webhook_deliveries f
        WHERE f.client_id = c.client_id AND f.leased_until > now()
    ) in_flight
    CROSS JOIN LATERAL (
        SELECT d.id, d.next_attempt_at, row_number() OVER (ORDER BY d.next_attempt_at, d.id) AS k
        FROM webhook_deliveries d
        WHERE d.client_id = c.client_id AND d.state = 'pending' AND d.next_attempt_at <= now()
        ORDER BY d.next_attempt_at, d.id
        LIMIT %(limit)s
    ) first_due
    WHERE c.client_id IS NOT NULL
),
-- locked in turn order, skipping what another worker holds: LIMIT counts only
-- the rows locked; a row another worker claimed since this statement began
-- is checked again as it is now, and left
due AS MATERIALIZED (
    SELECT d.id, d.attempts < %(max_attempts)s AS within_schedule
    FROM ranked r JOIN webhook_deliveries d ON d.id = r.id
    WHERE d.state = 'pending' AND d.next_attempt_at <= now()
    ORDER BY r.turn, r.next_attempt_at, r.id
    LIMIT %(limit)s
    FOR NO KEY UPDATE OF d SKIP LOCKED
),
claimed AS (
    UPDATE webhook_deliveries d
    SET attempts = d.attempts + CASE WHEN due.within_schedule THEN 1 ELSE 0 END,
        lease = d.lease + 1,
        state = CASE WHEN due.within_schedule THEN 'pending' ELSE 'dead' END,
        leased_until = CASE WHEN due.within_schedule THEN now() + make_interval(secs => %(lease_s)s::float8) END,
        next_attempt_at = CASE WHEN due.within_schedule THEN now() + make_interval(secs => %(lease_s)s::float8)
                               ELSE d.next_attempt_at END,
        last_attempt_at = CASE WHEN due.within_schedule THEN now() ELSE d.last_attempt_at END,
        last_error = CASE WHEN due.within_schedule THEN d.last_error
                          ELSE 'out of attempts: the last one recorded no end within its lease' END
    FROM due
    WHERE d.id = due.id AND d.state = 'pending'
    RETURNING d.id, d.attempts, d.lease, d.endpoint_id, d.job_public_id, d.job_status, d.error_code, d.story_id,
              d.occurred_at, d.created_at, d.trace_context, due.within_schedule
),
expired_endpoints_marked AS (
    UPDATE webhook_endpoints e SET failing_since = coalesce(e.failing_since, now())
    WHERE e.id IN (SELECT endpoint_id FROM claimed WHERE NOT within_schedule)
)
SELECT c.id, c.attempts, c.lease, c.endpoint_id, e.url, e.secret,
       CASE WHEN e.previous_secret_expires_at > now() THEN e.previous_secret END AS previous_secret,
       e.disabled_at IS NOT NULL AS endpoint_disabled,
       c.job_public_id, c.job_status::text AS job_status, c.error_code, c.story_id, c.occurred_at, c.created_at,
       c.trace_context
FROM claimed c JOIN webhook_endpoints e ON e.id = c.endpoint_id
WHERE c.within_schedule
ORDER BY c.id;

-- name: webhook_delivery_finish
-- The end of one attempt, guarded by its lease (a delivery whose lease ran
-- out and was claimed again, or that an operator retried, has another, and
-- an attempt already recorded has none): delivered, retry (due again in
-- %(retry_in_s)s), dead (out of retries: its endpoint is marked failing) or
-- gone (410: the endpoint is disabled and its other undelivered deliveries
-- die with it). A success clears failing.
WITH finished AS (
    UPDATE webhook_deliveries d
    SET state = CASE %(outcome)s WHEN 'delivered' THEN 'delivered' WHEN 'retry' THEN 'pending' ELSE 'dead' END,
        next_attempt_at = CASE WHEN %(outcome)s = 'retry'
                               THEN now() + make_interval(secs => %(retry_in_s)s::float8)
                               ELSE d.next_attempt_at END,
        leased_until = NULL,
        delivered_at = CASE WHEN %(outcome)s = 'delivered' THEN now() END,
        last_status_code = %(status_code)s, last_error = %(error)s
    WHERE d.id = %(delivery_id)s AND d.state = 'pending' AND d.leased_until IS NOT NULL
      AND d.lease = %(lease)s
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
-- an attempt of theirs in flight is no longer counted against the client; its
-- end finds the delivery dead and records nothing
others_dropped AS (
    UPDATE webhook_deliveries d
    SET state = 'dead', leased_until = NULL, last_error = 'the endpoint answered 410 Gone and was disabled'
    FROM finished
    WHERE %(outcome)s = 'gone' AND d.endpoint_id = finished.endpoint_id AND d.state = 'pending'
      AND d.id <> %(delivery_id)s
)
-- from the event to this attempt's end, by the database's clock; no row:
-- the attempt was no longer the delivery's
SELECT extract(epoch FROM now() - created_at)::float8 AS latency_s FROM finished;

-- name: draft_append
-- Every DRAFT_INTERVAL_S, one statement for all the jobs a worker process
-- holds: each job's text streamed since its last write, appended as a chunk
-- to its draft (migration 020 says why chunks, and why unlogged), where the
-- job is still running under this worker. The jobs' rows are held FOR SHARE
-- (in ascending id order, as every statement that locks several locks them)
-- until the commit, so that no draft lands after its job's end: an end
-- waits for this write and then deletes what it wrote (jobs_end), or ends
-- first and this finds the job no longer running. A chunk is appended only
-- where the draft is exactly `from_char` long (an empty draft: 0), so a
-- write sent again after its answer was lost changes nothing, and a draft
-- emptied by a crash of Postgres is not continued with a hole. Answers, for
-- each job still ours, how long its draft is now: the worker sends from
-- there next time (the whole text again after such a crash).
WITH piece AS MATERIALIZED (
    SELECT * FROM unnest(%(job_ids)s::bigint[], %(from_chars)s::integer[], %(texts)s::text[])
        AS p(job_id, from_char, text)
),
ours AS MATERIALIZED (
    SELECT j.id FROM story_jobs j
    WHERE j.id = ANY (ARRAY(SELECT job_id FROM piece)) AND j.status = 'running' AND j.worker_id = %(worker_id)s
    ORDER BY j.id
    FOR SHARE
),
held AS MATERIALIZED (
    SELECT o.id, coalesce((SELECT c.from_char + c.chars FROM story_draft_chunks c WHERE c.job_id = o.id
                           ORDER BY c.from_char DESC LIMIT 1), 0) AS chars
    FROM ours o
),
appended AS (
    INSERT INTO story_draft_chunks (job_id, from_char, chars, text)
    SELECT p.job_id, p.from_char, char_length(p.text), p.text
    FROM piece p JOIN held h ON h.id = p.job_id
    WHERE p.text <> '' AND p.from_char = h.chars
    ON CONFLICT DO NOTHING
    RETURNING job_id, from_char + chars AS chars
)
SELECT h.id AS job_id, coalesce(a.chars, h.chars) AS chars
FROM held h LEFT JOIN appended a ON a.job_id = h.id;
