-- storyjobs schema, version 29: stories in partitions by ranges of job id,
-- so that retention drops a whole day of them and gives its space back.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- Stories are most of a database's size (37 of 47 GB at 10 million finished
-- jobs), and the prune deleted them row by row: a day took seconds, and
-- VACUUM made the space reusable, never smaller. Partitioned by a range of
-- job_id (ids grow with time, as job_id_bounds relies on), a day's stories
-- are one table that the sweeper drops once every job of its range is gone
-- (sweeper/partitions.py): every rule that keeps a job keeps its story.
--
-- "One story per job" stays a unique key: job_id is the partition key. A
-- story's id is unique within each partition (each has its own index on id,
-- which GET /stories/{story_id} probes); across partitions it rests on the
-- worker's random uuid4 (122 bits), as a partitioned table cannot hold a
-- unique key without its partition key.
--
-- Nothing is moved and nothing is scanned here: the table as it was becomes
-- the default partition, stories_unranged, holding every story until the
-- sweeper's first pass. That pass bounds it (CHECK job_id < an id above the
-- sequence, added NOT VALID, then validated without blocking reads or
-- writes) and then adds ranged partitions above that bound, which the
-- validated bound lets Postgres do without reading stories_unranged. Its
-- rows leave it as the prune deletes them, row by row as before, and it
-- stays, empty, below the ranges.
ALTER TABLE stories RENAME TO stories_unranged;

CREATE TABLE stories (LIKE stories_unranged INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING COMPRESSION)
PARTITION BY RANGE (job_id);
-- the index of stories_unranged's UNIQUE (job_id) becomes this one's
-- partition: attaching builds no index
ALTER TABLE stories ADD CONSTRAINT stories_one_per_job UNIQUE (job_id);
ALTER TABLE stories ATTACH PARTITION stories_unranged DEFAULT;

-- A story as clients read it, one shape for the poll and GET
-- /stories/{story_id} (cost as text: exact). A function, not a join: a
-- generic plan on Postgres 15 locks and opens every partition a statement
-- names, which cost each poll 0.08 ms with 32 ranges (0.19 -> 0.27 ms), and
-- most polls are of live jobs, which have no story. The poll calls it for a
-- completed job only; here the job's id prunes to its partition.
CREATE FUNCTION story_json(job bigint, story uuid, job_public_id uuid) RETURNS json
LANGUAGE plpgsql STABLE STRICT AS $$
BEGIN
    RETURN (SELECT json_build_object(
                'story_id', s.id, 'job_id', job_public_id, 'title', s.title, 'body', s.body, 'model', s.model,
                'prompt_version', s.prompt_version, 'input_tokens', s.input_tokens,
                'output_tokens', s.output_tokens, 'cost_usd', s.cost_usd::text, 'created_at', s.created_at)
            FROM stories s WHERE s.job_id = job AND s.id = story);
END $$;

-- The ranged partitions, from the catalog: [lo, hi) of job id, hi NULL for
-- stories_ahead (to the highest id). stories_unranged is not among them.
CREATE VIEW story_partition_ranges AS
SELECT c.relname::text AS name,
       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \(''(\d+)''\)')::bigint AS lo,
       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''(\d+)''\)')::bigint AS hi
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'stories'::regclass AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT';

-- The sweeper's changes to the partitions (sweeper/partitions.py), as
-- functions: DDL takes no parameters, and its names and bounds are written
-- here once, quoted by format(). Each locks stories first (as every
-- statement on it does, so no deadlock), then looks again at what it is to
-- change: two callers at once (the sweeper and `storyjobs migrate`) are
-- serialized by that lock, and the second finds the work done. Each returns
-- whether it changed anything (NULL from story_partition_add: the ranges
-- moved since the caller read them).

-- Bounds stories_unranged below `bound`, NOT VALID: every story at or above
-- it now needs a ranged partition, which the same pass adds after validating.
CREATE FUNCTION stories_unranged_bound(bound bigint) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    LOCK TABLE stories IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM pg_constraint k
               WHERE k.conrelid = 'stories_unranged'::regclass AND k.conname = 'stories_unranged_below') THEN
        RETURN false;
    END IF;
    EXECUTE format('ALTER TABLE stories_unranged ADD CONSTRAINT stories_unranged_below '
                   'CHECK (job_id < %s) NOT VALID', bound);
    RETURN true;
END $$;

