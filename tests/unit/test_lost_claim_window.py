"""How long a worker searches for the claims of a claim statement whose
answer it lost: until that statement's timeout has passed on the server, and
a margin for the clocks, since until then it may still commit. On a
recording store; the clock is the test's."""

from __future__ import annotations

import psycopg

from shared.config import WorkerSettings
from tests.fakes.recording_worker_store import RecordingStore
from worker.claimer import STATEMENT_TIMEOUT_S
from worker.coordinator import Coordinator
from worker.offline import OfflineWriter


async def test_a_lost_claim_that_commits_just_before_its_statement_timeout_is_still_adopted() -> None:
    """A claim statement whose answer was lost commits one second before its statement timeout would have
    ended it: the worker is still searching then, adopts its job, and runs it once."""
    store, now = RecordingStore(), [1000.0]
    settings = WorkerSettings(worker_concurrency=2, metrics_port=0)
    worker = Coordinator(settings, store, OfflineWriter(0), listen=False, clock=lambda: now[0])
    store.fail_next("claim", psycopg.OperationalError("connection lost"))
    assert (await worker.round_once()).database_error is not None
    # a round a second, each searching and finding nothing yet
    for _ in range(int(STATEMENT_TIMEOUT_S) - 2):
        now[0] += 1.0
        assert (await worker.round_once()).adopted == 0
    searches = len(store.named("claims_of_lost_answer"))
    (job_id,) = store.add_pending(1)
    store.claim_lost(job_id)
    now[0] += 1.0
    assert (await worker.round_once()).adopted == 1
    assert len(store.named("claims_of_lost_answer")) == searches + 1
