"""An in-memory WorkerStore that records what the worker asked of it.

It keeps jobs and ledger rows as the SQL does (guarded by status and worker
id), so the coordinator's rules can be tested in milliseconds; a test can
make the next call of a method fail (before or after its effect, as when a
connection drops around a commit).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from shared.ratelimit import LimiterState, ProviderView
from shared.rows import ClaimedJob, Completion, Failure, HeartbeatRow, RetryStart, SettleResult
from shared.status import ErrorCode, JobStatus, LlmOutcome
from worker.store import WorkerStore

if TYPE_CHECKING:
    from worker.store import WorkerStore


@dataclass
class StoredJob:
    id: int
    status: JobStatus = JobStatus.PENDING
    worker_id: str | None = None
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
                 input_tokens_estimate: int | None = None,
                 worst_case_usd: Callable[[int], Decimal] = lambda _: Decimal(0)) -> None:
        self._worker_id = worker_id
        self.jobs: dict[int, StoredJob] = {}
        self.ledger: dict[tuple[int, int], LlmOutcome] = {}
        self.billed: dict[tuple[int, int], bool] = {}
        # what each job was accepted with, and what the budget charged an
        # ended job (as story_jobs.charged_usd and the budget trigger do)
        self.max_tokens = max_tokens
        self.input_tokens_estimate = input_tokens_estimate
        self.worst_case_usd = worst_case_usd
        self.charged: dict[int, Decimal] = {}
        self.calls: list[tuple[str, Any]] = []
        self._faults: dict[str, list[Fault]] = {}
        self._notifications: asyncio.Queue[None] = asyncio.Queue()
        # what the next claims answer of the shared rate bucket, and how long
        # a retry is held (another worker's 429)
        self.limiter = LimiterState()
        self.paused_s = 0.0
        self.provider_views: list[ProviderView | None] = []

    @property
    def worker_id(self) -> str:
        return self._worker_id

    # -- what tests use ---------------------------------------------------------------

    def add_pending(self, n: int = 1) -> list[int]:
        ids = []
        for _ in range(n):
            job_id = len(self.jobs) + 1
            self.jobs[job_id] = StoredJob(job_id)
            ids.append(job_id)
        return ids

    def fail_next(self, method: str, error: Exception, *, after_effect: bool = False) -> None:
        self._faults.setdefault(method, []).append(Fault(error, after_effect))

    def end_elsewhere(self, job_id: int, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        """What a cancellation or the sweeper does: the job fails, charged its
        worst case if it was running, and its open call is closed."""
        job = self.jobs[job_id]
        if job.status in (JobStatus.PENDING, JobStatus.RUNNING):
            self.charged[job_id] = self.worst_case_usd(job_id) if job.status is JobStatus.RUNNING else Decimal(0)
        job.status, job.error_code = JobStatus.FAILED, code
        for key, outcome in self.ledger.items():
            if key[0] == job_id and outcome is LlmOutcome.STARTED:
                self.ledger[key] = LlmOutcome.INTERRUPTED

    def budget_held(self) -> Decimal:
        """What the budget counts: an ended job's charge, a live job's reservation."""
        return sum((self.charged.get(job.id, self.worst_case_usd(job.id)) for job in self.jobs.values()),
                   Decimal(0))

    def notify(self) -> None:
        self._notifications.put_nowait(None)

    def named(self, method: str) -> list[Any]:
        return [args for name, args in self.calls if name == method]

    def statuses(self) -> dict[int, JobStatus]:
        return {job.id: job.status for job in self.jobs.values()}

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

    def _ours(self, job_id: int) -> bool:
        job = self.jobs.get(job_id)
        return job is not None and job.status is JobStatus.RUNNING and job.worker_id == self._worker_id

    async def settle_and_claim(
        self, completions: Sequence[Completion], claim_limit: int, provider_view: ProviderView | None,
    ) -> SettleResult:
        fault = self._enter("settle_and_claim", (list(completions), claim_limit))
        self.provider_views.append(provider_view)
        completed = []
        for completion in completions:
            self.ledger[(completion.job_id, completion.attempt)] = LlmOutcome.SUCCEEDED
            self.billed[(completion.job_id, completion.attempt)] = True
            if self._ours(completion.job_id):
                job = self.jobs[completion.job_id]
                job.status, job.story = JobStatus.COMPLETED, completion
                self.charged[job.id] = completion.cost_usd
                completed.append(completion.job_id)
        claimed: list[ClaimedJob] = []
        for job in self.jobs.values():
            if len(claimed) == claim_limit:
                break
            if job.status is JobStatus.PENDING:
                job.status, job.worker_id = JobStatus.RUNNING, self._worker_id
                self.ledger[(job.id, 1)] = LlmOutcome.STARTED
                claimed.append(self._claimed(job))
        self._leave(fault)
        return SettleResult(completed_ids=completed, already_completed_ids=[], claimed=claimed, limiter=self.limiter)

    async def fail_running(self, failures: Sequence[Failure]) -> list[int]:
        fault = self._enter("fail_running", list(failures))
        failed = []
        for failure in failures:
            self.ledger[(failure.job_id, failure.attempt)] = failure.call_outcome
            self.billed[(failure.job_id, failure.attempt)] = failure.billed
            for key, later in self.ledger.items():
                if key[0] == failure.job_id and key[1] > failure.attempt and later is LlmOutcome.STARTED:
                    self.ledger[key] = LlmOutcome.NOT_SENT
            if self._ours(failure.job_id):
                job = self.jobs[failure.job_id]
                job.status, job.error_code = JobStatus.FAILED, failure.error_code
                self.charged[job.id] = failure.cost_usd if failure.billed else Decimal(0)
                failed.append(failure.job_id)
        self._leave(fault)
        return failed

    async def claims_of_lost_answer(self, known_ids: Sequence[int]) -> list[ClaimedJob]:
        fault = self._enter("claims_of_lost_answer", list(known_ids))
        found = [
            self._claimed(job) for job in self.jobs.values()
            if self._ours(job.id) and job.id not in known_ids
            and self.ledger.get((job.id, 1)) is LlmOutcome.STARTED and (job.id, 2) not in self.ledger
        ]
        self._leave(fault)
        return found

    async def heartbeat(self, progress: Mapping[int, int]) -> list[HeartbeatRow]:
        fault = self._enter("heartbeat", dict(progress))
        rows = []
        for job_id, tokens in progress.items():
            alive = self._ours(job_id)
            job = self.jobs[job_id]
            if alive:
                job.progress = tokens
            rows.append(HeartbeatRow(id=job_id, status=job.status, error_code=job.error_code, alive=alive))
        self._leave(fault)
        return rows

    async def call_retry(
        self, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome, previous_error: str
    ) -> RetryStart:
        fault = self._enter("call_retry", (job_id, previous_attempt, previous_outcome))
        self.ledger[(job_id, previous_attempt)] = previous_outcome
        self.billed[(job_id, previous_attempt)] = not previous_outcome.certainly_unbilled
        attempt = None
        following = (job_id, previous_attempt + 1)
        if self._ours(job_id) and following in self.ledger:
            # run again after its answer was lost: the row it opened
            attempt = previous_attempt + 1 if self.ledger[following] is LlmOutcome.STARTED else None
        elif self._ours(job_id) and not self.paused_s:
            attempt = previous_attempt + 1
            self.ledger[following] = LlmOutcome.STARTED
        self._leave(fault)
        return RetryStart(attempt=attempt, paused_s=self.paused_s, owned=self._ours(job_id))

    async def pause(self, pause_s: float) -> None:
        fault = self._enter("pause", pause_s)
        self._leave(fault)

    def learn(self, view: ProviderView) -> None:
        self.calls.append(("learn", view))

    async def call_finish(
        self, job_id: int, attempt: int, *, outcome: LlmOutcome, billed: bool, input_tokens: int,
        output_tokens: int, cost_usd: Decimal, error_text: str | None, request_id: str | None = None,
    ) -> None:
        fault = self._enter("call_finish", (job_id, attempt, outcome, billed))
        self.ledger[(job_id, attempt)] = outcome
        self.billed[(job_id, attempt)] = billed
        job = self.jobs[job_id]
        if job.status is JobStatus.FAILED and self.charged.get(job_id, Decimal(0)) > cost_usd:
            self.charged[job_id] = cost_usd
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