-- stories_ahead, from `lo` to the highest id, with its own index of id (as
-- every partition has: GET /stories/{story_id} probes each).
CREATE FUNCTION stories_ahead_make(lo bigint) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('CREATE TABLE stories_ahead PARTITION OF stories FOR VALUES FROM (%s) TO (MAXVALUE)', lo);
    CREATE UNIQUE INDEX ON stories_ahead (id);
END $$;

-- Adds the partition [lo, hi) at the top of the ranges, with stories_ahead
-- above it: the catch-all for ids past the last range, so that a story is
-- never refused for want of a partition. Postgres cannot split a partition
-- without reading it, so stories_ahead is replaced only while empty, under
-- the lock on stories that keeps it so. False, and nothing changed, when it
-- is not empty.
CREATE FUNCTION story_partition_add(lo bigint, hi bigint) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    ahead_rows boolean;
    -- where the caller found the top: stories_ahead's start, or none yet
    expected bigint;
BEGIN
    LOCK TABLE stories IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM story_partition_ranges) THEN
        expected := lo;
    END IF;
    IF (SELECT r.lo FROM story_partition_ranges r WHERE r.hi IS NULL) IS DISTINCT FROM expected THEN
        RETURN NULL;
    END IF;
    IF to_regclass('stories_ahead') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM stories_ahead)' INTO ahead_rows;
        IF ahead_rows THEN
            RETURN false;
        END IF;
        DROP TABLE stories_ahead;
    END IF;
    EXECUTE format('CREATE TABLE %I PARTITION OF stories FOR VALUES FROM (%s) TO (%s)',
                   'stories_from_' || lo, lo, hi);
    EXECUTE format('CREATE UNIQUE INDEX ON %I (id)', 'stories_from_' || lo);
    PERFORM stories_ahead_make(hi);
    RETURN true;
END $$;

-- stories_ahead holding stories (the ids outran the ranges: a sweeper
-- stopped for days) is made a range of its own, so that ranges can follow
-- again, as stories_unranged was bounded: a CHECK of the range it is to
-- take, [where it begins, `hi`), added NOT VALID (every story at or above
-- `hi` now needs the range the same pass adds), then validated without
-- blocking, then story_partition_close_ahead.
CREATE FUNCTION stories_ahead_bound(hi bigint) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    LOCK TABLE stories IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM pg_constraint k
               WHERE k.conrelid = 'stories_ahead'::regclass AND k.conname = 'stories_ahead_below') THEN
        RETURN false;
    END IF;
    EXECUTE format('ALTER TABLE stories_ahead ADD CONSTRAINT stories_ahead_below '
                   'CHECK (job_id >= %s AND job_id < %s) NOT VALID',
                   (SELECT r.lo FROM story_partition_ranges r WHERE r.hi IS NULL), hi);
    RETURN true;
END $$;

-- Detaches stories_ahead and attaches it again as the range its validated
-- CHECK names, under a new name, with an empty stories_ahead above it: no
-- story is read or moved, and none is refused in between (one transaction).
CREATE FUNCTION story_partition_close_ahead() RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    lo bigint;
    hi bigint;
BEGIN
    LOCK TABLE stories IN ACCESS EXCLUSIVE MODE;
    lo := (SELECT r.lo FROM story_partition_ranges r WHERE r.hi IS NULL);
    hi := (SELECT substring(pg_get_constraintdef(k.oid) FROM 'job_id < (\d+)')::bigint
           FROM pg_constraint k
           WHERE k.conrelid = 'stories_ahead'::regclass AND k.conname = 'stories_ahead_below');
    IF hi IS NULL THEN
        RETURN false;
    END IF;
    ALTER TABLE stories DETACH PARTITION stories_ahead;
    EXECUTE format('ALTER TABLE stories_ahead RENAME TO %I', 'stories_from_' || lo);
    EXECUTE format('ALTER TABLE stories ATTACH PARTITION %I FOR VALUES FROM (%s) TO (%s)',
                   'stories_from_' || lo, lo, hi);
    EXECUTE format('ALTER TABLE %I DROP CONSTRAINT stories_ahead_below', 'stories_from_' || lo);
    PERFORM stories_ahead_make(hi);
    RETURN true;
END $$;

-- Drops a ranged partition (never stories_unranged or stories_ahead).
CREATE FUNCTION story_partition_drop(partition text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    LOCK TABLE stories IN ACCESS EXCLUSIVE MODE;
    IF NOT EXISTS (SELECT 1 FROM story_partition_ranges r WHERE r.name = partition AND r.hi IS NOT NULL) THEN
        RETURN false;
    END IF;
    EXECUTE format('DROP TABLE %I', partition);
    RETURN true;
END $$;
