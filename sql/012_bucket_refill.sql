-- 012: the rate bucket's refill, defined once.
--
-- What a kind of the shared bucket holds now: what it held at refilled_at,
-- plus its rate for the time since, plus what finished calls gave back,
-- never more than its capacity. A kind the row holds nothing for (a pause
-- wrote the row before its rate was known) was empty when written: the
-- provider had just said nothing was left. The claim round, a retry's start,
-- the console and `storyjobs stats` all read the bucket through it. A SQL
-- function of one expression that uses each argument once: the planner
-- inlines it, so it costs the statements nothing.
CREATE FUNCTION bucket_refilled(held double precision, rate double precision, capacity double precision,
                                refilled_at timestamptz, given_back double precision)
RETURNS double precision
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT least(capacity, coalesce(held, 0) + rate * greatest(extract(epoch FROM now() - refilled_at), 0)::float8
                           + given_back)
$$;
