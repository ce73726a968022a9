"""The model-based test of tests/model/worker_model.py on the real store: the
coordinator's statements run on Postgres (a fresh database per example), so
that the SQL's guards are what the invariants check (the recording store
keeps no copy of them). Faults are injected around the real statements:
refused before they run, or their answer lost after they committed. Cancels
are the api's statement, sweeps the sweeper's, another worker's claim the
claim under another worker id.

Besides the Hypothesis run, the orders in which one guard alone keeps an end
from a job no longer ours are played as scenarios, every time: an answer
arriving after a cancel or a sweep (a story, a refusal, a 429 that asks for
a retry), a completion written again after its answer was lost, and a claim
lost while a begun job's call is open."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from api.admission import admission
from api.store import ApiStore
from shared import db
from shared.config import ApiSettings
from shared.ratelimit import RateLimits
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest
from sweeper.store import PgSweeperStore
from tests.model.worker_model import MAX_TOKENS, OTHER_WORKER, JobState, WorkerMachine, World
from tests.support import postgres_server, worker_statements
from tests.support.database import create_key
from tests.support.money import money_problems
from worker.pg_store import PgWorkerStore
from worker.rows import Completion
from worker.store import ClaimAsk, RoundWritten

WORKER_ID = "w-model"
_counter = itertools.count()


class FaultyStore:
    """A WorkerStore around the real one whose next call of a method can
    fail: refused before it runs, or its answer lost after it committed."""

    def __init__(self, inner: PgWorkerStore) -> None:
        self._inner = inner
        self._faults: dict[str, list[tuple[Exception, bool]]] = {}

    @property
    def worker_id(self) -> str:
        return self._inner.worker_id

    def fail_next(self, method: str, error: Exception, *, after_effect: bool) -> None:
        self._faults.setdefault(method, []).append((error, after_effect))

    def _take(self, method: str) -> tuple[Exception, bool] | None:
        faults = self._faults.get(method)
        return faults.pop(0) if faults else None

    async def settle_and_claim(self, completions: Sequence[Completion], ask: ClaimAsk | None,
                               limits: RateLimits) -> RoundWritten:
        """Faults by part, as the real transaction fails: a refused settle
        commits nothing; a refused claim rolls back and the stories commit
        alone; a lost answer comes after both committed."""
        settle_fault = self._take("settle") if completions else None
        claim_fault = self._take("claim") if ask is not None else None
        if settle_fault is not None and not settle_fault[1]:
            raise settle_fault[0]
        if claim_fault is not None and not claim_fault[1]:
            if not completions:
                raise claim_fault[0]
            written = await self._inner.settle_and_claim(completions, None, limits)
            if settle_fault is not None:
                raise settle_fault[0]
            return RoundWritten(settled=written.settled, claimed=None, claim_refused=claim_fault[0])
        written = await self._inner.settle_and_claim(completions, ask, limits)
        for fault in (settle_fault, claim_fault):
            if fault is not None:
                raise fault[0]
        return written

    def __getattr__(self, method: str) -> Any:
        real = getattr(self._inner, method)
        if method == "notifications":
            return real

        async def call(*args: Any, **kwargs: Any) -> Any:
            faults = self._faults.get(method)
            fault = faults.pop(0) if faults else None
            if fault is not None and not fault[1]:
                raise fault[0]
            answer = await real(*args, **kwargs)
            if fault is not None:
                raise fault[0]
            return answer

        return call


class PgWorld:
    def __init__(self, server_url: str, template: str) -> None:
        self._server_url = server_url
        self._name = f"storyjobs_model_{os.getpid()}_{next(_counter)}"
        self.url = postgres_server.create_database_from_template(server_url, self._name, template)
        self._settings = ApiSettings(llm_max_tokens=MAX_TOKENS)

    async def open(self) -> None:
        self.pool = db.make_pool(self.url, application_name="storyjobs-model", connect_timeout_s=5,
                                 statement_timeout_s=30, min_size=1, max_size=4, wait_timeout_s=5)
        await self.pool.open(wait=True)
        self.conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        await create_key(self.conn, "model")
        cur = await self.conn.execute("SELECT id FROM api_clients WHERE name = 'model'")
        (self.client_id,) = await cur.fetchone() or (0,)
        self.faulty = FaultyStore(PgWorkerStore(self.pool, worker_id=WORKER_ID, provider="anthropic",
                                                model="model", listen_url=None, connect_timeout_s=5,
                                                default_max_tokens=MAX_TOKENS))
        self.store = self.faulty
        self._public: dict[int, uuid.UUID] = {}

    async def close(self) -> None:
        await self.conn.close()
        await self.pool.close()
        postgres_server.drop_database(self._server_url, self._name)

    async def add_pending(self, n: int) -> list[int]:
        ids = []
        for _ in range(n):
            # ids start at 1 in a fresh database: job n's prompt is "story n"
            job_id = len(self._public) + 1
            request = StoryRequest(prompt=f"story {job_id}")
            one = admission(self.client_id, uuid.uuid4().hex, request, self._settings)
            (result,) = await ApiStore(self.conn).job_insert_if_admitted(admissions=[one], queue_max=10_000,
                                                                         client_queue_max=10_000, budget_usd=Decimal(1000))
            assert result.outcome == "inserted" and result.public_id is not None
            cur = await self.conn.execute("SELECT id FROM story_jobs WHERE public_id = %s", (result.public_id,))
            (stored_id,) = await cur.fetchone() or (0,)
            assert stored_id == job_id
            self._public[job_id] = result.public_id
            ids.append(job_id)
        return ids

    async def end_elsewhere(self, job_id: int, code: ErrorCode) -> None:
        if code is ErrorCode.CANCELLED:
            await ApiStore(self.conn).job_cancel(client_id=self.client_id, job_id=self._public[job_id])
            return
        # a sweep of this job alone: its heartbeat made old, then the sweeper's pass
        await self.conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '1 hour' "
                                "WHERE id = %s AND status = 'running'", (job_id,))
        await PgSweeperStore(self.conn).fail_stale(
            heartbeat_timeout_s=600, job_timeout_s=86_400, pending_timeout_s=86_400, judge_running=True,
            batch_size=10, lock_timeout_s=5, now=datetime.now(UTC) + timedelta(seconds=1))

    async def claim_elsewhere(self) -> int | None:
        settled = await worker_statements.job_claim(self.conn, worker_id=OTHER_WORKER, claim_limit=1, provider="anthropic",
                                               model="model")
        return settled.claimed[0].id if settled.claimed else None

    def fail_next(self, method: str, error: Exception, *, after_effect: bool) -> None:
        self.faulty.fail_next(method, error, after_effect=after_effect)

    async def is_ours(self, job_id: int) -> bool:
        cur = await self.conn.execute("SELECT status = 'running' AND worker_id = %s FROM story_jobs WHERE id = %s",
                                      (WORKER_ID, job_id))
        row = await cur.fetchone()
        return bool(row and row[0])

    async def running(self) -> list[int]:
        cur = await self.conn.execute("SELECT id FROM story_jobs WHERE status IN ('pending', 'running') ORDER BY id")
        return [row[0] for row in await cur.fetchall()]

    async def ledger(self) -> dict[tuple[int, int], tuple[LlmOutcome, bool]]:
        cur = await self.conn.execute("SELECT job_id, attempt, outcome, billed FROM llm_calls")
        return {(job_id, attempt): (LlmOutcome(outcome), billed)
                for job_id, attempt, outcome, billed in await cur.fetchall()}

    async def job_states(self) -> dict[int, JobState]:
        cur = await self.conn.execute("SELECT id, status::text, worker_id, story_id::text, error_code, error_text "
                                      "FROM story_jobs")
        return {row[0]: JobState(*row[1:]) for row in await cur.fetchall()}

    async def charges(self) -> list[tuple[int, Decimal]]:
        """The ended jobs' charges."""
        cur = await self.conn.execute("SELECT id, charged_usd FROM story_jobs WHERE status IN ('completed', 'failed')")
        return await cur.fetchall()

    async def budget_held(self) -> Decimal:
        cur = await self.conn.execute("SELECT coalesce(sum(spent_usd + reserved_usd), 0) FROM budget_days "
                                      "WHERE client_id = 0")
        (held,) = await cur.fetchone() or (Decimal(0),)
        return Decimal(held)


