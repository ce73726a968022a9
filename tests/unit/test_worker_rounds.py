"""The worker's coordinator, one round at a time, on a recording store: claim
limits, the fallback poll, shutdown and its grace, adoption after a lost
answer, database errors of every kind, and text the database cannot store.
No database and no waiting: the clock is the test's."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import psycopg
import psycopg_pool
import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from shared.config import WorkerSettings
from shared.ratelimit import LimiterState
from shared.status import ErrorCode, JobStatus, LlmOutcome
from shared.story_request import StoryRequest
from tests.fakes.recording_worker_store import RecordingStore
from worker.backoff import MAX_S as BACKOFF_MAX_S
from worker.coordinator import SHUTDOWN_FLUSH_S, Coordinator, WorkerCrashed
from worker.helpers import start_helper
from worker.rows import Draft
from worker.writing import FREE, JobCall


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class GatedWriter:
    """Writes each story when the test opens its gate; ``retry_first`` makes
    every call ask for a retry (as after a 429) before it sends."""

    provider = "gated"
    model = "gated-model"
    price = FREE

    def __init__(self, *, open_all: bool = False, retry_first: bool = False, text: str = "Once upon a time.") -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.sent: list[str] = []
        self.open_all = open_all
        self.retry_first = retry_first
        self.text = text

    def gate(self, job_id: int) -> asyncio.Event:
        return self.gates.setdefault(f"story {job_id}", asyncio.Event())

    async def write(self, request: StoryRequest, call: JobCall) -> Draft:
        if self.retry_first:
            call.sending()
            call.refused(LlmOutcome.RATE_LIMITED)
            await call.retry(LlmOutcome.RATE_LIMITED, "429 rate limited")
        call.sending()
        self.sent.append(request.prompt)
        call.accepted()
        gate = self.gates.setdefault(request.prompt, asyncio.Event())
        if not self.open_all:
            await gate.wait()
        call.finished(3, 7)
        return Draft(title=f"Title\x00 of {request.prompt}", body=self.text, model="m\ud800",
                     prompt_version="v1", input_tokens=3, output_tokens=7, cost_usd=Decimal("0.001"))

    async def aclose(self) -> None:
        return None


def _settings(**overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {"worker_concurrency": 2, "worker_poll_interval_s": 5.0, "heartbeat_interval_s": 1.0,
                              "heartbeat_timeout_s": 3.0, "worker_shutdown_grace_s": 30.0, "metrics_port": 0,
                              **overrides}
    return WorkerSettings(**values)


def _worker(store: RecordingStore, writer: GatedWriter, clock: FakeClock, **settings: Any) -> Coordinator:
    return Coordinator(_settings(**settings), store, writer, listen=False, clock=clock)


async def _no_wait(_: float) -> None:
    """The heartbeat's interval and the backoffs, passed without waiting."""
    await asyncio.sleep(0)


async def _let_tasks_run() -> None:
    """Lets the job tasks take every step they can without waiting on anything."""
    for _ in range(10):
        await asyncio.sleep(0)


def _read_only() -> psycopg.Error:
    return psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction")


async def test_a_round_claims_only_as_many_jobs_as_there_are_free_slots() -> None:
    """With 2 slots and 5 pending jobs, a round claims 2; the next round claims nothing while both run."""
    store, clock = RecordingStore(), FakeClock()
    store.add_pending(5)
    worker = _worker(store, GatedWriter(), clock)
    assert (await worker.round_once()).claimed == 2
    await _let_tasks_run()
    second = await worker.round_once()
    assert second.claimed == 0 and second.wait_s > 0
    assert store.named("claim") == [2]
    assert sorted(worker.held_job_ids) == [1, 2]


