-- storyjobs schema, version 16: a webhook delivery carries its job's trace
-- context, written by the outbox's trigger with the event, so that the
-- delivery's first attempt joins the job's trace and later ones link to it.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.
CREATE OR REPLACE FUNCTION story_jobs_webhook_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status NOT IN ('completed', 'failed') OR OLD.status NOT IN ('pending', 'running') THEN
        RETURN NULL;
    END IF;
    INSERT INTO webhook_deliveries (endpoint_id, client_id, job_id, job_public_id, job_status, error_code, story_id,
                                    occurred_at, trace_context)
    SELECT e.id, NEW.client_id, NEW.id, NEW.public_id, NEW.status, NEW.error_code, NEW.story_id, NEW.completed_at,
           NEW.trace_context
    FROM webhook_endpoints e
    WHERE e.client_id = NEW.client_id AND e.disabled_at IS NULL
      AND (CASE WHEN NEW.status = 'completed' THEN 'job.completed'
                WHEN NEW.error_code = 'cancelled' THEN 'job.cancelled'
                ELSE 'job.failed' END) = ANY (e.events);
    RETURN NULL;
END
$$;
