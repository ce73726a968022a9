"""fair_claim: the claim's fair share across clients, and what it costs.

Share: one client queues 2,000 jobs, then 9 clients 20 each, through the
api's admission statement (which gives each job its turn); one connection
then claims 4 jobs a round until the queue is empty. In every window of 100
claims, each client with pending jobs at the window's start should get 1/k
of them (k such clients): reported as the smallest and largest share × k
over all windows and clients (1.00 is exact). The other clients' first job's
wait is the number of claims made before it, with the fair claim and with
the first-come claim it replaced (ORDER BY created_at, id on the live-jobs
index, run here from the same statement text).

Saturated: one client keeps its queue at its bound (CLIENT_QUEUE_MAX 50),
sending again through the api's admission statement the moment a claim
takes one of its jobs; from its 100th claim on, 4 other clients keep 3
pending jobs each the same way. One connection settles and claims 4 jobs a
round, as a worker does; each round's refills are one admission batch, the
saturated client's first. In every window of 100 claims after the others
come, each of the k = 5 clients should get 1/k: the saturated client's
largest share × k and the others' smallest and largest are reported. The others'
first jobs' wait is the number of claims made from their arrival to the
round that takes the last of them, with the fair claim and the first-come
one (behind the saturated client's full queue).

Scale: 1,000,000 pending jobs over 10,000 clients (100 each, turns as the
admission gives them). From one connection, claim_limit 1: latency of each
claim, p99, the fair and the first-come claim taking turns in blocks; then
4 connections completing and claiming 4 jobs a round for a few seconds per
claim, taking turns: jobs claimed per second.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from decimal import Decimal
from typing import Any

import msgspec
import psycopg

from api.admission import admission
from api.store import ApiStore
from shared import db
from shared.config import ApiSettings
from shared.queries import QUERIES
from shared.ratelimit import NO_LIMITS, claim_params
from tests.bench.harness import (
    BENCH_FINGERPRINT,
    BENCH_REQUEST,
    BENCH_REQUEST_JSON,
    BenchContext,
    BenchDatabase,
    BenchResult,
    FigureSpec,
    percentile,
)
from tests.support import worker_statements
from worker.rows import Completion

NAME = "fair_claim"
SPECS = {
    "share_min_x_k": FigureSpec("share of claims per client per window of 100, × k: smallest", "×"),
    "share_max_x_k": FigureSpec("share of claims per client per window of 100, × k: largest", "×"),
    "first_job_claims_ahead_fair": FigureSpec("claims before another client's first job: fair claim", "claims"),
    "first_job_claims_ahead_fifo": FigureSpec("claims before another client's first job: first-come claim",
                                              "claims"),
    "saturated_share_max_x_k": FigureSpec(
        "saturated client: its share of claims per window of 100, × k: largest", "×"),
    "saturated_others_share_min_x_k": FigureSpec(
        "saturated client: the others' share per window of 100, × k: smallest", "×"),
    "saturated_others_share_max_x_k": FigureSpec(
        "saturated client: the others' share per window of 100, × k: largest", "×"),
    "saturated_first_job_claims_ahead_fair": FigureSpec(
        "saturated client: claims before the others' first jobs: fair claim", "claims"),
    "saturated_first_job_claims_ahead_fifo": FigureSpec(
        "saturated client: claims before the others' first jobs: first-come claim", "claims"),
    "claim_p99_ms_fair": FigureSpec("claim p99 at scale: fair claim", "ms"),
    "claim_p99_ms_fifo": FigureSpec("claim p99 at scale: first-come claim", "ms"),
    "claim_p99_ratio": FigureSpec("claim p99 at scale, fair / first-come", "×"),
    "drain_jobs_per_s_fair": FigureSpec("drain at scale, 4 connections: fair claim", "jobs/s"),
    "drain_jobs_per_s_fifo": FigureSpec("drain at scale, 4 connections: first-come claim", "jobs/s"),
    "drain_ratio": FigureSpec("drain at scale, fair / first-come", "×"),
}
FAIR = QUERIES["job_claim"]
# the claim before turns: first come, first served across all clients
# the claimable scan's order only (the limiter's array of needs keeps its own)
FIFO = FAIR.replace("ORDER BY turn, id\nLIMIT", "ORDER BY created_at, id\nLIMIT", 1)
assert FIFO != FAIR
WINDOW = 100
CLAIM_BLOCK = 50
DRAIN_CONNECTIONS = 4
DRAIN_BATCH = 4
# the saturated client's queue bound (CLIENT_QUEUE_MAX), the claims it has alone before the others come, and
# how many others keep how many jobs pending
SATURATED_BOUND = 50
SATURATED_LEAD = 100
OTHERS = 4
OTHERS_KEEP = 3


def run(ctx: BenchContext, result: BenchResult) -> None:
    clients, per_client = (1_000, 100) if ctx.quick else (10_000, 100)
    claims = 300 if ctx.quick else 2_000
    drain_s = 2.0 if ctx.quick else 8.0
    result.params.update({"share": "1 client × 2,000 then 9 × 20, claimed 4 a round",
                          "scale_pending": clients * per_client, "scale_clients": clients,
                          "claims_per_run": claims, "drain_s_per_turn": drain_s,
                          "drain": f"{DRAIN_CONNECTIONS} connections × {DRAIN_BATCH} jobs a round"})
    with ctx.database("fair_share") as bench_db:
        built = _share_database(ctx, bench_db)
        for run_number in range(1, ctx.runs + 1):
            low, high, ahead_fair, ahead_fifo = asyncio.run(_share(ctx, built))
            result.add("share_min_x_k", low)
            result.add("share_max_x_k", high)
            result.add("first_job_claims_ahead_fair", ahead_fair)
            result.add("first_job_claims_ahead_fifo", ahead_fifo)
            ctx.progress(f"fair_claim run {run_number}/{ctx.runs}: share × k {low:.2f}..{high:.2f}, "
                         f"claims ahead {ahead_fair:.0f} (first-come {ahead_fifo:.0f})")
    saturated_claims = 600 if ctx.quick else 2_100
    result.params["saturated"] = (f"1 client refilling to {SATURATED_BOUND} the moment a job is claimed; "
                                  f"{OTHERS} keeping {OTHERS_KEEP} each from claim {SATURATED_LEAD}; "
                                  f"{saturated_claims:,} claims, {DRAIN_BATCH} a round")
    for run_number in range(1, ctx.runs + 1):
        share, others_low, others_high, ahead_fair, ahead_fifo = _saturated(ctx, saturated_claims)
        result.add("saturated_share_max_x_k", share)
        result.add("saturated_others_share_min_x_k", others_low)
        result.add("saturated_others_share_max_x_k", others_high)
        result.add("saturated_first_job_claims_ahead_fair", ahead_fair)
        result.add("saturated_first_job_claims_ahead_fifo", ahead_fifo)
        ctx.progress(f"fair_claim run {run_number}/{ctx.runs}: saturated client's share × k at most {share:.2f}, "
                     f"the others' {others_low:.2f}..{others_high:.2f}, claims before their first jobs "
                     f"{ahead_fair:.0f} (first-come {ahead_fifo:.0f})")
    with ctx.database("fair_scale") as bench_db:
        started = time.monotonic()
        _scale_fill(bench_db, clients=clients, per_client=per_client)
        ctx.progress(f"fair_claim: {clients * per_client:,} pending jobs over {clients:,} clients in "
                     f"{time.monotonic() - started:.0f} s")
        for run_number in range(1, ctx.runs + 1):
            latencies = asyncio.run(_claim_latencies(bench_db.url, claims))
            p99 = {name: percentile(values, 99) for name, values in latencies.items()}
            rates = asyncio.run(_drain_rates(bench_db.url, drain_s))
            result.add("claim_p99_ms_fair", p99["fair"])
            result.add("claim_p99_ms_fifo", p99["fifo"])
            result.add("claim_p99_ratio", p99["fair"] / p99["fifo"])
            result.add("drain_jobs_per_s_fair", rates["fair"])
            result.add("drain_jobs_per_s_fifo", rates["fifo"])
            result.add("drain_ratio", rates["fair"] / rates["fifo"])
            ctx.progress(f"fair_claim run {run_number}/{ctx.runs}: p99 {p99['fair']:.2f} ms vs "
                         f"{p99['fifo']:.2f} ms, drain {rates['fair']:,.0f} vs {rates['fifo']:,.0f} jobs/s")


# -- the share -------------------------------------------------------------------


def _share_database(ctx: BenchContext, bench_db: BenchDatabase) -> str:
    """The queue, admitted as the api admits it; kept as a template so that every run starts from it."""
    client_ids = [bench_db.create_client(f"client-{n}") for n in range(10)]
    asyncio.run(_admit(bench_db.url, [(client_ids[0], 2_000)] + [(client, 20) for client in client_ids[1:]]))
    with bench_db.connect() as conn:
        conn.execute("VACUUM ANALYZE story_jobs")
    bench_db.close()
    return bench_db.name


async def _admit(url: str, queues: list[tuple[int, int]]) -> None:
    settings = ApiSettings()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for client_id, jobs in queues:
            admissions = [admission(client_id, uuid.uuid4().hex, BENCH_REQUEST, settings) for _ in range(jobs)]
            for start in range(0, jobs, 200):
                results = await ApiStore(conn).job_insert_if_admitted(
                    admissions=admissions[start:start + 200], queue_max=1_000_000, client_queue_max=1_000_000)
                assert all(r.outcome == "inserted" for r in results), results


async def _share(ctx: BenchContext, template: str) -> tuple[float, float, float, float]:
    """Drains a copy of the queue with each claim; the fair one's windows, and the claims ahead of the
    other clients' first jobs with both."""
    order: dict[str, list[int]] = {}
    for name, query in (("fair", FAIR), ("fifo", FIFO)):
        with ctx.database(f"fair_share_{name}", template=template) as copy:
            async with await db.connect(copy.url, application_name="fair_claim", connect_timeout_s=30) as conn:
                claimed: list[int] = []
                while jobs := await _round(conn, query, [], DRAIN_BATCH):
                    claimed.extend(job["client_id"] for job in jobs)
            order[name] = claimed
            copy.close()
    fair = order["fair"]
    heavy = Counter(fair).most_common(1)[0][0]
    ratios: list[float] = []
    left = Counter(fair)
    for start in range(0, len(fair), WINDOW):
        window = fair[start:start + WINDOW]
        active = [client for client, remaining in left.items() if remaining > 0]
        if len(window) == WINDOW:
            counts = Counter(window)
            ratios.extend(counts[client] / WINDOW * len(active) for client in active)
        left.subtract(window)
    ahead = {name: max(claimed.index(client) for client in set(claimed) if client != heavy)
             for name, claimed in order.items()}
    return min(ratios), max(ratios), float(ahead["fair"]), float(ahead["fifo"])