async def test_a_written_story_frees_its_slot_for_the_claim_of_the_same_round() -> None:
    """A round that settles one story claims one more job right after it, in the same transaction."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.add_pending(3)
    worker = _worker(store, writer, clock)
    await worker.round_once()
    writer.gate(1).set()
    await _let_tasks_run()
    result = await worker.round_once()
    assert (result.completed, result.claimed) == (1, 1)
    assert [c.job_id for c in store.named("settle")[-1]] == [1] and store.named("claim")[-1] == 1
    assert [name for name, _ in store.calls][-2:] == ["settle", "claim"]
    assert store.statuses() == {1: JobStatus.COMPLETED, 2: JobStatus.RUNNING, 3: JobStatus.RUNNING}


async def test_an_empty_claim_waits_for_a_notify_or_the_poll() -> None:
    """A claim that finds fewer jobs than slots stops claiming; the fallback poll (by the clock)
    claims again, and a NOTIFY makes the next round claim at once."""
    store, clock = RecordingStore(), FakeClock()
    worker = _worker(store, GatedWriter(), clock, worker_poll_interval_s=5.0)
    assert (await worker.round_once()).claimed == 0
    store.add_pending(1)
    idle = await worker.round_once()
    assert idle.claimed == 0 and idle.wait_s == pytest.approx(5.0)
    clock.now += 5.0
    assert (await worker.round_once()).claimed == 1
    store.add_pending(1)
    worker.notified()
    assert (await worker.round_once()).claimed == 1
    assert len(store.named("claim")) == 3


async def test_busy_settling_rounds_do_not_push_the_poll_back() -> None:
    """While rounds keep settling stories (and claim nothing, no work being announced), the fallback
    poll still comes due: the round after the poll interval claims the job nobody announced."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.add_pending(2)
    worker = _worker(store, writer, clock, worker_concurrency=3, worker_poll_interval_s=5.0)
    await worker.round_once()  # claims 2 of 3 slots: no more work is expected
    unannounced = store.add_pending(1)[0]
    for job_id in (1, 2):
        clock.now += 3.0
        writer.gate(job_id).set()
        await _let_tasks_run()
        await worker.round_once()
    assert store.jobs[unannounced].status is JobStatus.RUNNING
    # the round that settled story 1 before the poll was due claimed nothing
    assert store.named("claim") == [3, 3] and len(store.named("settle")) == 2


async def test_the_claims_of_a_lost_answer_are_adopted_and_run() -> None:
    """A claim that committed but whose answer was lost is adopted at the next round, and its job runs
    with its first (never sent) request."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter(open_all=True)
    store.add_pending(1)
    store.fail_next("claim", psycopg.OperationalError("connection lost"), after_effect=True)
    worker = _worker(store, writer, clock)
    lost = await worker.round_once()
    assert lost.database_error is not None and lost.claimed == 0
    adopted = await worker.round_once()
    assert adopted.adopted == 1
    await _let_tasks_run()
    assert (await worker.round_once()).completed == 1
    assert writer.sent == ["story 1"] and store.ledger == {(1, 1): LlmOutcome.SUCCEEDED}


async def test_a_stopping_worker_adopts_the_claims_of_a_lost_answer_before_it_exits() -> None:
    """Stopped right after a claim's answer was lost, the worker still adopts and finishes that job
    within its grace, then exits clean: it is not left to the sweeper as billed."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter(open_all=True)
    store.add_pending(1)
    store.fail_next("claim", psycopg.OperationalError("connection lost"), after_effect=True)
    worker = _worker(store, writer, clock)
    await worker.round_once()
    worker.stop()
    assert (await worker.round_once()).adopted == 1
    await _let_tasks_run()
    assert (await worker.round_once()).completed == 1
    done = await worker.round_once()
    assert done.finished and done.clean
    assert store.statuses() == {1: JobStatus.COMPLETED}