class PgStoreMachine(WorkerMachine):
    server_url = ""
    template = ""
    # statements take real time: tasks are let run until they are still for longer
    settle_rounds = 100

    @invariant()
    def money_follows_the_ledger(self) -> None:
        """Each ended job is charged what its ledger rows say (reckoned here, apart from the database's
        derivation), its rows closed; each budget day's spent and reserved are its jobs' charges and
        reservations; and no ended job is charged less than the provider billed for it."""
        problems = self.run(money_problems(self._pg.conn))
        assert problems == [], problems
        charged = dict(self.run(self._pg.charges()))
        for job_id in {r.job_id for r in self.d.provider.requests}:
            billed = sum((r.cost for r in self.d.provider.for_job(job_id)), Decimal(0))
            if job_id in charged:
                assert charged[job_id] >= billed, ("charged less than the provider billed", job_id,
                                                   charged[job_id], billed)

    def check_invariants_now(self) -> None:
        super().check_invariants_now()
        self.money_follows_the_ledger()

    async def make_world(self) -> World:
        world = PgWorld(self.server_url, self.template)
        await world.open()
        self._pg = world
        return world

    async def close_world(self) -> None:
        await self._pg.close()


@pytest.fixture
def pg_machine(server_url: str, template_db: str) -> Iterator[type[PgStoreMachine]]:
    PgStoreMachine.server_url, PgStoreMachine.template = server_url, template_db
    yield PgStoreMachine


