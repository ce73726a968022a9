-- The sweeper's named queries (sweeper/store.py runs them): stale jobs and
-- the ledger rows they left open, the probe, the gauges, pruning, and the
-- minute rollup the console's history reads. The conventions are in
-- common.sql.


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
--
-- The batch lane has rules of its own (docs/batches.md): a batch job that
-- waits for a batch (pending, or running after an attempt that billed
-- nothing) fails as queue_timeout once it has waited BATCH_COLLECT_S and a
-- day (%(batch_collect_s)s); one in a batch, as timed_out an hour after its
-- batch expired (an intent never answered: a day after its fence). Its
-- ledger row stays open: its batch's result may still bill it.
WITH now_ AS (SELECT coalesce(%(now)s::timestamptz, now()) AS t),
stale_pending AS MATERIALIZED (
    SELECT j.id, 'queue_timeout' AS reason
    FROM story_jobs j, now_
    WHERE j.status = 'pending' AND j.lane = 'interactive'
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
    WHERE %(judge_running)s AND j.status = 'running' AND j.lane = 'interactive'
      AND (j.started_at < now_.t - make_interval(secs => %(job_timeout_s)s::float8)
        OR j.heartbeat_at < now_.t - make_interval(secs => %(heartbeat_timeout_s)s::float8))
    ORDER BY j.created_at, j.id
    LIMIT %(batch_size)s
    FOR NO KEY UPDATE OF j SKIP LOCKED
),
stale_batch_waiting AS MATERIALIZED (
    SELECT j.id, 'queue_timeout' AS reason
    FROM story_jobs j, now_
    WHERE j.batch_ready_at IS NOT NULL
      AND j.batch_ready_at < now_.t - make_interval(secs => %(batch_collect_s)s::float8) - interval '1 day'
      AND j.status IN ('pending', 'running')
    ORDER BY j.batch_ready_at, j.id
    LIMIT %(batch_size)s
    FOR NO KEY UPDATE OF j SKIP LOCKED
),
stale_batched AS MATERIALIZED (
    SELECT j.id, 'timed_out' AS reason
    FROM message_batches b
    CROSS JOIN now_
    JOIN message_batch_items i ON i.batch_id = b.id
    JOIN story_jobs j ON j.id = i.job_id
    WHERE %(judge_running)s AND b.state IN ('intent', 'sent')
      AND coalesce(b.expires_at, b.fence_at + interval '1 day') < now_.t - interval '1 hour'
      AND j.status = 'running' AND j.batch_id = b.id AND j.batch_ready_at IS NULL
    ORDER BY j.id
    LIMIT %(batch_size)s
    FOR NO KEY UPDATE OF j SKIP LOCKED
),
stale AS (
    SELECT id, reason FROM stale_pending
    UNION ALL
    SELECT id, reason FROM stale_running
    UNION ALL
    SELECT id, reason FROM stale_batch_waiting
    UNION ALL
    SELECT id, reason FROM stale_batched
)
-- ended through jobs_end (migration 019), which charges each what its ledger
-- says: a job that never ran nothing, one whose worker is gone or too slow
-- its open call's worst case; with the job's trace context (the sweeper's
-- span for the job links to its trace)
SELECT e.id, e.public_id, e.error_code AS reason, e.worker_id, e.trace_context
FROM now_, jobs_end(
    ARRAY(SELECT ROW(j.id, 'failed', s.reason,
                     CASE WHEN s.reason = 'queue_timeout' AND j.lane = 'batch' THEN 'no batch took the job in time'
                          WHEN s.reason = 'queue_timeout' THEN 'no worker picked the job up in time'
                          WHEN s.reason = 'timed_out' AND j.lane = 'batch'
                              THEN 'its batch expired without a result for it'
                          WHEN s.reason = 'timed_out' THEN 'the story took longer than the job timeout'
                          ELSE 'the worker stopped sending heartbeats' END,
                     NULL, NULL)::job_end
          FROM stale s JOIN story_jobs j ON j.id = s.id),
    '{pending,running}', NULL, NULL, now_.t) e;

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
-- The interactive lane's queue depth by live status and its oldest pending
-- job's age (job_queue_depth, migration 017), from the live-jobs indexes
-- only. The batch lane's jobs wait for their batch by design
-- (BATCH_COLLECT_S, then hours at the provider) and no worker claims them:
-- counted here, they would read as a queue nobody drains
-- (StoryjobsNoWorkerClaiming) and as a stalled one.
SELECT pending, running,
       coalesce(extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - oldest_pending_created_at), 0)::float8
           AS oldest_pending_age_seconds