# -- a saturated client -------------------------------------------------------------


def _saturated(ctx: BenchContext, claims: int) -> tuple[float, float, float, float, float]:
    """The fair claim's windows after the others come, and the claims before the others' first jobs with
    both claims (the first-come run stops once they are all claimed)."""
    order: dict[str, tuple[list[int], list[int], int, int]] = {}
    for name, query, until in (("fair", FAIR, claims), ("fifo", FIFO, None)):
        with ctx.database(f"fair_saturated_{name}") as bench_db:
            saturated = bench_db.create_client("saturated")
            others = [bench_db.create_client(f"other-{n}") for n in range(OTHERS)]
            bench_db.close()
            claimed, before, arrived = asyncio.run(_saturated_claims(bench_db.url, query, saturated, others,
                                                                     until))
            order[name] = (claimed, before, arrived, saturated)
    claimed, _, arrived, saturated = order["fair"]
    k = 1 + OTHERS
    shares: list[float] = []
    others_shares: list[float] = []
    for start in range(arrived, len(claimed) - WINDOW + 1, WINDOW):
        counts = Counter(claimed[start:start + WINDOW])
        assert len(counts) == k, counts
        shares.append(counts[saturated] / WINDOW * k)
        others_shares.extend(n / WINDOW * k for client, n in counts.items() if client != saturated)
    ahead = {}
    for name, (claimed, before, arrived, saturated) in order.items():
        # a round's jobs come back in id order, not in turn order: a job's wait is the claims of the rounds
        # before its own
        ahead[name] = float(max(before[claimed.index(client)] - arrived for client in set(claimed)
                                if client != saturated))
    return max(shares), min(others_shares), max(others_shares), ahead["fair"], ahead["fifo"]


