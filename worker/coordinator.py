"""The worker's coordinator: the one loop that owns the jobs this process holds.

A job enters the held set in a round (claimed, or adopted after a claim's
answer was lost) and leaves it in a round, once its end is written: only
``round_once`` adds to or removes from it, and what a round did (counted and
logged once, here) is what it returns. Around it, each in its own module:

* the executor (worker/executor.py) runs one job's call in the job's task
  and returns an outcome: Completed, Failed, Stopped or Lost;
* the heartbeat (worker/heartbeat.py) refreshes every held job and asks the
  coordinator to stop the stream of a job that is no longer ours;
* the listener (worker/listener.py) turns NOTIFY into an immediate claim.

A round collects the outcomes of finished tasks into the ends they need
written (a completion, a failure, or the ledger row of a stream stopped for
a job no longer ours), writes them (failures, stopped calls, then written
stories together with a claim for the free slots: one statement, one commit
for all of them) and claims. What was sent is known, never inferred:

* a job this process has begun stays held until its end is written, so
  adoption (which skips held jobs) can never begin it a second time;
* an end the database refuses for its data is written in a form it cannot
  refuse (numbers already checked against what the columns hold, text made
  storable, a fixed error text); if even that is refused the job stays held
  and the write is retried with backoff, never the request;
* a refused batch is taken apart one end at a time, and its stories are
  then written by a statement that only settles (no claim, no rate bucket
  round), so that a refusal of the claim is never blamed on a story, which
  was paid for; nothing is claimed until the batch is taken apart;
* after a claim's answer is lost, the jobs it may have claimed are adopted
  until the statement can no longer commit (its statement timeout), since
  the server may still be running it.

Every database error is met the same way: logged once per episode with its
SQLSTATE, waited out with backoff, never fatal. A helper task that dies of
anything else takes the worker down (``WorkerCrashed``). Crash-only: killed
at any line, a held job stays ``running`` until the sweeper fails it, and
nobody calls the LLM for it again. On SIGTERM the worker stops claiming,
lets held jobs finish within WORKER_SHUTDOWN_GRACE_S, fails what is left as
``interrupted`` (its stream closed), and returns.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import structlog
from psycopg_pool import PoolTimeout

from shared import db
from shared.config import WorkerSettings
from shared.provider_numbers import INT32_MAX
from shared.ratelimit import KINDS, LimiterState, ProviderView, RateLimits
from shared.rows import ClaimedJob, Completion, Failure, SettleResult
from shared.status import ErrorCode, LlmOutcome
from shared.text import storable, storable_or_none
from worker import metrics
from worker.executor import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    Completed,
    Failed,
    LedgerHooks,
    Lost,
    Outcome,
    execute,
    outcome_of,
)
from worker.heartbeat import Heartbeat
from worker.listener import listen
from worker.store import WorkerStore
from worker.writing import CallRecord, JobCall, StoryWriter, job_call

log = structlog.get_logger()

# after the grace period, how long shutdown still tries to record the
# interrupted jobs before it gives up and leaves them to the sweeper
SHUTDOWN_FLUSH_S = 10.0
# a claim statement whose answer was lost can still commit on the server
# until its statement timeout; adoption looks for its jobs until then
STATEMENT_TIMEOUT_S = 30.0
_ADOPTION_MARGIN_S = 5.0
# while a lost claim may still commit, how often an idle round looks again
_ADOPTION_RECHECK_S = 1.0
# an end refused in every form is tried again at most this often
_END_RETRY_MAX_S = 60.0
# refused as it was, then in its safe form: from then on it is retried, and
# given up once the job is no longer ours
_REFUSALS_GIVEN_UP = 3
# what a money column (numeric(14, 6)) holds
_USD_MAX = Decimal("99999999.999999")
SHUTDOWN = "shutdown"


def new_worker_id() -> str:
    """Unique per process start: a restarted pod with the same hostname is a
    new worker, and never mistakes its predecessor's jobs for its own."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class WorkerCrashed(RuntimeError):
    """A helper task (heartbeat, listener) died of something other than a
    database error; it was logged where it happened."""


