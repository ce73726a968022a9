-- 017: one definition of each small fragment the named queries repeated.
--
-- Each function is a SQL function of one SELECT of one expression, not
-- STRICT, and marked no more volatile than its body (IMMUTABLE for
-- budget_day, STABLE where it reads now()): the planner inlines such a call,
-- so a statement's plan and snapshot are what they were with the expression
-- written out (tests/integration/test_sql_fragments.py reads the plans).
-- The queue's counts read the table, which an inlined function cannot: they
-- are a view, which the planner expands in place in the same way.
-- bucket_refilled (migration 012) is the model.

-- The UTC day a time falls in: the day of the spend budgets (budget_days.day),
-- as admission and the budgets' reads take it (the budget triggers of
-- migrations 004 to 008 write the same expression).
CREATE FUNCTION budget_day(at timestamptz) RETURNS date
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (at AT TIME ZONE 'UTC')::date
$$;

-- How long the shared rate bucket still holds every claim, in seconds (0: no
-- pause, or none written): a row's paused_until may lie in the past, or be
-- '-infinity' or NULL, all of which are no pause.
CREATE FUNCTION bucket_paused_s(paused_until timestamptz) RETURNS double precision
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT greatest(extract(epoch FROM greatest(paused_until, now()) - now()), 0)::float8
$$;

-- What a kind of the shared bucket holds now, read at the rate the caller
-- knows: refilled to now (bucket_refilled) where the rate is known, as stored
-- where it is not (NULL rate). The console's view of the bucket and a retry's
-- start read it so.
CREATE FUNCTION bucket_held_now(held double precision, rate double precision, capacity double precision,
                                refilled_at timestamptz)
RETURNS double precision
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN rate IS NULL THEN held ELSE bucket_refilled(held, rate, capacity, refilled_at, 0) END
$$;

-- The interactive lane's live queue: its pending and running jobs, and when
-- the oldest pending one was created, each read on a live-jobs index only,
-- so the cost follows the queue, never the history. The pacing hint, the
-- console's overview and the sweeper's gauges read it. (The batch lane's
-- jobs wait for their batch by design, and are counted apart.)
CREATE VIEW job_queue_depth AS
SELECT (SELECT count(*) FROM story_jobs WHERE status = 'pending' AND lane = 'interactive') AS pending,
       (SELECT count(*) FROM story_jobs WHERE status = 'running' AND lane = 'interactive') AS running,
       (SELECT created_at FROM story_jobs WHERE status = 'pending' AND lane = 'interactive'
        ORDER BY created_at, id LIMIT 1) AS oldest_pending_created_at;