async def _saturated_claims(url: str, query: str, saturated: int, others: list[int],
                            claims: int | None) -> tuple[list[int], list[int], int]:
    """Rounds of settle and claim (``query``) until ``claims`` are made (None: until every other client's
    first job is claimed), each followed by the refills: the saturated client's to its bound, from
    SATURATED_LEAD claims on the others' to OTHERS_KEEP. The clients of the claims in order, the claims
    made before the round of each, and the number of claims made when the others came."""
    settings = ApiSettings()
    keep = {saturated: SATURATED_BOUND}
    pending = {saturated: 0}
    claimed: list[int] = []
    before: list[int] = []
    arrived = -1
    held: list[dict[str, Any]] = []
    async with await db.connect(url, application_name="fair_claim", connect_timeout_s=30) as conn:
        while True:
            if arrived < 0 and len(claimed) >= SATURATED_LEAD:
                arrived = len(claimed)
                keep.update(dict.fromkeys(others, OTHERS_KEEP))
                pending.update(dict.fromkeys(others, 0))
            # the saturated client first: it sends again the moment a slot frees
            asked = [client for client in keep for _ in range(keep[client] - pending[client])]
            admissions = [admission(client, uuid.uuid4().hex, BENCH_REQUEST, settings) for client in asked]
            results = await ApiStore(conn).job_insert_if_admitted(admissions=admissions, queue_max=1_000_000,
                                                                  client_queue_max=SATURATED_BOUND)
            assert all(r.outcome == "inserted" for r in results), results
            pending.update(keep)
            if claims is None and arrived >= 0 and set(others) <= set(claimed[arrived:]):
                break
            if claims is not None and len(claimed) >= claims:
                break
            held = await _round(conn, query, [_completion(job) for job in held], DRAIN_BATCH)
            before.extend([len(claimed)] * len(held))
            for job in held:
                claimed.append(job["client_id"])
                pending[job["client_id"]] -= 1
    return claimed, before, arrived


