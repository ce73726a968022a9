-- storyjobs schema, version 23: one claim statement, the shared rate
-- limiter's part of it in two functions.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- The claim (sql/worker.sql, job_claim) is one statement whether a rate limit
-- is configured or not. With one, the model's bucket row is locked and
-- refilled (llm_rate_bucket_hold), then the jobs it covers are chosen among
-- the claimable ones and what they take is written back
-- (llm_rate_bucket_take). Without one the statement calls neither: as
-- functions, their plans are made only in a session that runs them, so a
-- claim without a limit does not start the limiter's part of the plan on
-- every execution (about a fifth of its cost, docs/performance.md).

-- The bucket as a limited claim found it: locked, each kind refilled to now
-- (bucket_refilled, migration 012) and capped by what the provider last
-- said was left (NULL: no limit of that kind; 0 where the row is missing,
-- which the take recreates empty), the pause, and the job it held back.
CREATE TYPE llm_rate_bucket_state AS (
    paused_until  timestamptz,
    requests      double precision,
    input_tokens  double precision,
    output_tokens double precision,
    held_job_id   bigint,
    held_since    timestamptz
);

-- A claimable job's needs, in turn order.
CREATE TYPE job_need AS (
    id            bigint,
    turn          double precision,
    input_tokens  integer,
    output_tokens integer
);

-- What the take chose and left: the jobs to claim (in turn order), the
-- bucket after them, the needs of the first job it held back, and whether
-- this worker wakes for the bucket (else in how long its waker is overdue).
CREATE TYPE llm_rate_bucket_taken AS (
    chosen             bigint[],
    paused_until       timestamptz,
    requests           double precision,
    input_tokens       double precision,
    output_tokens      double precision,
    next_input_tokens  integer,
    next_output_tokens integer,
    waker              boolean,
    waker_in_s         double precision
);

-- Called first in the claim, before any job row is locked: the job rows are
-- then locked with SKIP LOCKED, so a statement holding the bucket never
-- waits for a job row and the bucket joins no deadlock.
CREATE FUNCTION llm_rate_bucket_hold(
    model text, provider_pause_s double precision,
    requests_rate double precision, requests_capacity double precision,
    input_tokens_rate double precision, input_tokens_capacity double precision,
    output_tokens_rate double precision, output_tokens_capacity double precision,
    provider_requests double precision, provider_input_tokens double precision,
    provider_output_tokens double precision
) RETURNS llm_rate_bucket_state
LANGUAGE plpgsql
AS $$
DECLARE
    b llm_rate_buckets;
    found_row boolean;
    s llm_rate_bucket_state;
BEGIN
    SELECT * INTO b FROM llm_rate_buckets r WHERE r.model = llm_rate_bucket_hold.model FOR NO KEY UPDATE;
    found_row := FOUND;
    -- greatest() passes over NULLs: no row, no pause
    s.paused_until := greatest(b.paused_until, now() + make_interval(secs => provider_pause_s));
    s.requests := CASE WHEN requests_rate IS NULL THEN NULL WHEN NOT found_row THEN 0
                       ELSE least(bucket_refilled(b.requests, requests_rate, requests_capacity, b.refilled_at, 0),
                                  coalesce(provider_requests, 'infinity')) END;
    s.input_tokens := CASE WHEN input_tokens_rate IS NULL THEN NULL WHEN NOT found_row THEN 0
                           ELSE least(bucket_refilled(b.input_tokens, input_tokens_rate, input_tokens_capacity,
                                                      b.refilled_at, 0),
                                      coalesce(provider_input_tokens, 'infinity')) END;
    s.output_tokens := CASE WHEN output_tokens_rate IS NULL THEN NULL WHEN NOT found_row THEN 0
                            ELSE least(bucket_refilled(b.output_tokens, output_tokens_rate, output_tokens_capacity,
                                                       b.refilled_at, 0),
                                       coalesce(provider_output_tokens, 'infinity')) END;
    s.held_job_id := b.held_job_id;
    s.held_since := b.held_since;
    RETURN s;
END
$$;

-- The jobs the bucket covers, in turn order, up to claim_limit, passing those
-- it does not cover: a job it does not cover stays pending without holding
-- back the jobs behind it that it covers, until it has waited for the bucket
-- LLM_RATE_BURST_S (burst_s: about what the bucket takes to fill); then the
-- jobs behind it stop passing it, so that it is never starved: the bucket
-- fills for it, and it goes first. The bucket is written as they leave it.
-- `needs` are the claimable jobs, locked by the calling claim, which claims
-- every job chosen here (a job it locked is still pending).
CREATE FUNCTION llm_rate_bucket_take(
    model text, worker_id text, bucket llm_rate_bucket_state, needs job_need[], claim_limit integer,
    burst_s double precision, requests_rate double precision, input_tokens_rate double precision,
    output_tokens_rate double precision
) RETURNS llm_rate_bucket_taken
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t llm_rate_bucket_taken;
    held_id bigint;
    held_turn double precision;
    reserving boolean;
    since timestamptz;
    taken_requests double precision;
    taken_input double precision;
    taken_output double precision;
    would_wake boolean;
    looked boolean := coalesce(cardinality(needs), 0) > 0;
    v_waker text;
    v_waker_until timestamptz;