FROM job_queue_depth;

-- name: job_prune_finished
-- Deletes finished jobs past retention, with their stories (those no
-- partition drop takes) and idempotency
-- keys (a key can then be used again), the oldest first: jobs finish within
-- their timeouts, so the oldest ids are the first to expire, and no index on
-- completed_at is needed. The ledger is not touched here (its own
-- retention: ledger_prune).
-- A job whose event is still being delivered (a delivery pending) is kept
-- until each of its deliveries is delivered or dead: the retry schedule
-- ends every one within about 28 hours, so the wait is bounded; an
-- undelivered event is never pruned. Nor is a batch job whose request's
-- result is still to be read. The walk on the primary key passes over every
-- job it cannot prune yet, live or kept, whatever their number, so none
-- stalls the prune behind it; it ends at %(below_id)s, above every job
-- created before the retention's cutoff (job_id_bounds), so it reads the
-- expired part of the table, never the whole history. It begins past
-- %(after_id)s, the last job the pass's batch before deleted (0 for a
-- pass's first): every job below it was judged by that batch, and the
-- entries of the jobs deleted stay in the key's index until a VACUUM, so
-- a walk from the start would read all the pass's, more each batch.
-- The walk hands the delete each row's place (ctid), which fetches the row
-- there rather than descending the primary key again for each id (a batch of
-- 500: 5.1 -> 4.3 ms). A job changed between the walk and the delete (a late
-- ledger change moving a finished job's charge) has moved: it is not
-- deleted by this batch, and a later batch or pass finds it again.
WITH oldest AS (
    SELECT j.id, j.ctid FROM story_jobs j
    WHERE j.id > %(after_id)s AND j.id < %(below_id)s
      AND j.status IN ('completed', 'failed')
      AND j.completed_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(retention_s)s::float8)
      AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.job_id = j.id AND d.state = 'pending')
      AND NOT EXISTS (SELECT 1 FROM message_batch_items i WHERE i.job_id = j.id AND i.result IS NULL)
    ORDER BY j.id LIMIT %(batch_size)s
),
pruned AS (
    DELETE FROM story_jobs j
    WHERE j.ctid = ANY (ARRAY(SELECT ctid FROM oldest))
    RETURNING j.id, j.trace_context
),
-- What goes with the jobs is found from an array of their ids, unnested,
-- one index probe a row. The generic plan takes an unnested array
-- for a few rows whatever the tables hold, so it always probes. Joined to
-- pruned, it took the batch for a tenth of the expired jobs (LIMIT with a
-- parameter) and, with a few hundred thousand jobs kept, hashed the whole
-- keys and deliveries tables once a batch.
gone AS (
    SELECT array_agg(id) AS ids FROM pruned
),
-- A story in a ranged partition goes when its partition is dropped
-- (sweeper/partitions.py), all at once, and so does one past the ranges:
-- the pass makes stories_ahead a range once it holds stories. Those of the
-- table as it was before migration 029 go row by row, from that partition
-- alone: the statement names no other, so it neither locks nor probes them.
stories_pruned AS (
    DELETE FROM stories_unranged s USING unnest((SELECT ids FROM gone)) AS g(job_id)
    WHERE s.job_id = g.job_id
),
-- The keys by their jobs (migration 031): written in their jobs' order, a
-- batch's keys are a few pages in a row; by (client, key) each was a page
-- of its own.
keys_pruned AS (
    DELETE FROM job_idempotency_keys k USING unnest((SELECT ids FROM gone)) AS g(job_id)
    WHERE k.job_id = g.job_id
),
-- a job's webhook deliveries go with it, each delivered or dead
deliveries_pruned AS (
    DELETE FROM webhook_deliveries d USING unnest((SELECT ids FROM gone)) AS g(job_id)
    WHERE d.job_id = g.job_id
)
-- with each job's trace context: the prune's span links to the jobs' traces
SELECT id, trace_context FROM pruned;

