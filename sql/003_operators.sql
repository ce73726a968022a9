-- storyjobs schema, version 3: operators' keys.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- The keys of the operators' console (/ops/), made by
-- `storyjobs keys create NAME --operator`. They are kept apart from the
-- clients' api_keys on purpose: no query that authenticates a client reads
-- this table, and no query of the console reads api_keys to authenticate,
-- so a client key can never reach /ops and an operator key never enqueues a
-- story. Stored like client keys: SHA-256 of the whole key, found by its
-- non-secret prefix (the same sj_<prefix>_<secret> shape, so
-- `storyjobs keys list` and `keys revoke PREFIX` name both kinds alike).
CREATE TABLE operator_keys (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- who holds the key: shown in the console and in every action's log line
    name        text NOT NULL CHECK (length(name) BETWEEN 1 AND 100),
    key_prefix  text NOT NULL UNIQUE,
    key_hash    bytea NOT NULL CHECK (length(key_hash) = 32),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
