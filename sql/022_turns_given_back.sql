-- storyjobs schema, version 22: the give-back of cancelled jobs' turns, one
-- definition.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- The turns of cancelled pending jobs given back to their clients, so that a
-- client that cancels queued jobs loses no place in the round
-- (sql/009_fair_share.sql; docs/provider-limits.md): its later pending jobs
-- move up by the length of each turn given up before them, and where its
-- last turn ends moves back by all of them. A client's jobs admitted while an
-- earlier one was pending have turns end to end, so a turn's length is where
-- the client's next live job's starts, or for its last one where its last
-- turn ends (a weight changed since does not matter).
--
-- Called by the statements that cancel pending jobs (job_cancel,
-- ops_job_cancel_pending), after they ended the jobs (jobs_end), under the
-- admission lock their caller holds. The ended jobs are `given_up`, with
-- their turns as they were: this function's queries see them ended. A job
-- claimed meanwhile is re-checked after its row lock and left alone. It was
-- a text fragment both statements included; one function now.
CREATE TYPE job_turn AS (
    id        bigint,
    client_id bigint,
    turn      double precision
);

CREATE FUNCTION job_turns_give_back(given_up job_turn[]) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF cardinality(given_up) IS NULL OR cardinality(given_up) = 0 THEN
        RETURN;
    END IF;
    WITH gone AS MATERIALIZED (
        SELECT g.id, g.client_id, g.turn FROM unnest(given_up) g WHERE g.turn IS NOT NULL
    ),
    live AS MATERIALIZED (
        SELECT j.id, j.status::text AS status, j.client_id, j.turn, false AS gone
        FROM story_jobs j
        JOIN (SELECT client_id, min(turn) AS from_turn FROM gone GROUP BY client_id) f ON f.client_id = j.client_id
        WHERE j.status IN ('pending', 'running') AND j.turn >= f.from_turn
          AND j.id <> ALL (ARRAY(SELECT id FROM gone))
        UNION ALL
        SELECT id, 'failed', client_id, turn, true FROM gone
    ),
    chain AS MATERIALIZED (
        SELECT l.id, l.status, l.client_id, l.turn, l.gone,
               coalesce(lead(l.turn) OVER w, a.last_turn, l.turn) - l.turn AS length
        FROM live l
        LEFT JOIN job_admission a ON a.client_id = l.client_id
        WINDOW w AS (PARTITION BY l.client_id ORDER BY l.turn, l.id)
    ),
    moved_up AS MATERIALIZED (
        SELECT id, status, gone, sum(CASE WHEN gone THEN length ELSE 0 END) OVER (
                   PARTITION BY client_id ORDER BY turn, id ROWS UNBOUNDED PRECEDING) AS shift
        FROM chain
    ),
    turns_moved AS (
        -- reached by id through `id = ANY (ARRAY(...))`, an index lookup
        -- whatever the generic plan guesses (see jobs_end, migration 019)
        UPDATE story_jobs j SET turn = j.turn - m.shift
        FROM moved_up m
        WHERE j.id = ANY (ARRAY(SELECT id FROM moved_up WHERE NOT gone AND status = 'pending' AND shift > 0))
          AND j.id = m.id AND j.status = 'pending'
    )
    UPDATE job_admission a SET last_turn = a.last_turn - g.length
    FROM (SELECT client_id, sum(length) AS length FROM chain WHERE gone GROUP BY client_id) g
    WHERE a.client_id = g.client_id AND g.length > 0;
END
$$;
