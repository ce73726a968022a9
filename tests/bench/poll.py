"""poll: GET /stories/jobs/{id}, the hottest path (every waiting client polls
it every few seconds), beside the least a Litestar app can do to answer it.

One database, one pending job, two servers up at once: ``python -m api``
and tests/bench/peer_apps/bare_poll.py, a bare Litestar + psycopg_pool app
that reads the same row by public_id (no key check, no queue position, no
estimate). Each run loads one, then the other, with the same load generator
at the same number of connections (wrk when installed), in short slices
taken in turns, so the ratio api / bare is measured on the same machine in
the same minute. The api does
more per request by contract (the key, the 404 for another client's job,
queue_position, Retry-After); the ratio says what that costs.
"""

from __future__ import annotations

import statistics
import uuid

import httpx

from tests.bench.api_load import API_ENV, one_job
from tests.bench.harness import BenchContext, BenchResult, FigureSpec
from tests.bench.loadgen import LoadResult, describe_tool, run_load
from tests.support.database import create_key_sync
from tests.support.host import free_port
from tests.system.procs import Proc, System, wait_while_running

NAME = "poll"
CONNECTIONS = 32
SERVERS = ("api", "bare")

SPECS: dict[str, FigureSpec] = {
    "ratio": FigureSpec(f"GET /stories/jobs/{{id}}, api / bare Litestar app, requests/s at {CONNECTIONS} "
                        "connections", "x"),
}
for _server in SERVERS:
    SPECS[f"{_server}_rps"] = FigureSpec(f"GET /stories/jobs/{{id}}, {_server}, {CONNECTIONS} connections", "req/s")
    SPECS[f"{_server}_p50_ms"] = FigureSpec(f"GET /stories/jobs/{{id}}, {_server}, p50", "ms")
    SPECS[f"{_server}_p99_ms"] = FigureSpec(f"GET /stories/jobs/{{id}}, {_server}, p99", "ms")
    SPECS[f"{_server}_errors"] = FigureSpec(f"GET /stories/jobs/{{id}}, {_server}, errors", "requests")


def run(ctx: BenchContext, result: BenchResult) -> None:
    slices, slice_s = (2, 1.0) if ctx.quick else (5, 3.0)
    warmup_s = 1.0 if ctx.quick else 2.0
    result.params.update({"slices": slices, "slice_s": slice_s, "warmup_s": warmup_s, "connections": CONNECTIONS,
                          "load_generator": describe_tool()})
    with ctx.database("poll") as bench_db:
        key = create_key_sync(bench_db.url, "bench")
        with ctx.processes(bench_db, **API_ENV) as system:
            api = system.api()
            job_id = one_job(api.base_url, key)
            bare_url = _start_bare(system)
            urls = {"api": f"{api.base_url}/stories/jobs/{job_id}", "bare": f"{bare_url}/stories/jobs/{job_id}"}

            def load(server: str, duration_s: float) -> LoadResult:
                return run_load(url=urls[server], method="GET", token=key, connections=CONNECTIONS,
                                duration_s=duration_s, key_prefix=uuid.uuid4().hex[:12], work_dir=system.log_dir)

            for server in SERVERS:
                load(server, warmup_s)
            for run_number in range(1, ctx.runs + 1):
                # short slices taken in turns, so that what else the machine
                # runs meanwhile weighs on both servers alike
                loads: dict[str, list[LoadResult]] = {server: [] for server in SERVERS}
                for n in range(slices):
                    for server in SERVERS if n % 2 == 0 else reversed(SERVERS):
                        loads[server].append(load(server, slice_s))
                _check_alive(system.procs)
                rps = {server: sum(x.requests for x in runs) / sum(x.duration_s for x in runs)
                       for server, runs in loads.items()}
                for server, runs in loads.items():
                    result.add(f"{server}_rps", rps[server])
                    result.add(f"{server}_p50_ms", statistics.median(x.p50_ms for x in runs))
                    result.add(f"{server}_p99_ms", max(x.p99_ms for x in runs))
                    result.add(f"{server}_errors", sum(x.errors for x in runs))
                result.add("ratio", rps["api"] / rps["bare"])
                ctx.progress(f"poll run {run_number}/{ctx.runs}: api {rps['api']:,.0f} req/s, "
                             f"bare {rps['bare']:,.0f} req/s, ratio {rps['api'] / rps['bare']:.2f}")


def _start_bare(system: System) -> str:
    port = free_port()
    proc = system.start("bare_poll", "tests.bench.peer_apps.bare_poll", "--port", str(port))
    base_url = f"http://127.0.0.1:{port}"
    wait_while_running(lambda: _answers(f"{base_url}/healthz"), [proc], timeout=30,
                       what="the bare poll app to answer")
    return base_url


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _check_alive(procs: list[Proc]) -> None:
    for proc in procs:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.output()[-2000:]}")