async def test_stop_claims_nothing_and_finishes_when_held_jobs_are_written() -> None:
    """After stop() no claim is made; the round after the last story is settled says finished."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.add_pending(3)
    worker = _worker(store, writer, clock, worker_concurrency=1)
    await worker.round_once()
    worker.stop()
    assert not (await worker.round_once()).finished
    writer.gate(1).set()
    await _let_tasks_run()
    settled = await worker.round_once()
    assert settled.completed == 1 and settled.claimed == 0
    assert (await worker.round_once()).finished
    assert store.statuses() == {1: JobStatus.COMPLETED, 2: JobStatus.PENDING, 3: JobStatus.PENDING}


async def test_past_the_grace_period_streams_are_stopped_and_their_jobs_failed_as_interrupted() -> None:
    """A held job still writing when the grace ends has its stream stopped and is failed as
    interrupted, with its call recorded as stopped (billed); then the worker finishes clean."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.add_pending(1)
    worker = _worker(store, writer, clock, worker_shutdown_grace_s=30.0)
    await worker.round_once()
    await _let_tasks_run()
    worker.stop()
    waiting = await worker.round_once()
    assert 0 < waiting.wait_s <= 30.0
    clock.now += 30.0
    await worker.round_once()
    await _let_tasks_run()
    failed = await worker.round_once()
    assert failed.failed == 1
    (failure,) = store.named("fail_running")[0]
    assert (failure.error_code, failure.call_outcome, failure.billed) == (
        ErrorCode.INTERRUPTED, LlmOutcome.STOPPED, True)
    assert (await worker.round_once()).finished


async def test_shutdown_gives_up_when_the_database_stays_away_past_grace_and_flush() -> None:
    """A written story that cannot be settled is given up SHUTDOWN_FLUSH_S after the grace: the run
    ends unclean (the sweeper takes over)."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter(open_all=True)
    store.add_pending(1)
    worker = _worker(store, writer, clock, worker_shutdown_grace_s=1.0)
    await worker.round_once()
    await _let_tasks_run()
    worker.stop()
    for _ in range(3):
        store.fail_next("settle", psycopg.OperationalError("connection refused"))
    assert (await worker.round_once()).database_error is not None
    clock.now += 1.0 + SHUTDOWN_FLUSH_S
    result = await worker.round_once()
    assert result.finished and not result.clean


async def test_every_database_error_is_backed_off_and_logged_once_per_episode() -> None:
    """A read-only database (not a connection error) is survived like an outage: each failed round
    backs off longer, up to a ceiling; one log line with the SQLSTATE when it starts, one when it ends."""
    store, clock = RecordingStore(), FakeClock()
    store.add_pending(1)
    worker = _worker(store, GatedWriter(), clock)
    waits = []
    with capture_logs() as logs:
        for _ in range(6):
            store.fail_next("claim", _read_only())
            result = await worker.round_once()
            assert result.database_error is not None and "25006" in result.database_error
            waits.append(result.wait_s)
        recovered = await worker.round_once()
    assert waits == sorted(waits) and waits[0] < waits[-1] == BACKOFF_MAX_S
    assert recovered.claimed == 1 and recovered.database_error is None
    errors = [e for e in logs if e["event"] == "worker.database_error"]
    assert len(errors) == 1 and errors[0]["sqlstate"] == "25006"
    assert [e["event"] for e in logs].count("worker.database_recovered") == 1


async def test_a_story_the_database_refuses_fails_its_job_and_not_the_others() -> None:
    """When a batch of two stories is refused for its data, they are settled one at a time: the good one
    completes, the refused one fails as internal_error, and the worker goes on."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter(open_all=True)
    store.add_pending(2)
    worker = _worker(store, writer, clock)
    await worker.round_once()
    await _let_tasks_run()
    store.fail_next("settle", psycopg.errors.DataError("invalid byte sequence"))
    assert (await worker.round_once()).database_error is not None
    store.fail_next("settle", psycopg.errors.DataError("invalid byte sequence"))
    refused = await worker.round_once()
    assert refused.unstorable == 1 and refused.database_error is None
    rounds = [await worker.round_once() for _ in range(3)]
    assert sum(r.completed for r in rounds) == 1 and sum(r.failed for r in rounds) == 1
    assert store.jobs[1].error_code is ErrorCode.INTERNAL_ERROR
    assert store.statuses() == {1: JobStatus.FAILED, 2: JobStatus.COMPLETED}
    assert store.ledger[(1, 1)] is LlmOutcome.SUCCEEDED


