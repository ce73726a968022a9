-- storyjobs schema, version 25: the batch lane's live jobs counted by a
-- function, for the one admission statement.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- The batch lane's live jobs (pending, or running in or between batches) of
-- one client (NULL: of every client), counted on story_jobs_batch_live_idx
-- up to at_most: what admission needs to know of that lane's bounds
-- (CLIENT_BATCH_QUEUE_MAX, BATCH_QUEUE_MAX). Admission is one statement for
-- both lanes (sql/api.sql, job_insert_if_admitted); as subqueries there, these
-- counts were planned with it on every POST, a lane's request or not (about
-- a seventh of its planning). A function's plans are made once per session,
-- and only where a batch is admitted.
CREATE FUNCTION batch_lane_live(client_id bigint, at_most integer) RETURNS bigint
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    counted bigint;
BEGIN
    IF batch_lane_live.client_id IS NULL THEN
        SELECT count(*) INTO counted FROM (
            SELECT 1 FROM story_jobs s
            WHERE s.lane = 'batch' AND s.status IN ('pending', 'running')
            LIMIT at_most) q;
    ELSE
        SELECT count(*) INTO counted FROM (
            SELECT 1 FROM story_jobs s
            WHERE s.lane = 'batch' AND s.status IN ('pending', 'running')
              AND s.client_id = batch_lane_live.client_id
            LIMIT at_most) q;
    END IF;
    RETURN counted;
END
$$;