End = Completion | Failure | CallRecord
"""What a held job needs written before it can be let go: its completion,
its failure, or (for a job no longer ours) its stopped call's ledger row."""


class HeldJob:
    __slots__ = ("job", "call", "task", "claimed_at", "progress", "stop_reason", "end", "refusals", "retry_at",
                 "found_gone")

    def __init__(self, job: ClaimedJob, call: JobCall, claimed_at: float) -> None:
        self.job = job
        self.call = call
        self.task: asyncio.Task[Outcome] | None = None
        self.claimed_at = claimed_at
        # output tokens as reported to clients: never goes back (heartbeat only)
        self.progress = 0
        # why the coordinator stopped its call: None while it runs normally
        self.stop_reason: str | None = None
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


@dataclass
class Claiming:
    """What the coordinator knows about claiming."""

    # a NOTIFY or the fallback poll said there may be pending jobs; a claim
    # that got fewer than it asked for says there are none
    work_may_wait: bool
    # when the next claim is due even without a NOTIFY: pushed back only by
    # a claim, so a busy coordinator that only settles still polls
    poll_due_at: float
    # claim statements that failed without an answer since adoption last
    # settled the question, and until when one of them may still commit
    lost_answers: int = 0
    adopt_until: float = float("-inf")
    adopt_next_at: float = float("-inf")
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
    let_go: int = 0  # jobs found no longer ours, let go without an end of ours
    unstorable: int = 0  # completions the database refused, failed instead
    database_error: str | None = None
    wait_s: float = 0.0
    finished: bool = False
    # when finished: everything held was recorded (False: left for the sweeper)
    clean: bool = True


