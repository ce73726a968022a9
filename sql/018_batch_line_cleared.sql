-- 018: no ended job left in the batch lane's line.
--
-- The operator's bulk cancel of pending jobs did not clear batch_ready_at
-- (every other end of a job does): a batch job it cancelled stayed in the
-- line, and a batch's intent could count it into a batch it then did not
-- move, a request count the items do not match. The statements now clear
-- it and read the status too; this clears what was left.
UPDATE story_jobs SET batch_ready_at = NULL
WHERE batch_ready_at IS NOT NULL AND status IN ('completed', 'failed');
