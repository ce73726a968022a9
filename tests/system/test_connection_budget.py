"""The connection budget of the README's Operations table, held under load.

One api, one worker and one sweeper serve 120 jobs while a sampler counts,
every few milliseconds, the database's server connections by
application_name in pg_stat_activity (each process names its connections:
storyjobs-api, storyjobs-worker, storyjobs-worker-listen, storyjobs-sweeper)
and, behind PgBouncer, the pooler's client connections by application_name
(SHOW CLIENTS). PgBouncer 1.18 passes a client's application_name on to the
server connection it is using, so there a server connection carries the
name of the process that used it last; what each process holds is then its
client connections, and the server connections are the pooler's.

The load is built to fill the pools: POSTs and GETs from 30 connections at
once, and jobs whose first request the provider answers 529 (retry after
50 ms), so that the jobs a round claimed together open their retry ledger
rows at the same moment, while the worker's rounds and heartbeats run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support import postgres_server
from tests.support.database import AdminSampler, create_key_sync
from tests.support.pgbouncer import PgBouncer
from tests.support.waiting import wait_until, wait_until_sync
from tests.system.procs import ApiProc, Proc, System, wait_while_running

pytestmark = pytest.mark.system

API_POOL_SIZE = 4
# the connections an api keeps open while idle (Operations, "Connection budget")
API_IDLE_CONNECTIONS = 2
# the README's table (Operations, "Connection budget"), for these settings
DIRECT_BUDGET = {"storyjobs-api": API_POOL_SIZE, "storyjobs-worker": 3, "storyjobs-worker-webhooks": 1,
                 "storyjobs-worker-batches": 1, "storyjobs-worker-drafts": 1, "storyjobs-worker-listen": 1,
                 "storyjobs-sweeper": 1}
POOLED_CLIENT_BUDGET = {"storyjobs-api": API_POOL_SIZE, "storyjobs-worker": 3, "storyjobs-worker-webhooks": 1,
                        "storyjobs-worker-batches": 1, "storyjobs-worker-drafts": 1, "storyjobs-sweeper": 1}
POOLED_DIRECT_BUDGET = {"storyjobs-worker-listen": 1}
TIMINGS = {"HEARTBEAT_INTERVAL_S": 0.2, "HEARTBEAT_TIMEOUT_S": 5, "SWEEPER_INTERVAL_S": 0.2,
           "JOB_TIMEOUT_S": 120, "LLM_TIMEOUT_S": 60, "LLM_READ_TIMEOUT_S": 30, "WORKER_POLL_INTERVAL_S": 0.5}
JOBS = 120


class ConnectionSampler(AdminSampler):
    """On a thread of its own, counts the connections of one database by application_name, every few
    milliseconds, and keeps the most of each seen at once: server connections (pg_stat_activity, read over
    a connection to the maintenance database, which is not counted), the pooler's client connections
    (SHOW CLIENTS) when a pooler is given, and all the database's server connections together."""

    def __init__(self, server_url: str, dbname: str, bouncer: PgBouncer | None = None) -> None:
        super().__init__(server_url, interval_s=0.005)
        self._dbname = dbname
        self._bouncer = bouncer
        self.server: Counter[str] = Counter()
        self.clients: Counter[str] = Counter()
        self.server_total = 0
        self.samples = 0

    def sample(self, conn: psycopg.Connection[Any]) -> None:
        rows = conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE datname = %s AND backend_type = 'client backend' GROUP BY 1", (self._dbname,),
        ).fetchall()
        self._keep_most(self.server, {name: int(n) for name, n in rows})
        self.server_total = max(self.server_total, sum(int(n) for _, n in rows))
        if self._bouncer is not None:
            clients = Counter(row["application_name"] for row in self._bouncer.show("clients")
                              if row["database"] == self._dbname)
            self._keep_most(self.clients, clients)
        self.samples += 1

    @staticmethod
    def _keep_most(most: Counter[str], now: dict[str, int]) -> None:
        for name, count in now.items():
            most[name] = max(most[name], count)


def _load(api_url: str, key: str) -> list[int]:
    """120 POSTs, 30 at a time, then GETs from 30 clients until every job is finished; the answers' statuses."""
    statuses: list[int] = []

    async def run() -> None:
        limit = asyncio.Semaphore(30)
        # connections idle for less than uvicorn's keep-alive (5 s, httpx's default expiry too): a
        # connection reused just as the server closes it is a ReadError that says nothing of the api
        async with httpx.AsyncClient(base_url=api_url, timeout=20, headers={"Authorization": f"Bearer {key}"},
                                     limits=httpx.Limits(max_connections=40, keepalive_expiry=2.0)) as client:
            async def post(n: int) -> str:
                async with limit:
                    answer = await client.post("/stories/generate", json={"prompt": f"budget #{n}#"},
                                               headers={"Idempotency-Key": str(uuid.uuid4())})
                statuses.append(answer.status_code)
                return str(answer.json()["job_id"])

            job_ids = await asyncio.gather(*(post(n) for n in range(JOBS)))

            async def follow(job_id: str) -> None:
                async def ended() -> bool:
                    async with limit:
                        answer = await client.get(f"/stories/jobs/{job_id}")
                    statuses.append(answer.status_code)
                    return bool(answer.json()["status"] in ("completed", "failed"))

                await wait_until(ended, timeout=120, interval=0.05, what=f"job {job_id} to end")

            await asyncio.gather(*(follow(job_id) for job_id in job_ids))

    asyncio.run(run())
    return statuses