class Coordinator:
    def __init__(
        self,
        settings: WorkerSettings,
        store: WorkerStore,
        writer: StoryWriter,
        *,
        listen: bool = True,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        statement_timeout_s: float = STATEMENT_TIMEOUT_S,
    ) -> None:
        self.settings = settings
        self.store = store
        self.worker_id = store.worker_id
        self._writer = writer
        self._listen = listen and settings.worker_listen
        self._clock = clock
        self._sleep = sleep
        self._statement_timeout_s = statement_timeout_s
        self._jobs: dict[int, HeldJob] = {}
        self._claiming = Claiming(work_may_wait=True, poll_due_at=clock() + settings.worker_poll_interval_s)
        self._shutdown: Shutdown | None = None
        # after the database refused a batch for its data, write one at a
        # time until the culprit is found
        self._isolating = False
        self._backoff_s = BACKOFF_FIRST_S
        self._errors = db.ErrorEpisode("worker", clock=clock, task="coordinator")
        self._configured_limits = RateLimits.from_settings(settings)
        self._limits = self._configured_limits
        # what the provider's headers last said (written by job tasks), and
        # the last one a claim round told the shared bucket (by the round)
        self._heard: ProviderView | None = None
        self._told: ProviderView | None = None
        self._heartbeat = Heartbeat(store, self, interval_s=settings.heartbeat_interval_s, clock=clock, sleep=sleep)
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
        helpers = [self._helper(self._heartbeat.run(), "heartbeat")]
        if self._listen:
            helpers.append(self._helper(listen(self.store, self.notified, clock=self._clock, sleep=self._sleep),
                                        "listener"))
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

    async def heartbeat_once(self) -> list[int]:
        """One heartbeat now (see worker/heartbeat.py): the ids of the jobs
        whose stream it stopped."""
        return await self._heartbeat.once()

    # -- what the helper tasks report ---------------------------------------------------

    def notified(self) -> None:
        """A NOTIFY (or the listener's start): pending jobs may be waiting."""
        self._claiming.work_may_wait = True
        self._wake.set()

    def heard(self, headers: Mapping[str, str]) -> None:
        """An answer's anthropic-ratelimit-* headers: told to the shared
        bucket at the next claim round."""
        view = ProviderView.from_headers(headers, seen_at=self._clock())
        if view is not None:
            self._heard = view
            # with no limit configured, the announced limits pace the claims
            # and the retries until the headers announce others
            self.store.learn(view)
            if any(kind in view.limits for kind in KINDS):
                self._limits = self._configured_limits.learned(view, max_tokens=self.settings.llm_max_tokens)

    def beats(self) -> dict[int, int]:
        """The held jobs and their progress, for the heartbeat: a job whose
        end is not yet written is still running, and still ours."""
        for held in self._jobs.values():
            held.progress = max(held.progress, held.call.output_tokens)
        return {job_id: held.progress for job_id, held in self._jobs.items()}

    def gone(self, job_id: int, reason: str) -> bool:
        """The heartbeat found the job no longer ours (swept or cancelled):
        its stream is stopped at once, so that nobody pays for text no one
        will see. True when a call was stopped. A job whose end the database
        refused in every form is then given up at the next round: whoever
        ended it closed its row, charged as unknown."""
        held = self._jobs.get(job_id)
        if held is None:
            return False
        if held.end is not None:
            held.found_gone = True
        return self._stop_call(held, reason)

    # -- the round --------------------------------------------------------------------

    async def round_once(self) -> RoundResult:
        """One round of the coordinator: stop streams past the shutdown grace,
        collect finished calls, write their ends, adopt the claims of a lost
        answer, settle written stories and claim for free slots. Never
        raises for a database error: the result carries it, with the backoff
        to wait."""
        self._wake.clear()
        now = self._clock()
        result = RoundResult()
        shutdown = self._shutdown
        if shutdown is not None:
            if now >= shutdown.grace_ends_at and not shutdown.streams_stopped:
                shutdown.streams_stopped = True
                for held in self._jobs.values():
                    self._stop_call(held, SHUTDOWN)
            if now >= shutdown.give_up_at:
                log.error("worker.shutdown_abandoned", job_ids=[h.public_id for h in self._jobs.values()],
                          detail="could not record these jobs; the sweeper will fail them")
                result.finished, result.clean = True, False
                return result
        self._collect(result)
        self._give_up_refused_ends(result)
        if now >= self._claiming.poll_due_at:
            self._claiming.work_may_wait = True
        failures = self._due(Failure, now)
        closes = self._due(CallRecord, now)
        completions = self._due(Completion, now)
        if not (failures or closes or completions):
            self._isolating = False  # nothing left to take apart
        # while a refused batch is taken apart, nothing is claimed: a refusal
        # of the claim must never be taken for a refusal of a story
        isolating = self._isolating
        adopting = self._claiming.lost_answers > 0 and now >= self._claiming.adopt_next_at
        claim_limit = 0 if isolating else self._claim_limit()
        if not (failures or closes or completions or adopting or claim_limit):
            if shutdown is not None and not self._jobs and self._may_exit(now, shutdown):
                result.finished = True
                return result
            result.wait_s = self._idle_wait_s(now)
            metrics.WORKER_BUSY.set(len(self._jobs))
            return result
        try:
            if failures:
                await self._write_failures(failures, result)
            if closes:
                await self._write_closes(closes, result)
            if adopting:
                await self._adopt(now, result)
            claim_limit = 0 if isolating else self._claim_limit()
            if isolating and completions:
                await self._settle(completions, result)
            elif completions or claim_limit:
                await self._settle_and_claim(completions, claim_limit, result)
                if claim_limit:
                    self._claiming.poll_due_at = now + self.settings.worker_poll_interval_s
        except db.DB_ERRORS as exc:
            self._errors.failed(exc, held=len(self._jobs), unsaved_ends=sum(h.end is not None
                                                                            for h in self._jobs.values()))
            result.database_error = db.describe(exc)
            result.wait_s = self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
            return result
        self._errors.succeeded()
        self._backoff_s = BACKOFF_FIRST_S
        metrics.WORKER_BUSY.set(len(self._jobs))
        return result

    def _collect(self, result: RoundResult) -> None:
        """Turns each finished call's outcome into the end its job needs
        written; lets go at once of a job lost before anything more was sent."""
        for held in list(self._jobs.values()):
            if held.end is not None or held.task is None or not held.task.done():
                continue
            outcome = outcome_of(held.task, held.call)
            metrics.JOB_RUN.observe(self._clock() - held.claimed_at)
            _count_call(outcome.call)
            if isinstance(outcome, Lost):
                # its row and its charge are set right as a stopped call's are
                metrics.LOST_OWNERSHIP.inc()
                log.warning("job.lost_ownership", job_id=held.public_id, reason=outcome.reason,
                            attempt=outcome.call.attempt)
                held.stop_reason = "ended elsewhere"
                held.end = outcome.call
            elif isinstance(outcome, Completed):
                held.end = _completion(held.job, outcome)
            elif isinstance(outcome, Failed):
                held.end = _failure(held.job.id, outcome.error_code, outcome.message, outcome.call)
            elif held.stop_reason == SHUTDOWN:
                # still ours: fail it now rather than leave it to the sweeper
                log.warning("job.stream_stopped", job_id=held.public_id, reason=SHUTDOWN,
                            attempt=outcome.call.attempt, output_tokens=outcome.call.output_tokens)
                held.end = _failure(held.job.id, ErrorCode.INTERRUPTED,
                                    "the worker shut down before the story was finished", outcome.call)
            else:
                metrics.LOST_OWNERSHIP.inc()
                log.warning("job.lost_ownership", job_id=held.public_id, reason=held.stop_reason,
                            attempt=outcome.call.attempt, sent=held.call.sent.value,
                            output_tokens=outcome.call.output_tokens)
                held.end = outcome.call

    def _may_exit(self, now: float, shutdown: Shutdown) -> bool:
        """Holding nothing, a stopping worker still looks for the jobs of a
        lost claim answer, within its grace: past it, a late commit is left
        to the sweeper, said once."""
        if not self._claiming.lost_answers:
            return True
        if now < shutdown.grace_ends_at:
            return False
        log.warning("worker.lost_claim_unsettled", detail="a claim whose answer was lost may still commit; "
                    "its jobs, never begun, are left to the sweeper")
        return True

    def _give_up_refused_ends(self, result: RoundResult) -> None:
        for held in list(self._jobs.values()):
            if held.end is not None and held.refusals >= _REFUSALS_GIVEN_UP and held.found_gone:
                log.error("job.end_given_up", job_id=held.public_id,
                          detail="its end was refused in every form and the job is no longer ours")
                self._release(held)
                result.let_go += 1

    def _due(self, kind: type[End], now: float) -> list[HeldJob]:
        """The held jobs whose end of this kind can be written now, in id
        order; one while a batch refused for its data is being taken apart."""
        due = sorted((h for h in self._jobs.values() if isinstance(h.end, kind) and h.retry_at <= now),
                     key=lambda h: h.job.id)
        return due[:1] if self._isolating else due

    def _free_slots(self) -> int:
        """A job whose story waits to be settled leaves in the same statement
        that claims, so its slot is already free for that claim."""
        settling = sum(isinstance(h.end, Completion) for h in self._jobs.values())
        return max(0, self.settings.worker_concurrency - len(self._jobs) + settling)

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
        with), the end of the grace, the shutdown's last chance, the next try
        of an end the database refused. Without one, a job finishing or a
        NOTIFY wakes the loop first."""
        # a claim the limiter held back is due when the bucket covers the
        # next job, not at the next poll: the work is known to wait
        claiming = self._claiming
        claim_at = claiming.not_before if claiming.work_may_wait else max(claiming.poll_due_at, claiming.not_before)
        deadlines = [claim_at] if self._shutdown is None and self._free_slots() else []
        deadlines += [h.retry_at for h in self._jobs.values() if h.end is not None]
        if self._claiming.lost_answers:
            deadlines.append(self._claiming.adopt_next_at)
        if self._shutdown is not None:
            deadlines.append(self._shutdown.give_up_at)
            if not self._shutdown.streams_stopped:
                deadlines.append(self._shutdown.grace_ends_at)
        future = [deadline - now for deadline in deadlines if deadline > now]
        return min(future, default=self.settings.worker_poll_interval_s)

    # -- writing ends ----------------------------------------------------------------

    async def _write_failures(self, batch: list[HeldJob], result: RoundResult) -> None:
        failures = [h.end for h in batch if isinstance(h.end, Failure)]
        try:
            failed_ids = set(await self.store.fail_running(failures))
        except db.DB_ERRORS as exc:
            self._refused(exc, batch, result)
            return
        self._written(batch)
        for held in batch:
            self._release(held)
            if held.job.id in failed_ids:
                result.failed += 1
                metrics.FAILED.inc()
                assert isinstance(held.end, Failure)
                log.warning("job.failed", job_id=held.public_id, error_code=held.end.error_code,
                            error=held.end.error_text)
            else:
                result.lost_races += 1
                metrics.LOST_FAILURE.inc()
                log.info("job.lost_race", job_id=held.public_id, transition="running_to_failed",
                         detail="the job had already been failed elsewhere")

    async def _write_closes(self, batch: list[HeldJob], result: RoundResult) -> None:
        """The ledger rows of calls stopped because their job was no longer
        ours: whoever ended the job closed them as interrupted, not knowing
        what was sent; now it is known."""
        for held in batch:
            record = held.end
            assert isinstance(record, CallRecord)
            try:
                await self.store.call_finish(
                    held.job.id, record.attempt, outcome=record.outcome, billed=record.billed,
                    input_tokens=record.input_tokens, output_tokens=record.output_tokens,
                    cost_usd=record.cost_usd, error_text=f"the job was {held.stop_reason} while this call was open",
                    request_id=storable_or_none(record.request_id),
                )
            except db.DB_ERRORS as exc:
                if db.is_transient(exc):
                    raise
                # the job is not ours: its row stays as whoever ended it closed
                # it (interrupted, charged the worst case)
                log.error("llm.ledger_write_failed", job_id=held.public_id, attempt=record.attempt,
                          error=db.describe(exc))
            self._release(held)
            result.let_go += 1

    async def _adopt(self, now: float, result: RoundResult) -> None:
        """A claim whose answer was lost (connection dropped around its
        commit) may have left jobs running under our id that never reached
        us. No call was begun for them, and a job this process began is
        still held (so skipped here): they are ours to run now, also while
        stopping. A statement still running on the server can commit later,
        so the search goes on until its statement timeout has passed, or
        until the one lost claim is found to have committed."""
        found = await self.store.claims_of_lost_answer(list(self._jobs))
        for job in found:
            log.warning("job.adopted", job_id=str(job.public_id), detail="claimed by a statement whose answer was lost")
            held = self._hold(job)
            result.adopted += 1
            if self._shutdown is not None and self._shutdown.streams_stopped:
                # past the grace nothing more is begun: failed as interrupted, nothing sent
                self._stop_call(held, SHUTDOWN)
        if (found and self._claiming.lost_answers == 1) or now >= self._claiming.adopt_until:
            self._claiming.lost_answers = 0
        self._claiming.adopt_next_at = now + _ADOPTION_RECHECK_S

    async def _settle(self, batch: list[HeldJob], result: RoundResult) -> None:
        """Written stories alone, without a claim or the rate bucket's round
        (while a refused batch is taken apart): a refusal here is the
        story's own."""
        completions = [h.end for h in batch if isinstance(h.end, Completion)]
        try:
            settled = await self.store.settle(completions)
        except db.DB_ERRORS as exc:
            self._refused(exc, batch, result)
            return
        self._written(batch)
        self._settled(batch, settled, result)

    async def _settle_and_claim(self, batch: list[HeldJob], claim_limit: int, result: RoundResult) -> None:
        completions = [h.end for h in batch if isinstance(h.end, Completion)]
        view = self._heard if self._heard is not self._told else None
        try:
            settled = await self.store.settle_and_claim(completions, claim_limit, view)
        except db.DB_ERRORS as exc:
            if claim_limit and db.is_transient(exc) and not isinstance(exc, PoolTimeout):
                # no answer, or not one the server sent: it may have committed,
                # and its jobs are ours, never begun. A backend the server
                # ended (57P: a terminated session, a shutdown) runs nothing
                # more, so one search settles it; otherwise the statement may
                # still be running there, until its statement timeout
                self._claiming.lost_answers += 1
                later = 0.0 if _server_ended(exc) else self._statement_timeout_s + _ADOPTION_MARGIN_S
                self._claiming.adopt_until = max(self._claiming.adopt_until, self._clock() + later)
            if batch and not db.is_transient(exc):
                # refused, and the claim and the bucket's round may be what
                # was refused: the stories are taken apart with settle alone,
                # one at a time, before one of them is blamed
                self._isolating = True
                raise
            self._refused(exc, batch, result)
            return
        self._written(batch)
        self._settled(batch, settled, result)
        for job in settled.claimed:
            self.claims += 1
            metrics.CLAIMED.inc()
            metrics.JOB_QUEUE_WAIT.observe(max((job.started_at - job.created_at).total_seconds(), 0.0))
            self._hold(job)
        result.claimed = len(settled.claimed)
        if settled.claimed:
            metrics.WORKER_LAST_CLAIM.set_to_current_time()
        if view is not None:
            self._told = view
        self._limited(settled.limiter, claim_limit, len(settled.claimed))

    def _settled(self, batch: list[HeldJob], settled: SettleResult, result: RoundResult) -> None:
        completed = set(settled.completed_ids).union(settled.already_completed_ids)
        for held in batch:
            self._release(held)
            assert isinstance(held.end, Completion)
            if held.job.id in completed:
                result.completed += 1
                metrics.COMPLETED.inc()
                log.info("job.completed", job_id=held.public_id, output_tokens=held.end.output_tokens,
                         cost_usd=str(held.end.cost_usd))
            else:
                result.lost_races += 1
                metrics.LOST_COMPLETION.inc()
                log.warning("job.lost_race", job_id=held.public_id, transition="running_to_completed",
                            detail="sweeper raced, story orphaned")

    def _limited(self, limiter: LimiterState, claim_limit: int, claimed: int) -> None:
        """What the shared rate limiter said: its gauges, and when a claim is
        worth trying again if it held jobs back."""
        for kind in KINDS:
            available = getattr(limiter, kind)
            if available is not None:
                metrics.LLM_RATELIMIT_AVAILABLE.labels(kind=kind).set(available)
        if not self._limits.limited:
            self._limits = self._configured_limits.announced(limiter.announced(),
                                                             max_tokens=self.settings.llm_max_tokens)
        held_back = claim_limit > 0 and (limiter.paused_s > 0 or limiter.next_output_tokens is not None)
        if held_back:
            metrics.LLM_RATELIMIT_WAITS.inc()
            self._claiming.not_before = self._clock() + limiter.claim_again_in_s(self._limits)
        elif claimed < claim_limit:
            self._claiming.work_may_wait = False

    def _written(self, batch: list[HeldJob]) -> None:
        if len(batch) <= 1:
            self._isolating = False

    def _refused(self, exc: Exception, batch: list[HeldJob], result: RoundResult) -> None:
        """After a database error writing a batch of ends: raise it again (a
        transient error is waited out; a batch refused for its data is then
        written one end at a time, stories without a claim), unless the one
        end of a batch written on its own was refused for good: that end is
        then rewritten in a form the database cannot refuse, and, refused in
        that form too, tried again later."""
        if db.is_transient(exc) or not batch:
            raise exc
        if len(batch) > 1:
            self._isolating = True
            raise exc
        self._isolating = False
        (held,) = batch
        held.refusals += 1
        end = held.end
        if isinstance(end, Completion):
            result.unstorable += 1
            log.error("job.completion_unstorable", job_id=held.public_id, error=db.describe(exc))
            held.end = _failure(held.job.id, ErrorCode.INTERNAL_ERROR,
                                f"the story could not be stored ({db.describe(exc)})",
                                CallRecord(end.attempt, LlmOutcome.SUCCEEDED, True, end.input_tokens,
                                           end.output_tokens, end.cost_usd, end.request_id))
        elif isinstance(end, Failure) and held.refusals <= 2:
            log.error("job.end_unstorable", job_id=held.public_id, error=db.describe(exc),
                      detail="written again in a form the database cannot refuse")
            held.end = _safe(end)
        else:
            # kept, heartbeats and all, until the database takes it or the
            # job is no longer ours; never sent again
            held.retry_at = self._clock() + min(2.0 ** held.refusals, _END_RETRY_MAX_S)
            if held.refusals == _REFUSALS_GIVEN_UP:
                log.error("job.end_refused", job_id=held.public_id, error=db.describe(exc),
                          detail="the job stays held; its end is tried again with backoff")

    def _release(self, held: HeldJob) -> None:
        """Lets go of a job whose end was written: the one way out of the
        held set."""
        self._jobs.pop(held.job.id, None)

    # -- one job ------------------------------------------------------------------

    def _hold(self, job: ClaimedJob) -> HeldJob:
        """Holds a job and starts its task at once, so that the heartbeat
        never sees a held job that is not running."""
        hooks = LedgerHooks(self.store, job, self.heard, clock=self._clock, sleep=self._sleep)
        call = job_call(job, self._writer, hooks, default_max_tokens=self.settings.llm_max_tokens)
        held = HeldJob(job, call, self._clock())
        self._jobs[job.id] = held
        held.task = asyncio.create_task(execute(job, self._writer, call), name=f"job-{job.id}")
        held.task.add_done_callback(lambda _: self._wake.set())
        return held

    def _stop_call(self, held: HeldJob, reason: str) -> bool:
        """Stops a job's call that is still under way (also one whose task
        has not taken its first step: nothing is then sent)."""
        if held.stop_reason is not None or held.end is not None or held.task is None or held.task.done():
            return False
        held.stop_reason = reason
        held.task.cancel()
        return True

    # -- waiting and helpers ----------------------------------------------------------

    async def _pause(self, result: RoundResult) -> None:
        if result.database_error is not None:
            # the whole backoff: a job finishing must not hammer a database that is down
            await self._sleep(result.wait_s)
            return
        if result.wait_s <= 0:
            return
        try:
            async with asyncio.timeout(result.wait_s):
                await self._wake.wait()
        except TimeoutError:
            pass

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


