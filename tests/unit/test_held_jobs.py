"""The held set's transitions, one at a time and without a database: a job
is held, the outcome its task reported (``Finished``) becomes the end it
needs written, and it leaves only when released. What a stop may reach (a
call under way) and what taking a report may not do (end a job, change the
set) is checked here too."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from shared.status import ErrorCode, LlmOutcome
from worker.executor import outcome_of
from worker.held import SHUTDOWN, Close, HeldJob, HeldJobs
from worker.inbox import Finished
from worker.outcomes import Completed, Failed, Lost, Outcome, Stopped
from worker.rows import ClaimedJob, Completion, Draft, Failure, RetryStart
from worker.writing import FREE, CallRecord, JobCall


class NoHooks:
    """A call's hooks that nothing here calls."""

    async def next_attempt(self, attempt: int, previous: LlmOutcome, error: str) -> RetryStart:
        raise AssertionError("no retry in these tests")

    async def rate_limited(self, pause_s: float) -> None:
        raise AssertionError("no 429 in these tests")

    def provider_said(self, headers: object) -> None:
        return None


def _job(job_id: int) -> ClaimedJob:
    now = datetime.now(UTC)
    return ClaimedJob(id=job_id, public_id=uuid.uuid4(), client_id=7, request={"prompt": "p"}, created_at=now,
                      started_at=now)


def _held(jobs: HeldJobs, job_id: int) -> HeldJob:
    return jobs.hold(_job(job_id), JobCall(FREE, NoHooks(), model="m", max_tokens=100), now=10.0)


async def _finish(held: HeldJob, outcome: Outcome) -> Finished:
    """Gives the held job a task that returns ``outcome``: the report its task's end posts."""
    async def returns() -> Outcome:
        return outcome

    held.task = asyncio.create_task(returns())
    await held.task
    return Finished(held.job.id, outcome_of(held.task, held.call, held.stop))


def _take(jobs: HeldJobs, reports: list[Finished], counted: list[CallRecord] | None = None) -> None:
    """What the round does with the reports: each becomes its job's end."""
    for report in reports:
        jobs.finished(report, 20.0, (counted if counted is not None else []).append)


async def _running(held: HeldJob) -> asyncio.Event:
    """Gives the held job a task that runs until the returned event is set."""
    release = asyncio.Event()

    async def runs() -> Outcome:
        await release.wait()
        return Stopped(CallRecord(1, LlmOutcome.STOPPED, False, 0, 0, Decimal(0)), "test")

    held.task = asyncio.create_task(runs())
    await asyncio.sleep(0)
    return release


_SENT = CallRecord(1, LlmOutcome.SUCCEEDED, True, 3, 7, Decimal("0.01"), "req_1")
_DRAFT = Draft(title="T\x00", body="B", model="m", prompt_version="v1", input_tokens=3, output_tokens=7,
               cost_usd=Decimal("0.01"))


async def test_each_outcome_becomes_the_end_its_job_needs_written() -> None:
    """A story becomes a completion (made storable), a failure a failure, a call stopped at shutdown a
    failure as interrupted, a call stopped or lost for a job no longer ours a close of its ledger row."""
    jobs = HeldJobs()
    outcomes: dict[int, Outcome] = {
        1: Completed(_DRAFT, _SENT),
        2: Failed(ErrorCode.LLM_REJECTED, "400", CallRecord(1, LlmOutcome.REJECTED, False, 0, 0, Decimal(0))),
        3: Stopped(CallRecord(1, LlmOutcome.STOPPED, True, 3, 100, Decimal("0.02")), SHUTDOWN),
        4: Stopped(CallRecord(1, LlmOutcome.STOPPED, True, 3, 100, Decimal("0.02")), "cancelled"),
        5: Lost("ended elsewhere while a retry waited", CallRecord(1, LlmOutcome.NOT_SENT, False, 0, 0, Decimal(0))),
    }
    reports = [await _finish(_held(jobs, job_id), outcome) for job_id, outcome in outcomes.items()]
    counted: list[CallRecord] = []
    _take(jobs, reports, counted)
    _take(jobs, reports, counted)  # a report taken twice changes nothing
    ends = {held.job.id: held.end for held in jobs}
    completion, failure, interrupted, stopped, lost = (ends[n] for n in range(1, 6))
    assert isinstance(completion, Completion) and completion.title == "T" and completion.attempt == 1
    assert isinstance(failure, Failure) and failure.error_code is ErrorCode.LLM_REJECTED and not failure.billed
    assert isinstance(interrupted, Failure) and interrupted.error_code is ErrorCode.INTERRUPTED and interrupted.billed
    assert stopped == Close(outcomes[4].call, "cancelled")
    assert lost == Close(outcomes[5].call, "ended elsewhere")
    assert len(counted) == 5 and len(jobs) == 5, "taking a report ends nothing: a job leaves only when released"


async def test_a_job_leaves_the_set_only_when_released() -> None:
    """Release is the one way out; releasing a job twice changes nothing."""
    jobs = HeldJobs()
    held = _held(jobs, 1)
    _held(jobs, 2)
    jobs.release(held)
    jobs.release(held)
    assert jobs.ids == [2] and 1 not in jobs


