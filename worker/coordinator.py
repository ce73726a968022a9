"""The worker's coordinator: the one loop that owns the jobs this process holds.

Each round drains the inbox (worker/inbox.py), where every other task
reports what it saw (a job's task finished, with its outcome; a job found
no longer ours; the provider's rate limit headers; a NOTIFY; SIGTERM; a
helper that died), then decides and writes, alone, on those reports only:
only the round changes the held set or stops a job, and what it did is what
it returns. Its parts, one concern each: the held set (worker/held.py), the
executor of one job's call (worker/executor.py), the end writer and its
refusal policy (worker/ends.py), the claimer with the rate limits and
adoption (worker/claimer.py), the shutdown (worker/shutdown.py); the
heartbeat, the draft writer and the listener only report or write their
own. A round writes the ends that are due, then settles written stories and
claims for the free slots: two statements in one pipeline and one
transaction, the stories sent again alone when the claim is refused, so a
claim's refusal never touches a story that was paid for.

Every database error is logged once per episode and waited out with the
worker's one backoff (worker/backoff.py), never fatal; a helper task that
dies of anything else crashes the worker (``WorkerCrashed``; the policy and
why: worker/helpers.py). Killed at any line, a held job stays ``running``
until the sweeper fails it, and nobody calls the LLM for it again.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from opentelemetry.trace import Tracer

from shared import db
from shared.config import WorkerSettings
from worker import metrics
from worker.backoff import Backoff
from worker.claimer import STATEMENT_TIMEOUT_S, Claimer
from worker.drafts import DraftStore, DraftWriter
from worker.ends import EndWriter
from worker.executor import LedgerHooks, start
from worker.heartbeat import Heartbeat
from worker.held import SHUTDOWN, HeldJobs
from worker.helpers import WorkerCrashed, start_helper
from worker.inbox import Finished, Gone, Heard, HelperDied, Inbox, Notified, Report, StopAsked
from worker.listener import listen
from worker.rows import ClaimedJob
from worker.shutdown import SHUTDOWN_FLUSH_S, Shutdown
from worker.store import WorkerStore
from worker.writing import StoryWriter, job_call

__all__ = ["SHUTDOWN", "SHUTDOWN_FLUSH_S", "STATEMENT_TIMEOUT_S", "Coordinator", "RoundResult", "WorkerCrashed",
           "new_worker_id"]

log = structlog.get_logger()


def new_worker_id() -> str:
    """Unique per process start: a restarted pod with the same hostname is a
    new worker, and never mistakes its predecessor's jobs for its own."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass
