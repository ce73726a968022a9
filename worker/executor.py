"""One job's call, from its stored request to an outcome.

The executor runs in the job's own task. It asks the writer for the story,
writes the ledger row of each retry before the retry is sent (through
``LedgerHooks``), and ends by returning one Outcome (worker/outcomes.py),
which the task's ``Finished`` report carries to the round. It never touches
the coordinator's held set: whether the job is completed, failed or let go,
and what is logged and counted about it, is decided by the round that takes
the report.

A call is stopped through the job's StopSignal, which the executor owns:
the round sets it when the shutdown grace is over, or when the heartbeat
reported the job no longer ours. The writer then runs in a task of the executor's
own, which the signal cancels; the executor returns ``Stopped`` with what
its JobCall says was sent. Nobody else cancels a job's task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import structlog
from opentelemetry.trace import Span, StatusCode, Tracer

from shared import db, prompt, telemetry
from shared.ratelimit import ProviderView, RateLimits
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest
from shared.text import storable
from worker import metrics
from worker.backoff import Backoff
from worker.inbox import Finished, Heard, Inbox
from worker.outcomes import Completed, Failed, Lost, Outcome, Stopped
from worker.rows import ClaimedJob, Draft, RetryStart
from worker.store import WorkerStore
from worker.writing import JobCall, LostOwnership, StoryWriter, WriteFailed

log = structlog.get_logger()


class StopSignal:
    """Asks a job's executor to stop its call. The first reason set stands;
    setting it again does nothing."""

    __slots__ = ("_stop_writing", "reason")

    def __init__(self) -> None:
        self.reason: str | None = None
        self._stop_writing: Callable[[], object] | None = None

    @property
    def is_set(self) -> bool:
        return self.reason is not None

    def set(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        if self._stop_writing is not None:
            self._stop_writing()

    def _stops(self, writing: asyncio.Task[Draft]) -> None:
        """The executor's writing task, cancelled when the signal is set."""
        self._stop_writing = writing.cancel


async def execute(job: ClaimedJob, writer: StoryWriter, call: JobCall, stop: StopSignal, *,
                  tracer: Tracer | None = None) -> Outcome:
    """The job's call, as the span ``storyjobs.job.run`` in the job's trace
    when traces are on (``tracer``): the provider's SDK makes each attempt's
    span inside it (worker/anthropic_writer.py)."""
    structlog.contextvars.bind_contextvars(job_id=str(job.public_id))
    if stop.reason is not None:
        # stopped before its first step: nothing was sent
        return Stopped(call.record(LlmOutcome.STOPPED), stop.reason)
    if tracer is None:
        return await _run(job, writer, call, stop)
    parent = telemetry.context_from_carrier(telemetry.carrier_of(job.trace_context))
    with tracer.start_as_current_span("storyjobs.job.run", context=parent, record_exception=False,
                                      set_status_on_exception=False, attributes={
                                          "storyjobs.job.id": str(job.public_id),
                                          "gen_ai.operation.name": "chat",
                                          "gen_ai.provider.name": writer.provider,
                                          "gen_ai.request.model": call.model,
                                          "gen_ai.request.max_tokens": call.max_tokens}) as span:
        outcome = await _run(job, writer, call, stop)
        _describe(span, outcome)
        return outcome


async def _run(job: ClaimedJob, writer: StoryWriter, call: JobCall, stop: StopSignal) -> Outcome:
    log.debug("job.started", queue_wait_s=(job.started_at - job.created_at).total_seconds())
    try:
        request = msgspec.convert(job.request, StoryRequest)
    except msgspec.ValidationError as exc:
        return Failed(ErrorCode.INVALID_REQUEST, f"the stored request is not valid: {exc}",
                      call.record(LlmOutcome.NOT_SENT))
    call.input_tokens_at_most = prompt.input_tokens_at_most(request)
    writing = asyncio.create_task(writer.write(request, call))
    stop._stops(writing)
    try:
        draft = await writing
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if stop.reason is not None and writing.cancelled() and not (current and current.cancelling()):
            return Stopped(call.record(LlmOutcome.STOPPED), stop.reason)
        raise
    except WriteFailed as exc:
        return Failed(exc.error_code, exc.message, call.record(exc.outcome))
    except LostOwnership:
        return Lost("ended elsewhere while a retry waited", call.record(LlmOutcome.NOT_SENT))
    except Exception as exc:  # noqa: BLE001 - a bug must end the job with what was sent, not strand it
        log.exception("job.unexpected_error")
        return Failed(ErrorCode.INTERNAL_ERROR, f"the worker failed unexpectedly: {type(exc).__name__}",
                      call.record(LlmOutcome.FAILED))
    return Completed(draft, call.record(LlmOutcome.SUCCEEDED))