async def test_a_claim_the_database_refuses_never_fails_a_story_that_was_paid_for() -> None:
    """A claim refused for good in the round that settles a written story is not blamed on the story: the
    claim rolls back, the story sent with it commits alone and its job completes; the
    next round claims."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter(open_all=True)
    store.add_pending(1)
    worker = _worker(store, writer, clock)
    await worker.round_once()
    await _let_tasks_run()
    store.add_pending(1)
    worker.notified()
    store.fail_next("claim", psycopg.errors.CheckViolation("the claim is refused"))
    with capture_logs() as logs:
        refused = await worker.round_once()
    assert refused.database_error is not None and "the claim is refused" in refused.database_error
    assert (refused.completed, refused.unstorable, refused.claimed) == (1, 0, 0)
    assert "job.completion_unstorable" not in [e["event"] for e in logs]
    assert [[c.job_id for c in completions] for completions in store.named("settle")] == [[1]]
    assert (await worker.round_once()).claimed == 1
    assert store.statuses() == {1: JobStatus.COMPLETED, 2: JobStatus.RUNNING}


async def test_provider_text_is_made_storable_before_it_is_settled() -> None:
    """NUL is dropped and an unpaired surrogate replaced in what the provider wrote."""
    store, clock = RecordingStore(), FakeClock()
    store.add_pending(1)
    worker = _worker(store, GatedWriter(open_all=True, text="Once\x00 upon a time \udc80."), clock)
    await worker.round_once()
    await _let_tasks_run()
    await worker.round_once()
    story = store.jobs[1].story
    assert story is not None
    assert (story.title, story.body, story.model) == ("Title of story 1", "Once upon a time \ufffd.", "m\ufffd")


async def test_a_retry_refused_for_a_job_no_longer_ours_sends_nothing() -> None:
    """When the job was cancelled while its call waited to be retried, the retry's ledger row is not
    opened, no request is sent, and the worker lets the job go."""
    store, clock = RecordingStore(), FakeClock()
    store.add_pending(1)
    writer = GatedWriter(retry_first=True, open_all=True)
    worker = _worker(store, writer, clock)
    await worker.round_once()
    store.end_elsewhere(1)
    with capture_logs() as logs:
        await _let_tasks_run()
        assert (await worker.round_once()).let_go == 1
    assert writer.sent == [] and worker.held_job_ids == []
    assert store.ledger == {(1, 1): LlmOutcome.RATE_LIMITED}
    events = [e["event"] for e in logs]
    assert "job.lost_ownership" in events and not {"job.failed", "job.completed"} & set(events)


async def test_a_heartbeat_that_finds_a_job_gone_stops_its_stream_and_records_what_it_cost() -> None:
    """A job failed elsewhere is found by the next heartbeat and reported: the round stops its stream (the
    heartbeat stops nothing itself), its call is closed as stopped (billed), and the job let go without a
    completion."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.add_pending(1)
    worker = _worker(store, writer, clock)
    await worker.round_once()
    await _let_tasks_run()
    store.end_elsewhere(1, ErrorCode.INTERRUPTED)
    assert await worker.heartbeat_once() == [1]
    [held] = worker.held
    assert not held.stop.is_set, "the heartbeat only reports"
    await worker.round_once()
    assert held.stop.reason == "interrupted"
    await _let_tasks_run()
    assert (await worker.round_once()).let_go == 1
    assert store.named("call_finish") == [(1, 1, LlmOutcome.STOPPED, True)]
    assert worker.held_job_ids == [] and store.named("fail_running") == []


async def test_a_helper_task_that_dies_takes_the_worker_down() -> None:
    """A heartbeat that fails with something other than a database error ends run() with WorkerCrashed,
    instead of leaving a worker that claims but cannot heartbeat."""
    store = RecordingStore()
    store.add_pending(1)
    store.fail_next("heartbeat", RuntimeError("a bug"))
    worker = Coordinator(_settings(), store, GatedWriter(), listen=False, clock=FakeClock(), sleep=_no_wait)
    with capture_logs() as logs, pytest.raises(WorkerCrashed):
        await asyncio.wait_for(worker.run(), 10)
    assert [e["task"] for e in logs if e["event"] == "worker.task_crashed"] == ["heartbeat"]


