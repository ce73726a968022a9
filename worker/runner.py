"""The worker: claim pending jobs, write their stories, settle them.

The coordinator's decisions are one method, ``Worker.round_once()``, which
writes what is waiting (failures, then written stories together with a claim
for the free slots: one statement, one commit per round however many jobs it
carries) and returns what it did; ``run()`` only repeats it and waits in
between. Each claimed job runs in its own task; a heartbeat task refreshes
every held job in one statement and stops the stream of any job that is no
longer ours; a listener task turns NOTIFY into an immediate claim, with a poll
every WORKER_POLL_INTERVAL_S as the fallback.

Every database error, of any kind, is met the same way in every loop: logged
once per episode with its SQLSTATE, waited out with backoff, never fatal. A
helper task that dies of anything else takes the worker down (``WorkerCrashed``,
a non-zero exit): a worker that claims but cannot heartbeat must not go on.

Crash-only: killed at any line, a held job stays ``running`` until the sweeper
fails it, and nobody calls the LLM for it again. On SIGTERM the worker stops
claiming, lets held jobs finish within WORKER_SHUTDOWN_GRACE_S, fails what is
left as ``interrupted`` (its stream closed), and returns.
"""

from __future__ import annotations

import asyncio
import enum
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

from shared import db
from shared.config import WorkerSettings
from shared.ratelimit import KINDS, LimiterState, ProviderView, RateLimits
from shared.rows import ClaimedJob, Completion, Draft, Failure, RetryStart
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest
from shared.text import storable, storable_or_none
from worker import metrics
from worker.store import WorkerStore
from worker.writing import JobCall, LostOwnership, StoryWriter, WriteFailed

log = structlog.get_logger()

# after the grace period, how long shutdown still tries to record the
# interrupted jobs before it gives up and leaves them to the sweeper
SHUTDOWN_FLUSH_S = 10.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0