# -- scale -------------------------------------------------------------------------


def _scale_fill(bench_db: BenchDatabase, *, clients: int, per_client: int) -> None:
    """clients × per_client pending jobs, client by client (as first come, first served would take
    them), with the turns the admission gives jobs queued that way: each client's n-th job turn n."""
    with bench_db.connect() as conn:
        conn.execute("INSERT INTO api_clients (name) SELECT 'scale-' || n FROM generate_series(1, %(clients)s) n",
                     {"clients": clients})
        conn.execute(
            """
            INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn)
            SELECT 1 + (n - 1) / %(per_client)s, 'pending-' || n, %(fingerprint)s, %(request)s::jsonb,
                   (n - 1) %% %(per_client)s
            FROM generate_series(1, %(jobs)s) AS n
            """,
            {"per_client": per_client, "jobs": clients * per_client, "fingerprint": BENCH_FINGERPRINT,
             "request": BENCH_REQUEST_JSON},
        )
        conn.execute("VACUUM ANALYZE story_jobs")


def _params(claim_limit: int, worker_id: str) -> dict[str, Any]:
    """What the worker's claim sends without a rate limit."""
    return {**claim_params(NO_LIMITS, None, default_max_tokens=4000), "worker_id": worker_id, "claim_limit": claim_limit, "provider": "offline",
            "model": "offline-writer"}