@pytest.mark.parametrize("name", ["deliverer", "batch lane"])
async def test_any_helper_that_dies_crashes_the_worker_as_the_heartbeat_does(name: str) -> None:
    """One policy for every helper (worker/helpers.py): the deliverer or the batch lane dying of a bug
    crashes the worker (WorkerCrashed, no gentle stop), as the heartbeat does; a helper that returned once
    stopped did not die."""
    worker = Coordinator(_settings(), RecordingStore(), GatedWriter(), listen=False, clock=FakeClock(),
                         sleep=_no_wait)

    async def returns() -> None:
        return None

    async def dies() -> None:
        raise RuntimeError("a bug")

    start_helper(returns(), "stopped", worker.inbox)
    start_helper(dies(), name, worker.inbox)
    with capture_logs() as logs, pytest.raises(WorkerCrashed):
        await asyncio.wait_for(worker.run(), 10)
    assert [e["task"] for e in logs if e["event"] == "worker.task_crashed"] == [name]
    assert "worker.stopping" not in [e["event"] for e in logs]


async def test_a_job_found_gone_is_stopped_at_once_also_while_the_round_waits_out_a_database_error() -> None:
    """The round's backoff after a database error writes nothing, but takes the reports as they come: a
    stop the heartbeat reports is not held up by the backoff."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.add_pending(1)
    backoffs: list[float] = []

    async def a_long_backoff(seconds: float) -> None:
        backoffs.append(seconds)
        await asyncio.Event().wait()

    worker = Coordinator(_settings(), store, writer, listen=False, clock=clock, sleep=a_long_backoff)
    assert (await worker.round_once()).claimed == 1
    await _let_tasks_run()
    [held] = worker.held
    clock.now += 60.0
    store.fail_next("claim", psycopg.OperationalError("connection lost"))
    running = asyncio.create_task(worker.run())
    while not any(b > 0 for b in backoffs):
        await asyncio.sleep(0)
    store.end_elsewhere(1)
    assert await worker.heartbeat_once() == [1]
    await _let_tasks_run()
    assert held.stop.is_set and held.task is not None and held.task.done()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


async def test_heartbeat_database_errors_are_survived() -> None:
    """The heartbeat task meets a read-only database, logs it once, and beats again afterwards."""
    store = RecordingStore()
    store.add_pending(1)
    for _ in range(3):
        store.fail_next("heartbeat", _read_only())
    worker = Coordinator(_settings(), store, GatedWriter(), listen=False, clock=FakeClock(), sleep=_no_wait)
    with capture_logs() as logs:
        task = asyncio.create_task(worker.run())
        while len(store.named("heartbeat")) < 5:
            await asyncio.sleep(0)
        worker.stop()
        store.end_elsewhere(1)
        assert await asyncio.wait_for(task, 10)
    errors = [e for e in logs if e["event"] == "worker.database_error"]
    assert [(e["task"], e["sqlstate"]) for e in errors] == [("heartbeat", "25006")]


async def test_a_worker_with_every_slot_busy_waits_for_a_job_to_finish() -> None:
    """With no free slot and the poll overdue, an idle round waits (it does not spin) until a job
    finishing wakes it."""
    store, clock = RecordingStore(), FakeClock()
    store.add_pending(3)
    worker = _worker(store, GatedWriter(), clock, worker_concurrency=2, worker_poll_interval_s=5.0)
    await worker.round_once()
    await _let_tasks_run()
    clock.now += 60.0
    idle = await worker.round_once()
    assert idle.claimed == 0 and idle.wait_s > 0


async def test_a_job_found_gone_before_its_task_ran_is_let_go_and_nothing_is_sent() -> None:
    """A job the heartbeat finds gone between its claim and its task's first step is never started: no
    request, its slot freed, no completion or failure written for it."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter(open_all=True)
    store.add_pending(1)
    worker = _worker(store, writer, clock)
    assert (await worker.round_once()).claimed == 1
    store.end_elsewhere(1)
    with capture_logs() as logs:
        assert await worker.heartbeat_once() == [1]  # before the job's task took a step
        await worker.round_once()  # takes the report: the job's stop is set before its first step
        await _let_tasks_run()
        await worker.round_once()
    assert writer.sent == [] and worker.held_job_ids == []
    assert [e["event"] for e in logs].count("job.lost_ownership") == 1
    assert store.named("call_finish") == [(1, 1, LlmOutcome.NOT_SENT, False)]
    assert store.named("fail_running") == [] and store.named("settle") == []


