-- storyjobs schema, version 6: the console's history, one row per minute.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.
--
-- Why: charts over an hour, a day or a week would otherwise scan a week of
-- jobs and ledger rows at every look. The sweeper keeps this table at each
-- pass (sweeper/rollup.py: it recounts the last few minutes, so a late
-- commit lands in its minute), the console reads at most 10,080 rows for a
-- week, and rows older than eight days are deleted by the same pass.

CREATE TABLE minute_rollup (
    -- the minute's start, date_trunc('minute', ...)
    minute        timestamptz PRIMARY KEY,
    -- jobs that finished in the minute; failed counts cancellations too
    completed     integer NOT NULL DEFAULT 0,
    failed        integer NOT NULL DEFAULT 0,
    cancelled     integer NOT NULL DEFAULT 0,
    -- the ledger's requests started in the minute: what was billed, and 429s
    spend_usd     numeric(14, 6) NOT NULL DEFAULT 0,
    rate_limited  integer NOT NULL DEFAULT 0,
    -- the most pending and running jobs a sweeper pass saw in the minute
    pending_max   integer NOT NULL DEFAULT 0,
    running_max   integer NOT NULL DEFAULT 0,
    -- jobs claimed in the minute by how long they waited, jobs completed in
    -- it by how long they ran: counts per bucket of shared/rows.py's
    -- ROLLUP_BOUNDS_S (element 1: under the second bound, ...), so that
    -- percentiles over any range are sums of these
    wait_counts   integer[] NOT NULL DEFAULT '{}',
    run_counts    integer[] NOT NULL DEFAULT '{}'
);
