-- storyjobs schema, version 26: the clients screen's "today" from counts the
-- jobs' inserts keep, not from a day of jobs.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- Each client's jobs created on each UTC day (budget_day). The clients
-- screen showed each client's jobs created today by counting them: a whole
-- day of jobs read for every look, 190 ms at 330,000 jobs a day. A trigger
-- counts them as they are inserted instead, once per statement (an
-- admission's batch is one row per client here), so that every way a job is
-- made is counted and none can forget to. In the services only admissions
-- insert jobs, and they run one at a time under their advisory lock
-- (job_admission_lock), so these rows are never waited for. A row a day per
-- client that made a job: 365,000 a year for 1,000 clients, a few tens of
-- megabytes; kept like the budgets' days.
CREATE TABLE client_days (
    day        date NOT NULL,
    client_id  bigint NOT NULL,
    jobs       bigint NOT NULL CHECK (jobs >= 0),
    PRIMARY KEY (day, client_id)
);

CREATE FUNCTION story_jobs_count_created() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO client_days AS d (day, client_id, jobs)
    SELECT budget_day(c.created_at), c.client_id, count(*) FROM created c GROUP BY 1, 2 ORDER BY 1, 2
    ON CONFLICT (day, client_id) DO UPDATE SET jobs = d.jobs + excluded.jobs;
    RETURN NULL;
END
$$;

CREATE TRIGGER story_jobs_created_counted
    AFTER INSERT ON story_jobs
    REFERENCING NEW TABLE AS created
    FOR EACH STATEMENT
    EXECUTE FUNCTION story_jobs_count_created();

-- Today's jobs made before the trigger, from the first id of a job made 5
-- minutes before the day began (ids follow created_at to within an
-- admission's transaction), found by a binary search over the primary key
-- as job_id_bounds finds it: a day of jobs is read, however long the
-- history. The trigger's lock holds new jobs back until this commits, and
-- every job inserted before it is visible here.
DO $$
DECLARE
    day_start timestamptz := date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    lo bigint;
    hi bigint;
    mid bigint;
    probed timestamptz;
BEGIN
    SELECT min(id), max(id) + 1 INTO lo, hi FROM story_jobs;
    WHILE lo < hi LOOP
        mid := lo + (hi - lo) / 2;
        SELECT j.created_at INTO probed FROM story_jobs j WHERE j.id >= mid ORDER BY j.id LIMIT 1;
        IF probed < day_start - interval '5 minutes' THEN
            lo := mid + 1;
        ELSE
            hi := mid;
        END IF;
    END LOOP;
    -- each job on its own day: a migration that waited past midnight for
    -- its lock has counted the new day's first jobs too
    INSERT INTO client_days (day, client_id, jobs)
    SELECT budget_day(j.created_at), j.client_id, count(*) FROM story_jobs j
    WHERE j.id >= lo AND j.created_at >= day_start
    GROUP BY 1, 2;
END
$$;

-- The failures among a day's jobs (cancellations aside), on an index of
-- their own: a day's failures, not a day's jobs, are read for them. Only an
-- end that fails a job writes to it. Built here with a lock that holds the
-- jobs' writes while it builds; on a large table build it first
-- (docs/operations.md):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS story_jobs_failed_idx ON story_jobs (id)
--       INCLUDE (client_id, created_at) WHERE status = 'failed' AND error_code IS DISTINCT FROM 'cancelled';
CREATE INDEX IF NOT EXISTS story_jobs_failed_idx ON story_jobs (id)
    INCLUDE (client_id, created_at) WHERE status = 'failed' AND error_code IS DISTINCT FROM 'cancelled';