async def test_a_lost_claim_answer_never_adopts_a_job_this_worker_has_begun() -> None:
    """A claim whose answer is lost while another job's request is in flight adopts only the lost
    claim's job: the search is told the job already begun (which the SQL then leaves out: proven on
    Postgres), and one request is sent for it."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.add_pending(1)
    worker = _worker(store, writer, clock)
    await worker.round_once()
    await _let_tasks_run()
    assert writer.sent == ["story 1"]
    store.add_pending(1)
    store.fail_next("claim", psycopg.OperationalError("connection lost"), after_effect=True)
    worker.notified()
    assert (await worker.round_once()).database_error is not None
    adopted = await worker.round_once()
    await _let_tasks_run()
    assert adopted.adopted == 1 and sorted(worker.held_job_ids) == [1, 2]
    assert store.named("claims_of_lost_answer") == [[1]]
    assert writer.sent == ["story 1", "story 2"]


async def test_an_adopted_job_keeps_the_max_tokens_it_was_accepted_with() -> None:
    """A job adopted after a lost claim answer runs with its own max_tokens, not the worker's."""
    store, clock, writer = RecordingStore(max_tokens=123), FakeClock(), GatedWriter()
    store.add_pending(1)
    store.fail_next("claim", psycopg.OperationalError("connection lost"), after_effect=True)
    worker = _worker(store, writer, clock, llm_max_tokens=4000)
    await worker.round_once()
    await worker.round_once()
    await _let_tasks_run()
    (held,) = worker.held
    assert held.call.max_tokens == 123


async def test_a_claim_that_commits_after_its_answer_was_lost_is_still_adopted() -> None:
    """A lost claim statement that commits on the server after the first search is found by a later
    round, until its statement timeout has passed; then the search stops."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.fail_next("claim", psycopg.OperationalError("connection lost"))
    worker = _worker(store, writer, clock)
    assert (await worker.round_once()).database_error is not None
    assert (await worker.round_once()).adopted == 0  # nothing committed yet
    # the statement commits late: its job is running under this worker, never begun
    (job_id,) = store.add_pending(1)
    store.claim_lost(job_id)
    clock.now += 1.0
    assert (await worker.round_once()).adopted == 1
    clock.now += 60.0
    await worker.round_once()
    searches = len(store.named("claims_of_lost_answer"))
    clock.now += 60.0
    await worker.round_once()
    assert len(store.named("claims_of_lost_answer")) == searches


async def test_a_stopping_worker_holding_nothing_exits_clean_after_a_lost_claim_answer() -> None:
    """Stopped after a claim's answer was lost and nothing was found, the worker looks again until its
    grace ends, then exits clean instead of giving up as if it had left jobs behind."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.fail_next("claim", psycopg.OperationalError("connection lost"))
    worker = _worker(store, writer, clock, worker_shutdown_grace_s=5.0)
    await worker.round_once()
    worker.stop()
    assert (await worker.round_once()).adopted == 0
    waiting = await worker.round_once()
    assert not waiting.finished and 0 < waiting.wait_s <= 5.0
    clock.now += 5.0
    with capture_logs() as logs:
        rounds = [await worker.round_once() for _ in range(2)]  # one more search, then the exit
    assert [(r.finished, r.clean) for r in rounds] == [(False, True), (True, True)]
    assert [e["event"] for e in logs] == ["worker.lost_claim_unsettled"]


