-- storyjobs schema, version 21: history that stays cheap to read.
-- Applied by `storyjobs migrate` inside one transaction; see shared/migrate.py.

-- The ledger by time: a btree on started_at instead of the BRIN index of
-- migration 001. BRIN narrows a range to the pages whose rows' times fall in
-- it, which holds only while rows arrive in time order on new pages. Once the
-- table has free space in old pages (fillfactor 70, a VACUUM after the
-- prune, updates that move rows), new rows land there: 16,977 new rows spread
-- over 540 of 693 ranges, and "the last hour" read 69,045 of 88,591 pages. A
-- btree reads what the range holds, whatever page a row sits on; the insert
-- it costs is one entry on the rightmost leaf.
--
-- Built here with a lock that holds the ledger's writes while it builds (a
-- few seconds per million rows). On a large ledger build it first, without
-- that lock, and this migration then keeps it (docs/operations.md):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS llm_calls_started_at_idx ON llm_calls (started_at);
CREATE INDEX IF NOT EXISTS llm_calls_started_at_idx ON llm_calls (started_at);
DROP INDEX IF EXISTS llm_calls_started_at_brin;

-- The hot table kept clean. VACUUM skips the indexes' cleanup ("index scan
-- bypassed") when dead entries sit on under 2 % of the table's pages: with
-- a large history that is always, so the dead entries of the live-jobs
-- indexes stayed until a scan happened to clean them, and the claim read
-- them (0.17 -> 1.31 ms after one snapshot held for 90 s, the live-jobs index
-- 96 -> 216 kB, never shrinking). Cleanup on: every VACUUM of story_jobs
-- cleans every index. The thresholds of migration 001 (a fixed count of
-- changes, not a share of a table that grows with history) stay.
ALTER TABLE story_jobs SET (vacuum_index_cleanup = on);

-- The history's tables lose a day's rows at once to the prune. With the
-- default share (20 % of the table) a table of 30 days was vacuumed only
-- after six days' prunes, and never gave its space back for reuse before:
-- vacuum them after a fixed number of dead rows instead.
ALTER TABLE stories SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
                         autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE job_idempotency_keys SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
                                      autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE webhook_deliveries SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
                                    autovacuum_analyze_scale_factor = 0.02);
-- the ledger is only appended to (and each row updated once, HOT): its
-- statistics follow the newest rows, which every read by time asks for
ALTER TABLE llm_calls SET (autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 10000);