def test_the_coordinator_keeps_its_promise_on_postgres(pg_machine: type[PgStoreMachine]) -> None:
    """The model's invariants hold with every statement running on Postgres."""
    examples = int(os.environ.get("STORYJOBS_MODEL_EXAMPLES", "12"))
    run_state_machine_as_test(pg_machine, settings=settings(
        max_examples=examples, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def _play(machine_type: type[PgStoreMachine], *steps: Callable[[PgStoreMachine], None]) -> PgStoreMachine:
    """Runs the steps on a fresh machine, every invariant checked after each, as Hypothesis would."""
    machine = machine_type()
    try:
        machine.check_invariants_now()
        for step in steps:
            step(machine)
            machine.check_invariants_now()
    finally:
        machine.teardown()
    return machine


def _first_request(machine: PgStoreMachine) -> Any:
    (request,) = machine.d.provider.waiting
    return request


def test_a_story_that_arrives_after_a_cancel_changes_nothing(pg_machine: type[PgStoreMachine]) -> None:
    """A job cancelled while its request is in flight stays cancelled when the story arrives and is settled."""
    machine = _play(pg_machine, lambda m: m.add_jobs(1),
                    lambda m: m.end_then_answer(_first_request(m), ErrorCode.CANCELLED, "stream"))
    assert machine.d.ended[1].error_code == "cancelled"


def test_a_failure_that_arrives_after_a_sweep_changes_nothing(pg_machine: type[PgStoreMachine]) -> None:
    """A job swept while its request is in flight keeps the sweep's end when the provider's 400 fails it."""
    machine = _play(pg_machine, lambda m: m.add_jobs(1),
                    lambda m: m.end_then_answer(_first_request(m), ErrorCode.INTERRUPTED, "rejected"))
    assert machine.d.ended[1].error_code == "interrupted"


def test_a_429_that_arrives_after_a_cancel_sends_no_retry(pg_machine: type[PgStoreMachine]) -> None:
    """A job cancelled while its request is in flight gets no retry (and no ledger row for one) after a 429."""
    machine = _play(pg_machine, lambda m: m.add_jobs(1),
                    lambda m: m.end_then_answer(_first_request(m), ErrorCode.CANCELLED, "rate_limited"))
    assert len(machine.d.provider.requests) == 1


def test_a_completion_written_again_after_its_answer_was_lost_changes_nothing(
    pg_machine: type[PgStoreMachine],
) -> None:
    """A round that completed a job but lost its answer writes the completion again: the job keeps its story."""
    machine = _play(pg_machine, lambda m: m.add_jobs(1),
                    lambda m: m.statement_fails("settle", lost_answer=True),
                    lambda m: m.answer_request(_first_request(m), "stream"),
                    lambda m: m.round(), lambda m: m.round())
    assert machine.d.ended[1].status == "completed"


def test_a_claim_lost_while_a_call_is_open_never_begins_that_call_again(pg_machine: type[PgStoreMachine]) -> None:
    """After a claim's answer is lost while job 1's request is in flight, adoption runs job 2 and leaves job 1."""
    machine = _play(pg_machine, lambda m: m.add_jobs(1), lambda m: m.claim_lost_while_a_call_is_open())
    assert sorted(r.job_id for r in machine.d.provider.requests) == [1, 2]