async def test_a_lost_claim_found_after_the_grace_is_failed_and_never_begun() -> None:
    """Past the shutdown grace, the job of a lost claim answer found by adoption is not begun: it is
    failed as interrupted with nothing sent, and the worker exits clean."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter(open_all=True)
    store.add_pending(1)
    store.fail_next("claim", psycopg.OperationalError("connection lost"), after_effect=True)
    store.fail_next("claims_of_lost_answer", psycopg.OperationalError("connection refused"))
    worker = _worker(store, writer, clock, worker_shutdown_grace_s=5.0)
    await worker.round_once()
    worker.stop()
    assert (await worker.round_once()).database_error is not None  # the search fails within the grace
    clock.now += 5.0
    assert (await worker.round_once()).adopted == 1
    await _let_tasks_run()
    assert (await worker.round_once()).failed == 1
    assert writer.sent == []
    (failure,) = store.named("fail_running")[0]
    assert (failure.error_code, failure.call_outcome, failure.billed) == (
        ErrorCode.INTERRUPTED, LlmOutcome.NOT_SENT, False)
    assert (await worker.round_once()).finished


async def test_an_end_refused_in_every_form_is_given_up_only_once_the_job_is_no_longer_ours() -> None:
    """A failure the database refuses as it is and in its safe form keeps the job held (its slot too);
    once the heartbeat finds the job ended elsewhere, the round lets it go."""
    store, clock = RecordingStore(), FakeClock()
    store.add_pending(1)
    worker = _worker(store, GatedWriter(open_all=True, text=""), clock)
    await worker.round_once()
    await _let_tasks_run()
    for _ in range(3):
        store.fail_next("settle", psycopg.errors.DataError("refused"))
        store.fail_next("fail_running", psycopg.errors.DataError("refused"))
    for _ in range(10):  # until it was refused the third time, the last before it may be given up
        await worker.round_once()
        clock.now += 60.0
        if [h.refusals for h in worker.held] == [3]:
            break
    assert worker.held_job_ids == [1] and [h.refusals for h in worker.held] == [3]
    store.end_elsewhere(1, ErrorCode.TIMED_OUT)
    assert await worker.heartbeat_once() == [1]
    assert (await worker.round_once()).let_go == 1 and worker.held_job_ids == []


async def test_an_end_refused_in_every_form_is_tried_again_only_after_its_backoff() -> None:
    """Refused as it is and in its safe form, a failure waits 2 ** refusals seconds (at most a minute)
    before the database is asked again, however many rounds run meanwhile."""
    store, clock = RecordingStore(), FakeClock()
    store.add_pending(1)
    worker = _worker(store, GatedWriter(open_all=True, text=""), clock)
    await worker.round_once()
    await _let_tasks_run()
    for _ in range(6):
        store.fail_next("settle", psycopg.errors.DataError("refused"))
        store.fail_next("fail_running", psycopg.errors.DataError("refused"))
    for _ in range(3):
        await worker.round_once()
        clock.now += 60.0
    # the minute passed since is past any backoff: this round asks, is refused, and backs off
    await worker.round_once()
    (held,) = worker.held
    assert held.refusals >= 3
    asked = len(store.named("fail_running"))
    for _ in range(5):
        await worker.round_once()
        clock.now += 1.0
    assert len(store.named("fail_running")) == asked
    clock.now += 60.0
    await worker.round_once()
    assert len(store.named("fail_running")) == asked + 1


async def test_a_claim_the_limiter_held_back_is_tried_again_when_the_bucket_covers_the_next_job() -> None:
    """At 30 requests a minute, a claim held back with 0.2 of a request left waits 1.6 s (what the
    bucket takes to cover the next job), not the 5 s poll, and then claims."""
    store, clock = RecordingStore(), FakeClock()
    worker = _worker(store, GatedWriter(), clock, worker_poll_interval_s=5.0, llm_requests_per_minute=30)
    store.limiter = LimiterState(requests=0.2, next_input_tokens=100, next_output_tokens=800)
    held_back = await worker.round_once()
    assert held_back.claimed == 0
    store.limiter = LimiterState(requests=0.0)
    store.add_pending(1)
    idle = await worker.round_once()
    assert idle.claimed == 0 and idle.wait_s == pytest.approx(1.6)
    clock.now += 1.6
    assert (await worker.round_once()).claimed == 1


async def test_a_claim_held_back_while_another_worker_wakes_for_the_bucket_waits_for_that_role_to_end() -> None:
    """Held back with another worker the bucket's waker for 4.2 s more, a worker waits those 4.2 s
    rather than the 1.6 s the bucket takes to cover the next job: one worker wakes for it, not all."""
    store, clock = RecordingStore(), FakeClock()
    worker = _worker(store, GatedWriter(), clock, worker_poll_interval_s=5.0, llm_requests_per_minute=30)
    store.limiter = LimiterState(requests=0.2, next_input_tokens=100, next_output_tokens=800, waker=False,
                                 waker_in_s=4.2)
    assert (await worker.round_once()).claimed == 0
    store.limiter = LimiterState(requests=0.0)
    store.add_pending(1)
    idle = await worker.round_once()
    assert idle.claimed == 0 and idle.wait_s == pytest.approx(4.2)
    clock.now += 4.2
    assert (await worker.round_once()).claimed == 1


async def test_a_claim_whose_session_the_server_ended_is_searched_for_once() -> None:
    """A claim lost because the server ended its session (57P01) cannot commit later: one search for its
    jobs settles it, and a stopping worker then exits at once instead of waiting out its grace."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.fail_next("claim", psycopg.errors.AdminShutdown("terminating connection"))
    worker = _worker(store, writer, clock)
    assert (await worker.round_once()).database_error is not None
    worker.stop()
    assert (await worker.round_once()).adopted == 0
    assert (await worker.round_once()).finished
    assert len(store.named("claims_of_lost_answer")) == 1


