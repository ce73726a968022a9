"""An end the database refuses in every form waits 2 ** refusals seconds
(at most _END_RETRY_MAX_S) before it is asked again (worker.ends): soon
enough that a database that takes it again finds it written within seconds,
never a busy loop. On a recording store; the clock is the test's."""

from __future__ import annotations

import asyncio

import psycopg
from structlog.testing import capture_logs

from shared.config import WorkerSettings
from tests.fakes.recording_worker_store import RecordingStore
from worker.coordinator import Coordinator
from worker.ends import _END_RETRY_MAX_S, REFUSALS_GIVEN_UP
from worker.offline import OfflineWriter


async def _a_story_the_database_refuses(refusals: int) -> tuple[RecordingStore, Coordinator, list[float]]:
    """A worker whose one story is written, with its next ``refusals`` settles
    and failures refused for their data; the clock is the list's one value."""
    store, now = RecordingStore(), [1000.0]
    worker = Coordinator(WorkerSettings(worker_concurrency=1, metrics_port=0), store, OfflineWriter(0),
                         listen=False, clock=lambda: now[0])
    store.add_pending(1)
    await worker.round_once()
    for _ in range(10):
        await asyncio.sleep(0)  # the story is written
    for _ in range(refusals):
        store.fail_next("settle", psycopg.errors.DataError("refused"))
        store.fail_next("fail_running", psycopg.errors.DataError("refused"))
    return store, worker, now


async def test_a_refused_end_is_asked_again_exactly_when_its_backoff_ends() -> None:
    """After its third refusal a failure waits 2 ** 3 = 8 s: not asked again half a second before, asked at 8 s."""
    store, worker, now = await _a_story_the_database_refuses(6)
    for _ in range(10):
        if worker.held and next(iter(worker.held)).refusals >= 3:
            break
        now[0] += _END_RETRY_MAX_S  # past any backoff: this round asks, and is refused
        await worker.round_once()
    (held,) = worker.held
    assert held.refusals == 3
    asked = len(store.named("fail_running"))
    now[0] += 2 ** 3 - 0.5
    await worker.round_once()
    assert len(store.named("fail_running")) == asked
    now[0] += 0.5
    await worker.round_once()
    assert len(store.named("fail_running")) == asked + 1


async def test_an_end_refused_in_every_form_is_logged_once_however_often_it_is_refused_again() -> None:
    """job.end_refused is logged when the end has been refused in every form, once: the refusals after it,
    each retried on its backoff, add nothing to the log."""
    _, worker, now = await _a_story_the_database_refuses(10)
    with capture_logs() as logs:
        for _ in range(8):
            now[0] += _END_RETRY_MAX_S  # past any backoff: each round asks, and is refused
            await worker.round_once()
    (held,) = worker.held
    assert held.refusals > REFUSALS_GIVEN_UP + 1
    assert [e["event"] for e in logs].count("job.end_refused") == 1
