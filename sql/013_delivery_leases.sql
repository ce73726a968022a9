-- 013: webhook deliveries that always end, leases a late attempt cannot
-- match, and delivery slots shared fairly across clients.

-- The client whose job wrote the event, so that the claim can share the
-- delivery slots between clients without reading the endpoints.
ALTER TABLE webhook_deliveries ADD COLUMN client_id bigint;
UPDATE webhook_deliveries d SET client_id = e.client_id FROM webhook_endpoints e WHERE e.id = d.endpoint_id;
ALTER TABLE webhook_deliveries ALTER COLUMN client_id SET NOT NULL;

-- The attempt's lease: a number written by each claim, one more than the
-- last, and never lowered (an operator's retry raises it too), so an attempt
-- whose lease ran out can never record its end onto a later one. attempts,
-- which an operator's retry sets back to 0, is no guard.
ALTER TABLE webhook_deliveries ADD COLUMN lease bigint NOT NULL DEFAULT 0;
-- While an attempt is in flight, the end of its lease (next_attempt_at then
-- says the same); NULL once the attempt's end is recorded. An attempt whose
-- lease ran out (its worker was killed) is no longer in flight.
ALTER TABLE webhook_deliveries ADD COLUMN leased_until timestamptz;

-- The claim walks the clients with undelivered rows, and each one's due rows
-- in order, through this index: its cost follows the clients and their due
-- rows, never the delivered history.
CREATE INDEX webhook_deliveries_client_due_idx ON webhook_deliveries (client_id, next_attempt_at, id)
    WHERE state = 'pending';
-- A client's attempts in flight, which the claim counts: at most the
-- delivery slots of all workers, and the leases that ran out until they are
-- claimed again.
CREATE INDEX webhook_deliveries_in_flight_idx ON webhook_deliveries (client_id)
    WHERE leased_until IS NOT NULL;

-- A delivery that went past the schedule (shared/webhooks.py MAX_ATTEMPTS,
-- 8) while a send raised what the delivery loop did not catch: claimed again
-- at every lease, with no attempt recorded. It is dead, as the claim now
-- makes any delivery whose last attempt's lease runs out.
UPDATE webhook_deliveries
SET state = 'dead', last_error = 'out of attempts: no attempt recorded its end within its lease'
WHERE state = 'pending' AND attempts >= 8;

-- The outbox's trigger writes the client with the event.
CREATE OR REPLACE FUNCTION story_jobs_webhook_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status NOT IN ('completed', 'failed') OR OLD.status NOT IN ('pending', 'running') THEN
        RETURN NULL;
    END IF;
    INSERT INTO webhook_deliveries (endpoint_id, client_id, job_id, job_public_id, job_status, error_code, story_id,
                                    occurred_at)
    SELECT e.id, NEW.client_id, NEW.id, NEW.public_id, NEW.status, NEW.error_code, NEW.story_id, NEW.completed_at
    FROM webhook_endpoints e
    WHERE e.client_id = NEW.client_id AND e.disabled_at IS NULL
      AND (CASE WHEN NEW.status = 'completed' THEN 'job.completed'
                WHEN NEW.error_code = 'cancelled' THEN 'job.cancelled'
                ELSE 'job.failed' END) = ANY (e.events);
    RETURN NULL;
END
$$;

-- An operator's retry of a dead delivery is an audited action like the others
-- (job_id: the delivery's job; filter: the delivery's id).
ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('job_cancel', 'pending_cancel', 'client_keys_revoke', 'key_revoke', 'client_weight_set',
                      'retry_delivery'));
