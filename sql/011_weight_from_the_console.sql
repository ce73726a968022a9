-- 011: an operator sets a client's weight from the console, and the audit
-- trail says who did (filter: the client_id and the weight set).
ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('job_cancel', 'pending_cancel', 'client_keys_revoke', 'key_revoke', 'client_weight_set'));
