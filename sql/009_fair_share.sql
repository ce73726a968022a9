-- storyjobs schema, version 9: a fair share of the workers for every client.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.
--
-- The claim serves the clients with pending jobs in turn, weighted, oldest
-- first within a client (start-time fair queuing). Each job gets its place
-- in the round, its `turn`, when it is admitted, under the admission lock:
--
--     turn = greatest(V, where the client's last turn ends)
--     a turn lasts 1 / the client's weight
--
-- where V is the smallest turn still pending (the round being served now).
-- A client that sent 2,000 jobs has turns 0, 1, ... 1,999; one that comes
-- later with 20, while turn V is served, gets V, V + 1, ... V + 19, and the
-- two alternate from V on; a client of weight 2 gets turns half a turn
-- apart, so two jobs to the others' one. The claim then takes pending jobs
-- in turn order (ties: the older job) from one index: as cheap as first
-- come, first served, whatever the number of clients or of their jobs.

-- The client's share (`storyjobs keys create NAME --weight N`): jobs admitted
-- after a change take it; jobs already queued keep their turns.
ALTER TABLE api_clients ADD COLUMN weight integer NOT NULL DEFAULT 1 CHECK (weight BETWEEN 1 AND 1000);

-- NULL for a job admitted before this version: numbered below in the order
-- it had, ahead of every new one.
ALTER TABLE story_jobs ADD COLUMN turn double precision;

-- Where the last turn given to a client ends (client 0: to any client, the
-- floor when no job is pending), under the admission lock.
ALTER TABLE job_admission ADD COLUMN last_turn double precision NOT NULL DEFAULT 0;

UPDATE story_jobs j SET turn = n.turn
FROM (SELECT id, (row_number() OVER (ORDER BY created_at, id) - 1)::float8 AS turn
      FROM story_jobs WHERE status = 'pending') n
WHERE j.id = n.id;

UPDATE job_admission a SET last_turn = coalesce((
    SELECT max(turn) + 1 FROM story_jobs j WHERE j.status = 'pending' AND (a.client_id = 0 OR j.client_id = a.client_id)), 0);

-- The claim's index: pending jobs only, in turn order. An entry is written
-- when a job is admitted; the claim's update leaves the predicate and writes
-- none, and a heartbeat touches neither column, so it stays a HOT update.
CREATE INDEX story_jobs_turn_idx ON story_jobs (turn, id) WHERE status = 'pending';

-- The first pending job the bucket did not cover, and since when: after
-- LLM_RATE_BURST_S the jobs behind it stop passing it, so it is not starved.
ALTER TABLE llm_rate_buckets ADD COLUMN held_job_id bigint, ADD COLUMN held_since timestamptz;

-- The limits per minute the last limited round paced the bucket by
-- (configured, or announced by the provider's headers): a worker that has
-- heard no header yet learns them here instead of claiming unpaced.
ALTER TABLE llm_rate_buckets
    ADD COLUMN requests_per_minute double precision,
    ADD COLUMN input_tokens_per_minute double precision,
    ADD COLUMN output_tokens_per_minute double precision;
