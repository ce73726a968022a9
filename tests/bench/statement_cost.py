"""statement_cost: the database's instructions per job in the worker's round
(its written stories settled, then its claim, one transaction sent as
one pipeline), counted by valgrind's callgrind.

CPU time moves with whatever else a shared machine is doing; an instruction
count does not (the same statements give the same count, to a fraction of a
percent, whatever the load), so a change to the statement or the schema is
measured on its own, in one run. The count leaves out what only the kernel
does (the commit's write and fsync, the socket).

A private Postgres from this machine's binaries runs under callgrind, which
follows each backend it forks. One connection sends the round as a worker
does (worker/pg_store.py, one pipeline): it completes the jobs it claimed in the previous round and
claims the next ones, one job a round and ten, without and with a rate limit
configured, one job a round for a client with a webhook endpoint (whose
completions write the outbox), and ten a round with stories of 6,000
characters (the others' are 940: a story's text is what grows). Each figure
is the difference between two connections' totals, of ROUNDS/5 and of
ROUNDS rounds, over the difference in jobs, so connecting,
warming up and planning cancel out. Needs valgrind and the Postgres server
binaries (Debian's postgresql package); without them it reports nothing.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

import psycopg

from api.store import ApiStore
from shared import db
from shared.ratelimit import NO_LIMITS, RateLimits
from shared.webhooks import EVENTS, new_secret
from tests.bench.harness import (
    BENCH_FINGERPRINT,
    BENCH_REQUEST_JSON,
    BenchContext,
    BenchResult,
    FigureSpec,
)
from tests.support import postgres_server, private_postgres, worker_statements
from tests.support.waiting import wait_until_sync
from worker.pg_store import PgWorkerStore
from worker.rows import ClaimedJob, Completion
from worker.store import ClaimAsk

NAME = "statement_cost"
SPECS = {
    "one_kinstr_per_job": FigureSpec("round (settle, then claim), one job a round: instructions per job", "k"),
    "batched_kinstr_per_job": FigureSpec("round (settle, then claim), ten jobs a round: instructions per job", "k"),
    "one_limited_kinstr_per_job": FigureSpec(
        "round with a rate limit, one job a round: instructions per job", "k"),
    "one_webhook_kinstr_per_job": FigureSpec(
        "round for a client with a webhook endpoint, one job a round: instructions per job", "k"),
    "long_story_batched_kinstr_per_job": FigureSpec(
        "round, ten jobs a round, stories of 6,000 characters: instructions per job", "k"),
}
_SENTENCE = "Once upon a time, a small fox could not sleep. "
SHORT_STORY, LONG_STORY = _SENTENCE * 20, _SENTENCE * 128
ROUNDS, QUICK_ROUNDS = 200, 20
# so generous that the bucket never holds a job back
_LIMITS = RateLimits(1e6, 1e9, 1e9, 1e12, 1e9, 1e12)


def run(ctx: BenchContext, result: BenchResult) -> None:
    bindir = _server_bindir()
    missing = [what for what, found in (("valgrind", shutil.which("valgrind")), ("the Postgres server", bindir))
               if not found]
    if missing:
        result.note(f"not measured: {' and '.join(missing)} not found")
        return
    assert bindir is not None
    rounds = QUICK_ROUNDS if ctx.quick else ROUNDS
    result.params.update({"rounds": rounds, "server": bindir})
    with _server_under_callgrind(bindir) as server:
        for run_number in range(1, ctx.runs + 1):
            for key, batch, limited, webhook, story in (
                    ("one_kinstr_per_job", 1, False, False, SHORT_STORY),
                    ("batched_kinstr_per_job", 10, False, False, SHORT_STORY),
                    ("one_limited_kinstr_per_job", 1, True, False, SHORT_STORY),
                    ("one_webhook_kinstr_per_job", 1, False, True, SHORT_STORY),
                    ("long_story_batched_kinstr_per_job", 10, False, False, LONG_STORY)):
                per_job = _instructions_per_job(server, rounds=rounds, batch=batch, limited=limited,
                                                webhook=webhook, story=story)
                result.add(key, per_job / 1000)
                ctx.progress(f"statement_cost run {run_number}/{ctx.runs}: {key} {per_job / 1000:,.0f} k")


class _Server:
    def __init__(self, url: str, profiles: Path) -> None:
        self.url = url
        self.profiles = profiles
        self._databases = 0

    def new_database(self) -> str:
        """A copy of the migrated template (migrating under callgrind is slow)."""
        if self._databases == 0:
            postgres_server.create_migrated_database(self.url, "cost_template")
        self._databases += 1
        return postgres_server.create_database_from_template(self.url, f"cost_{self._databases}", "cost_template")

    def instructions(self, pid: int) -> int:
        """The backend's total, written by callgrind when the backend exits."""
        path = self.profiles / f"cg.{pid}"
        totals: list[int] = []

        def written() -> bool:
            if path.exists():
                totals.extend(int(line.split()[1]) for line in path.read_text(errors="replace").splitlines()
                              if line.startswith("totals:"))
            return bool(totals)

        wait_until_sync(written, timeout=120, interval=0.2, what=f"callgrind's totals for backend {pid}")
        return totals[0]


