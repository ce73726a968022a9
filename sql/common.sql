-- The named queries several callers share: the migrations' bookkeeping and
-- the schema version, the status enum's values, clients and keys as
-- shared/keys.py creates them and the api checks them, and the reads the
-- console and the sweeper both make (id bounds of a time range, today's
-- budgets). shared/queries.py parses every sql/*.sql file of queries (this
-- one, api.sql, worker.sql, sweeper.sql, console.sql) once, into one set of
-- names, and shared/store.py runs these; each caller's file says which
-- module runs its own.
--
-- A block starts with `-- name: <table>_<verb>_<condition>`, then comment
-- lines saying what it does and why, then one statement with %(named)s
-- parameters, whole: a part several statements need is a SQL function or
-- view in a migration. Every status change names the status it expects in
-- its WHERE clause: zero rows means the caller lost a race.
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

-- name: database_settings_keep
-- Run by every `storyjobs migrate`, not by one numbered migration, because a
-- database's own settings do not travel with its data: a copy made from a
-- template or a dump restored without --create loses them while its
-- schema_migrations says everything was applied. jit = off: the planner
-- JIT-compiles a statement whose estimated cost passes jit_above_cost, and
-- after an ANALYZE taken during a backlog or over a large history the
-- services' millisecond statements (admission, the prune, the rollup) were
-- estimated that dear and spent 100-500 ms compiling at every execution.
-- None of them gains from JIT (each reads few rows through an index). A
-- database setting reaches every connection, through a transaction pooler
-- too, which forwards no startup options. A role that does not own the
-- database sets it for itself instead, and the NOTICE says so.
DO $$
BEGIN
    EXECUTE format('ALTER DATABASE %I SET jit = off', current_database());
EXCEPTION WHEN insufficient_privilege THEN
    EXECUTE format('ALTER ROLE %I IN DATABASE %I SET jit = off', current_user, current_database());
    RAISE NOTICE 'jit = off set for role % only: it does not own database %; run ALTER DATABASE % SET jit = off as its owner (docs/operations.md)',
        current_user, current_database(), current_database();
END
$$;

-- name: database_snapshot_ages
-- What holds this database's VACUUM back: the oldest open transaction (a
-- prepared one included), the oldest snapshot still held (a backend's xmin:
-- while it is held, no row deleted or updated after it can be removed, from
-- any table, and the live-jobs indexes fill with dead entries), and the
-- oldest xmin a replication slot keeps, in transactions (a slot records no
-- time). Another role's sessions show their times only to a role with the
-- privileges of pg_read_all_stats (pg_monitor has them); without them
-- `known` is false and the ages mean nothing. Autovacuum's own snapshot
-- holds nothing back, and a session of another database holds back only the
-- shared catalogs, so neither is counted; a walsender's is (a standby's
-- hot_standby_feedback). NULL: nothing open.
SELECT pg_has_role('pg_read_all_stats', 'USAGE') AS known,
       extract(epoch FROM now() - least(
           (SELECT min(a.xact_start) FROM pg_stat_activity a
            WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
              AND a.backend_type <> 'autovacuum worker'),
           (SELECT min(p.prepared) FROM pg_prepared_xacts p WHERE p.database = current_database())
       ))::float8 AS oldest_transaction_age_s,
       extract(epoch FROM now() - (
           SELECT min(coalesce(a.xact_start, a.query_start, a.backend_start)) FROM pg_stat_activity a
           WHERE a.backend_xmin IS NOT NULL AND a.pid <> pg_backend_pid()
             AND (a.datname = current_database() OR a.backend_type = 'walsender')
             AND a.backend_type <> 'autovacuum worker'
       ))::float8 AS oldest_snapshot_age_s,
       (SELECT max(greatest(age(s.xmin), age(s.catalog_xmin))) FROM pg_replication_slots s
        WHERE s.database IS NULL OR s.database = current_database())::bigint AS replication_slot_xmin_age;

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
-- Also the console's clients screen; no row: no such client.
UPDATE api_clients SET weight = %(weight)s WHERE id = %(client_id)s
RETURNING id;

-- name: api_key_insert
INSERT INTO api_keys (client_id, key_prefix, key_hash)
VALUES (%(client_id)s, %(key_prefix)s, %(key_hash)s);

-- name: api_key_get
-- Authentication only: the api compares key_hash in constant time.
SELECT k.client_id, k.key_hash, k.revoked_at IS NOT NULL AS revoked
FROM api_keys k
WHERE k.key_prefix = %(key_prefix)s;

-- name: job_cancel
-- A cancellation: DELETE /stories/jobs/{job_id} (the client's own job,
-- %(client_id)s) or an operator's (NULL: whoever's the job). pending or
-- running -> failed (cancelled), through jobs_end (migration 019): charged
-- what its ledger says (a running job's open call its worst case, until its
-- worker, which sees the change at its next heartbeat and closes its
-- stream, writes what the call cost), and its open call closed as
-- interrupted. A pending job's turn is given back to its client
-- (job_turns_give_back, migration 022), so the caller takes the admission
-- lock first.
-- The snapshot row tells the caller why nothing changed; no row: no such job
-- (for this client).
WITH job AS (
    SELECT id, status FROM story_jobs
    WHERE public_id = %(job_id)s AND (%(client_id)s::bigint IS NULL OR client_id = %(client_id)s::bigint)
),
cancelled AS MATERIALIZED (
    SELECT c.* FROM jobs_end(
        ARRAY(SELECT ROW(id, 'failed', 'cancelled',
                         CASE WHEN %(client_id)s::bigint IS NULL THEN 'cancelled by an operator'
                              ELSE 'cancelled by the client' END, NULL, NULL)::job_end
              FROM job),
        '{pending,running}', NULL, NULL) c
),
given_back AS MATERIALIZED (
    SELECT job_turns_give_back(ARRAY(SELECT ROW(id, client_id, turn)::job_turn FROM cancelled
                                     WHERE was_pending AND turn IS NOT NULL))
)
SELECT job.status::text AS previous_status, EXISTS (SELECT 1 FROM cancelled) AS cancelled
FROM job CROSS JOIN (SELECT count(*) FROM given_back) g;

-- name: budget_days_today
-- Today's (UTC) spend and reservations, all clients (scope 'all') and each
-- client with a row, with the client's own budget if it has one: the
-- sweeper's gauges and `storyjobs stats`.
SELECT CASE WHEN b.client_id = 0 THEN 'all' ELSE c.name END AS scope, b.client_id,
       b.spent_usd, b.reserved_usd, c.budget_usd_per_day AS client_budget_usd
FROM budget_days b LEFT JOIN api_clients c ON c.id = b.client_id
WHERE b.day = budget_day(coalesce(%(now)s::timestamptz, now()))
ORDER BY b.client_id;

-- name: operator_key_insert
-- `storyjobs keys create NAME --operator`.
INSERT INTO operator_keys (name, key_prefix, key_hash)
VALUES (%(name)s, %(key_prefix)s, %(key_hash)s);

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

-- name: transaction_lock_timeout_set
-- How long the statements of this transaction may wait for a lock before
-- they fail (SET LOCAL: nothing outlives the transaction, so this is safe on
-- a pooled connection).
SELECT set_config('lock_timeout', %(lock_timeout_ms)s::text, true);