def _describe(span: Span, outcome: Outcome) -> None:
    """What the run span says of its end: the usage the ledger charges, the
    attempts, whether it was billed; an error type and status on failure.
    Never the prompt or the story."""
    record = outcome.call
    span.set_attributes({
        "storyjobs.llm.attempts": record.attempt,
        "storyjobs.llm.outcome": record.outcome.value,
        "storyjobs.llm.billed": record.billed,
        "gen_ai.usage.input_tokens": record.input_tokens,
        "gen_ai.usage.output_tokens": record.output_tokens,
    })
    if isinstance(outcome, Failed):
        span.set_attribute("error.type", outcome.error_code.value)
        span.set_status(StatusCode.ERROR, outcome.error_code.value)
    elif isinstance(outcome, (Stopped, Lost)):
        span.set_attribute("storyjobs.job.stopped", outcome.reason)


def start(job: ClaimedJob, writer: StoryWriter, call: JobCall, stop: StopSignal, inbox: Inbox, *,
          tracer: Tracer | None = None) -> asyncio.Task[Outcome]:
    """The job's call in a task of its own, which reports its outcome to the
    round when it ends (``Finished``): the round acts on that report alone."""
    task = asyncio.create_task(execute(job, writer, call, stop, tracer=tracer), name=f"job-{job.id}")
    task.add_done_callback(lambda done: inbox.put(Finished(job.id, outcome_of(done, call, stop))))
    return task


def outcome_of(task: asyncio.Task[Outcome], call: JobCall, stop: StopSignal) -> Outcome:
    """A finished task's outcome, for its ``Finished`` report. One cancelled
    (the process is ending) returns none: where its call stood. One that
    raised (a defect outside the writer's call, which ``_run`` already
    turns into a failure) fails its job with what was sent, as ``_run``
    does: a job must not be stranded by a report that never came."""
    if task.cancelled():
        return Stopped(call.record(LlmOutcome.STOPPED), stop.reason or "shutdown")
    exc = task.exception()
    if exc is not None:
        log.error("job.unexpected_error", error=type(exc).__name__, exc_info=exc)
        return Failed(ErrorCode.INTERNAL_ERROR, f"the worker failed unexpectedly: {type(exc).__name__}",
                      call.record(LlmOutcome.FAILED))
    return task.result()


class LedgerHooks:
    """What a job's call asks of the database: a retry's ledger row (waited
    for through another worker's 429 pause and through database errors,
    which are transient here as everywhere in the worker), a shared pause
    after a 429, both at the rate limits the round holds (``limits``, read
    only); and the provider's headers, reported to the round."""

    def __init__(
        self,
        store: WorkerStore,
        job: ClaimedJob,
        inbox: Inbox,
        limits: Callable[[], RateLimits],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._job = job
        self._inbox = inbox
        self._limits = limits
        self._clock = clock
        self._sleep = sleep

    async def next_attempt(self, attempt: int, previous: LlmOutcome, error: str) -> RetryStart:
        """The next attempt's row (or not ours). The statement is idempotent:
        run again after its answer was lost, it answers the row it made."""
        errors = db.ErrorEpisode("worker", clock=self._clock, task="retry", job_id=str(self._job.public_id))
        backoff = Backoff()
        while True:
            try:
                started = await self._store.call_retry(self._job.id, attempt, previous, storable(error),
                                                       self._limits())
            except db.DB_ERRORS as exc:
                errors.failed(exc, attempt=attempt)
                await self._sleep(backoff.next_s())
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
            await self._store.pause(pause_s, self._limits())
        except db.DB_ERRORS as exc:
            # this job still waits out its own retry-after; only the others are not told
            log.warning("llm.pause_not_shared", pause_s=round(pause_s, 3), error=db.describe(exc))

    def provider_said(self, headers: Mapping[str, str]) -> None:
        view = ProviderView.from_headers(headers, seen_at=self._clock())
        if view is not None:
            self._inbox.put(Heard(view))