async def test_a_claim_that_never_got_a_connection_is_not_searched_for() -> None:
    """A claim that timed out waiting for a pooled connection was never sent: nothing is searched for."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.fail_next("claim", psycopg_pool.PoolTimeout("couldn't get a connection"))
    worker = _worker(store, writer, clock)
    assert (await worker.round_once()).database_error is not None
    await worker.round_once()
    assert store.named("claims_of_lost_answer") == []


async def test_a_jobs_run_is_measured_from_its_claim_to_its_end() -> None:
    """storyjobs_job_run_seconds observes, per job, the time from its claim to the end of its work, by the
    worker's clock: a story written 42 s after its claim adds 42 s to the histogram's sum."""
    def run_seconds() -> float:
        return REGISTRY.get_sample_value("storyjobs_job_run_seconds_sum") or 0.0

    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter()
    store.add_pending(1)
    worker = _worker(store, writer, clock)
    assert (await worker.round_once()).claimed == 1
    before = run_seconds()
    clock.now += 42.0
    writer.gate(1).set()
    await _let_tasks_run()
    assert (await worker.round_once()).completed == 1
    assert run_seconds() - before == pytest.approx(42.0)


async def test_once_a_refused_batch_is_taken_apart_the_ends_are_batched_again() -> None:
    """A batch of stories refused for its data is written one story at a time to find the culprit; once one
    written alone is taken, the ends left are written together again, not one a round."""
    store, clock, writer = RecordingStore(), FakeClock(), GatedWriter(open_all=True)
    store.add_pending(3)
    worker = _worker(store, writer, clock, worker_concurrency=3)
    await worker.round_once()
    await _let_tasks_run()
    store.fail_next("settle", psycopg.errors.DataError("invalid byte sequence"))
    assert (await worker.round_once()).database_error is not None
    for _ in range(3):
        await worker.round_once()
    assert [len(stories) for stories in store.named("settle")] == [3, 1, 2]
    assert store.statuses() == {1: JobStatus.COMPLETED, 2: JobStatus.COMPLETED, 3: JobStatus.COMPLETED}
