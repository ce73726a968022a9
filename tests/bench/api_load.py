"""api: requests/s and latency of the two hot endpoints over loopback.

One ``python -m api`` process (QUEUE_MAX and CLIENT_QUEUE_MAX at their
largest, no workers) on a fresh database per measurement; a load generator
in another process (wrk when installed) keeps a fixed number of connections
busy after a short warm-up:

* POST /stories/generate, a new Idempotency-Key per request (every request
  stores a pending job, so the queue grows during the run);
* GET /stories/jobs/{id} of one existing pending job.

wrk has no rate limit (that is wrk2), so "p99 at half the maximum rate" is
stood in for by the p99 at 4 connections, next to the figures at 32.
"""

from __future__ import annotations

import uuid

import httpx

from tests.bench.harness import BenchContext, BenchResult, FigureSpec
from tests.bench.loadgen import POST_BODY, LoadResult, describe_tool, run_load
from tests.support.database import create_key_sync

NAME = "api"
FULL_CONNECTIONS = 32
LOW_CONNECTIONS = 4
API_ENV = {"QUEUE_MAX": 10_000_000, "CLIENT_QUEUE_MAX": 10_000_000}

SPECS: dict[str, FigureSpec] = {}
for _endpoint, _title in (("post", "POST /stories/generate"), ("get", "GET /stories/jobs/{id}")):
    SPECS[f"{_endpoint}_rps"] = FigureSpec(f"{_title}, {FULL_CONNECTIONS} connections", "req/s")
    SPECS[f"{_endpoint}_p50_ms"] = FigureSpec(f"{_title}, {FULL_CONNECTIONS} connections, p50", "ms")
    SPECS[f"{_endpoint}_p99_ms"] = FigureSpec(f"{_title}, {FULL_CONNECTIONS} connections, p99", "ms")
    SPECS[f"{_endpoint}_low_rps"] = FigureSpec(f"{_title}, {LOW_CONNECTIONS} connections", "req/s")
    SPECS[f"{_endpoint}_low_p50_ms"] = FigureSpec(f"{_title}, {LOW_CONNECTIONS} connections, p50", "ms")
    SPECS[f"{_endpoint}_low_p99_ms"] = FigureSpec(
        f"{_title}, {LOW_CONNECTIONS} connections, p99 (stands in for p99 at half the max rate)", "ms")
    SPECS[f"{_endpoint}_errors"] = FigureSpec(f"{_title}, errors (status >= 400 or socket), both loads",
                                              "requests")
SPECS["post_pending_after"] = FigureSpec(
    f"pending jobs after the POST run at {FULL_CONNECTIONS} connections (each admission counts them)", "jobs")


def run(ctx: BenchContext, result: BenchResult) -> None:
    duration_s = 2.0 if ctx.quick else 10.0
    warmup_s = 1.0 if ctx.quick else 2.0
    result.params.update({
        "duration_s": duration_s, "warmup_s": warmup_s, "connections": [FULL_CONNECTIONS, LOW_CONNECTIONS],
        "load_generator": describe_tool(), "api_env": API_ENV,
        "half_rate_stand_in": f"p99 at {LOW_CONNECTIONS} connections (no rate-limited load generator)",
    })
    for run_number in range(1, ctx.runs + 1):
        for endpoint in ("post", "get"):
            errors = 0
            for connections, suffix in ((FULL_CONNECTIONS, ""), (LOW_CONNECTIONS, "_low")):
                load, pending_after = _load_once(ctx, endpoint, connections=connections,
                                                 duration_s=duration_s, warmup_s=warmup_s)
                if endpoint == "post" and connections == FULL_CONNECTIONS:
                    result.add("post_pending_after", pending_after)
                result.add(f"{endpoint}{suffix}_rps", load.requests_per_s)
                result.add(f"{endpoint}{suffix}_p50_ms", load.p50_ms)
                result.add(f"{endpoint}{suffix}_p99_ms", load.p99_ms)
                errors += load.errors
                ctx.progress(f"api run {run_number}/{ctx.runs}: {endpoint.upper()} × {connections}: "
                             f"{load.requests_per_s:,.0f} req/s, p50 {load.p50_ms:.1f} ms, "
                             f"p99 {load.p99_ms:.1f} ms, {load.errors} errors")
            result.add(f"{endpoint}_errors", errors)


def _load_once(ctx: BenchContext, endpoint: str, *, connections: int, duration_s: float,
               warmup_s: float) -> tuple[LoadResult, int]:
    """The load, and how many jobs were pending at its end."""
    with ctx.database(f"api_{endpoint}") as bench_db:
        key = create_key_sync(bench_db.url, "bench")
        with ctx.processes(bench_db, **API_ENV) as system:
            api = system.api()
            if endpoint == "post":
                url, method = f"{api.base_url}/stories/generate", "POST"
            else:
                url, method = f"{api.base_url}/stories/jobs/{one_job(api.base_url, key)}", "GET"
            work_dir = system.log_dir
            run_id = uuid.uuid4().hex[:12]
            run_load(url=url, method=method, token=key, connections=connections, duration_s=warmup_s,
                     key_prefix=f"warmup-{run_id}", work_dir=work_dir)
            load = run_load(url=url, method=method, token=key, connections=connections, duration_s=duration_s,
                            key_prefix=f"measured-{run_id}", work_dir=work_dir)
            if api.popen.poll() is not None:
                raise RuntimeError(f"the api exited ({api.popen.returncode}) under load:\n{api.output()[-2000:]}")
        pending_after = bench_db.count_status("pending")
    return load, pending_after


def one_job(base_url: str, key: str) -> str:
    answer = httpx.post(f"{base_url}/stories/generate", json=POST_BODY, timeout=10,
                        headers={"Authorization": f"Bearer {key}", "Idempotency-Key": uuid.uuid4().hex})
    if answer.status_code != 202:
        raise RuntimeError(f"POST /stories/generate answered {answer.status_code}: {answer.text[:300]}")
    return str(answer.json()["job_id"])