async def _round(conn: psycopg.AsyncConnection[Any], query: str, completions: list[Completion],
                 claim_limit: int, worker_id: str = "bench-fair") -> list[dict[str, Any]]:
    """A worker's round: the written stories settled, then the claim (``query``)."""
    if completions:
        await worker_statements.job_settle(conn, worker_id=worker_id, completions=completions)
    if not claim_limit:
        return []
    cur = await conn.execute(query, _params(claim_limit, worker_id))
    row = await cur.fetchone()
    assert row is not None
    claimed: list[dict[str, Any]] = msgspec.json.decode(row[0])
    return claimed


def _completion(job: dict[str, Any]) -> Completion:
    return Completion(job_id=job["id"], client_id=job["client_id"], attempt=1, title="The Fox and the Moon",
                      body="Once upon a time, a small fox could not sleep.", model="m", prompt_version="v1",
                      input_tokens=100, output_tokens=180, cost_usd=Decimal("0.0027"), request_id="req_1")


async def _claim_latencies(url: str, claims: int) -> dict[str, list[float]]:
    async with await db.connect(url, application_name="fair_claim", connect_timeout_s=30, generic_plans=True) as conn:
        for query in (FAIR, FIFO):
            for _ in range(20):
                await _round(conn, query, [], 1)
        latencies: dict[str, list[float]] = {"fair": [], "fifo": []}
        turn = 0
        while any(len(values) < claims for values in latencies.values()):
            for name, query in (("fair", FAIR), ("fifo", FIFO))[:: 1 if turn % 2 == 0 else -1]:
                for _ in range(min(CLAIM_BLOCK, claims - len(latencies[name]))):
                    started = time.perf_counter()
                    jobs = await _round(conn, query, [], 1)
                    latencies[name].append((time.perf_counter() - started) * 1000)
                    if len(jobs) != 1:
                        raise RuntimeError("a claim found no pending job")
            turn += 1
    return latencies


async def _drain_rates(url: str, seconds: float) -> dict[str, float]:
    """Jobs claimed per second by DRAIN_CONNECTIONS connections, each completing what it claimed in the
    previous round as a worker does; the two claims take turns, twice each."""
    totals = {"fair": 0, "fifo": 0}
    spent = {"fair": 0.0, "fifo": 0.0}
    conns = [await db.connect(url, application_name="fair_claim", connect_timeout_s=30, generic_plans=True)
             for _ in range(DRAIN_CONNECTIONS)]
    try:
        for name, query in (("fair", FAIR), ("fifo", FIFO), ("fifo", FIFO), ("fair", FAIR)):
            started = time.perf_counter()
            deadline = started + seconds / 2
            counts = await asyncio.gather(*(_drain(conn, query, deadline, f"bench-{n}")
                                            for n, conn in enumerate(conns)))
            totals[name] += sum(counts)
            spent[name] += time.perf_counter() - started
    finally:
        for conn in conns:
            await conn.close()
    return {name: totals[name] / spent[name] for name in totals}


async def _drain(conn: psycopg.AsyncConnection[Any], query: str, deadline: float, worker_id: str) -> int:
    held: list[dict[str, Any]] = []
    claimed = 0
    while time.perf_counter() < deadline:
        held = await _round(conn, query, [_completion(job) for job in held], DRAIN_BATCH, worker_id)
        claimed += len(held)
    # what is still held is completed, so that the next turn starts from the same state
    await _round(conn, query, [_completion(job) for job in held], 0, worker_id)
    return claimed