def new_worker_id() -> str:
    """Unique per process start: a restarted pod with the same hostname is a
    new worker, and never mistakes its predecessor's jobs for its own."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class WorkerCrashed(RuntimeError):
    """A helper task (heartbeat, listener) died of something other than a
    database error; it was logged where it happened."""


class Phase(enum.Enum):
    WRITING = "writing"  # the LLM call is under way
    SETTLING = "settling"  # the story is written, its completion not yet committed


class HeldJob:
    __slots__ = ("job", "call", "task", "phase", "stop_reason", "claimed_at", "progress")

    def __init__(self, job: ClaimedJob, call: JobCall, claimed_at: float) -> None:
        self.job = job
        self.call = call
        self.task: asyncio.Task[None] | None = None
        self.phase = Phase.WRITING
        # why its stream was stopped: None while it runs normally
        self.stop_reason: str | None = None
        self.claimed_at = claimed_at
        # output tokens as reported to clients: never goes back, although the
        # estimate made while streaming may exceed the provider's final count
        self.progress = 0


@dataclass
class Claiming:
    """What the coordinator knows about claiming."""

    # a NOTIFY or the fallback poll said there may be pending jobs; a claim
    # that got fewer than it asked for says there are none
    work_may_wait: bool
    # when the next claim is due even without a NOTIFY: pushed back only by
    # a claim, so a busy coordinator that only settles still polls
    poll_due_at: float
    # a claim statement failed without an answer: it may have committed, and
    # the jobs it claimed are ours, with their first request never sent
    answer_lost: bool = False
    # the shared rate limiter held jobs back (or is paused): no claim before
    not_before: float = float("-inf")


@dataclass
class Shutdown:
    """Set by stop(): no more claims, held jobs finish within the grace."""

    grace_ends_at: float
    give_up_at: float
    streams_stopped: bool = False


@dataclass
class RoundResult:
    """What one round did, and how long the loop may wait before the next
    (it wakes earlier when a job finishes or a NOTIFY comes)."""

    completed: int = 0
    lost_races: int = 0  # completions or failures whose job had been ended elsewhere
    failed: int = 0
    claimed: int = 0
    adopted: int = 0
    unstorable: int = 0  # completions the database refused, failed instead
    database_error: str | None = None
    wait_s: float = 0.0
    finished: bool = False
    # when finished: everything held was recorded (False: left for the sweeper)
    clean: bool = True


@dataclass
class _Queues:
    """Written by job tasks, emptied by rounds."""

    completions: list[Completion] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        store: WorkerStore,
        writer: StoryWriter,
        *,
        listen: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.store = store
        self.worker_id = store.worker_id
        self._writer = writer
        self._listen = listen and settings.worker_listen
        self._clock = clock
        self._jobs: dict[int, HeldJob] = {}
        self._queues = _Queues()
        self._claiming = Claiming(work_may_wait=True, poll_due_at=clock() + settings.worker_poll_interval_s)
        self._shutdown: Shutdown | None = None
        # after the database refused a batch for its data, write one at a
        # time until the culprit is found
        self._isolating = False
        self._backoff_s = BACKOFF_FIRST_S
        self._errors = db.ErrorEpisode("worker", clock=clock, task="coordinator")
        self._limits = RateLimits.from_settings(settings)
        # what the provider's headers last said, until a claim round has told
        # the shared bucket
        self._provider_view: ProviderView | None = None
        self._wake = asyncio.Event()
        self._crashed: str | None = None
        self.claims = 0  # jobs claimed by this process, for logs

    # -- public -----------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; finish what is held within the grace period."""
        if self._shutdown is not None:
            return
        now = self._clock()
        grace = self.settings.worker_shutdown_grace_s
        self._shutdown = Shutdown(grace_ends_at=now + grace, give_up_at=now + grace + SHUTDOWN_FLUSH_S)
        log.info("worker.stopping", held=len(self._jobs), grace_s=grace)
        self._wake.set()

    @property
    def held_job_ids(self) -> list[int]:
        return list(self._jobs)

    async def run(self) -> bool:
        """Runs until stopped and drained. True when everything held was
        recorded; False when shutdown left jobs for the sweeper. Raises
        WorkerCrashed when a helper task died."""
        structlog.contextvars.bind_contextvars(worker_id=self.worker_id)
        metrics.WORKER_SLOTS.set(self.settings.worker_concurrency)
        log.info("worker.started", concurrency=self.settings.worker_concurrency,
                 provider=self._writer.provider, model=self._writer.model, listen=self._listen)
        helpers = [self._helper(self._heartbeat_loop(), "heartbeat")]
        if self._listen:
            helpers.append(self._helper(self._listen_loop(), "listener"))
        try:
            while True:
                if self._crashed is not None:
                    raise WorkerCrashed(f"the {self._crashed} task died")
                result = await self.round_once()
                if result.finished:
                    return result.clean
                await self._pause(result)
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            metrics.WORKER_BUSY.set(0)
            log.info("worker.stopped", claimed=self.claims, left=len(self._jobs))

    async def _pause(self, result: RoundResult) -> None:
        if result.database_error is not None:
            # the whole backoff: a job finishing must not hammer a database that is down
            await asyncio.sleep(result.wait_s)
            return
        if result.wait_s <= 0:
            return
        try:
            async with asyncio.timeout(result.wait_s):
                await self._wake.wait()
        except TimeoutError:
            pass

    # -- the round --------------------------------------------------------------------

    async def round_once(self) -> RoundResult:
        """One round of the coordinator: stop streams past the shutdown grace,
        write failures, adopt the claims of a lost answer, settle written
        stories and claim for free slots. Never raises for a database error:
        the result carries it, with the backoff to wait."""
        self._wake.clear()
        now = self._clock()
        shutdown = self._shutdown
        if shutdown is not None:
            if now >= shutdown.grace_ends_at and not shutdown.streams_stopped:
                shutdown.streams_stopped = True
                self._stop_streams("shutdown")
            if now >= shutdown.give_up_at:
                log.error("worker.shutdown_abandoned", job_ids=[str(h.job.public_id) for h in self._jobs.values()],
                          detail="could not record these jobs; the sweeper will fail them")
                return RoundResult(finished=True, clean=False)
        if now >= self._claiming.poll_due_at:
            self._claiming.work_may_wait = True
        if not (self._queues.failures or self._queues.completions or self._claiming.answer_lost
                or self._claim_limit() > 0):
            if shutdown is not None and not self._jobs:
                return RoundResult(finished=True)
            return RoundResult(wait_s=self._idle_wait_s(now))
        result = RoundResult()
        try:
            if self._queues.failures:
                await self._write_failures(result)
            if self._claiming.answer_lost:
                await self._adopt_lost_claims(result)
            claim_limit = self._claim_limit()
            if self._queues.completions or claim_limit:
                await self._settle_and_claim(claim_limit, result)
                if claim_limit:
                    self._claiming.poll_due_at = now + self.settings.worker_poll_interval_s
        except db.DB_ERRORS as exc:
            self._errors.failed(exc, held=len(self._jobs), unsaved_stories=len(self._queues.completions))
            result.database_error = db.describe(exc)
            result.wait_s = self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
            return result
        self._errors.succeeded()
        self._backoff_s = BACKOFF_FIRST_S
        metrics.WORKER_BUSY.set(len(self._jobs))
        return result

    def _free_slots(self) -> int:
        """A job whose story waits to be settled leaves in the same statement
        that claims, so its slot is already free for that claim."""
        return max(0, self.settings.worker_concurrency - len(self._jobs) + len(self._queues.completions))

    def _claim_limit(self) -> int:
        """How many jobs the next statement claims: none while stopping, while
        no work may be waiting, or while the rate limiter holds jobs back;
        else the free slots."""
        if (self._shutdown is not None or not self._claiming.work_may_wait
                or self._clock() < self._claiming.not_before):
            return 0
        return self._free_slots()

    def _idle_wait_s(self, now: float) -> float:
        """Until the next deadline: the poll (if a slot is free to claim
        with), the end of the grace, the shutdown's last chance. Without
        one, a job finishing or a NOTIFY wakes the loop first."""
        deadlines = ([max(self._claiming.poll_due_at, self._claiming.not_before)]
                     if self._shutdown is None and self._free_slots() else [])
        if self._shutdown is not None:
            deadlines.append(self._shutdown.give_up_at)
            if not self._shutdown.streams_stopped:
                deadlines.append(self._shutdown.grace_ends_at)
        future = [deadline - now for deadline in deadlines if deadline > now]
        return min(future, default=self.settings.worker_poll_interval_s)

    def _take(self, queue: list[Completion] | list[Failure]) -> int:
        """How many of a queue the next statement carries: all of it, or one
        while a batch refused for its data is being taken apart."""
        return 1 if self._isolating else len(queue)

    async def _write_failures(self, result: RoundResult) -> None:
        queue = self._queues.failures
        batch = queue[:self._take(queue)]
        try:
            failed_ids = set(await self.store.fail_running(batch))
        except db.DB_ERRORS as exc:
            self._reraise_unless_refused_alone(exc, batch)
            # one failure the database will never take: leave the job to the
            # sweeper, which fails it once its heartbeats stop
            del queue[0]
            log.error("job.failure_unrecorded", job_id=self._release(batch[0].job_id), error=db.describe(exc))
            return
        del queue[:len(batch)]
        for failure in batch:
            public_id = self._release(failure.job_id)
            if failure.job_id in failed_ids:
                result.failed += 1
                metrics.FAILED.inc()
                log.warning("job.failed", job_id=public_id, error_code=failure.error_code, error=failure.error_text)
            else:
                result.lost_races += 1
                metrics.LOST_FAILURE.inc()
                log.info("job.lost_race", job_id=public_id, transition="running_to_failed",
                         detail="the job had already been failed elsewhere")
        if len(batch) == 1:
            self._isolating = False

    async def _adopt_lost_claims(self, result: RoundResult) -> None:
        """A claim whose answer was lost (connection dropped around its
        commit) left jobs running under our id that never reached us. Their
        LLM call was certainly never sent, so they are ours to run now, also
        while stopping: they are held like any other."""
        for job in await self.store.claims_of_lost_answer(list(self._jobs)):
            log.warning("job.adopted", job_id=str(job.public_id), detail="claimed by a statement whose answer was lost")
            self._hold(job)
            result.adopted += 1
        self._claiming.answer_lost = False

    async def _settle_and_claim(self, claim_limit: int, result: RoundResult) -> None:
        queue = self._queues.completions
        batch = queue[:self._take(queue)]
        view = self._provider_view
        try:
            settled = await self.store.settle_and_claim(batch, claim_limit, view)
        except db.DB_ERRORS as exc:
            self._claiming.answer_lost = self._claiming.answer_lost or (claim_limit > 0 and db.is_transient(exc))
            self._reraise_unless_refused_alone(exc, batch)
            # one story the database will not store: the job fails instead
            # of holding the worker's every next round
            (completion,) = batch
            del queue[0]
            self._queue_failure(self._jobs[completion.job_id], ErrorCode.INTERNAL_ERROR,
                                f"the story could not be stored ({db.describe(exc)})", LlmOutcome.SUCCEEDED,
                                billed=True)
            result.unstorable += 1
            log.error("job.completion_unstorable", job_id=self._public_id(completion.job_id), error=db.describe(exc))
            return
        del queue[:len(batch)]
        if len(batch) <= 1:
            self._isolating = False
        completed = set(settled.completed_ids).union(settled.already_completed_ids)
        for completion in batch:
            public_id = self._release(completion.job_id)
            if completion.job_id in completed:
                result.completed += 1
                metrics.COMPLETED.inc()
                log.info("job.completed", job_id=public_id, output_tokens=completion.output_tokens,
                         cost_usd=str(completion.cost_usd))
            else:
                result.lost_races += 1
                metrics.LOST_COMPLETION.inc()
                log.warning("job.lost_race", job_id=public_id, transition="running_to_completed",
                            detail="sweeper raced, story orphaned")
        for job in settled.claimed:
            self.claims += 1
            metrics.CLAIMED.inc()
            metrics.JOB_QUEUE_WAIT.observe(max((job.started_at - job.created_at).total_seconds(), 0.0))
            self._hold(job)
        result.claimed = len(settled.claimed)
        if settled.claimed:
            metrics.WORKER_LAST_CLAIM.set_to_current_time()
        if self._provider_view is view:
            self._provider_view = None  # told to the shared bucket
        self._limited(settled.limiter, claim_limit, len(settled.claimed))

    def _limited(self, limiter: LimiterState, claim_limit: int, claimed: int) -> None:
        """What the shared rate limiter said: its gauges, and when a claim is
        worth trying again if it held jobs back."""
        for kind in KINDS:
            available = getattr(limiter, kind)
            if available is not None:
                metrics.LLM_RATELIMIT_AVAILABLE.labels(kind=kind).set(available)
        held_back = claim_limit > 0 and (limiter.paused_s > 0 or limiter.next_output_tokens is not None)
        if held_back:
            metrics.LLM_RATELIMIT_WAITS.inc()
            self._claiming.not_before = self._clock() + limiter.wait_s(self._limits)
        elif claimed < claim_limit:
            self._claiming.work_may_wait = False

    def _reraise_unless_refused_alone(self, exc: Exception, batch: Sequence[Completion | Failure]) -> None:
        """After a database error writing a batch: raise it again (a
        transient error is waited out; a batch refused for its data is then
        written one item at a time), unless the one item of a batch was
        refused for good, which the caller then deals with."""
        if db.is_transient(exc) or not batch:
            raise exc
        if len(batch) > 1:
            self._isolating = True
            raise exc

    def _release(self, job_id: int) -> str | None:
        """Lets go of a job whose end was written; its public id, for logs."""
        held = self._jobs.pop(job_id, None)
        return str(held.job.public_id) if held else None

    def _public_id(self, job_id: int) -> str | None:
        held = self._jobs.get(job_id)
        return str(held.job.public_id) if held else None

    # -- one job ------------------------------------------------------------------

    def _hold(self, job: ClaimedJob) -> None:
        """Holds a job and starts its task at once, so that the heartbeat
        never sees a held job that is not running."""
        held = HeldJob(job, self._job_call(job), self._clock())
        self._jobs[job.id] = held
        held.task = asyncio.create_task(self._write(held), name=f"job-{job.id}")
        held.task.add_done_callback(lambda _: self._cancelled_before_start(held))

    def _cancelled_before_start(self, held: HeldJob) -> None:
        """A task stopped on purpose before its first step never runs its
        body, so nothing was sent for its job: record that here."""
        if not (held.task is not None and held.task.cancelled() and held.stop_reason is not None
                and self._jobs.get(held.job.id) is held):
            return
        if held.stop_reason == "shutdown":
            self._queue_failure(held, ErrorCode.INTERRUPTED, "the worker shut down before the story was started",
                                LlmOutcome.NOT_SENT, billed=False)
            self._wake.set()
        else:
            self._lost_ownership(held, f"{held.stop_reason} before its request was sent")

    def _job_call(self, job: ClaimedJob) -> JobCall:
        return JobCall(self._writer.price, _JobHooks(self, job), max_tokens=job.max_tokens)

    def heard(self, headers: Mapping[str, str]) -> None:
        """An answer's anthropic-ratelimit-* headers: told to the shared bucket
        at the next claim round."""
        view = ProviderView.from_headers(headers, seen_at=self._clock())
        if view is not None:
            self._provider_view = view

    async def _write(self, held: HeldJob) -> None:
        job, call = held.job, held.call
        structlog.contextvars.bind_contextvars(job_id=str(job.public_id))
        log.debug("job.claimed", queue_wait_s=(job.started_at - job.created_at).total_seconds())
        try:
            try:
                request = msgspec.convert(job.request, StoryRequest)
            except msgspec.ValidationError as exc:
                self._fail(held, ErrorCode.INVALID_REQUEST, f"the stored request is not valid: {exc}",
                           LlmOutcome.REJECTED, billed=False)
                return
            draft = await self._writer.write(request, call)
        except WriteFailed as exc:
            self._fail(held, exc.error_code, exc.message, exc.outcome, billed=exc.billed)
        except LostOwnership:
            # the guarded statement closed the previous attempt's row and sent nothing
            self._lost_ownership(held, "ended elsewhere while a retry waited")
        except asyncio.CancelledError:
            if held.stop_reason is None:
                raise
            await self._stopped_mid_call(held)
        except Exception as exc:  # noqa: BLE001 - a bug must fail the job, not strand it
            log.exception("job.unexpected_error")
            self._fail(held, ErrorCode.INTERNAL_ERROR, f"the worker failed unexpectedly: {type(exc).__name__}",
                       LlmOutcome.FAILED, billed=True)
        else:
            self._record_call(LlmOutcome.SUCCEEDED, call)
            held.phase = Phase.SETTLING
            self._queues.completions.append(_completion(job, call.attempt, draft))
        finally:
            metrics.JOB_RUN.observe(self._clock() - held.claimed_at)
            self._wake.set()

    def _fail(self, held: HeldJob, code: ErrorCode, message: str, outcome: LlmOutcome, *, billed: bool) -> None:
        self._record_call(outcome, held.call, billed=billed)
        self._queue_failure(held, code, message, outcome, billed=billed)

    def _queue_failure(
        self, held: HeldJob, code: ErrorCode, message: str, outcome: LlmOutcome, *, billed: bool
    ) -> None:
        call = held.call
        held.phase = Phase.SETTLING
        self._queues.failures.append(
            Failure(
                job_id=held.job.id,
                attempt=call.attempt,
                error_code=code,
                error_text=storable(message),
                call_outcome=outcome,
                billed=billed,
                input_tokens=call.input_tokens,
                output_tokens=call.output_tokens,
                cost_usd=call.cost_usd,
            )
        )

    def _lost_ownership(self, held: HeldJob, reason: str) -> None:
        metrics.LOST_OWNERSHIP.inc()
        log.warning("job.lost_ownership", job_id=str(held.job.public_id), reason=reason)
        self._jobs.pop(held.job.id, None)

    async def _stopped_mid_call(self, held: HeldJob) -> None:
        """The stream was closed on purpose: record what it cost."""
        call = held.call
        log.warning("job.stream_stopped", reason=held.stop_reason, output_tokens=call.output_tokens)
        if held.stop_reason == "shutdown":
            # still ours: fail it now rather than leave it to the sweeper
            self._fail(held, ErrorCode.INTERRUPTED, "the worker shut down before the story was finished",
                       LlmOutcome.STOPPED, billed=True)
            return
        self._record_call(LlmOutcome.STOPPED, call)
        try:
            await self.store.call_finish(
                held.job.id, call.attempt, outcome=LlmOutcome.STOPPED, billed=True,
                input_tokens=call.input_tokens, output_tokens=call.output_tokens, cost_usd=call.cost_usd,
                error_text=f"stream stopped: job {held.stop_reason}",
            )
        except db.DB_ERRORS as exc:
            # whoever ended the job closed the row as interrupted; only the partial usage is lost
            log.warning("llm.ledger_write_failed", attempt=call.attempt, error=db.describe(exc))
        finally:
            # held until its ledger row says what it cost
            self._jobs.pop(held.job.id, None)
            metrics.WORKER_BUSY.set(len(self._jobs))

    def _record_call(self, outcome: LlmOutcome, call: JobCall, *, billed: bool = True) -> None:
        metrics.LLM_REQUESTS_BY_OUTCOME[outcome].inc()
        if billed:
            metrics.INPUT_TOKENS.inc(call.input_tokens)
            metrics.OUTPUT_TOKENS.inc(call.output_tokens)
            metrics.LLM_COST.inc(float(call.cost_usd))

    def _stop_streams(self, reason: str) -> None:
        for held in self._jobs.values():
            if held.phase is Phase.WRITING and held.task is not None and held.stop_reason is None:
                held.stop_reason = reason
                held.task.cancel()

    # -- heartbeats ------------------------------------------------------------------

    async def heartbeat_once(self) -> list[int]:
        """Refreshes every held job in one statement; stops the stream of each
        job that is no longer ours, and returns their ids."""
        if not self._jobs:
            return []
        for held in self._jobs.values():
            held.progress = max(held.progress, held.call.output_tokens)
        progress = {job_id: held.progress for job_id, held in self._jobs.items()}
        rows = await self.store.heartbeat(progress)
        alive = {row.id for row in rows if row.alive}
        reasons = {row.id: row.error_code or row.status for row in rows}
        return [job_id for job_id in progress.keys() - alive if self._lost(job_id, reasons.get(job_id) or "gone")]

    async def _heartbeat_loop(self) -> None:
        errors = db.ErrorEpisode("worker", clock=self._clock, task="heartbeat")
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await self.heartbeat_once()
            except db.DB_ERRORS as exc:
                errors.failed(exc, jobs=len(self._jobs))
                continue
            errors.succeeded()

    def _lost(self, job_id: int, reason: str) -> bool:
        """The job is no longer ours (swept or cancelled): stop paying for it."""
        held = self._jobs.get(job_id)
        if held is None or held.phase is Phase.SETTLING or held.stop_reason is not None:
            return False
        held.stop_reason = reason
        metrics.LOST_OWNERSHIP.inc()
        log.warning("job.lost_ownership", job_id=str(held.job.public_id), reason=reason)
        if held.task is not None:
            held.task.cancel()
        return True

    # -- wake-ups and helpers --------------------------------------------------------------

    async def _listen_loop(self) -> None:
        errors = db.ErrorEpisode("worker", clock=self._clock, task="listener")
        delay = BACKOFF_FIRST_S
        while True:
            try:
                async for _ in self.store.notifications():
                    errors.succeeded()
                    delay = BACKOFF_FIRST_S
                    self._notified()
            except db.DB_ERRORS as exc:
                errors.failed(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    def _notified(self) -> None:
        self._claiming.work_may_wait = True
        self._wake.set()

    def _helper(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(work, name=name)
        task.add_done_callback(self._helper_done)
        return task

    def _helper_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        log.error("worker.task_crashed", task=task.get_name(), error=repr(exc),
                  detail="the worker stops: it must not hold jobs it cannot heartbeat", exc_info=exc)
        self._crashed = task.get_name()
        self._wake.set()


class _JobHooks:
    """A job's call asking its worker for a retry's ledger row, a shared
    pause after a 429, and to hear the provider's rate-limit headers."""

    def __init__(self, worker: Worker, job: ClaimedJob) -> None:
        self._worker = worker
        self._job = job

    async def next_attempt(self, attempt: int, previous: LlmOutcome, error: str) -> RetryStart:
        started = await self._worker.store.call_retry(self._job.id, attempt, previous, storable(error))
        if started.attempt is None and started.owned:
            # held by a 429's pause: the previous attempt is counted when the
            # retry's row is opened, after the wait
            metrics.LLM_RATELIMIT_WAITS.inc()
        else:
            metrics.LLM_REQUESTS_BY_OUTCOME[previous].inc()
        return started

    async def rate_limited(self, pause_s: float) -> None:
        metrics.LLM_RATELIMITED.inc()
        try:
            await self._worker.store.pause(pause_s)
        except db.DB_ERRORS as exc:
            # this job still waits out its own retry-after; only the others are not told
            log.warning("llm.pause_not_shared", pause_s=round(pause_s, 3), error=db.describe(exc))

    def provider_said(self, headers: Mapping[str, str]) -> None:
        self._worker.heard(headers)


def _completion(job: ClaimedJob, attempt: int, draft: Draft) -> Completion:
    """The job's completion, with the provider's text made storable."""
    return Completion(
        job_id=job.id,
        client_id=job.client_id,
        attempt=attempt,
        title=storable(draft.title),
        body=storable(draft.body),
        model=storable(draft.model),
        prompt_version=draft.prompt_version,
        input_tokens=draft.input_tokens,
        output_tokens=draft.output_tokens,
        cost_usd=draft.cost_usd,
        request_id=storable_or_none(draft.request_id),
    )

