"""An in-memory WorkerStore that records what the worker asked of it and
answers as the test configured.

It is for the coordinator's decisions (what it asks for, when, with what),
not for the SQL: it keeps no job rows and checks none of the statements'
guards (a job's status and worker id, a claim's pending jobs, adoption's
begun jobs, a retry's ownership); those are proven on Postgres
(tests/model/test_worker_model_pg.py, tests/integration). What it answers
follows what the test set up:

* ``add_pending``: the jobs the next claims hand out, in order;
* ``end_elsewhere``: jobs the database says are no longer this worker's
  (cancelled or swept), from then on, in every answer about them;
* ``claim_lost``: a job claimed by a statement whose answer was lost, which
  the next search for such claims finds;
* ``fail_next``: the next call of a method fails, before or after its
  effect, as when a connection drops around a commit;
* ``limiter`` and ``paused_s``: what claims and retries hear of the shared
  rate bucket.

It answers a repeated call as it answered the first (a completion written
again after its answer was lost is "already completed"), since that is what
the statements promise and what the coordinator relies on.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from shared.ratelimit import LimiterState, ProviderView, RateLimits
from shared.status import ErrorCode, JobStatus, LlmOutcome
from worker.rows import (
    ClaimedJob,
    ClaimResult,
    Completion,
    Failure,
    HeartbeatRow,
    RetryStart,
    SettleResult,
)
from worker.store import ClaimAsk, RoundWritten

if TYPE_CHECKING:
    from worker.store import WorkerStore


@dataclass
class StoredJob:
    """What the test set up for a job, and what the store answered about it."""

    id: int
    # PENDING until claimed; then RUNNING, COMPLETED or FAILED as answered
    status: JobStatus = JobStatus.PENDING
    # set by end_elsewhere: the database says the job is no longer ours
    gone: bool = False
    error_code: ErrorCode | None = None
    progress: int = 0
    public_id: uuid.UUID = field(default_factory=uuid.uuid4)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    story: Completion | None = None


@dataclass
class Fault:
    error: Exception
    after_effect: bool  # the call's effect happens, then the answer is lost


class RecordingStore:
    def __init__(self, worker_id: str = "w-test", *, max_tokens: int | None = None,
                 input_tokens_estimate: int | None = None) -> None:
        self._worker_id = worker_id
        self.jobs: dict[int, StoredJob] = {}
        # the ledger as the worker wrote it: each attempt's outcome and billed
        self.ledger: dict[tuple[int, int], LlmOutcome] = {}
        self.billed: dict[tuple[int, int], bool] = {}
        # what each claimed job says it was accepted with
        self.max_tokens = max_tokens
        self.input_tokens_estimate = input_tokens_estimate
        self.calls: list[tuple[str, Any]] = []
        self._faults: dict[str, list[Fault]] = {}
        self._pending: list[int] = []
        self._lost_claims: list[int] = []
        self._notifications: asyncio.Queue[None] = asyncio.Queue()
        # what the next claims answer of the shared rate bucket, and how long
        # a retry is held (another worker's 429)
        self.limiter = LimiterState()
        self.paused_s = 0.0
        self.provider_views: list[ProviderView | None] = []
        # the rate limits each claim and pause was given
        self.limits_seen: list[RateLimits] = []

    @property
    def worker_id(self) -> str:
        return self._worker_id

    # -- what tests set up and read ---------------------------------------------------

    def add_pending(self, n: int = 1) -> list[int]:
        ids = []
        for _ in range(n):
            job_id = len(self.jobs) + 1
            self.jobs[job_id] = StoredJob(job_id)
            self._pending.append(job_id)
            ids.append(job_id)
        return ids

    def fail_next(self, method: str, error: Exception, *, after_effect: bool = False) -> None:
        self._faults.setdefault(method, []).append(Fault(error, after_effect))

    def end_elsewhere(self, job_id: int, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        """From now on the database answers that the job is no longer ours
        (a cancel or a sweep ended it, and closed its open call)."""
        job = self.jobs[job_id]
        job.gone, job.status, job.error_code = True, JobStatus.FAILED, code
        if job_id in self._pending:
            self._pending.remove(job_id)
        for key, outcome in self.ledger.items():
            if key[0] == job_id and outcome is LlmOutcome.STARTED:
                self.ledger[key] = LlmOutcome.INTERRUPTED

    def claim_elsewhere(self) -> int | None:
        """Another worker takes the next pending job: no claim here hands it out."""
        return self._pending.pop(0) if self._pending else None

    def claim_lost(self, job_id: int) -> None:
        """A claim whose answer was lost committed this job (its first row
        written): the next search for the claims of a lost answer finds it."""
        self.jobs[job_id].status = JobStatus.RUNNING
        self._pending.remove(job_id)
        self.ledger[(job_id, 1)] = LlmOutcome.STARTED
        self._lost_claims.append(job_id)

    def notify(self) -> None:
        self._notifications.put_nowait(None)

    def named(self, method: str) -> list[Any]:
        return [args for name, args in self.calls if name == method]

    def statuses(self) -> dict[int, JobStatus]:
        return {job.id: job.status for job in self.jobs.values()}

    def held_here(self, job_id: int) -> bool:
        """Claimed, and not yet answered as ended nor set up as ended elsewhere."""
        job = self.jobs.get(job_id)
        return job is not None and job.status is JobStatus.RUNNING and not job.gone

    # -- WorkerStore ------------------------------------------------------------------

    def _enter(self, method: str, args: Any) -> Fault | None:
        self.calls.append((method, args))
        faults = self._faults.get(method)
        fault = faults.pop(0) if faults else None
        if fault is not None and not fault.after_effect:
            raise fault.error
        return fault

    @staticmethod
    def _leave(fault: Fault | None) -> None:
        if fault is not None:
            raise fault.error

    def _settled(self, completions: Sequence[Completion]) -> tuple[list[int], list[int]]:
        completed, already = [], []
        for completion in completions:
            self.ledger[(completion.job_id, completion.attempt)] = LlmOutcome.SUCCEEDED
            self.billed[(completion.job_id, completion.attempt)] = True
            job = self.jobs[completion.job_id]
            if job.status is JobStatus.COMPLETED:
                already.append(job.id)
            elif self.held_here(job.id):
                job.status, job.story = JobStatus.COMPLETED, completion
                completed.append(job.id)
        return completed, already

    async def settle_and_claim(self, completions: Sequence[Completion], ask: ClaimAsk | None,
                               limits: RateLimits) -> RoundWritten:
        """Recorded as a "settle" and a "claim" call, each with its faults, as
        the real transaction fails: a refused settle commits nothing; a
        refused claim rolls back and the stories commit alone;
        a lost answer comes after both committed."""
        settle_fault = self._enter("settle", list(completions)) if completions else None
        claim_fault = None
        if ask is not None:
            try:
                claim_fault = self._enter("claim", ask.limit)
            except Exception as refused:
                if not completions:
                    raise
                settled = self._settle(completions)
                self._leave(settle_fault)
                return RoundWritten(settled=settled, claimed=None, claim_refused=refused)
        settled_now = self._settle(completions) if completions else None
        claimed = None
        if ask is not None:
            claimed = self._claim(ask, limits, answer_lost=settle_fault is not None or claim_fault is not None)
        self._leave(settle_fault)
        self._leave(claim_fault)
        return RoundWritten(settled=settled_now, claimed=claimed)

    def _settle(self, completions: Sequence[Completion]) -> SettleResult:
        completed, already = self._settled(completions)
        return SettleResult(completed_ids=completed, already_completed_ids=already)

    def _claim(self, ask: ClaimAsk, limits: RateLimits, *, answer_lost: bool) -> ClaimResult:
        self.provider_views.append(ask.view)
        self.limits_seen.append(limits)
        claimed: list[ClaimedJob] = []
        while self._pending and len(claimed) < ask.limit:
            job = self.jobs[self._pending.pop(0)]
            job.status = JobStatus.RUNNING
            self.ledger[(job.id, 1)] = LlmOutcome.STARTED
            claimed.append(self._claimed(job))
        if answer_lost:
            self._lost_claims.extend(job.id for job in claimed)
        return ClaimResult(claimed=claimed, limiter=self.limiter)

    async def fail_running(self, failures: Sequence[Failure], limits: RateLimits) -> list[int]:
        fault = self._enter("fail_running", list(failures))
        failed = []
        for failure in failures:
            self.ledger[(failure.job_id, failure.attempt)] = failure.call_outcome
            self.billed[(failure.job_id, failure.attempt)] = failure.billed
            for key, later in self.ledger.items():
                if key[0] == failure.job_id and key[1] > failure.attempt and later is LlmOutcome.STARTED:
                    self.ledger[key] = LlmOutcome.NOT_SENT
            if self.held_here(failure.job_id):
                job = self.jobs[failure.job_id]
                job.status, job.error_code = JobStatus.FAILED, failure.error_code
                failed.append(failure.job_id)
        self._leave(fault)
        return failed

    async def claims_of_lost_answer(self, known_ids: Sequence[int]) -> list[ClaimedJob]:
        """Each job a lost claim committed, found once (which jobs the real
        search leaves out is the SQL's to prove)."""
        fault = self._enter("claims_of_lost_answer", list(known_ids))
        found = [self._claimed(self.jobs[job_id]) for job_id in self._lost_claims if self.held_here(job_id)]
        self._lost_claims.clear()
        self._leave(fault)
        return found

    async def heartbeat(self, progress: Mapping[int, int]) -> list[HeartbeatRow]:
        fault = self._enter("heartbeat", dict(progress))
        rows = []
        for job_id, tokens in progress.items():
            alive = self.held_here(job_id)
            job = self.jobs[job_id]
            if alive:
                job.progress = tokens
            rows.append(HeartbeatRow(id=job_id, status=job.status, error_code=job.error_code, alive=alive))
        self._leave(fault)
        return rows

    async def call_retry(
        self, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome, previous_error: str,
        limits: RateLimits,
    ) -> RetryStart:
        fault = self._enter("call_retry", (job_id, previous_attempt, previous_outcome))
        self.ledger[(job_id, previous_attempt)] = previous_outcome
        self.billed[(job_id, previous_attempt)] = not previous_outcome.certainly_unbilled
        owned = self.held_here(job_id)
        attempt = None
        following = (job_id, previous_attempt + 1)
        if owned and following in self.ledger:
            # asked again after its answer was lost: the row it opened
            attempt = previous_attempt + 1 if self.ledger[following] is LlmOutcome.STARTED else None
        elif owned and not self.paused_s:
            attempt = previous_attempt + 1
            self.ledger[following] = LlmOutcome.STARTED
        self._leave(fault)
        return RetryStart(attempt=attempt, paused_s=self.paused_s, owned=owned)

    async def pause(self, pause_s: float, limits: RateLimits) -> None:
        fault = self._enter("pause", pause_s)
        self.limits_seen.append(limits)
        self._leave(fault)

    async def call_finish(
        self, job_id: int, attempt: int, *, outcome: LlmOutcome, billed: bool, input_tokens: int,
        output_tokens: int, cost_usd: Decimal, error_text: str | None, request_id: str | None = None,
    ) -> None:
        fault = self._enter("call_finish", (job_id, attempt, outcome, billed))
        self.ledger[(job_id, attempt)] = outcome
        self.billed[(job_id, attempt)] = billed
        for key, later in self.ledger.items():
            if key[0] == job_id and key[1] > attempt and later in (LlmOutcome.STARTED, LlmOutcome.INTERRUPTED):
                self.ledger[key] = LlmOutcome.NOT_SENT
        self._leave(fault)

    async def notifications(self) -> AsyncIterator[None]:
        yield
        while True:
            await self._notifications.get()
            yield

    def _claimed(self, job: StoredJob) -> ClaimedJob:
        return ClaimedJob(id=job.id, public_id=job.public_id, client_id=1, request={"prompt": f"story {job.id}"},
                          created_at=job.created_at, started_at=datetime.now(UTC), max_tokens=self.max_tokens,
                          input_tokens_estimate=self.input_tokens_estimate)


if TYPE_CHECKING:
    # mypy holds the fake to the protocol the coordinator takes, so that the two cannot drift apart
    _: WorkerStore = RecordingStore()