-- name: ledger_prune
-- The ledger's own retention (LEDGER_RETENTION_S): deletes up to
-- %(batch_size)s rows of interactive calls that started longer ago than
-- %(retention_s)s and whose job is gone, oldest first, on the index of those
-- rows alone (migration 032): a batch request's row is kept with its batch.
-- A gone job's rows are final: nothing that ends or charges a job can reach
-- them. A job's rows wait for the job, which the prune keeps while it is
-- live or a delivery is pending, and which a sweeper stopped for days
-- leaves behind by days: the walk reads at most four batches' worth of the
-- oldest rows, so that behind many such rows a statement stays short and
-- deletes what it finds among them (nothing when none is gone yet), and the
-- ledger waits for the jobs' prune. The walk begins at %(after)s, the
-- latest start among the rows the pass's batch before deleted (NULL for a
-- pass's first: the oldest): the rows before it were judged by that batch.
-- A deleted row's entry stays in the index until a VACUUM and, while a
-- snapshot older than the delete is open, the walk reads its row to learn
-- so: from the oldest, a batch would read all the pass's deleted rows. From
-- the very instant, not past it, as two calls can start at the same one.
-- The delete is handed each row's place (ctid), as the jobs' prune is: one
-- fetch at each, not a descent of the primary key for each row (a batch of
-- 500: 3.3 -> 2.3 ms). A gone job's rows are final, so none moves between
-- the walk and the delete.
-- How many rows were deleted, and the latest start among them.
WITH doomed AS (
    SELECT c.ctid
    FROM (SELECT l.ctid, l.job_id, l.attempt FROM llm_calls l
          WHERE l.batch_id IS NULL
            AND l.started_at >= coalesce(%(after)s::timestamptz, '-infinity')
            AND l.started_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(retention_s)s::float8)
          ORDER BY l.started_at LIMIT 4 * %(batch_size)s) c
    WHERE NOT EXISTS (SELECT 1 FROM story_jobs j WHERE j.id = c.job_id)
    LIMIT %(batch_size)s
),
deleted AS (
    DELETE FROM llm_calls l
    WHERE l.ctid = ANY (ARRAY(SELECT ctid FROM doomed))
    RETURNING l.started_at
)
SELECT count(*) AS deleted, max(started_at) AS last_started_at FROM deleted;

-- name: job_claim_floor_advance
-- Raises the claim's floor (migration 030) to the turn being served
-- (job_turn_served, migration 034: the smallest pending turn, or, with none
-- pending, where the last turn given ends), the turn admission gives from;
-- never lowers it.
-- Runs under the admission lock (job_admission_lock, its own statement
-- before this one), so that every admission before it is seen and none
-- gives a turn while it reads. The walk starts at the floor it raises: it
-- reads only the entries claimed since the floor last rose. The sweeper runs
-- it at each pass and between passes, at HEARTBEAT_INTERVAL_S. The new
-- floor.
WITH raised AS (
    UPDATE job_claim_floor f SET turn = s.turn
    FROM job_turn_served s
    WHERE s.turn > f.turn
    RETURNING f.turn
)
SELECT coalesce((SELECT turn FROM raised), (SELECT turn FROM job_claim_floor)) AS turn;


