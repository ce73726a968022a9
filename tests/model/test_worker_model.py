"""The worker's coordinator, model-tested on the recording store: the rules
and invariants of tests/model/worker_model.py, in milliseconds per step."""

from __future__ import annotations

import os
from decimal import Decimal

from hypothesis import HealthCheck, settings

from shared.status import ErrorCode, JobStatus, LlmOutcome
from tests.fakes.recording_worker_store import RecordingStore
from tests.model.worker_model import INPUT_ESTIMATE, MAX_TOKENS, WorkerMachine, World, worst_case


class RecordingWorld:
    def __init__(self) -> None:
        self.store = RecordingStore(max_tokens=MAX_TOKENS, input_tokens_estimate=INPUT_ESTIMATE,
                                    worst_case_usd=worst_case)

    async def add_pending(self, n: int) -> list[int]:
        return self.store.add_pending(n)

    async def end_elsewhere(self, job_id: int, code: ErrorCode) -> None:
        self.store.end_elsewhere(job_id, code)

    def fail_next(self, method: str, error: Exception, *, after_effect: bool) -> None:
        self.store.fail_next(method, error, after_effect=after_effect)

    async def is_ours(self, job_id: int) -> bool:
        job = self.store.jobs.get(job_id)
        return job is not None and job.status is JobStatus.RUNNING and job.worker_id == self.store.worker_id

    async def running(self) -> list[int]:
        return [job.id for job in self.store.jobs.values() if job.status in (JobStatus.PENDING, JobStatus.RUNNING)]

    async def ledger(self) -> dict[tuple[int, int], tuple[LlmOutcome, bool]]:
        return {key: (outcome, self.store.billed.get(key, outcome not in (LlmOutcome.NOT_SENT,)))
                for key, outcome in self.store.ledger.items()}

    async def budget_held(self) -> Decimal:
        return self.store.budget_held()


class RecordingStoreMachine(WorkerMachine):
    async def make_world(self) -> World:
        return RecordingWorld()


RecordingStoreMachine.TestCase.settings = settings(
    # CI's count; `make bench` (tests/bench/model.py) runs many more
    max_examples=int(os.environ.get("STORYJOBS_MODEL_RECORDING_EXAMPLES", "150")), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_the_coordinator_keeps_its_promise_on_the_recording_store = RecordingStoreMachine.TestCase
