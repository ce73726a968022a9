-- 015: each job's trace context, and each webhook delivery's.
--
-- The W3C trace context (traceparent, and tracestate when there is one) of
-- the span that admitted the job, as a JSON object of text, so that what
-- happens to the job later (its run, its webhooks, the sweeper failing or
-- pruning it) can join or link to its trace. NULL when tracing was off or
-- the job was admitted outside any span. Nothing reads it to decide
-- anything: a value that is not such an object is ignored.
ALTER TABLE story_jobs ADD COLUMN trace_context jsonb;
ALTER TABLE webhook_deliveries ADD COLUMN trace_context jsonb;