class RoundResult:
    """What one round did, and how long the loop may wait before the next
    (it wakes earlier when a report arrives)."""

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
    def __init__(self, settings: WorkerSettings, store: WorkerStore, writer: StoryWriter, *, listen: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 statement_timeout_s: float = STATEMENT_TIMEOUT_S, tracer: Tracer | None = None,
                 drafts: DraftStore | None = None) -> None:
        self.settings = settings
        # traces on: each job's run is a span in its trace (worker/executor.py)
        self._tracer = tracer
        self.store = store
        self.worker_id = store.worker_id
        self._writer = writer
        self._listen = listen and settings.worker_listen
        self._clock = clock
        self._sleep = sleep
        self.inbox = Inbox()
        self.held = HeldJobs()
        self._claimer = Claimer(settings, store, clock=clock, statement_timeout_s=statement_timeout_s)
        self._ends = EndWriter(store, self.held, clock=clock)
        self._shutdown: Shutdown | None = None
        self._crashed: str | None = None
        self._backoff = Backoff()
        self._errors = db.ErrorEpisode("worker", clock=clock, task="coordinator")
        self._heartbeat = Heartbeat(store, self.held, self.inbox, interval_s=settings.heartbeat_interval_s,
                                    clock=clock, sleep=sleep)
        # the text streamed so far, written for the poll (DRAFT_INTERVAL_S; 0 or no store: none)
        self._drafts = (DraftWriter(drafts, self.held, interval_s=settings.draft_interval_s, clock=clock,
                                    sleep=sleep)
                        if drafts is not None and settings.draft_interval_s > 0 else None)
        self.claims = 0  # jobs claimed by this process, for logs

    # -- what others may ask ----------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM: stop claiming; finish what is held within the grace period."""
        self.inbox.put(StopAsked())

    def notified(self) -> None:
        """A NOTIFY: pending jobs may be waiting."""
        self.inbox.put(Notified())

    @property
    def held_job_ids(self) -> list[int]:
        return self.held.ids

    async def heartbeat_once(self) -> list[int]:
        """One heartbeat now (see worker/heartbeat.py): the ids of the jobs
        it reported no longer ours, whose streams the next round stops."""
        return await self._heartbeat.once()

    async def drafts_once(self) -> int:
        """One draft write now (see worker/drafts.py): how many jobs had new text."""
        return 0 if self._drafts is None else await self._drafts.once()

    async def run(self) -> bool:
        """Runs until stopped and drained. True when everything held was
        recorded; False when shutdown left jobs for the sweeper. Raises
        WorkerCrashed when a helper task died."""
        structlog.contextvars.bind_contextvars(worker_id=self.worker_id)
        metrics.WORKER_SLOTS.set(self.settings.worker_concurrency)
        log.info("worker.started", concurrency=self.settings.worker_concurrency,
                 provider=self._writer.provider, model=self._writer.model, listen=self._listen)
        helpers = [start_helper(self._heartbeat.run(), "heartbeat", self.inbox)]
        if self._drafts is not None:
            helpers.append(start_helper(self._drafts.run(), "drafts", self.inbox))
        if self._listen:
            helpers.append(start_helper(listen(self.store, self.inbox, clock=self._clock, sleep=self._sleep),
                                        "listener", self.inbox))
        try:
            while True:
                result = await self.round_once()
                if result.finished:
                    return result.clean
                await self._pause(result)
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            metrics.WORKER_BUSY.set(0)
            log.info("worker.stopped", claimed=self.claims, left=len(self.held))

    # -- the round --------------------------------------------------------------------

    async def round_once(self) -> RoundResult:
        """One round: take in the reports (the outcomes of finished calls,
        the jobs found gone), stop streams past the shutdown grace, write
        the ends due, adopt the claims of a lost answer, settle written
        stories and claim for free slots.
        Never raises for a database error: the result carries it, with the
        backoff to wait. Raises WorkerCrashed when a helper task died."""
        self._take_reports()
        if self._crashed is not None:
            raise WorkerCrashed(f"the {self._crashed} task died")
        now = self._clock()
        result = RoundResult()
        shutdown = self._shutdown
        if shutdown is not None and shutdown.due(now, self.held):
            result.finished, result.clean = True, False
            return result
        self._ends.give_up_refused(result)
        failures, closes, completions = self._ends.due(now)
        adopting = self._claimer.adopting(now)
        claim_limit = self._claim_limit()
        if not (failures or closes or completions or adopting or claim_limit):
            if shutdown is not None and not len(self.held) and self._claimer.may_exit(now, shutdown.grace_ends_at):
                result.finished = True
                return result
            result.wait_s = self._idle_wait_s(now)
            metrics.WORKER_BUSY.set(len(self.held))
            return result
        limits = self._claimer.limits
        try:
            if failures:
                await self._ends.write_failures(failures, limits, result)
            if closes:
                await self._ends.write_closes(closes, result)
            if adopting:
                for job in await self._claimer.adopt(self.held.ids, now):
                    self._hold(job)
                    result.adopted += 1
            claim_limit = self._claim_limit()  # adopted jobs took slots
            if completions or claim_limit:
                for job in await self._claimer.settle_and_claim(self._ends, completions, claim_limit, result):
                    self._hold(job)
                    result.claimed += 1
        except db.DB_ERRORS as exc:
            self._errors.failed(exc, held=len(self.held), unsaved_ends=self.held.ends_waiting())
            result.database_error = db.describe(exc)
            result.wait_s = self._backoff.next_s()
            return result
        self._errors.succeeded()
        self._backoff.reset()
        metrics.WORKER_BUSY.set(len(self.held))
        return result

    def _take_reports(self) -> None:
        """What the other tasks reported since the last round: the round
        alone turns it into changes."""
        for report in self.inbox.drain():
            self._take(report)

    def _take(self, report: Report) -> None:
        if isinstance(report, Finished):
            self.held.finished(report, self._clock(), metrics.count_call)
        elif isinstance(report, Gone):
            self.held.found_gone(report.job_id, report.reason)
        elif isinstance(report, Heard):
            self._claimer.heard(report.view)
        elif isinstance(report, Notified):
            self._claimer.notified()
        elif isinstance(report, StopAsked):
            if self._shutdown is None:
                grace = self.settings.worker_shutdown_grace_s
                self._shutdown = Shutdown(self._clock(), grace)
                log.info("worker.stopping", held=len(self.held), grace_s=grace)
        elif isinstance(report, HelperDied):
            self._crashed = report.task

    def _claim_limit(self) -> int:
        return self._claimer.limit(self.held.free_slots(self.settings.worker_concurrency),
                                   stopping=self._shutdown is not None)

    def _hold(self, job: ClaimedJob) -> None:
        """Holds a job and starts its task at once, so that the heartbeat
        never sees a held job that is not running. Past the shutdown grace
        nothing more is begun: its stop signal is set before its first step,
        and it fails as interrupted, nothing sent."""
        claimer = self._claimer
        hooks = LedgerHooks(self.store, job, self.inbox, lambda: claimer.limits, clock=self._clock,
                            sleep=self._sleep)
        call = job_call(job, self._writer, hooks, default_max_tokens=self.settings.llm_max_tokens)
        held = self.held.hold(job, call, self._clock())
        self.claims += 1
        if self._shutdown is not None and self._shutdown.streams_stopped:
            held.stop.set(SHUTDOWN)
        held.task = start(job, self._writer, call, held.stop, self.inbox, tracer=self._tracer)

    # -- waiting ----------------------------------------------------------------

    def _idle_wait_s(self, now: float) -> float:
        """Until the next deadline: the claim (if a slot is free to claim
        with), the end of the grace, the shutdown's last chance, the next try
        of an end the database refused. Without one, a report wakes the loop
        first."""
        claiming = self._shutdown is None and self.held.free_slots(self.settings.worker_concurrency) > 0
        deadlines = self._claimer.deadlines(claiming=claiming) + self.held.retry_deadlines()
        if self._shutdown is not None:
            deadlines += self._shutdown.deadlines()
        future = [deadline - now for deadline in deadlines if deadline > now]
        return min(future, default=self.settings.worker_poll_interval_s)

    async def _pause(self, result: RoundResult) -> None:
        if result.database_error is not None:
            await self._wait_out(result.wait_s)
        elif result.wait_s > 0:
            await self.inbox.wait(result.wait_s)

    async def _wait_out(self, backoff_s: float) -> None:
        """The whole backoff after a database error: a job finishing must not
        hammer a database that is down. The reports are still taken as they
        come (nothing is written), so that a stop the heartbeat asks for is
        not held up by a backoff of the round's."""
        backoff = asyncio.ensure_future(self._sleep(backoff_s))
        try:
            while not backoff.done():
                report = asyncio.ensure_future(self.inbox.wait(backoff_s))
                await asyncio.wait({backoff, report}, return_when=asyncio.FIRST_COMPLETED)
                report.cancel()
                self._take_reports()
        finally:
            backoff.cancel()
