-- storyjobs schema, version 27: what one ledger row adds to the counts the
-- console and the sweeper's rollup keep, written once.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- Each ledger row's part of the counts: one request, billed or not; what
-- it spent once it ended (one still open spends nothing yet: its job's
-- reservation holds it); its tokens if billed; a 429 or a 529 answered. The
-- rollup (sweeper.sql rollup_minutes) and the overview (console.sql
-- ops_overview) each count a part of the same requests, the overview adding
-- the rollup's minutes to its own read, so both must count a request alike.
-- A plain view over llm_calls: a statement reading it plans it inline, on
-- llm_calls' own indexes. Summed where read (coalesce: a sum of no rows is
-- NULL).
CREATE VIEW llm_call_tallies AS
SELECT l.job_id, l.attempt, l.started_at, l.provider,
       l.billed::integer AS billed_calls,
       CASE WHEN l.outcome <> 'started'
            THEN llm_call_charge(l.billed, l.outcome, l.cost_usd, l.worst_case_usd) END AS spend_usd,
       CASE WHEN l.billed THEN l.input_tokens END AS billed_input_tokens,
       CASE WHEN l.billed THEN l.output_tokens END AS billed_output_tokens,
       (l.outcome = 'rate_limited')::integer AS rate_limited,
       (l.outcome = 'overloaded')::integer AS overloaded
FROM llm_calls l;

-- A job's charge (migration 019) with how many of its rows were billed: a
-- failed job with billed rows is a story paid for and not delivered, which
-- the rollup and the overview both count. A row not billed is charged 0,
-- so the charge is that of the billed rows.
CREATE OR REPLACE VIEW job_charges AS
SELECT c.job_id, sum(llm_call_charge(c.billed, c.outcome, c.cost_usd, c.worst_case_usd)) AS charge_usd,
       count(*) FILTER (WHERE c.billed) AS billed_calls
FROM llm_calls c
GROUP BY c.job_id;
