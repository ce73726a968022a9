"""The jobs a worker process holds, from their claim until their end is
written, and every change to them.

Only the round (worker/coordinator.py) changes the held set, through the
methods below, all synchronous, and on reports alone: a job is held when
claimed or adopted, gets the end the outcome its task reported calls for
(``Finished``: a completion, a failure, or a stopped call's ledger row), and
leaves once that end is written. The round also sets a job's StopSignal,
which its executor owns (``signal_stop``), at the end of the shutdown's
grace or when the heartbeat reported the job no longer ours, so that a
stream nobody will see stops at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from decimal import Decimal

import msgspec
import structlog

from shared.provider_numbers import INT32_MAX
from shared.status import ErrorCode, LlmOutcome
from shared.text import storable, storable_or_none
from worker import metrics
from worker.executor import StopSignal
from worker.inbox import Finished
from worker.outcomes import Completed, Failed, Lost, Outcome, Stopped
from worker.rows import ClaimedJob, Completion, Failure
from worker.writing import CallRecord, JobCall, StreamedText

log = structlog.get_logger()

SHUTDOWN = "shutdown"
# what a money column (numeric(14, 6)) holds
_USD_MAX = Decimal("99999999.999999")


class Close(msgspec.Struct, frozen=True):
    """The ledger row of a call stopped because its job was no longer ours
    (``reason``: what ended the job): the only end such a job needs."""

    record: CallRecord
    reason: str


End = Completion | Failure | Close
"""What a held job needs written before it can be let go."""


class HeldJob:
    __slots__ = ("job", "call", "stop", "task", "claimed_at", "end", "refusals", "retry_at", "found_gone")

    def __init__(self, job: ClaimedJob, call: JobCall, claimed_at: float) -> None:
        self.job = job
        self.call = call
        # set by the round (shutdown, or the heartbeat's report): the executor stops
        self.stop = StopSignal()
        self.task: asyncio.Task[Outcome] | None = None
        self.claimed_at = claimed_at
        self.end: End | None = None
        # how often the database refused its end for its data, and when to try again
        self.refusals = 0
        self.retry_at = float("-inf")
        # the heartbeat found it no longer ours: only then may an end the
        # database keeps refusing be given up
        self.found_gone = False

    @property
    def public_id(self) -> str:
        return str(self.job.public_id)

    @property
    def running(self) -> bool:
        """Its call may still be under way."""
        return self.end is None and self.task is not None and not self.task.done()


class HeldJobs:
    def __init__(self) -> None:
        self._jobs: dict[int, HeldJob] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[HeldJob]:
        return iter(list(self._jobs.values()))

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    @property
    def ids(self) -> list[int]:
        return list(self._jobs)

    # -- what others may read or signal ------------------------------------------------

    def beats(self) -> dict[int, int]:
        """The held jobs and their output tokens so far, for the heartbeat:
        a job whose end is not yet written is still running, and still ours."""
        return {job_id: held.call.output_tokens for job_id, held in self._jobs.items()}

    def texts(self) -> dict[int, StreamedText]:
        """The text streamed so far of each held job whose call is still
        under way, for the draft writer: once a call has ended, its draft
        waits only for the job's end, which deletes it."""
        return {job_id: held.call.text for job_id, held in self._jobs.items() if held.running}

    def signal_stop(self, job_id: int, reason: str) -> bool:
        """Stops a held job's call that is still under way, through the stop
        signal its executor owns (also one whose task has not taken its first
        step: nothing is then sent). True when a call was stopped."""
        held = self._jobs.get(job_id)
        if held is None or not held.running or held.stop.is_set:
            return False
        held.stop.set(reason)
        return True

    # -- the round's changes ----------------------------------------------------------

    def hold(self, job: ClaimedJob, call: JobCall, now: float) -> HeldJob:
        held = HeldJob(job, call, now)
        self._jobs[job.id] = held
        return held

    def release(self, held: HeldJob) -> None:
        """Lets go of a job whose end was written (or given up): the one way out."""
        self._jobs.pop(held.job.id, None)

    def found_gone(self, job_id: int, reason: str) -> None:
        """The heartbeat reported the job no longer ours: a call still under
        way is stopped; a job whose end waits may be given up if the database
        keeps refusing it."""
        held = self._jobs.get(job_id)
        if held is None:
            return
        if held.end is not None:
            held.found_gone = True
        self.signal_stop(job_id, reason)

    def stop_all(self, reason: str) -> None:
        for job_id in self.ids:
            self.signal_stop(job_id, reason)

    def finished(self, report: Finished, now: float, count_call: Callable[[CallRecord], None]) -> None:
        """Turns a finished call's outcome, as its task reported it, into the
        end its job needs written."""
        held = self._jobs.get(report.job_id)
        if held is None or held.end is not None:
            return
        metrics.JOB_RUN.observe(now - held.claimed_at)
        count_call(report.outcome.call)
        held.end = _end_of(held, report.outcome)

    def due(self, kind: type[Completion] | type[Failure] | type[Close], now: float, *, one: bool) -> list[HeldJob]:
        """The held jobs whose end of this kind can be written now, in id
        order; only the first with ``one`` (a refused batch taken apart)."""
        found = sorted((h for h in self._jobs.values() if isinstance(h.end, kind) and h.retry_at <= now),
                       key=lambda h: h.job.id)
        return found[:1] if one else found

    def ends_waiting(self) -> int:
        return sum(h.end is not None for h in self._jobs.values())

    def free_slots(self, concurrency: int) -> int:
        """A job whose story waits to be settled is settled before the claim
        of the same round, so its slot is already free for that claim."""
        settling = sum(isinstance(h.end, Completion) for h in self._jobs.values())
        return max(0, concurrency - len(self._jobs) + settling)

    def retry_deadlines(self) -> list[float]:
        return [h.retry_at for h in self._jobs.values() if h.end is not None]