async def test_a_story_waiting_to_be_settled_frees_its_slot_for_the_claim() -> None:
    """With 3 slots, a running job takes one; a job whose story waits to be settled takes none; a failure
    waiting to be written still takes one."""
    jobs = HeldJobs()
    await _running(_held(jobs, 1))
    _take(jobs, [await _finish(_held(jobs, 2), Completed(_DRAFT, _SENT)),
                 await _finish(_held(jobs, 3), Failed(ErrorCode.LLM_ERROR, "x", _SENT))])
    assert jobs.free_slots(3) == 1
    assert jobs.free_slots(1) == 0


async def test_ends_are_due_in_id_order_and_one_at_a_time_while_a_batch_is_taken_apart() -> None:
    """Due ends of a kind come in job id order; with ``one`` only the first; an end waiting out a refusal
    is not due before its retry time."""
    jobs = HeldJobs()
    _take(jobs, [await _finish(_held(jobs, job_id), Completed(_DRAFT, _SENT)) for job_id in (3, 1, 2)])
    assert [h.job.id for h in jobs.due(Completion, 20.0, one=False)] == [1, 2, 3]
    assert [h.job.id for h in jobs.due(Completion, 20.0, one=True)] == [1]
    assert jobs.due(Failure, 20.0, one=False) == []
    first = jobs.due(Completion, 20.0, one=True)[0]
    first.retry_at = 30.0
    assert [h.job.id for h in jobs.due(Completion, 25.0, one=False)] == [2, 3]
    assert sorted(jobs.retry_deadlines()) == [float("-inf"), float("-inf"), 30.0]


async def test_a_stop_reaches_only_a_call_under_way_and_its_first_reason_stands() -> None:
    """signal_stop stops a running call once (the first reason is kept); a finished call, an unknown job
    and a job whose end waits are not stopped."""
    jobs = HeldJobs()
    running = _held(jobs, 1)
    release = await _running(running)
    await _finish(_held(jobs, 2), Completed(_DRAFT, _SENT))
    assert jobs.signal_stop(1, "cancelled")
    assert not jobs.signal_stop(1, SHUTDOWN)
    assert running.stop.reason == "cancelled"
    assert not jobs.signal_stop(2, "cancelled") and not jobs.signal_stop(9, "cancelled")
    release.set()
    await asyncio.sleep(0)


async def test_a_job_found_gone_while_its_end_waits_may_be_given_up() -> None:
    """found_gone marks a job whose end waits to be written (it may then be given up) and stops a call
    still under way, without marking it."""
    jobs = HeldJobs()
    waiting = _held(jobs, 1)
    finished = await _finish(waiting, Failed(ErrorCode.LLM_ERROR, "x", _SENT))
    running = _held(jobs, 2)
    release = await _running(running)
    _take(jobs, [finished])
    jobs.found_gone(1, "timed_out")
    jobs.found_gone(2, "cancelled")
    jobs.found_gone(3, "cancelled")  # not held: nothing to do
    assert waiting.found_gone and not running.found_gone
    assert running.stop.reason == "cancelled" and waiting.stop.reason is None
    release.set()
    await asyncio.sleep(0)


@pytest.mark.parametrize("stopped_first", [True, False], ids=["before-its-first-step", "while-it-runs"])
async def test_a_stopped_executor_returns_what_its_call_sent(stopped_first: bool) -> None:
    """The executor stops on its signal, before its first step (nothing sent) or while its writer waits
    (the writer's task cancelled by the signal), and returns Stopped with the signal's reason."""
    from worker.executor import execute

    class WaitingWriter:
        provider, model, price = "w", "m", FREE

        async def write(self, request: object, call: JobCall) -> Draft:
            call.sending()
            call.accepted()
            await asyncio.Event().wait()
            raise AssertionError("never answered")

        async def aclose(self) -> None:
            return None

    jobs = HeldJobs()
    held = _held(jobs, 1)
    if stopped_first:
        held.stop.set("cancelled")
    held.task = asyncio.create_task(execute(held.job, WaitingWriter(), held.call, held.stop))
    for _ in range(5):  # the executor's step, then its writer's
        await asyncio.sleep(0)
    held.stop.set("cancelled")
    outcome = await held.task
    assert isinstance(outcome, Stopped) and outcome.reason == "cancelled"
    if stopped_first:
        assert (outcome.call.outcome, outcome.call.billed) == (LlmOutcome.NOT_SENT, False)
    else:
        assert (outcome.call.outcome, outcome.call.billed) == (LlmOutcome.STOPPED, True)


async def test_a_task_that_raised_reports_its_job_failed_with_what_was_sent() -> None:
    """A job's task that raised (a defect outside the writer's call) still reports an outcome: its job
    fails as internal_error with what its call sent, so that no job waits for a report that never comes."""
    jobs = HeldJobs()
    held = _held(jobs, 1)

    async def raises() -> Outcome:
        raise RuntimeError("a bug")

    held.task = asyncio.create_task(raises())
    with pytest.raises(RuntimeError):
        await held.task
    outcome = outcome_of(held.task, held.call, held.stop)
    assert isinstance(outcome, Failed) and outcome.error_code is ErrorCode.INTERNAL_ERROR
    assert (outcome.call.outcome, outcome.call.billed) == (LlmOutcome.NOT_SENT, False)
    _take(jobs, [Finished(1, outcome)])
    assert isinstance(held.end, Failure) and held.end.error_code is ErrorCode.INTERNAL_ERROR
