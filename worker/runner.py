"""The worker's loop: claim pending jobs, write their stories, settle them.

One coordinator task owns every state change. Each round it sends one
statement, job_settle_and_claim, that completes the stories written since
the last round and claims as many pending jobs as there are free slots: one
commit per round however many jobs it carries. Each claimed job runs in its
own task; a heartbeat task refreshes every held job in one statement and
stops the stream of any job that is no longer ours; a listener task turns
NOTIFY into an immediate claim, with a slow poll as the fallback.

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
from collections.abc import Callable

import msgspec
import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool

from shared import db, store
from shared.config import WorkerSettings
from shared.rows import ClaimedJob, Completion, Failure
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest
from worker import metrics
from worker.writing import JobCall, StoryWriter, WriteFailed

log = structlog.get_logger()

DB_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)
# after the grace period, how long shutdown still tries to record the
# interrupted jobs before it gives up and leaves them to the sweeper
_SHUTDOWN_FLUSH_S = 10.0
_MAX_BACKOFF_S = 5.0


def new_worker_id() -> str:
    """Unique per process start: a restarted pod with the same hostname is a
    new worker, and never mistakes its predecessor's jobs for its own."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


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


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        pool: AsyncConnectionPool,
        writer: StoryWriter,
        *,
        listen_url: str | None,
        worker_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.worker_id = worker_id or new_worker_id()
        self._pool = pool
        self._writer = writer
        self._listen_url = listen_url if settings.worker_listen else None
        self._clock = clock
        self._jobs: dict[int, HeldJob] = {}
        self._completions: list[Completion] = []
        self._failures: list[Failure] = []
        self._wake = asyncio.Event()
        self._maybe_work = True
        self._claims_uncertain = False
        self._stopping = False
        self._stopped = asyncio.Event()
        self._db_down_since: float | None = None
        self._grace_ends: float | None = None
        self.claims = 0  # jobs claimed by this process, for tests and logs

    # -- public -----------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; finish what is held within the grace period."""
        if self._stopping:
            return
        self._stopping = True
        log.info("worker.stopping", held=len(self._jobs), grace_s=self.settings.worker_shutdown_grace_s)
        self._stopped.set()
        self._wake.set()

    @property
    def held_job_ids(self) -> list[int]:
        return list(self._jobs)

    async def run(self) -> bool:
        """Runs until stopped and drained. True when everything held was
        recorded; False when shutdown left jobs for the sweeper."""
        structlog.contextvars.bind_contextvars(worker_id=self.worker_id)
        metrics.WORKER_SLOTS.set(self.settings.worker_concurrency)
        log.info("worker.started", concurrency=self.settings.worker_concurrency,
                 provider=self._writer.provider, model=self._writer.model,
                 listen=self._listen_url is not None)
        helpers = [asyncio.create_task(self._heartbeat_loop(), name="heartbeat")]
        if self._listen_url is not None:
            helpers.append(asyncio.create_task(self._listen_loop(self._listen_url), name="listen"))
        grace = asyncio.create_task(self._enforce_grace(), name="grace")
        try:
            return await self._coordinate()
        finally:
            for task in (*helpers, grace):
                task.cancel()
            await asyncio.gather(*helpers, grace, return_exceptions=True)
            metrics.WORKER_BUSY.set(0)
            log.info("worker.stopped", claimed=self.claims, left=len(self._jobs))

    # -- coordinator --------------------------------------------------------------

    async def _coordinate(self) -> bool:
        backoff = 0.5
        give_up_at: float | None = None
        next_poll = self._clock() + self.settings.worker_poll_interval_s
        while True:
            self._wake.clear()
            if self._stopping and not self._jobs and not self._completions and not self._failures:
                return True
            if self._stopping and give_up_at is None and self._shutdown_deadline_passed():
                give_up_at = self._clock() + _SHUTDOWN_FLUSH_S
            if give_up_at is not None and self._clock() > give_up_at:
                log.error("worker.shutdown_abandoned", job_ids=list(self._jobs),
                          detail="could not record these jobs; the sweeper will fail them")
                return False
            claim_limit = 0 if self._stopping else self._free_slots()
            want_claim = claim_limit > 0 and self._maybe_work
            if self._failures or self._completions or want_claim or self._claims_uncertain:
                try:
                    if self._failures:
                        await self._flush_failures()
                    if self._completions or want_claim or self._claims_uncertain:
                        await self._settle_and_claim(claim_limit if want_claim else 0)
                    self._database_back()
                    backoff = 0.5
                    next_poll = self._clock() + self.settings.worker_poll_interval_s
                except DB_ERRORS as exc:
                    self._database_down(exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            timeout = max(next_poll - self._clock(), 0.0) if not self._stopping else 1.0
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                if self._clock() >= next_poll:
                    self._maybe_work = True
                    next_poll = self._clock() + self.settings.worker_poll_interval_s

    def _free_slots(self) -> int:
        # a job whose story waits in _completions leaves in the same statement
        # that claims, so its slot is already free for that claim
        return self.settings.worker_concurrency - len(self._jobs) + len(self._completions)

    async def _settle_and_claim(self, claim_limit: int) -> None:
        batch, self._completions = self._completions, []
        try:
            async with self._pool.connection() as conn:
                if self._claims_uncertain:
                    await self._adopt_lost_claims(conn)
                    claim_limit = max(0, claim_limit - sum(1 for j in self._jobs.values() if j.task is None))
                result = await store.job_settle_and_claim(
                    conn,
                    worker_id=self.worker_id,
                    completions=batch,
                    claim_limit=claim_limit,
                    provider=self._writer.provider,
                    model=self._writer.model,
                )
        except BaseException:
            # keep the written stories: the next round completes them
            self._completions = batch + self._completions
            self._claims_uncertain = self._claims_uncertain or claim_limit > 0
            raise
        self._claims_uncertain = False
        completed = set(result.completed_ids).union(result.already_completed_ids)
        for completion in batch:
            held = self._jobs.pop(completion.job_id, None)
            public_id = str(held.job.public_id) if held else None
            if completion.job_id in completed:
                metrics.COMPLETED.inc()
                log.info("job.completed", job_id=public_id, output_tokens=completion.output_tokens,
                         cost_usd=str(completion.cost_usd))
            else:
                metrics.LOST_COMPLETION.inc()
                log.warning("job.lost_race", job_id=public_id, transition="running_to_completed",
                            detail="sweeper raced, story orphaned")
        for job in result.claimed:
            self._start(job)
        for held in list(self._jobs.values()):
            if held.task is None:  # adopted after an uncertain claim
                self._start_task(held)
        if result.claimed:
            metrics.WORKER_LAST_CLAIM.set_to_current_time()
        if len(result.claimed) < claim_limit:
            self._maybe_work = False
        metrics.WORKER_BUSY.set(len(self._jobs))

    async def _adopt_lost_claims(self, conn: store.Conn) -> None:
        """A claim whose answer was lost (connection dropped around its
        commit) left jobs running under our id that never reached us. Their
        LLM call was certainly never sent, so they are ours to run now."""
        for job in await store.job_list_running_for_worker(
            conn, worker_id=self.worker_id, known_ids=list(self._jobs)
        ):
            log.warning("job.adopted", job_id=str(job.public_id),
                        detail="claimed by a statement whose answer was lost")
            self._jobs[job.id] = HeldJob(job, self._job_call(job), self._clock())

    async def _flush_failures(self) -> None:
        batch, self._failures = self._failures, []
        try:
            async with self._pool.connection() as conn:
                failed_ids = set(await store.job_fail_running(conn, worker_id=self.worker_id, failures=batch))
        except BaseException:
            self._failures = batch + self._failures
            raise
        for failure in batch:
            held = self._jobs.pop(failure.job_id, None)
            public_id = str(held.job.public_id) if held else None
            if failure.job_id in failed_ids:
                metrics.FAILED.inc()
                log.warning("job.failed", job_id=public_id, error_code=failure.error_code,
                            error=failure.error_text)
            else:
                metrics.LOST_FAILURE.inc()
                log.info("job.lost_race", job_id=public_id, transition="running_to_failed",
                         detail="the job had already been failed elsewhere")
        metrics.WORKER_BUSY.set(len(self._jobs))

    # -- one job ------------------------------------------------------------------

    def _job_call(self, job: ClaimedJob) -> JobCall:
        async def next_attempt(attempt: int, previous: LlmOutcome, error: str) -> int:
            metrics.LLM_REQUESTS_BY_OUTCOME[previous].inc()
            async with self._pool.connection() as conn:
                return await store.llm_call_start(
                    conn,
                    job_id=job.id,
                    previous_attempt=attempt,
                    previous_outcome=previous.value,
                    previous_billed=not previous.certainly_unbilled,
                    previous_error=error,
                )

        return JobCall(self._writer.price, next_attempt)

    def _start(self, job: ClaimedJob) -> None:
        self.claims += 1
        metrics.CLAIMED.inc()
        metrics.JOB_QUEUE_WAIT.observe(max((job.started_at - job.created_at).total_seconds(), 0.0))
        held = HeldJob(job, self._job_call(job), self._clock())
        self._jobs[job.id] = held
        self._start_task(held)

    def _start_task(self, held: HeldJob) -> None:
        held.task = asyncio.create_task(self._write(held), name=f"job-{held.job.id}")

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
            self._completions.append(
                Completion(
                    job_id=job.id,
                    client_id=job.client_id,
                    attempt=call.attempt,
                    title=draft.title,
                    body=draft.body,
                    model=draft.model,
                    prompt_version=draft.prompt_version,
                    input_tokens=draft.input_tokens,
                    output_tokens=draft.output_tokens,
                    cost_usd=draft.cost_usd,
                    request_id=draft.request_id,
                )
            )
        finally:
            metrics.JOB_RUN.observe(self._clock() - held.claimed_at)
            self._wake.set()

    def _fail(self, held: HeldJob, code: ErrorCode, message: str, outcome: LlmOutcome, *, billed: bool) -> None:
        call = held.call
        self._record_call(outcome, call, billed=billed)
        self._failures.append(
            Failure(
                job_id=held.job.id,
                attempt=call.attempt,
                error_code=code.value,
                error_text=message,
                call_outcome=outcome.value,
                billed=billed,
                input_tokens=call.input_tokens,
                output_tokens=call.output_tokens,
                cost_usd=call.cost_usd,
            )
        )

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
            async with self._pool.connection() as conn:
                await store.llm_call_finish(
                    conn, job_id=held.job.id, attempt=call.attempt, outcome=LlmOutcome.STOPPED.value, billed=True,
                    input_tokens=call.input_tokens, output_tokens=call.output_tokens,
                    cost_usd=call.cost_usd, error_text=f"stream stopped: job {held.stop_reason}",
                )
        except DB_ERRORS as exc:
            # the sweeper closed the row as interrupted; only the partial usage is lost
            log.warning("llm.ledger_write_failed", attempt=call.attempt, error=str(exc).strip()[:200])
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

    # -- heartbeats ------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            if not self._jobs:
                continue
            for held in self._jobs.values():
                held.progress = max(held.progress, held.call.output_tokens)
            progress = {job_id: held.progress for job_id, held in self._jobs.items()}
            try:
                async with self._pool.connection() as conn:
                    rows = await store.job_heartbeat(conn, worker_id=self.worker_id, progress=progress)
            except DB_ERRORS as exc:
                if not failing:
                    log.warning("worker.heartbeat_failed", jobs=len(progress), error=str(exc).strip()[:200])
                failing = True
                continue
            if failing:
                log.info("worker.heartbeat_recovered", jobs=len(progress))
                failing = False
            alive = {row.id for row in rows if row.alive}
            reasons = {row.id: row.error_code or row.status for row in rows}
            for job_id in progress.keys() - alive:
                self._lost(job_id, reasons.get(job_id) or "gone")

    def _lost(self, job_id: int, reason: str) -> None:
        """The job is no longer ours (swept or cancelled): stop paying for it."""
        held = self._jobs.get(job_id)
        if held is None or held.phase is Phase.SETTLING or held.stop_reason is not None:
            return
        held.stop_reason = reason
        metrics.LOST_OWNERSHIP.inc()
        log.warning("job.lost_ownership", job_id=str(held.job.public_id), reason=reason)
        if held.task is not None:
            held.task.cancel()

    # -- wake-ups ------------------------------------------------------------------

    async def _listen_loop(self, url: str) -> None:
        delay = 0.5
        while True:
            try:
                conn = await db.connect(url, application_name="storyjobs-worker-listen",
                                        connect_timeout_s=self.settings.db_connect_timeout_s)
                async with conn:
                    await store.job_listen_pending(conn)
                    delay = 0.5
                    # notifications sent while we were not listening are lost
                    self._notified()
                    async for _ in conn.notifies():
                        self._notified()
            except DB_ERRORS as exc:
                log.info("worker.listen_reconnecting", retry_in_s=delay, error=str(exc).strip()[:200])
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)

    def _notified(self) -> None:
        self._maybe_work = True
        self._wake.set()

    # -- shutdown and outages -------------------------------------------------------------

    async def _enforce_grace(self) -> None:
        await self._stopped.wait()
        self._grace_ends = self._clock() + self.settings.worker_shutdown_grace_s
        await asyncio.sleep(self.settings.worker_shutdown_grace_s)
        for held in self._jobs.values():
            if held.phase is Phase.WRITING and held.task is not None and held.stop_reason is None:
                held.stop_reason = "shutdown"
                held.task.cancel()

    def _shutdown_deadline_passed(self) -> bool:
        return self._grace_ends is not None and self._clock() > self._grace_ends

    def _database_down(self, exc: Exception) -> None:
        if self._db_down_since is None:
            self._db_down_since = self._clock()
            log.warning("worker.database_unavailable", error=str(exc).strip()[:200],
                        held=len(self._jobs), unsaved_stories=len(self._completions))

    def _database_back(self) -> None:
        if self._db_down_since is not None:
            log.info("worker.database_recovered", down_s=round(self._clock() - self._db_down_since, 1))
            self._db_down_since = None