def _start(system: System, fake_llm: FakeAnthropicServer, env: dict[str, Any]) -> list[Proc]:
    fake_llm.fake.default = Plan(chunks=5, duration_s=0.5)
    for n in range(JOBS):
        fake_llm.fake.queue_for(f"#{n}#", Plan(status=529, retry_after_ms=50))
    llm: dict[str, Any] = {"ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": fake_llm.base_url}
    return [
        system.api(QUEUE_MAX=1000, API_POOL_SIZE=API_POOL_SIZE, **env),
        system.worker(WORKER_CONCURRENCY=20, **env, **llm),
        system.sweeper(**env),
    ]


def _api(procs: list[Proc]) -> ApiProc:
    """The api of the processes _start started (it starts it first)."""
    api = procs[0]
    assert isinstance(api, ApiProc)
    return api


def _wait_listening(server_url: str, dbname: str, procs: list[Proc]) -> None:
    with postgres_server.admin(server_url) as conn:
        wait_while_running(lambda: conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                                                "AND application_name = 'storyjobs-worker-listen'",
                                                (dbname,)).fetchone() == (1,),
                           procs, what="the worker to listen", timeout=30)


def _completed(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM story_jobs WHERE status = 'completed'").fetchone()
    assert row is not None
    return int(row[0])


def test_without_a_pooler_each_process_holds_at_most_its_stated_server_connections(
    system: System, fake_llm: FakeAnthropicServer, server_url: str, database_name: str, database_url: str,
) -> None:
    """Directly on Postgres under a load that fills the pools: the api holds at most API_POOL_SIZE server
    connections, the worker 3 plus its webhooks' 1, its batch lane's 1 and its LISTEN connection, the sweeper 1."""
    key = create_key_sync(database_url, "budget")
    procs = _start(system, fake_llm, TIMINGS)
    _wait_listening(server_url, database_name, procs)
    with ConnectionSampler(server_url, database_name) as sampler:
        statuses = _load(_api(procs).base_url, key)
    assert _completed(database_url) == JOBS
    assert set(statuses) == {200, 202}
    assert sampler.samples > 100
    held = {name: sampler.server[name] for name in DIRECT_BUDGET}
    assert all(held[name] <= budget for name, budget in DIRECT_BUDGET.items()), (held, DIRECT_BUDGET)
    assert set(sampler.server) <= set(DIRECT_BUDGET), sampler.server
    assert held["storyjobs-api"] == API_POOL_SIZE, "the load did not fill the api's pool"
    assert held["storyjobs-worker"] == 3, "the load did not fill the worker's pool"


def test_behind_pgbouncer_each_process_holds_its_stated_client_connections_and_the_server_only_the_pool(
    system: System, fake_llm: FakeAnthropicServer, server_url: str, database_name: str, database_url: str,
    pgbouncer_factory: Callable[..., PgBouncer],
) -> None:
    """Through PgBouncer (3 server connections) under load: the database sees the pooler's 3 server connections
    and the worker's direct LISTEN connection, nothing more; at the pooler the api holds at most API_POOL_SIZE
    client connections, the worker 3 plus its webhooks' 1 and its batch lane's 1, the sweeper 1."""
    bouncer = pgbouncer_factory(default_pool_size=3)
    env: dict[str, Any] = {"DATABASE_URL": bouncer.url(database_name), "DATABASE_POOLER": "transaction",
           "DATABASE_LISTEN_URL": database_url, **TIMINGS}
    key = create_key_sync(database_url, "budget")
    procs = _start(system, fake_llm, env)
    _wait_listening(server_url, database_name, procs)
    with ConnectionSampler(server_url, database_name, bouncer) as sampler:
        statuses = _load(_api(procs).base_url, key)
    assert _completed(database_url) == JOBS
    assert set(statuses) == {200, 202}
    assert sampler.samples > 100
    assert sampler.server_total <= 3 + 1, sampler.server
    assert sampler.server["storyjobs-worker-listen"] <= POOLED_DIRECT_BUDGET["storyjobs-worker-listen"]
    clients = {name: sampler.clients[name] for name in POOLED_CLIENT_BUDGET}
    assert all(clients[name] <= budget for name, budget in POOLED_CLIENT_BUDGET.items()), (clients,)
    assert set(sampler.clients) <= set(POOLED_CLIENT_BUDGET), sampler.clients
    assert clients["storyjobs-api"] == API_POOL_SIZE, "the load did not fill the api's pool"
    assert clients["storyjobs-worker"] == 3, "the load did not fill the worker's pool"


def test_an_idle_api_keeps_two_connections_open_for_its_first_requests(
    system: System, server_url: str, database_name: str,
) -> None:
    """Started and asked nothing, an api replica opens two server connections, so that its first requests do
    not wait to connect, and no more while it stays idle."""
    system.api()
    with postgres_server.admin(server_url) as conn:
        def held() -> int:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                               "AND application_name = 'storyjobs-api'", (database_name,)).fetchone()
            assert row is not None
            return int(row[0])

        wait_until_sync(lambda: held() >= API_IDLE_CONNECTIONS, timeout=10,
                        what="the api's pool to open its first connections")
        time.sleep(1)
        assert held() == API_IDLE_CONNECTIONS