BEGIN
    -- the first job the bucket does not cover on its own
    SELECT n.id, n.turn INTO held_id, held_turn FROM unnest(needs) n
    WHERE NOT ((bucket.requests IS NULL OR bucket.requests >= 1)
               AND (bucket.input_tokens IS NULL OR n.input_tokens <= bucket.input_tokens)
               AND (bucket.output_tokens IS NULL OR n.output_tokens <= bucket.output_tokens))
    ORDER BY n.turn, n.id LIMIT 1;
    reserving := coalesce(held_id = bucket.held_job_id
                          AND bucket.held_since < now() - make_interval(secs => burst_s), false);
    since := CASE WHEN held_id IS NULL THEN NULL WHEN held_id = bucket.held_job_id THEN bucket.held_since
                  ELSE now() END;
    SELECT coalesce(array_agg(c.id ORDER BY c.turn, c.id), '{}'), count(*),
           coalesce(sum(c.input_tokens), 0), coalesce(sum(c.output_tokens), 0)
    INTO t.chosen, taken_requests, taken_input, taken_output
    FROM (
        SELECT n.id, n.turn, n.input_tokens, n.output_tokens, row_number() OVER w AS k,
               sum(n.input_tokens) OVER w AS input_cum, sum(n.output_tokens) OVER w AS output_cum
        FROM unnest(needs) n
        WHERE (bucket.requests IS NULL OR bucket.requests >= 1)
          AND (bucket.input_tokens IS NULL OR n.input_tokens <= bucket.input_tokens)
          AND (bucket.output_tokens IS NULL OR n.output_tokens <= bucket.output_tokens)
          AND NOT coalesce(reserving AND (held_turn, held_id) < (n.turn, n.id), false)
        WINDOW w AS (ORDER BY n.turn, n.id)
    ) c
    WHERE c.k <= claim_limit
      AND (bucket.requests IS NULL OR c.k <= bucket.requests)
      AND (bucket.input_tokens IS NULL OR c.input_cum <= bucket.input_tokens)
      AND (bucket.output_tokens IS NULL OR c.output_cum <= bucket.output_tokens);
    t.paused_until := bucket.paused_until;
    t.requests := bucket.requests - taken_requests;
    t.input_tokens := bucket.input_tokens - taken_input;
    t.output_tokens := bucket.output_tokens - taken_output;
    -- held back (paused, or a job looked at and not chosen) with a slot
    -- still free: this worker would wake for the bucket
    would_wake := claim_limit > taken_requests
                  AND (coalesce(bucket.paused_until > now(), false)
                       OR coalesce(cardinality(needs), 0) > cardinality(t.chosen));
    INSERT INTO llm_rate_buckets AS b (model, requests, input_tokens, output_tokens, refilled_at, paused_until,
                                       held_job_id, held_since, requests_per_minute, input_tokens_per_minute,
                                       output_tokens_per_minute, waker, waker_until)
    VALUES (llm_rate_bucket_take.model, t.requests, t.input_tokens, t.output_tokens, now(),
            coalesce(bucket.paused_until, '-infinity'), held_id, since, requests_rate * 60,
            input_tokens_rate * 60, output_tokens_rate * 60,
            CASE WHEN would_wake THEN llm_rate_bucket_take.worker_id END,
            CASE WHEN would_wake THEN greatest(bucket.paused_until, now()) + make_interval(secs => burst_s) END)
    ON CONFLICT (model) DO UPDATE
    SET requests = excluded.requests, input_tokens = excluded.input_tokens,
        output_tokens = excluded.output_tokens,
        refilled_at = greatest(b.refilled_at, excluded.refilled_at),
        paused_until = greatest(b.paused_until, excluded.paused_until),
        requests_per_minute = excluded.requests_per_minute, input_tokens_per_minute = excluded.input_tokens_per_minute,
        output_tokens_per_minute = excluded.output_tokens_per_minute,
        -- a claim that looked at no job (paused, or no slot) leaves them as they are
        held_job_id = CASE WHEN looked THEN excluded.held_job_id ELSE b.held_job_id END,
        held_since = CASE WHEN looked THEN excluded.held_since ELSE b.held_since END,
        -- the role is taken when it is free, ours or overdue, and given up
        -- by its holder when it no longer would wake; a claim of none (a
        -- round that only tells the bucket what was heard) leaves it
        waker = CASE WHEN claim_limit = 0 THEN b.waker
                     WHEN b.waker IS NULL OR b.waker = llm_rate_bucket_take.worker_id OR b.waker_until <= now()
                     THEN excluded.waker ELSE b.waker END,
        waker_until = CASE WHEN claim_limit = 0 THEN b.waker_until
                           WHEN b.waker IS NULL OR b.waker = llm_rate_bucket_take.worker_id OR b.waker_until <= now()
                           THEN excluded.waker_until ELSE b.waker_until END
    RETURNING b.waker, b.waker_until INTO v_waker, v_waker_until;
    SELECT n.input_tokens, n.output_tokens INTO t.next_input_tokens, t.next_output_tokens
    FROM unnest(needs) n WHERE n.id <> ALL (t.chosen) ORDER BY n.turn, n.id LIMIT 1;
    t.waker := coalesce(v_waker = llm_rate_bucket_take.worker_id, false);
    t.waker_in_s := greatest(coalesce(extract(epoch FROM v_waker_until - now()), 0), 0);
    RETURN t;
END
$$;