def _end_of(held: HeldJob, outcome: Outcome) -> End:
    """What a finished call's job needs written, logged once here."""
    if isinstance(outcome, Completed):
        return completion(held.job, outcome)
    if isinstance(outcome, Failed):
        return failure(held.job.id, outcome.error_code, outcome.message, outcome.call)
    if isinstance(outcome, Lost):
        # its row and its charge are set right as a stopped call's are
        metrics.LOST_OWNERSHIP.inc()
        log.warning("job.lost_ownership", job_id=held.public_id, reason=outcome.reason, attempt=outcome.call.attempt)
        return Close(outcome.call, "ended elsewhere")
    assert isinstance(outcome, Stopped)
    if outcome.reason == SHUTDOWN:
        # still ours: failed now rather than left to the sweeper
        log.warning("job.stream_stopped", job_id=held.public_id, reason=SHUTDOWN, attempt=outcome.call.attempt,
                    output_tokens=outcome.call.output_tokens)
        return failure(held.job.id, ErrorCode.INTERRUPTED, "the worker shut down before the story was finished",
                       outcome.call)
    metrics.LOST_OWNERSHIP.inc()
    log.warning("job.lost_ownership", job_id=held.public_id, reason=outcome.reason, attempt=outcome.call.attempt,
                sent=held.call.sent.value, output_tokens=outcome.call.output_tokens)
    return Close(outcome.call, outcome.reason)


def completion(job: ClaimedJob, done: Completed) -> Completion:
    """The job's completion, with the provider's text made storable and the
    usage its call record holds (checked against what the columns hold)."""
    draft, record = done.draft, done.call
    return Completion(
        job_id=job.id,
        client_id=job.client_id,
        attempt=record.attempt,
        title=storable(draft.title),
        body=storable(draft.body),
        model=storable(draft.model),
        prompt_version=draft.prompt_version,
        input_tokens=record.input_tokens,
        output_tokens=record.output_tokens,
        cost_usd=record.cost_usd,
        request_id=storable_or_none(record.request_id),
    )


def failure(job_id: int, code: ErrorCode, message: str, record: CallRecord) -> Failure:
    return Failure(
        job_id=job_id,
        attempt=record.attempt,
        error_code=code,
        error_text=storable(message),
        call_outcome=record.outcome,
        billed=record.billed,
        input_tokens=record.input_tokens,
        output_tokens=record.output_tokens,
        cost_usd=record.cost_usd,
        request_id=storable_or_none(record.request_id),
    )


def safe(failed: Failure) -> Failure:
    """The failure in a form no column can refuse: counts and cost within
    what the columns hold, a fixed text."""
    return Failure(
        job_id=failed.job_id,
        attempt=failed.attempt,
        error_code=failed.error_code,
        error_text="the job ended, but what ended it could not be stored; see the worker's log",
        call_outcome=failed.call_outcome,
        billed=failed.billed,
        input_tokens=min(max(failed.input_tokens, 0), INT32_MAX),
        output_tokens=min(max(failed.output_tokens, 0), INT32_MAX),
        cost_usd=min(max(failed.cost_usd, Decimal(0)), _USD_MAX),
    )


def unstorable(completed: Completion, error: str) -> Failure:
    """A completion the database refused even alone: the job fails, its
    call recorded as the success it was (billed)."""
    return failure(completed.job_id, ErrorCode.INTERNAL_ERROR, f"the story could not be stored ({error})",
                   CallRecord(completed.attempt, LlmOutcome.SUCCEEDED, True, completed.input_tokens,
                              completed.output_tokens, completed.cost_usd, completed.request_id))