-- name: budget_over_reservation_total
-- What the charges of every day's jobs have passed their reservations by
-- (only the provider's reported usage can), all clients: the sweeper's
-- storyjobs_budget_over_reservation_usd_total. budget_days keeps every day,
-- so the total only grows; one row per day is read.
SELECT coalesce(sum(over_reservation_usd), 0) FROM budget_days WHERE client_id = 0;

-- name: rollup_minutes
-- The sweeper's history (minute_rollup): recounts every minute from
-- %(from_minute)s to the current one from the jobs (ids from %(from_id)s up,
-- which job_id_bounds found for the oldest job that could have been claimed
-- or finished since) and the ledger (by time, on its started_at index), and
-- records the queue depth this pass saw in the current minute. A recount
-- replaces a minute's counts, so a job committed late lands in its minute at
-- the next pass; the depths only grow within a minute.
--
-- A ledger row is counted in the minute it started, but its charge is known
-- only when it ends, which for a long call (up to LLM_TIMEOUT_S) or a batch
-- (up to a day) is long after that minute left the window: the ledger side of
-- the minutes where the calls of the jobs that finished in the window started
-- is recounted too (a job's calls end by its end, nearly all of them), and
-- so are the minutes of the calls that changed after their job's end (a
-- batch's result read after its job was cancelled), which the ledger's
-- trigger marks (migration 028): every charge is counted once its job ends,
-- or once it is known after that. Those minutes are a few, each read on the
-- started_at index, and only their ledger columns are written.
--
-- For the console's overview (migration 024, console.sql's ops_overview),
-- which sums the day's minutes before this pass's minute and reads the rest
-- from the jobs and the ledger: the ended_* columns count only the calls
-- whose job is neither running nor finished in this pass's minute or later
-- (or is gone): the overview reads those calls itself. A job ending moves
-- its calls from one side to the other, and its calls' minutes are
-- recounted by the pass after it ends (late_minutes), so each call is
-- counted on exactly one side. The current minute's row keeps
-- %(ending_from_id)s (the least of its passes'): every job that ends after
-- this pass is at or above it, so the overview reads the jobs from there.
WITH minutes AS (
    SELECT generate_series(%(from_minute)s::timestamptz, date_trunc('minute', now()), interval '1 minute') AS minute
),
jobs AS MATERIALIZED (
    SELECT j.id, j.status, j.error_code, j.created_at, j.started_at, j.completed_at
    FROM story_jobs j
    WHERE j.id >= %(from_id)s
      AND (j.started_at >= %(from_minute)s OR j.completed_at >= %(from_minute)s)
  UNION
    -- a batch job can wait and run for days, longer than %(from_id)s
    -- assumes: those finished in the window, on their own index (migration 024)
    SELECT j.id, j.status, j.error_code, j.created_at, j.started_at, j.completed_at
    FROM story_jobs j
    WHERE j.lane = 'batch' AND j.completed_at IS NOT NULL AND j.completed_at >= %(from_minute)s
),
finished AS (
    SELECT date_trunc('minute', j.completed_at) AS minute,
           count(*) FILTER (WHERE j.status = 'completed') AS completed,
           count(*) FILTER (WHERE j.status = 'failed') AS failed,
           count(*) FILTER (WHERE j.error_code = 'cancelled') AS cancelled,
           -- a failed job with billed calls: a story paid for, not delivered
           count(billed.cost_usd) AS undelivered,
           coalesce(sum(billed.cost_usd), 0) AS undelivered_usd
    FROM jobs j
    -- a failed job's charge, on the ledger's primary key (OFFSET 0 keeps the
    -- lookup per job: pulled up, the view's grouping would read the whole
    -- ledger), looked up only for failed jobs
    LEFT JOIN LATERAL (
        SELECT b.charge_usd AS cost_usd FROM job_charges b
        WHERE j.status = 'failed' AND b.job_id = j.id AND b.billed_calls > 0
        OFFSET 0
    ) billed ON true
    WHERE j.completed_at >= %(from_minute)s AND j.status IN ('completed', 'failed')
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
-- the minutes marked by ledger rows that changed after their jobs ended
-- (migration 028), each taken by the pass that recounts it: those in the
-- window with it, those before it as late minutes (a mark this pass cannot
-- see yet, not committed, stays for the next)
stale AS MATERIALIZED (
    DELETE FROM minute_rollup_stale s RETURNING s.minute
),
-- the minutes before the window where the calls of the jobs that ended in it
-- started, and the marked ones (as far back as the rollup keeps)
late_minutes AS MATERIALIZED (
    SELECT date_trunc('minute', l.started_at) AS minute
    FROM jobs j
    -- each job's calls on the primary key (OFFSET 0 keeps it a lookup per
    -- job: a generic plan cannot know how few jobs these are, and hashed
    -- eight days of the ledger instead, 120 ms at 33,000 jobs a day)
    CROSS JOIN LATERAL (
        SELECT l.started_at FROM llm_calls l
        WHERE l.job_id = j.id AND l.started_at < %(from_minute)s AND l.started_at >= now() - interval '8 days'
        OFFSET 0
    ) l
    WHERE j.completed_at >= %(from_minute)s
  UNION
    SELECT s.minute FROM stale s
    WHERE s.minute < %(from_minute)s AND s.minute >= date_trunc('minute', now() - interval '8 days')
),
-- Each minute's calls, counted once for both: the window's minutes
-- (calls started from %(from_minute)s on) and, before it, the minutes of
-- late_minutes (every call started in one): disjoint sets of minutes. With
-- the overview's side of each minute (ended_*): the calls whose job is
-- neither running nor finished in this pass's minute or later; and the
-- writers of all of the minute's calls. What a call counts for is
-- llm_call_tallies' (migration 027), as in the overview.
minute_calls AS MATERIALIZED (
    SELECT date_trunc('minute', l.started_at) AS minute,
           coalesce(sum(l.spend_usd), 0) AS spend_usd,
           sum(l.rate_limited) AS rate_limited,
           coalesce(sum(l.billed_calls) FILTER (WHERE ended.ended), 0) AS ended_billed_calls,
           coalesce(sum(l.spend_usd) FILTER (WHERE ended.ended), 0) AS ended_spend_usd,
           coalesce(sum(l.billed_input_tokens) FILTER (WHERE ended.ended), 0) AS ended_input_tokens,
           coalesce(sum(l.billed_output_tokens) FILTER (WHERE ended.ended), 0) AS ended_output_tokens,
           coalesce(sum(l.rate_limited) FILTER (WHERE ended.ended), 0) AS ended_rate_limited,
           coalesce(sum(l.overloaded) FILTER (WHERE ended.ended), 0) AS ended_overloaded,
           array_agg(DISTINCT l.provider) AS providers
    FROM (
        SELECT l.* FROM llm_call_tallies l WHERE l.started_at >= %(from_minute)s
      UNION ALL
        SELECT l.* FROM llm_call_tallies l
        JOIN late_minutes m ON l.started_at >= m.minute AND l.started_at < m.minute + interval '1 minute'
    ) l
    -- whether the call's job has ended, looked up once per call on the
    -- primary key (OFFSET 0: inlined, the test was repeated for each count
    -- that reads it, and with many calls estimated it became one hashed scan
    -- of every job)
    CROSS JOIN LATERAL (
        SELECT NOT EXISTS (SELECT 1 FROM story_jobs j
                           WHERE j.id = l.job_id
                             AND (j.status = 'running' OR j.completed_at >= date_trunc('minute', now())))
               AS ended
        OFFSET 0
    ) ended
    GROUP BY 1
),
calls AS (SELECT * FROM minute_calls WHERE minute >= %(from_minute)s),
late_calls AS (SELECT * FROM minute_calls WHERE minute < %(from_minute)s),
late_written AS (
    INSERT INTO minute_rollup AS r (minute, spend_usd, rate_limited, ended_billed_calls, ended_spend_usd,
                                    ended_input_tokens, ended_output_tokens, ended_rate_limited, ended_overloaded,
                                    providers)
    SELECT minute, spend_usd, rate_limited, ended_billed_calls, ended_spend_usd, ended_input_tokens,
           ended_output_tokens, ended_rate_limited, ended_overloaded, providers
    FROM late_calls
    ON CONFLICT (minute) DO UPDATE SET
        spend_usd = EXCLUDED.spend_usd, rate_limited = EXCLUDED.rate_limited,
        ended_billed_calls = EXCLUDED.ended_billed_calls, ended_spend_usd = EXCLUDED.ended_spend_usd,
        ended_input_tokens = EXCLUDED.ended_input_tokens, ended_output_tokens = EXCLUDED.ended_output_tokens,
        ended_rate_limited = EXCLUDED.ended_rate_limited, ended_overloaded = EXCLUDED.ended_overloaded,
        providers = EXCLUDED.providers
),
written AS (
    INSERT INTO minute_rollup AS r (minute, completed, failed, cancelled, spend_usd, rate_limited,
                                    pending_max, running_max, wait_counts, run_counts,
                                    undelivered, undelivered_usd, ended_billed_calls, ended_spend_usd,
                                    ended_input_tokens, ended_output_tokens, ended_rate_limited, ended_overloaded,
                                    providers, jobs_from_id)
    SELECT m.minute, coalesce(f.completed, 0), coalesce(f.failed, 0), coalesce(f.cancelled, 0),
           coalesce(c.spend_usd, 0), coalesce(c.rate_limited, 0),
           CASE WHEN m.minute = date_trunc('minute', now()) THEN %(pending)s ELSE 0 END,
           CASE WHEN m.minute = date_trunc('minute', now()) THEN %(running)s ELSE 0 END,
           h.wait_counts, h.run_counts,
           coalesce(f.undelivered, 0), coalesce(f.undelivered_usd, 0),
           coalesce(c.ended_billed_calls, 0), coalesce(c.ended_spend_usd, 0), coalesce(c.ended_input_tokens, 0),
           coalesce(c.ended_output_tokens, 0), coalesce(c.ended_rate_limited, 0), coalesce(c.ended_overloaded, 0),
           coalesce(c.providers, '{}'),
           CASE WHEN m.minute = date_trunc('minute', now()) THEN %(ending_from_id)s::bigint END
    FROM minutes m
    JOIN histograms h ON h.minute = m.minute
    LEFT JOIN finished f ON f.minute = m.minute
    LEFT JOIN calls c ON c.minute = m.minute
    ON CONFLICT (minute) DO UPDATE SET
        completed = EXCLUDED.completed, failed = EXCLUDED.failed, cancelled = EXCLUDED.cancelled,
        spend_usd = EXCLUDED.spend_usd, rate_limited = EXCLUDED.rate_limited,
        pending_max = greatest(r.pending_max, EXCLUDED.pending_max),
        running_max = greatest(r.running_max, EXCLUDED.running_max),
        wait_counts = EXCLUDED.wait_counts, run_counts = EXCLUDED.run_counts,
        undelivered = EXCLUDED.undelivered, undelivered_usd = EXCLUDED.undelivered_usd,
        ended_billed_calls = EXCLUDED.ended_billed_calls, ended_spend_usd = EXCLUDED.ended_spend_usd,
        ended_input_tokens = EXCLUDED.ended_input_tokens, ended_output_tokens = EXCLUDED.ended_output_tokens,
        ended_rate_limited = EXCLUDED.ended_rate_limited, ended_overloaded = EXCLUDED.ended_overloaded,
        providers = EXCLUDED.providers,
        -- a minute's first pass sees the fewest jobs: the least id is the bound
        jobs_from_id = least(r.jobs_from_id, EXCLUDED.jobs_from_id)
    RETURNING 1
)
SELECT count(*) AS minutes FROM written;

-- name: rollup_last_minute
-- Where the last pass stopped: the newest minute of the rollup, on its
-- primary key (one entry). The next pass recounts from there at least.
-- When the newest row has no jobs_from_id (none yet, or a row written
-- before migration 024, or by a sweeper from before it), the last 25 hours
-- are recounted: the overview sums the day from the rollup's columns once a
-- pass has written that id, so every minute of the day must hold them then.
SELECT CASE WHEN r.jobs_from_id IS NULL THEN least(r.minute, date_trunc('minute', now()) - interval '25 hours') ELSE r.minute END
FROM (SELECT NULL) one
LEFT JOIN LATERAL (SELECT minute, jobs_from_id FROM minute_rollup ORDER BY minute DESC LIMIT 1) r ON true;

-- name: rollup_prune
-- The history's rows past what the console shows (a week) and a day more.
DELETE FROM minute_rollup WHERE minute < now() - interval '8 days';

-- name: webhook_delivery_gauges
-- The sweeper's gauges, read from the undelivered rows only: how many wait,
-- and the age of the oldest.
SELECT count(*) AS undelivered,
       coalesce(extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - min(created_at)), 0)::float8
           AS oldest_undelivered_age_seconds
FROM webhook_deliveries WHERE state = 'pending';

-- name: story_partitions_state
-- What the sweeper keeps the stories' partitions by (sweeper/partitions.py,
-- migration 029): stories_unranged's bound (NULL until the first pass sets
-- it) and whether it is validated; where stories_ahead begins (NULL before
-- the first range), and the bound of the range it is being made, if it is
-- (NULL while it is only the catch-all); the id the next job will take.
SELECT substring(pg_get_constraintdef(u.oid) FROM 'job_id < (\d+)')::bigint AS bound,
       coalesce(u.convalidated, false) AS bound_valid,
       (SELECT r.lo FROM story_partition_ranges r WHERE r.hi IS NULL) AS ahead_from_id,
       substring(pg_get_constraintdef(a.oid) FROM 'job_id < (\d+)')::bigint AS ahead_bound,
       coalesce(a.convalidated, false) AS ahead_bound_valid,
       coalesce(pg_sequence_last_value(pg_get_serial_sequence('story_jobs', 'id')::regclass), 0) + 1 AS next_id