def _instructions_per_job(server: _Server, *, rounds: int, batch: int, limited: bool, webhook: bool,
                          story: str) -> float:
    url = server.new_database()
    asyncio.run(_prepare(url, jobs=2 * (rounds + 40) * batch, limited=limited, webhook=webhook))
    short = rounds // 5
    totals = [server.instructions(asyncio.run(_rounds(url, rounds=n, batch=batch, limited=limited, story=story)))
              for n in (short, rounds)]
    return (totals[1] - totals[0]) / ((rounds - short) * batch)


async def _prepare(url: str, *, jobs: int, limited: bool, webhook: bool) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("INSERT INTO api_clients (name) VALUES ('bench')")
        await conn.execute(
            "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn) "
            "SELECT 1, 'pending-' || n, %(fingerprint)s, %(request)s::jsonb, n FROM generate_series(1, %(jobs)s) AS n",
            {"fingerprint": BENCH_FINGERPRINT, "request": BENCH_REQUEST_JSON, "jobs": jobs})
        if limited:
            await worker_statements.llm_rate_bucket_ensure(conn, model="m", limits=_LIMITS)
        if webhook:
            await ApiStore(conn).webhook_endpoint_insert(
                client_id=1, url="https://hooks.example.com/storyjobs", events=list(EVENTS),
                secret=new_secret(), max_per_client=10)
        await conn.execute("VACUUM ANALYZE")


async def _rounds(url: str, *, rounds: int, batch: int, limited: bool, story: str) -> int:
    """20 warm-up rounds, then ``rounds`` more, on one connection set up as
    a worker's; returns the backend's pid."""
    limits = _LIMITS if limited else NO_LIMITS
    conn = await db.connect(url, application_name="statement_cost", connect_timeout_s=60, generic_plans=True)
    async with conn:
        cur = await conn.execute("SELECT pg_backend_pid()")
        row = await cur.fetchone()
        assert row is not None
        store = PgWorkerStore(conn, worker_id="w1", provider="p", model="m", default_max_tokens=4000)
        held: list[ClaimedJob] = []
        for _ in range(20 + rounds):
            # a round as the worker sends it: the written stories settled,
            # then the claim, one transaction
            written = await store.settle_and_claim([_completion(job, story) for job in held], ClaimAsk(batch), limits)
            assert written.claimed is not None
            held = written.claimed.claimed
        return int(row[0])


def _completion(job: ClaimedJob, story: str) -> Completion:
    return Completion(job_id=job.id, client_id=job.client_id, attempt=1, title="The Fox and the Moon",
                      body=story, model="m", prompt_version="v1",
                      input_tokens=100, output_tokens=180, cost_usd=Decimal("0.0027"), request_id="req_1")


def _server_bindir() -> str | None:
    """The newest Postgres server binaries on this machine: pg_config's, else Debian's."""
    found = private_postgres.server_bindirs()
    return found[0] if found else None


@contextmanager
def _server_under_callgrind(bindir: str) -> Iterator[_Server]:
    with private_postgres.private_server(
            bindir, settings={"autovacuum": "off", "fsync": "off"}, start_timeout_s=180,
            wrapper=("valgrind", "--tool=callgrind", "--trace-children=yes",
                     "--callgrind-out-file={directory}/cg.%p"),
            what="Postgres under callgrind") as server:
        yield _Server(server.url, server.directory)
