"""The worker's coordinator, model-tested on the recording store: the rules
and invariants of tests/model/worker_model.py, in milliseconds per step.

What this run checks is the coordinator's own decisions, with the store
answering as the rules set it up (tests/fakes/recording_worker_store.py): at
most one billed request per job, a request only for a job it holds (and
that the store has not been told is gone), every request's ledger row asked
for before it is sent and closed with what the provider did, and a request
sent again only after a refusal. The budget and the job rows are the
database's, and so are the guards that keep them: those invariants are
checked by the same machine on Postgres (test_worker_model_pg.py)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from shared.status import ErrorCode, LlmOutcome
from tests.fakes.recording_worker_store import RecordingStore
from tests.model.worker_model import INPUT_ESTIMATE, MAX_TOKENS, JobState, WorkerMachine, World


class RecordingWorld:
    def __init__(self) -> None:
        self.store = RecordingStore(max_tokens=MAX_TOKENS, input_tokens_estimate=INPUT_ESTIMATE)

    async def add_pending(self, n: int) -> list[int]:
        return self.store.add_pending(n)

    async def end_elsewhere(self, job_id: int, code: ErrorCode) -> None:
        self.store.end_elsewhere(job_id, code)

    async def claim_elsewhere(self) -> int | None:
        # the store keeps no rows for another worker's jobs: the job is simply never claimed here
        self.store.claim_elsewhere()
        return None

    def fail_next(self, method: str, error: Exception, *, after_effect: bool) -> None:
        self.store.fail_next(method, error, after_effect=after_effect)

    async def is_ours(self, job_id: int) -> bool:
        return self.store.held_here(job_id)

    async def running(self) -> list[int]:
        return [job.id for job in self.store.jobs.values() if not job.gone and job.status.value in ("pending", "running")]

    async def ledger(self) -> dict[tuple[int, int], tuple[LlmOutcome, bool]]:
        return {key: (outcome, self.store.billed.get(key, outcome not in (LlmOutcome.NOT_SENT,)))
                for key, outcome in self.store.ledger.items()}

    async def budget_held(self) -> None:
        return None

    async def job_states(self) -> dict[int, JobState] | None:
        return None


class RecordingStoreMachine(WorkerMachine):
    async def make_world(self) -> World:
        return RecordingWorld()


RecordingStoreMachine.TestCase.settings = settings(
    # CI's count; `make bench` (tests/bench/model.py) runs many more
    max_examples=int(os.environ.get("STORYJOBS_MODEL_RECORDING_EXAMPLES", "150")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_the_coordinator_keeps_its_promise_on_the_recording_store = RecordingStoreMachine.TestCase
