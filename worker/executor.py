"""One job's call, from its stored request to an outcome.

The executor runs in the job's own task. It asks the writer for the story,
writes the ledger row of each retry before the retry is sent (through
``LedgerHooks``), and ends by returning one Outcome to the coordinator. It
never touches the coordinator's held set: whether the job is completed,
failed or let go, and what is logged and counted about it, is decided by the
round that collects the outcome.

A task the coordinator cancels (its job is no longer ours, or the shutdown
grace is over) cannot return; ``outcome_of`` turns its cancellation into
``Stopped`` with what its JobCall says was sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import structlog

from shared import db, prompt
from shared.rows import ClaimedJob, Draft, RetryStart
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest
from shared.text import storable
from worker import metrics
from worker.store import WorkerStore
from worker.writing import CallRecord, JobCall, LostOwnership, StoryWriter, WriteFailed

log = structlog.get_logger()

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0


class Completed(msgspec.Struct, frozen=True):
    draft: Draft
    call: CallRecord


class Failed(msgspec.Struct, frozen=True):
    error_code: ErrorCode
    message: str
    call: CallRecord


class Stopped(msgspec.Struct, frozen=True):
    """The coordinator stopped the call; ``call`` is where it stood."""

    call: CallRecord


class Lost(msgspec.Struct, frozen=True):
    """The job was ended elsewhere before a retry could be sent: nothing
    more was sent; ``call`` is the refused attempt, whose row (and the
    job's charge) still says what whoever ended the job assumed."""

    reason: str
    call: CallRecord


Outcome = Completed | Failed | Stopped | Lost


async def execute(job: ClaimedJob, writer: StoryWriter, call: JobCall) -> Outcome:
    structlog.contextvars.bind_contextvars(job_id=str(job.public_id))
    log.debug("job.started", queue_wait_s=(job.started_at - job.created_at).total_seconds())
    try:
        request = msgspec.convert(job.request, StoryRequest)
    except msgspec.ValidationError as exc:
        return Failed(ErrorCode.INVALID_REQUEST, f"the stored request is not valid: {exc}",
                      call.record(LlmOutcome.NOT_SENT))
    call.input_tokens_at_most = prompt.input_tokens_at_most(request)
    try:
        draft = await writer.write(request, call)
    except WriteFailed as exc:
        return Failed(exc.error_code, exc.message, call.record(exc.outcome))
    except LostOwnership:
        return Lost("ended elsewhere while a retry waited", call.record(LlmOutcome.NOT_SENT))
    except Exception as exc:  # noqa: BLE001 - a bug must end the job with what was sent, not strand it
        log.exception("job.unexpected_error")
        return Failed(ErrorCode.INTERNAL_ERROR, f"the worker failed unexpectedly: {type(exc).__name__}",
                      call.record(LlmOutcome.FAILED))
    return Completed(draft, call.record(LlmOutcome.SUCCEEDED))


def outcome_of(task: asyncio.Task[Outcome], call: JobCall) -> Outcome:
    """A finished task's outcome; a cancelled one's is where its call stood."""
    if task.cancelled():
        return Stopped(call.record(LlmOutcome.STOPPED))
    return task.result()


class LedgerHooks:
    """What a job's call asks of the database: a retry's ledger row (waited
    for through another worker's 429 pause and through database errors,
    which are transient here as everywhere in the worker), a shared pause
    after a 429; and the provider's headers, handed to ``heard``."""

    def __init__(
        self,
        store: WorkerStore,
        job: ClaimedJob,
        heard: Callable[[Mapping[str, str]], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._job = job
        self._heard = heard
        self._clock = clock
        self._sleep = sleep

    async def next_attempt(self, attempt: int, previous: LlmOutcome, error: str) -> RetryStart:
        """The next attempt's row (or not ours). The statement is idempotent:
        run again after its answer was lost, it answers the row it made."""
        errors = db.ErrorEpisode("worker", clock=self._clock, task="retry", job_id=str(self._job.public_id))
        backoff_s = BACKOFF_FIRST_S
        while True:
            try:
                started = await self._store.call_retry(self._job.id, attempt, previous, storable(error))
            except db.DB_ERRORS as exc:
                errors.failed(exc, attempt=attempt)
                await self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)
                continue
            errors.succeeded()
            if started.owned and started.attempt is None:
                # another worker's 429 holds every request; the previous
                # attempt is counted when the retry's row is opened
                metrics.LLM_RATELIMIT_WAITS.inc()
                await self._sleep(max(started.paused_s, 0.01))
                continue
            if started.attempt is not None:
                metrics.LLM_REQUESTS_BY_OUTCOME[previous].inc()
            return started

    async def rate_limited(self, pause_s: float) -> None:
        metrics.LLM_RATELIMITED.inc()
        try:
            await self._store.pause(pause_s)
        except db.DB_ERRORS as exc:
            # this job still waits out its own retry-after; only the others are not told
            log.warning("llm.pause_not_shared", pause_s=round(pause_s, 3), error=db.describe(exc))

    def provider_said(self, headers: Mapping[str, str]) -> None:
        self._heard(headers)
