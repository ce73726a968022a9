"""The sweeper's pass, on a recording store: what it does with the stale jobs
found, when it judges running jobs, how it batches and prunes, and what a
lock timeout or a lost connection does to the next pass. No database and no
waiting: the clock is the test's."""

from __future__ import annotations

import asyncio
import math
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from shared.config import SweeperSettings
from shared.rows import SnapshotAges
from shared.status import ErrorCode
from sweeper.__main__ import run
from sweeper.rows import PrunedJob, QueueGauges
from sweeper.sweep import PRUNE_BATCHES_PER_PASS, Sweeper
from tests.fakes.recording_sweeper_store import (
    LEDGER_STARTED_AT,
    SERVER_STARTED_AT,
    RecordingSweeperStore,
    stale,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(**overrides: Any) -> SweeperSettings:
    return SweeperSettings(**{"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 60.0, "job_timeout_s": 480.0,
                              "pending_timeout_s": 1800.0, "sweeper_batch_size": 100, "metrics_port": 0,
                              **overrides})


def reclaimed_total(reason: ErrorCode) -> float:
    return REGISTRY.get_sample_value("storyjobs_sweeper_reclaimed_total", {"reason": reason}) or 0.0


async def judging_sweeper(store: RecordingSweeperStore, **overrides: Any) -> Sweeper:
    """A sweeper that has seen the database writable for a whole heartbeat timeout."""
    clock = FakeClock()
    sweeper = Sweeper(settings(**overrides), store, clock=clock)
    await sweeper.probe()
    clock.now += sweeper.settings.heartbeat_timeout_s
    return sweeper


async def test_stale_jobs_found_are_counted_by_reason_metered_and_logged() -> None:
    """Each stale job the store fails counts under its reason, in the result, the metric and a log event."""
    store = RecordingSweeperStore()
    jobs = [stale(ErrorCode.INTERRUPTED), stale(ErrorCode.TIMED_OUT), stale(ErrorCode.QUEUE_TIMEOUT, None),
            stale(ErrorCode.INTERRUPTED, "w-2")]
    store.stale_batches = [jobs]
    sweeper = await judging_sweeper(store)
    before = {reason: reclaimed_total(reason) for reason in ErrorCode}
    with capture_logs() as logs:
        result = await sweeper.sweep_once()
    assert (result.interrupted, result.timed_out, result.queue_timeout) == (2, 1, 1)
    assert result.reclaimed == 4 and result.judged_running
    assert reclaimed_total(ErrorCode.INTERRUPTED) - before[ErrorCode.INTERRUPTED] == 2
    assert reclaimed_total(ErrorCode.QUEUE_TIMEOUT) - before[ErrorCode.QUEUE_TIMEOUT] == 1
    events = [(e["job_id"], e["reason"], e["worker_id"]) for e in logs if e["event"] == "sweeper.reclaimed"]
    assert events == [(str(job.public_id), job.reason, job.worker_id) for job in jobs]
    assert [e for e in logs if e["event"] == "sweeper.pass"][0]["reclaimed"] == 4


async def test_running_jobs_are_judged_only_after_a_whole_heartbeat_timeout_writable() -> None:
    """Until the database has been seen writable for HEARTBEAT_TIMEOUT_S, a pass applies the pending rule only."""
    store = RecordingSweeperStore()
    clock = FakeClock()
    sweeper = Sweeper(settings(), store, clock=clock)
    assert not (await sweeper.sweep_once()).judged_running
    clock.now += 59.0
    assert not (await sweeper.sweep_once()).judged_running
    clock.now += 1.0
    assert (await sweeper.sweep_once()).judged_running
    assert [call["judge_running"] for call in store.named("fail_stale")] == [False, False, True]


async def test_a_pass_that_may_not_judge_running_jobs_reclaims_only_the_pending_ones() -> None:
    """Before the wait is over, a heartbeat older than the timeout is no proof of death: only queue timeouts."""
    store = RecordingSweeperStore()
    store.stale_batches = [[stale(ErrorCode.INTERRUPTED), stale(ErrorCode.QUEUE_TIMEOUT, None)]]
    result = await Sweeper(settings(), store, clock=FakeClock()).sweep_once()
    assert (result.interrupted, result.queue_timeout, result.judged_running) == (0, 1, False)


async def test_every_statement_waits_for_a_lock_at_most_one_heartbeat_interval() -> None:
    """The probe and each batch take the lock a heartbeat takes, under a lock timeout of HEARTBEAT_INTERVAL_S."""
    store = RecordingSweeperStore()
    sweeper = Sweeper(settings(heartbeat_interval_s=2.5), store, clock=FakeClock())
    await sweeper.probe()
    await sweeper.sweep_once()
    assert [call["lock_timeout_s"] for call in store.named("probe") + store.named("fail_stale")] == [2.5, 2.5, 2.5]


async def test_a_lock_timeout_fails_the_pass_and_starts_the_wait_again() -> None:
    """A probe that times out on a lock raises out of the pass; once the loop reports it, running jobs wait again."""
    store = RecordingSweeperStore()
    sweeper = await judging_sweeper(store)
    store.fail_next("probe", psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"))
    with pytest.raises(psycopg.errors.LockNotAvailable):
        await sweeper.sweep_once()
    assert store.named("fail_stale") == []
    sweeper.connection_lost()
    assert not (await sweeper.sweep_once()).judged_running


async def test_the_loop_treats_a_database_error_in_a_pass_as_an_outage() -> None:
    """A pass that loses its connection is logged once, and the next pass does not judge running jobs."""
    store = RecordingSweeperStore()
    sweeper = await judging_sweeper(store)
    assert sweeper.running_jobs_judgeable()
    store.fail_next("fail_stale", psycopg.OperationalError("server closed the connection unexpectedly"))
    stop = asyncio.Event()
    with capture_logs() as logs:
        loop = asyncio.create_task(run(sweeper, stop))
        async with asyncio.timeout(10):
            while not store.named("fail_stale"):
                await asyncio.sleep(0)
        stop.set()
        await loop
    assert [e["event"] for e in logs if e["event"].startswith("sweeper.database")] == ["sweeper.database_error"]
    assert not sweeper.running_jobs_judgeable()
    assert REGISTRY.get_sample_value("storyjobs_sweeper_heartbeat_checks_enabled") == 0


async def test_a_restarted_server_starts_the_wait_again() -> None:
    """A new server start time means heartbeats may have been lost: running jobs wait a heartbeat timeout again."""
    store = RecordingSweeperStore()
    sweeper = await judging_sweeper(store)
    assert (await sweeper.sweep_once()).judged_running
    store.server_started_at = SERVER_STARTED_AT.replace(hour=1)
    with capture_logs() as logs:
        assert not (await sweeper.sweep_once()).judged_running
    assert "sweeper.server_restarted" in [e["event"] for e in logs]


async def test_full_batches_are_swept_again_until_one_comes_back_short() -> None:
    """A batch of SWEEPER_BATCH_SIZE may have left more behind: the pass asks again until a batch is short."""
    store = RecordingSweeperStore()
    store.stale_batches = [[stale(ErrorCode.QUEUE_TIMEOUT)] * 2, [stale(ErrorCode.QUEUE_TIMEOUT)] * 2,
                           [stale(ErrorCode.QUEUE_TIMEOUT)]]
    result = await Sweeper(settings(sweeper_batch_size=2), store, clock=FakeClock()).sweep_once()
    assert len(store.named("fail_stale")) == 3 and result.queue_timeout == 5


async def test_pruning_stops_when_nothing_is_left_or_after_ten_batches() -> None:
    """Prune batches run until one deletes nothing, and never more than ten in one pass, so a pass stays short."""
    store = RecordingSweeperStore()
    store.prune_counts = [3, 3, 0, 3]
    sweeper = Sweeper(settings(), store, clock=FakeClock())
    assert (await sweeper.sweep_once()).pruned == 6
    assert len(store.named("prune_finished")) == 3
    store.prune_counts = [7] * 12
    store.calls.clear()
    assert (await sweeper.sweep_once()).pruned == 70
    assert len(store.named("prune_finished")) == 10


async def test_a_pass_reads_where_the_prune_ends_once_and_gives_it_to_each_batch() -> None:
    """The prune's walk ends where prune_below_id said at the pass's start, for every batch of the pass."""
    store = RecordingSweeperStore()
    store.prune_counts = [5, 5, 0]
    store.prune_below = 4_321
    await Sweeper(settings(), store, clock=FakeClock()).sweep_once()
    assert len(store.named("prune_below_id")) == 1
    assert [call["below_id"] for call in store.named("prune_finished")] == [4_321] * 3


async def test_each_batch_of_a_pass_walks_on_from_the_last_job_the_batch_before_deleted() -> None:
    """The first batch of a pass walks from the start, each next one from the highest id its predecessor
    deleted, in whatever order the statement returned them; the next pass starts again from the start."""
    store = RecordingSweeperStore()
    store.prune_batches = [[PrunedJob(id=7), PrunedJob(id=12), PrunedJob(id=9)], [PrunedJob(id=30)], []]
    sweeper = Sweeper(settings(), store, clock=FakeClock())
    await sweeper.sweep_once()
    assert [call["after_id"] for call in store.named("prune_finished")] == [0, 12, 30]
    store.calls.clear()
    await sweeper.sweep_once()
    assert [call["after_id"] for call in store.named("prune_finished")] == [0]


async def test_a_pass_raises_the_claims_floor_once_after_its_rules_within_its_lock_timeout() -> None:
    """After the rules, which may fail the pending job the floor would stop at; waiting for the admission
    lock no longer than the pass's other statements wait for theirs."""
    store = RecordingSweeperStore()
    store.stale_batches = [[stale(ErrorCode.QUEUE_TIMEOUT)]]
    sweeper = Sweeper(settings(), store, clock=FakeClock())
    await sweeper.sweep_once()
    names = [name for name, _ in store.calls]
    assert names.count("advance_claim_floor") == 1
    assert names.index("advance_claim_floor") > max(i for i, name in enumerate(names) if name == "fail_stale")
    (call,) = store.named("advance_claim_floor")
    assert call["lock_timeout_s"] == store.named("fail_stale")[0]["lock_timeout_s"]


async def test_between_passes_the_loop_raises_the_claims_floor_after_each_probe() -> None:
    """A held snapshot makes each claim walk every job claimed since the floor last rose: between passes, at the
    heartbeat interval, the loop raises it too, after the probe that finds the database writable."""
    store = RecordingSweeperStore()
    sweeper = Sweeper(settings(heartbeat_interval_s=0.01, sweeper_interval_s=3600.0), store, clock=FakeClock())
    stop = asyncio.Event()
    loop = asyncio.create_task(run(sweeper, stop))
    async with asyncio.timeout(10):
        while len(store.named("probe")) < 4:
            await asyncio.sleep(0.005)
    stop.set()
    await loop
    names = [name for name, _ in store.calls if name in ("probe", "advance_claim_floor", "fail_stale")]
    after_the_pass = names[names.index("advance_claim_floor") + 1:]
    assert "fail_stale" not in after_the_pass
    assert after_the_pass[:6] == ["probe", "advance_claim_floor"] * 3
    assert {call["lock_timeout_s"] for call in store.named("advance_claim_floor")} == {0.01}


async def test_between_passes_an_advance_that_waited_too_long_for_its_lock_is_no_outage() -> None:
    """The admission lock not had in time is logged once for the run of misses, and the probes that found the
    database writable still count: no database error, and the heartbeat checks stay on. The first advance that
    gets it says so."""
    store = RecordingSweeperStore()
    store.claim_floor = None
    clock = FakeClock()
    sweeper = Sweeper(settings(heartbeat_interval_s=0.01, sweeper_interval_s=3600.0), store, clock=clock)
    stop = asyncio.Event()
    with capture_logs() as logs:
        loop = asyncio.create_task(run(sweeper, stop))
        async with asyncio.timeout(10):
            while len(store.named("advance_claim_floor")) < 3:
                await asyncio.sleep(0.005)
        clock.now += sweeper.settings.heartbeat_timeout_s
        assert sweeper.running_jobs_judgeable()
        stop.set()
        await loop
    # one warning for the run of misses, as an outage is logged once
    events = [e["event"] for e in logs if e["log_level"] in ("warning", "error")]
    assert events == ["sweeper.claim_floor_lock_waited"]
    store.claim_floor = 5.0
    with capture_logs() as logs:
        await sweeper.advance_claim_floor()
        await sweeper.advance_claim_floor()
    assert [(e["event"], e["after_misses"]) for e in logs] == [
        ("sweeper.claim_floor_advanced", len(store.named("advance_claim_floor")) - 2)]


async def test_the_ledgers_prune_runs_only_when_its_retention_is_set_in_batches_until_one_is_short() -> None:
    """Unset, a pass never deletes from the ledger. Set, it deletes batch after batch while they come full, at
    most PRUNE_BATCHES_PER_PASS, and reports and counts what they deleted."""
    store = RecordingSweeperStore()
    await Sweeper(settings(), store, clock=FakeClock()).sweep_once()
    assert store.named("prune_ledger") == []
    store.ledger_batches = [100, 100, 99, 100]
    before = REGISTRY.get_sample_value("storyjobs_sweeper_ledger_pruned_total") or 0.0
    result = await Sweeper(settings(ledger_retention_s=40 * 86400.0), store, clock=FakeClock()).sweep_once()
    assert result.ledger_pruned == 299
    assert REGISTRY.get_sample_value("storyjobs_sweeper_ledger_pruned_total") == before + 299
    assert [call["retention_s"] for call in store.named("prune_ledger")] == [40 * 86400.0] * 3
    assert {call["batch_size"] for call in store.named("prune_ledger")} == {100}
    store.ledger_batches = [100] * 20
    endless = await Sweeper(settings(ledger_retention_s=40 * 86400.0), store, clock=FakeClock()).sweep_once()
    assert endless.ledger_pruned == 100 * PRUNE_BATCHES_PER_PASS


async def test_each_ledger_batch_of_a_pass_walks_on_from_the_latest_start_the_batch_before_deleted() -> None:
    """The pass's first ledger batch walks from the oldest call, each next one from the latest start its
    predecessor deleted; the next pass starts again from the oldest."""
    store = RecordingSweeperStore()
    store.ledger_batches = [100, 100, 7]
    sweeper = Sweeper(settings(ledger_retention_s=40 * 86400.0), store, clock=FakeClock())
    await sweeper.sweep_once()
    minute = timedelta(minutes=1)
    assert [call["after"] for call in store.named("prune_ledger")] == [
        None, LEDGER_STARTED_AT + minute, LEDGER_STARTED_AT + 2 * minute]
    store.calls.clear()
    await sweeper.sweep_once()
    assert [call["after"] for call in store.named("prune_ledger")] == [None]


async def test_the_queue_read_by_a_pass_is_its_result_and_the_rollups_depth() -> None:
    """The pass reports the queue it read, and records that depth in the console's history."""
    store = RecordingSweeperStore()
    store.gauges = QueueGauges(pending=7, running=3, oldest_pending_age_seconds=12.5)
    result = await Sweeper(settings(), store, clock=FakeClock()).sweep_once()
    assert (result.pending, result.running, result.oldest_pending_age_seconds) == (7, 3, 12.5)
    assert store.named("record_minutes") == [{"pending": 7, "running": 3}]
    assert REGISTRY.get_sample_value("storyjobs_jobs", {"status": "pending"}) == 7


async def test_snapshot_ages_are_exported_and_unknown_ones_are_nan() -> None:
    """A pass exports the oldest transaction's and snapshot's ages and the slots' xmin age; when the role cannot
    see other sessions the ages are NaN, not a reassuring 0."""
    store = RecordingSweeperStore()
    store.snapshots = SnapshotAges(known=True, oldest_transaction_age_s=42.0, oldest_snapshot_age_s=40.5,
                                   replication_slot_xmin_age=1234)
    sweeper = Sweeper(settings(), store, clock=FakeClock())
    await sweeper.sweep_once()
    assert REGISTRY.get_sample_value("storyjobs_database_oldest_transaction_age_seconds") == 42.0
    assert REGISTRY.get_sample_value("storyjobs_database_oldest_snapshot_age_seconds") == 40.5
    assert REGISTRY.get_sample_value("storyjobs_database_replication_slot_xmin_age_transactions") == 1234
    assert REGISTRY.get_sample_value("storyjobs_database_snapshot_ages_known") == 1
    store.snapshots = SnapshotAges(known=False, oldest_transaction_age_s=3.0, oldest_snapshot_age_s=3.0,
                                   replication_slot_xmin_age=None)
    await sweeper.sweep_once()
    assert math.isnan(REGISTRY.get_sample_value("storyjobs_database_oldest_snapshot_age_seconds") or 0.0)
    assert math.isnan(REGISTRY.get_sample_value("storyjobs_database_oldest_transaction_age_seconds") or 0.0)
    assert REGISTRY.get_sample_value("storyjobs_database_snapshot_ages_known") == 0
