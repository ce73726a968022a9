"""The named mutants. Each is one small textual change (``target`` replaced
by ``replacement``, found exactly once in ``file``), names the invariant it
attacks, and the tests of the tier that should notice. A restructuring that
moves a target updates its mutant in the same change:
tests/repo/test_mutants.py fails while a target is not found exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tier = Literal["unit", "integration", "model", "system"]


@dataclass(frozen=True)
class Mutant:
    name: str
    invariant: str
    tier: Tier
    file: str
    # (target, replacement) pairs, applied together: a guard that two
    # predicates hold (a locking scan's and the update's own) falls only
    # when both go
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    timeout_s: float = 300.0


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        # every end goes through jobs_end (migration 019, as 033 replaced
        # it): the worker's, the cancels', the sweeper's, the batch lane's
        name="end-without-its-holder",
        invariant="an end (completed or failed) written by a worker that no longer holds the job changes nothing",
        tier="model",
        file="sql/033_every_end_locked_first.sql",
        edits=(("          AND (by_worker IS NULL OR j.worker_id = by_worker)\n"
                "          AND (by_batch IS NULL OR j.batch_id = by_batch)\n        -- (only a claim",
                "        -- (only a claim"),),
        # the orders that attack it, played first; then the model's own search
        tests=("tests/integration/test_round_completions.py::"
               "test_an_end_sent_by_a_worker_that_does_not_hold_the_job_changes_nothing",
               "tests/model/test_worker_model_pg.py::test_a_story_that_arrives_after_a_cancel_changes_nothing",
               "tests/model/test_worker_model_pg.py::test_a_failure_that_arrives_after_a_sweep_changes_nothing",
               "tests/model/test_worker_model_pg.py::test_the_coordinator_keeps_its_promise_on_postgres"),
    ),
    Mutant(
        name="end-without-running-guard",
        invariant="a completed or failed job never changes again, whoever tries to end it",
        tier="model",
        file="sql/033_every_end_locked_first.sql",
        edits=(("          AND j.status = ANY (expected)\n          AND (by_worker IS NULL",
                "          AND (by_worker IS NULL"),),
        tests=("tests/model/test_worker_model_pg.py::test_a_story_that_arrives_after_a_cancel_changes_nothing",
               "tests/integration/test_races.py",
               "tests/model/test_worker_model_pg.py::test_the_coordinator_keeps_its_promise_on_postgres"),
    ),
    Mutant(
        # the lock taken before the calls' close, which writes the row of a
        # job that ended meanwhile (its charge moves): only the caller's jobs
        name="end-locks-only-the-jobs-still-its-callers",
        invariant="an end takes every job row it may write in ascending id order, before any other: it never "
                  "deadlocks with a statement that holds a lower job's row and waits for a higher one",
        tier="integration",
        file="sql/033_every_end_locked_first.sql",
        edits=(("    WHERE j.id = ANY (ARRAY(SELECT (x).job_id FROM unnest(ends) x))\n    ORDER BY j.id\n",
                "    WHERE j.id = ANY (ARRAY(SELECT (x).job_id FROM unnest(ends) x)) AND j.status = ANY (expected)\n"
                "      AND (by_worker IS NULL OR j.worker_id = by_worker)\n    ORDER BY j.id\n"),),
        tests=("tests/integration/test_lock_order.py::test_an_end_takes_a_job_cancelled_meanwhile_in_id_order_with_the_rest",),
    ),
    # money by construction (migration 019): a job's charge is derived from
    # its ledger rows, in one place
    Mutant(
        name="charge-unknown-row-as-zero",
        invariant="a request whose outcome is unknown (open, interrupted, a lost batch's) costs its worst case",
        tier="integration",
        file="sql/019_money_follows_the_ledger.sql",
        edits=(("                WHEN outcome IN ('started', 'interrupted') THEN worst_case_usd\n",
                "                WHEN outcome IN ('started', 'interrupted') THEN 0\n"),),
        tests=("tests/integration/test_budgets.py",
               "tests/integration/test_batch_money.py::"
               "test_a_job_cancelled_while_its_batch_is_in_flight_is_charged_nothing_when_its_result_is_canceled",
               "tests/model/test_worker_model_pg.py::test_the_coordinator_keeps_its_promise_on_postgres"),
    ),
    Mutant(
        # the batch lane's bug this derivation replaced: a request its result
        # said was never billed stayed charged its worst case
        name="charge-unbilled-row-at-its-worst-case",
        invariant="a request certainly not billed costs nothing",
        tier="integration",
        file="sql/019_money_follows_the_ledger.sql",
        edits=(("    SELECT CASE WHEN NOT billed THEN 0\n", "    SELECT CASE WHEN NOT billed THEN worst_case_usd\n"),),
        tests=("tests/integration/test_batch_money.py",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    Mutant(
        name="end-charges-nothing",
        invariant="a job is charged, when it ends, what its ledger says: what its calls reported, or the worst case "
                  "of a call whose outcome is unknown",
        tier="integration",
        file="sql/033_every_end_locked_first.sql",
        edits=(("            charged_usd = coalesce((SELECT g.charge_usd FROM job_charges g WHERE g.job_id = j.id), 0)",
                "            charged_usd = 0"),),
        tests=("tests/integration/test_budgets.py",
               "tests/integration/test_round_completions.py"),
    ),
    Mutant(
        name="ended-charge-not-followed",
        invariant="an ended job's charge follows its ledger when a result arrives after the end, down as well as "
                  "up, and the day's spend with it",
        tier="integration",
        # the ledger's trigger as migration 028 replaced it
        file="sql/028_late_ledger_changes.sql",
        edits=(("    WHERE j.id = d.id AND j.charged_usd IS DISTINCT FROM d.charged_usd;",
                "    WHERE false AND j.charged_usd IS DISTINCT FROM d.charged_usd;"),),
        tests=("tests/integration/test_batch_money.py",
               "tests/integration/test_budgets.py"),
    ),
    Mutant(
        name="sweeper-without-status-guard",
        invariant="the sweeper never changes a job that already ended",
        tier="integration",
        file="sql/sweeper.sql",
        # the running rule's scan and the update's own guard
        edits=(("    WHERE %(judge_running)s AND j.status = 'running' AND j.lane = 'interactive'\n",
                "    WHERE %(judge_running)s AND j.status <> 'pending' AND j.lane = 'interactive'\n"),
               ("    '{pending,running}', NULL, NULL, now_.t) e;",
                "    '{pending,running,completed,failed}', NULL, NULL, now_.t) e;")),
        tests=("tests/integration/test_races.py", "tests/integration/test_sweeper.py"),
    ),
    Mutant(
        name="claim-floor-raised-without-the-admission-lock",
        invariant="no pending job is below the claim's floor: an admission in flight is seen by the advance",
        tier="integration",
        file="sweeper/store.py",
        edits=(("            await job_admission_lock(conn)\n            (turn,) = await fetch_scalars(conn, "
                "\"job_claim_floor_advance\")",
                "            (turn,) = await fetch_scalars(conn, \"job_claim_floor_advance\")"),),
        tests=("tests/integration/test_claim_floor.py",),
    ),
    Mutant(
        # the turn being served (migration 034), read by admission and the
        # floor's advance alike
        name="turn-served-the-latest-pending",
        invariant="no pending job is below the claim's floor: each is claimed in its turn",
        tier="integration",
        file="sql/034_turn_served.sql",
        edits=(("                 ORDER BY j.turn, j.id LIMIT 1),\n",
                "                 ORDER BY j.turn DESC, j.id LIMIT 1),\n"),),
        tests=("tests/integration/test_claim_floor.py",),
    ),
    Mutant(
        name="turn-served-among-jobs-claimed-too",
        invariant="admission gives a new job its turn from the smallest pending one: a client is never put ahead "
                  "of the round being served",
        tier="integration",
        file="sql/034_turn_served.sql",
        edits=(("                 WHERE j.status = 'pending' AND j.lane = 'interactive'\n",
                "                 WHERE j.lane = 'interactive'\n"),),
        tests=("tests/integration/test_claim_floor.py", "tests/integration/test_fair_turns.py"),
    ),
    Mutant(
        name="claim-floor-raised-past-the-smallest-pending-turn",
        invariant="no pending job is below the claim's floor: each is claimed in its turn",
        tier="integration",
        file="sql/sweeper.sql",
        edits=(("    UPDATE job_claim_floor f SET turn = s.turn\n",
                "    UPDATE job_claim_floor f SET turn = s.turn + 1\n"),),
        tests=("tests/integration/test_claim_floor.py",),
    ),
    Mutant(
        name="claim-without-pending-predicate",
        invariant="only a pending job is claimed: a job is run by one worker, once",
        tier="integration",
        file="sql/worker.sql",
        # the claim's scan and its own guard
        edits=(("    WHERE status = 'pending' AND lane = 'interactive' AND turn >= (SELECT turn FROM job_claim_floor)\n"
                "    ORDER BY turn, id\n    LIMIT (SELECT CASE WHEN coalesce(paused_until",
                "    WHERE lane = 'interactive' AND turn >= (SELECT turn FROM job_claim_floor)\n"
                "    ORDER BY turn, id\n    LIMIT (SELECT CASE WHEN coalesce(paused_until"),
               ("WHERE j.id = ANY (ARRAY(SELECT id FROM chosen)) AND j.status = 'pending'",
                "WHERE j.id = ANY (ARRAY(SELECT id FROM chosen))")),
        tests=("tests/integration/test_races.py",),
    ),
    Mutant(
        name="rate-limited-counted-billed",
        invariant="a 429 was certainly not billed: its ledger row says so and it may be retried",
        tier="integration",
        file="shared/status.py",
        edits=(("return self in (LlmOutcome.RATE_LIMITED, LlmOutcome.OVERLOADED,",
                "return self in (LlmOutcome.OVERLOADED,"),),
        tests=("tests/integration/test_llm_calls.py",),
    ),
    Mutant(
        name="retry-without-its-ledger-row",
        invariant="a retry is sent only with its ledger row, opened while the job is running under this worker",
        tier="model",
        file="sql/worker.sql",
        edits=(("    WHERE id = %(job_id)s AND status = 'running' AND worker_id = %(worker_id)s\n    FOR SHARE",
                "    WHERE id = %(job_id)s\n    FOR SHARE"),),
        tests=("tests/model/test_worker_model_pg.py", "tests/integration/test_llm_calls.py"),
    ),
    Mutant(
        name="adoption-reruns-a-begun-job",
        invariant="a job a worker has begun is never begun again by that worker",
        tier="model",
        file="sql/worker.sql",
        edits=(("      AND NOT (j.id = ANY (%(known_ids)s::bigint[]))\n", ""),),
        tests=("tests/model/test_worker_model_pg.py", "tests/integration/test_races.py"),
    ),
    Mutant(
        # a claim the database refuses rolls the whole round back, stories
        # included, and they are not sent again alone: a claim the database
        # keeps refusing would keep every paid story from being settled
        name="claim-before-the-stories-are-settled",
        invariant="a refusal on the claim side never keeps a story that was paid for from being settled",
        tier="integration",
        file="worker/pg_store.py",
        edits=(("            settled_alone = _settled(await _one_row(conn, *settle))\n",
                "            raise\n"),),
        tests=("tests/integration/test_round_refusals.py",),
    ),
    Mutant(
        name="delivery-finished-without-its-lease",
        invariant="an attempt that no longer holds the delivery's lease records nothing",
        tier="model",
        file="sql/worker.sql",
        edits=(("    WHERE d.id = %(delivery_id)s AND d.state = 'pending' AND d.leased_until IS NOT NULL\n"
                "      AND d.lease = %(lease)s\n",
                "    WHERE d.id = %(delivery_id)s AND d.state = 'pending' AND d.leased_until IS NOT NULL\n"),),
        tests=("tests/integration/test_webhook_delivery.py", "tests/model/test_delivery_model_pg.py"),
    ),
    Mutant(
        name="delivery-claim-first-due-first",
        invariant="one client's slow receivers delay another client's webhook by at most one attempt",
        tier="integration",
        file="sql/worker.sql",
        edits=(("    ORDER BY r.turn, r.next_attempt_at, r.id\n", "    ORDER BY r.next_attempt_at, r.id\n"),),
        tests=("tests/integration/test_webhook_delivery.py", "tests/model/test_delivery_model_pg.py"),
    ),
    Mutant(
        name="delivery-claimed-past-the-schedule",
        invariant="a delivery ends dead after its schedule: no attempt counter grows without bound",
        tier="integration",
        file="sql/worker.sql",
        edits=(("    SELECT d.id, d.attempts < %(max_attempts)s AS within_schedule\n",
                "    SELECT d.id, true AS within_schedule\n"),),
        tests=("tests/integration/test_webhook_delivery.py", "tests/model/test_delivery_model_pg.py"),
    ),
    Mutant(
        name="url-rule-skips-the-ipv6-ranges",
        invariant="no delivery reaches an address that is not public (NAT64, IPv4-translated, site-local, ...)",
        tier="unit",
        file="shared/webhooks.py",
        edits=(("        if address not in _V6_GLOBAL_UNICAST:\n            raise UnsafeUrl(f\"{address} is not a public address\")\n",
                ""),),
        tests=("tests/unit/test_webhook_address_rule.py",),
    ),
    Mutant(
        name="endpoint-limit-without-its-lock",
        invariant="concurrent registrations of one client never make more endpoints than the limit",
        tier="integration",
        file="api/store.py",
        edits=(("            await self.conn.execute(Q[\"webhook_endpoint_insert_lock\"], {\"client_id\": client_id})\n",
                ""),),
        tests=("tests/integration/test_webhook_endpoint_rules.py",),
    ),
    Mutant(
        name="stale-turn-for-a-saturated-client",
        invariant="a client refilling its full queue takes its own next turn, not the one being served",
        tier="integration",
        file="sql/api.sql",
        edits=(("    WHERE bound IS NOT NULL AND (bound IS DISTINCT FROM kept OR admitted > 0)\n",
                "    WHERE bound IS NOT NULL AND bound IS DISTINCT FROM kept\n"),),
        tests=("tests/integration/test_fair_turns.py", "tests/model/test_fair_turns_model_pg.py"),
    ),
    Mutant(
        name="cancelled-turns-kept",
        invariant="a client's cancelled pending jobs give their turns back: it loses no place in the round",
        tier="integration",
        file="sql/common.sql",
        edits=(("                                     WHERE was_pending AND turn IS NOT NULL))\n",
                "                                     WHERE false))\n"),),
        tests=("tests/integration/test_fair_turns.py", "tests/model/test_fair_turns_model_pg.py"),
    ),
    Mutant(
        name="operator-cancelled-turns-kept",
        invariant="the pending jobs an operator cancels give their turns back: their client loses no place in "
                  "the round",
        tier="integration",
        file="sql/console.sql",
        edits=(("                                     WHERE turn IS NOT NULL))\n",
                "                                     WHERE false))\n"),),
        tests=("tests/integration/test_fair_turns.py", "tests/model/test_fair_turns_model_pg.py"),
    ),
    Mutant(
        # the unlimited claim served first come, first served: one client's
        # long queue takes every claim until it is drained
        name="claim-in-arrival-order",
        invariant="the claim takes pending jobs in their clients' turns: two clients with jobs waiting share the "
                  "claims by their weights",
        tier="model",
        file="sql/worker.sql",
        edits=(("    ORDER BY turn, id\n    LIMIT (SELECT CASE WHEN coalesce(paused_until",
                "    ORDER BY id\n    LIMIT (SELECT CASE WHEN coalesce(paused_until"),),
        tests=("tests/model/test_fair_turns_model_pg.py",),
    ),
    Mutant(
        # every client's turn lasts 1, whatever its weight
        name="turns-without-the-weight",
        invariant="a client of weight w is given w turns to a weight-1 client's one",
        tier="model",
        file="sql/api.sql",
        edits=(("        SELECT a.ord, a.client_id, coalesce(c.weight, 1)::float8 AS weight,",
                "        SELECT a.ord, a.client_id, 1::float8 AS weight,"),),
        tests=("tests/model/test_fair_turns_model_pg.py",),
    ),
    Mutant(
        name="url-rule-ignores-numeric-spellings",
        invariant="a host the resolver reads as a number (2130706433, 0x7f.0.0.1, 127.1) is judged as that address",
        tier="unit",
        file="shared/webhooks.py",
        edits=(("    return numeric_host(bare)\n", "    return None\n"),),
        tests=("tests/unit/test_webhook_address_rule.py",),
    ),
    # the batch lane (docs/batches.md): each run against the test that plays
    # its fault out, then the lane's model-based test; the first that fails
    # kills it (tests.mutants runs a mutant's tests in order, stopping there)
    Mutant(
        name="batch-create-with-sdk-retries",
        invariant="a create whose answer is lost is never sent again: one batch, each request billed once",
        tier="integration",
        file="worker/batch/anthropic_batches.py",
        edits=(("            max_retries=0,\n", "            max_retries=2,\n"),),
        tests=("tests/integration/test_batch_lane.py::test_a_create_whose_answer_is_lost_is_adopted_by_listing_never_created_again",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    Mutant(
        name="batch-create-5xx-read-as-refused",
        invariant="a create answered 5xx may have made its batch: its jobs are reconciled, never sent again",
        tier="unit",
        file="worker/batch/anthropic_batches.py",
        edits=(("        if 400 <= status < 500:\n", "        if 400 <= status < 600:\n"),),
        tests=("tests/unit/test_anthropic_batches.py::"
               "test_a_create_answered_with_a_5xx_is_unknown_whether_or_not_a_batch_was_made",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    Mutant(
        name="batch-unbilled-result-billed",
        invariant="an errored, expired or canceled request billed nothing: its ledger row says so",
        tier="integration",
        file="sql/019_money_follows_the_ledger.sql",
        edits=(("SET finished_at = now(), outcome = a.outcome, billed = false, cost_usd = 0, error_text = a.error_text",
                "SET finished_at = now(), outcome = a.outcome, billed = true, cost_usd = 0, error_text = a.error_text"),),
        tests=("tests/integration/test_batch_lane.py::test_requests_that_billed_nothing_go_into_a_later_batch_until_their_attempts_run_out",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    Mutant(
        name="batch-cancel-closes-the-ledger-row",
        invariant="a batch request's ledger row stays open until its result is read, whoever ended its job",
        tier="integration",
        file="sql/033_every_end_locked_first.sql",
        edits=(("      AND c.outcome = 'started' AND c.batch_id IS NULL;",
                "      AND c.outcome = 'started';"),),
        tests=("tests/integration/test_batch_lane.py::test_a_job_cancelled_in_flight_reads_cancelled_and_its_billed_story_is_kept_unseen",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    Mutant(
        name="batch-max-attempts-ignored",
        invariant="a request that billed nothing is sent at most BATCH_MAX_ATTEMPTS times",
        tier="integration",
        file="sql/batch.sql",
        edits=(("                   g.rejected OR g.attempt >= %(max_attempts)s,\n",
                "                   g.rejected,\n"),),
        tests=("tests/integration/test_batch_lane.py::test_requests_that_billed_nothing_go_into_a_later_batch_until_their_attempts_run_out",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    Mutant(
        # every end takes its job out of the line, in jobs_end: a cancel, the
        # operator's bulk cancel, the sweeper's rules
        name="ended-job-stays-in-line",
        invariant="a job ended while it waits for a batch leaves the line: the live jobs behind it are sent",
        tier="integration",
        file="sql/033_every_end_locked_first.sql",
        edits=(("            batch_ready_at = NULL,\n            -- what its ledger says",
                "            -- what its ledger says"),),
        tests=("tests/integration/test_batch_lane.py::test_jobs_cancelled_while_waiting_leave_the_line_for_the_jobs_behind_them",
               "tests/integration/test_batch_lane.py::"
               "test_jobs_an_operator_cancels_in_bulk_leave_the_line_and_a_row_left_in_it_is_never_counted",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    # the batch lane's writes fenced by its lease (sql/batch.sql)
    Mutant(
        name="stray-recorded-without-the-lease",
        invariant="a holder paused past its lease records nothing: never the new holder's batch as a stray",
        tier="integration",
        file="sql/batch.sql",
        edits=(("       %(processing_status)s, %(lost_batch_id)s\nWHERE batch_lease_held(%(holder)s, %(token)s)\n",
                "       %(processing_status)s, %(lost_batch_id)s\n"),),
        tests=("tests/integration/test_batch_money.py::"
               "test_a_holder_paused_past_its_lease_never_takes_the_new_holders_batch_for_a_stray",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    Mutant(
        name="never-sent-closed-by-any-holder",
        invariant="only the holder that made an intent may close it as never sent without the lease",
        tier="integration",
        file="sql/batch.sql",
        edits=(("    WHERE (lease.held OR (%(outcome)s = 'not_sent' AND b.holder = %(holder)s))\n",
                "    WHERE (lease.held OR %(outcome)s = 'not_sent')\n"),),
        tests=("tests/integration/test_batch_money.py::"
               "test_only_the_holder_that_made_an_intent_closes_it_as_never_sent_without_the_lease",),
    ),
    Mutant(
        name="loss-declared-without-the-lease",
        invariant="a holder paused past its lease declares no intent lost: the new holder reconciles it",
        tier="model",
        file="sql/batch.sql",
        edits=(("    FROM lease\n    WHERE lease.held AND b.id = %(batch_id)s AND b.state = 'intent'\n    RETURNING b.id\n),\n"
                "items_read AS MATERIALIZED (\n    UPDATE message_batch_items i SET result = 'lost'",
                "    FROM lease\n    WHERE b.id = %(batch_id)s AND b.state = 'intent'\n    RETURNING b.id\n),\n"
                "items_read AS MATERIALIZED (\n    UPDATE message_batch_items i SET result = 'lost'"),),
        tests=("tests/integration/test_batch_money.py",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    Mutant(
        name="batch-reconcile-adopts-any-size",
        invariant="a lost create is reconciled only to a batch of its own size: never another's, never a stray",
        tier="integration",
        file="worker/batch/reconciler.py",
        edits=(("\n                        and b.counts.total == intent.request_count]", "]"),),
        tests=("tests/integration/test_batch_lane.py::"
               "test_a_lost_intents_late_batch_is_a_stray_never_the_next_intents_batch_of_another_size",
               "tests/model/test_batch_lane_model_pg.py"),
    ),
    # drafts (migration 020): written only while the job runs under its
    # worker, and gone with the job's end
    Mutant(
        name="draft-after-the-end",
        invariant="no draft is written for a job that is no longer running: a cancel stops its draft at once",
        tier="integration",
        file="sql/worker.sql",
        edits=(("    WHERE j.id = ANY (ARRAY(SELECT job_id FROM piece)) AND j.status = 'running' "
                "AND j.worker_id = %(worker_id)s\n",
                "    WHERE j.id = ANY (ARRAY(SELECT job_id FROM piece)) AND j.worker_id = %(worker_id)s\n"),),
        tests=("tests/integration/test_drafts.py",),
    ),
    Mutant(
        name="draft-by-another-worker",
        invariant="a job's draft is written by the worker that holds the job alone",
        tier="integration",
        file="sql/worker.sql",
        edits=(("    WHERE j.id = ANY (ARRAY(SELECT job_id FROM piece)) AND j.status = 'running' "
                "AND j.worker_id = %(worker_id)s\n",
                "    WHERE j.id = ANY (ARRAY(SELECT job_id FROM piece)) AND j.status = 'running'\n"),),
        tests=("tests/integration/test_drafts.py",),
    ),
    Mutant(
        name="draft-write-without-the-row-lock",
        invariant="no draft outlives its job: an end that meets a draft write waits for it and deletes what it wrote",
        tier="integration",
        file="sql/worker.sql",
        edits=(("    ORDER BY j.id\n    FOR SHARE\n),\nheld AS MATERIALIZED", "    ORDER BY j.id\n),\nheld AS MATERIALIZED"),),
        tests=("tests/integration/test_drafts.py",),
    ),
    Mutant(
        name="end-keeps-the-draft",
        invariant="a job's draft is deleted in the statement that ends the job, whatever ends it",
        tier="integration",
        file="sql/033_every_end_locked_first.sql",
        edits=(("    DELETE FROM story_draft_chunks c WHERE c.job_id = ANY (ARRAY(SELECT (x).id FROM unnest(done) x));\n",
                ""),),
        tests=("tests/integration/test_drafts.py",),
    ),
    Mutant(
        name="draft-continued-with-a-hole",
        invariant="a draft is appended only where it ends: a piece sent again, or after the table was emptied, "
                  "changes nothing",
        tier="integration",
        file="sql/worker.sql",
        edits=(("    WHERE p.text <> '' AND p.from_char = h.chars\n", "    WHERE p.text <> ''\n"),),
        tests=("tests/integration/test_drafts.py",),
    ),
    # what one ledger row counts for, written once (migration 027) for the
    # rollup and the overview alike: the rollup-against-overview checks
    # cannot see a change to both, so each count is checked against the table
    Mutant(
        name="unbilled-tokens-counted",
        invariant="the console's tokens are the billed requests' only",
        tier="integration",
        file="sql/027_one_tally.sql",
        edits=(("       CASE WHEN l.billed THEN l.input_tokens END AS billed_input_tokens,\n",
                "       l.input_tokens AS billed_input_tokens,\n"),),
        tests=("tests/integration/test_ops_api.py::test_the_overview_agrees_with_the_database",),
    ),
    Mutant(
        name="open-request-spent",
        invariant="a request still open has spent nothing yet: its job's reservation holds its worst case",
        tier="integration",
        file="sql/027_one_tally.sql",
        edits=(("       CASE WHEN l.outcome <> 'started'\n", "       CASE WHEN true\n"),),
        tests=("tests/integration/test_ops_api.py::test_the_overview_agrees_with_the_database",),
    ),
    Mutant(
        name="undelivered-without-a-billed-request",
        invariant="a failed job is a story paid for and not delivered only when a request of it was billed",
        tier="integration",
        file="sql/027_one_tally.sql",
        edits=(("       count(*) FILTER (WHERE c.billed) AS billed_calls\n", "       count(*) AS billed_calls\n"),),
        tests=("tests/integration/test_ops_api.py::test_the_overview_agrees_with_the_database",),
    ),
    Mutant(
        name="late-ledger-change-forgotten",
        invariant="a request that changes after its job ended (a batch's result read after a cancel) reaches the "
                  "history and the overview's spend at the next pass",
        tier="integration",
        file="sql/028_late_ledger_changes.sql",
        edits=(("      AND j.status IN ('completed', 'failed') AND j.completed_at < now()\n",
                "      AND j.status IN ('completed', 'failed') AND j.completed_at < now() AND false\n"),),
        tests=("tests/integration/test_history.py::"
               "test_a_call_that_ends_after_its_job_was_counted_ended_is_recounted_by_the_next_pass",),
    ),
    Mutant(
        name="late-ledger-mark-left",
        invariant="a marked minute is recounted by one pass, which takes its mark away",
        tier="integration",
        file="sql/sweeper.sql",
        edits=(("    DELETE FROM minute_rollup_stale s RETURNING s.minute\n",
                "    SELECT s.minute FROM minute_rollup_stale s\n"),),
        tests=("tests/integration/test_history.py::"
               "test_a_call_that_ends_after_its_job_was_counted_ended_is_recounted_by_the_next_pass",),
    ),
    # the stories' partitions (migration 029, sweeper/partitions.py): a
    # partition is dropped only when no story can be in it or come to it
    Mutant(
        name="story-partition-dropped-with-its-jobs",
        invariant="a range of stories is dropped only once every job of its range is pruned",
        tier="integration",
        file="sql/sweeper.sql",
        edits=(("  AND NOT EXISTS (SELECT 1 FROM story_jobs j WHERE j.id >= r.lo AND j.id < r.hi)\n", ""),),
        tests=("tests/integration/test_story_partitions.py::test_a_range_is_dropped_once_its_every_job_is_pruned_and_not_before",),
    ),
    Mutant(
        name="story-partition-dropped-under-an-admission",
        invariant="a range of stories is kept while an admission could still take an id in it",
        tier="integration",
        file="sql/sweeper.sql",
        edits=(("j.id >= r.hi AND j.created_at < now() - interval '5 minutes')",
                "j.id >= r.hi)"),),
        tests=("tests/integration/test_story_partitions.py::test_an_empty_range_is_kept_while_an_admission_could_still_take_an_id_there",),
    ),
    Mutant(
        name="stories-ahead-replaced-holding-stories",
        invariant="stories_ahead is replaced only while empty: a story past the ranges is never lost",
        tier="integration",
        file="sql/029_story_partitions.sql",
        edits=(("        IF ahead_rows THEN\n", "        IF ahead_rows AND false THEN\n"),),
        tests=("tests/integration/test_story_partitions.py::test_stories_past_the_ranges_make_stories_ahead_a_range_and_ranges_follow_it",),
    ),
    Mutant(
        name="unranged-stories-left-by-the-prune",
        invariant="a story no partition drop takes is deleted with its job",
        tier="integration",
        file="sql/sweeper.sql",
        edits=(("    DELETE FROM stories_unranged s USING", "    DELETE FROM stories_ahead s USING"),),
        tests=("tests/integration/test_story_partitions.py::test_the_prune_deletes_the_old_tables_stories_row_by_row",),
    ),
    Mutant(
        name="ledger-pruned-under-its-job",
        invariant="a ledger row outlives its job: a job's charge is read from its rows",
        tier="integration",
        file="sql/sweeper.sql",
        edits=(("    WHERE NOT EXISTS (SELECT 1 FROM story_jobs j WHERE j.id = c.job_id)\n    LIMIT", "    LIMIT"),),
        tests=("tests/integration/test_sweeper.py::"
               "test_the_ledger_is_kept_unless_its_own_retention_is_set_then_only_rows_of_gone_jobs_go",),
    ),
    Mutant(
        name="ledger-pruned-of-a-batch-request",
        invariant="a batch request's ledger row is kept with its batch, whose cost the console reads from it",
        tier="integration",
        file="sql/sweeper.sql",
        edits=(("          WHERE l.batch_id IS NULL\n            AND l.started_at >=", "          WHERE l.started_at >="),),
        tests=("tests/integration/test_sweeper.py::"
               "test_the_ledger_is_kept_unless_its_own_retention_is_set_then_only_rows_of_gone_jobs_go",),
    ),
)
