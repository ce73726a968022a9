-- storyjobs schema, version 2: the error codes and ledger outcomes are
-- constrained as the statuses are, and no ledger row stays open once its job
-- has finished.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- The values mirror shared.status.ErrorCode and LlmOutcome
-- (tests/integration/test_schema.py keeps them in step). A CHECK, not an
-- enum type: adding a value later is one statement that rewrites nothing.
ALTER TABLE story_jobs ADD CONSTRAINT story_jobs_error_code_known CHECK (error_code IN (
    'interrupted', 'timed_out', 'queue_timeout', 'cancelled', 'llm_error', 'llm_rejected',
    'llm_unavailable', 'invalid_request', 'internal_error'));

-- A row opened before this version by a job that was then cancelled, or failed
-- by the sweeper while a retry's row was being opened, was never closed: close
-- it as the sweeper would, assumed billed. (A job that is gone was pruned, so
-- it had finished.)
UPDATE llm_calls c
SET finished_at = now(), outcome = 'interrupted',
    error_text = 'the job had finished while this call was open'
WHERE c.outcome = 'started'
  AND NOT EXISTS (SELECT 1 FROM story_jobs j WHERE j.id = c.job_id AND j.status = 'running');

ALTER TABLE llm_calls ADD CONSTRAINT llm_calls_outcome_known CHECK (outcome IN (
    'started', 'succeeded', 'stopped', 'rate_limited', 'overloaded', 'connect_failed', 'not_sent',
    'rejected', 'failed', 'interrupted'));

-- `started` is the only outcome of an open row; every other one is final.
ALTER TABLE llm_calls ADD CONSTRAINT llm_calls_finished_when_known
    CHECK ((outcome = 'started') = (finished_at IS NULL));