def _server_ended(exc: Exception) -> bool:
    """The server ended the session the statement ran in (57P01 admin
    shutdown, 57P02 crash shutdown): its backend is gone, with whatever it
    was running."""
    return getattr(exc, "sqlstate", None) in ("57P01", "57P02")


def _count_call(record: CallRecord) -> None:
    metrics.LLM_REQUESTS_BY_OUTCOME[record.outcome].inc()
    if record.billed:
        metrics.INPUT_TOKENS.inc(record.input_tokens)
        metrics.OUTPUT_TOKENS.inc(record.output_tokens)
        metrics.LLM_COST.inc(float(record.cost_usd))


def _completion(job: ClaimedJob, done: Completed) -> Completion:
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


def _failure(job_id: int, code: ErrorCode, message: str, record: CallRecord) -> Failure:
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


def _safe(failure: Failure) -> Failure:
    """The failure in a form no column can refuse: counts and cost within
    what the columns hold, a fixed text."""
    return Failure(
        job_id=failure.job_id,
        attempt=failure.attempt,
        error_code=failure.error_code,
        error_text="the job ended, but what ended it could not be stored; see the worker's log",
        call_outcome=failure.call_outcome,
        billed=failure.billed,
        input_tokens=min(max(failure.input_tokens, 0), INT32_MAX),
        output_tokens=min(max(failure.output_tokens, 0), INT32_MAX),
        cost_usd=min(max(failure.cost_usd, Decimal(0)), _USD_MAX),
    )