FROM (SELECT 1) AS one
LEFT JOIN pg_constraint u ON u.conrelid = 'stories_unranged'::regclass AND u.conname = 'stories_unranged_below'
LEFT JOIN pg_constraint a ON a.conrelid = to_regclass('stories_ahead') AND a.conname = 'stories_ahead_below';

-- name: stories_unranged_bound
SELECT stories_unranged_bound(%(bound)s);

-- name: transaction_statement_timeout_off
-- For a statement that reads a whole table and blocks nobody (a VALIDATE):
-- the session's statement timeout would cancel it on a large one, forever.
SELECT set_config('statement_timeout', '0', true);

-- name: stories_unranged_validate
-- Reads stories_unranged whole, under a lock that lets reads and writes on.
ALTER TABLE stories_unranged VALIDATE CONSTRAINT stories_unranged_below;

-- name: story_partition_add
SELECT story_partition_add(%(lo)s, %(hi)s);

-- name: stories_ahead_bound
SELECT stories_ahead_bound(%(hi)s);

-- name: stories_ahead_validate
ALTER TABLE stories_ahead VALIDATE CONSTRAINT stories_ahead_below;

-- name: story_partition_close_ahead
SELECT story_partition_close_ahead();

-- name: story_partitions_droppable
-- The ranged partitions that no story can come to, oldest first: no job of
-- their range is left (every rule that keeps a job, a delivery pending or a
-- batch result unread, keeps its partition), and none can still be
-- admitted there, as a job above the range is over 5 minutes old: ids are
-- taken in order, and an admission lasts at most its statement timeout
-- (60 s). A range of jobs pruned is one past retention.
SELECT r.name FROM story_partition_ranges r
WHERE r.hi IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM story_jobs j WHERE j.id >= r.lo AND j.id < r.hi)
  AND EXISTS (SELECT 1 FROM story_jobs j WHERE j.id >= r.hi AND j.created_at < now() - interval '5 minutes')
ORDER BY r.lo;

-- name: story_partition_drop
SELECT story_partition_drop(%(name)s);
