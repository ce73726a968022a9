"""HTTP load at a fixed concurrency: Debian's ``wrk`` driven by a small Lua
script when it is installed, else an async httpx loop in a separate process
(``python -m tests.bench.loadgen``), so the load generator is never the
benchmark process itself.

Both keep N connections busy for a duration (closed loop, no rate limit) and
answer requests/s, p50 and p99 latency, and errors (answers of 400 and above,
plus connection errors and timeouts). A POST gets a new Idempotency-Key per
request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_RESULT_MARK = "LOAD_RESULT "

# wrk runs this in every thread's own Lua state; args: token, key prefix
_WRK_COMMON = """
local thread_count = 0

function setup(thread)
  thread_count = thread_count + 1
  thread:set("thread_number", thread_count)
end

function init(args)
  wrk.headers["Authorization"] = "Bearer " .. args[1]
  key_prefix = args[2]
  counter = 0
end

function done(summary, latency, requests)
  io.write(string.format(
    '%s{"requests": %.0f, "duration_us": %.0f, "errors": %.0f, "status_errors": %.0f, '
    .. '"p50_us": %.0f, "p99_us": %.0f, "tool": "wrk"}\\n',
    "LOAD_RESULT ", summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout
      + summary.errors.status,
    summary.errors.status, latency:percentile(50), latency:percentile(99)))
end
"""

_WRK_POST = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"prompt": "bench", "length": "short"}'

function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = key_prefix .. "-" .. thread_number .. "-" .. counter
  return wrk.format()
end
"""

POST_BODY = {"prompt": "bench", "length": "short"}


@dataclass(frozen=True)
class LoadResult:
    requests: int
    duration_s: float
    errors: int
    p50_ms: float
    p99_ms: float
    tool: str

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


def describe_tool() -> str:
    return "wrk (1 thread)" if wrk_available() else "httpx async loop in a separate process"


def run_load(*, url: str, method: str, token: str, connections: int, duration_s: float, key_prefix: str,
             work_dir: Path, headers: dict[str, str] | None = None) -> LoadResult:
    """Keeps ``connections`` requests in flight against ``url`` for ``duration_s``,
    each with ``headers`` too. A 304 counts as an answer, not an error."""
    extra = [arg for name, value in (headers or {}).items() for arg in ("--header", f"{name}: {value}")]
    if wrk_available():
        return _run_wrk(url=url, method=method, token=token, connections=connections, duration_s=duration_s,
                        key_prefix=key_prefix, work_dir=work_dir, headers=headers or {})
    command = [sys.executable, "-m", "tests.bench.loadgen", "--url", url, "--method", method, "--token", token,
               "--connections", str(connections), "--duration-s", str(duration_s), "--key-prefix", key_prefix,
               *extra]
    return _parse(_run(command, timeout_s=duration_s + 60))


def _run_wrk(*, url: str, method: str, token: str, connections: int, duration_s: float, key_prefix: str,
             work_dir: Path, headers: dict[str, str]) -> LoadResult:
    script = work_dir / f"wrk_{method.lower()}.lua"
    script.write_text(_WRK_COMMON + (_WRK_POST if method == "POST" else ""))
    command = ["wrk", "--threads", "1", "--connections", str(connections), "--duration", f"{duration_s:g}s",
               "--timeout", "10s", "--script", str(script),
               *(arg for name, value in headers.items() for arg in ("--header", f"{name}: {value}")),
               url, "--", token, key_prefix]
    return _parse(_run(command, timeout_s=duration_s + 60))


def _run(command: list[str], *, timeout_s: float) -> str:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    if process.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({process.returncode}):\n{output[-2000:]}")
    return output


def _parse(output: str) -> LoadResult:
    for line in output.splitlines():
        if line.startswith(_RESULT_MARK):
            data = json.loads(line.removeprefix(_RESULT_MARK))
            return LoadResult(
                requests=int(data["requests"]),
                duration_s=data["duration_us"] / 1e6,
                errors=int(data["errors"]),
                p50_ms=data["p50_us"] / 1000,
                p99_ms=data["p99_us"] / 1000,
                tool=data["tool"],
            )
    raise RuntimeError(f"the load generator printed no result:\n{output[-2000:]}")


# -- the httpx fallback, run as its own process -------------------------------------------


async def _httpx_load(url: str, method: str, token: str, connections: int, duration_s: float,
                      key_prefix: str, headers: dict[str, str]) -> dict[str, object]:
    import httpx

    latencies: list[float] = []
    errors = 0
    status_errors = 0
    counter = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=10,
                                 headers={"Authorization": f"Bearer {token}", **headers}) as client:
        deadline = time.perf_counter() + duration_s

        async def user() -> None:
            nonlocal errors, status_errors, counter
            while time.perf_counter() < deadline:
                counter += 1
                started = time.perf_counter()
                try:
                    if method == "POST":
                        answer = await client.post(url, json=POST_BODY,
                                                   headers={"Idempotency-Key": f"{key_prefix}-{counter}"})
                    else:
                        answer = await client.get(url)
                except httpx.HTTPError:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - started)
                if answer.status_code >= 400:
                    status_errors += 1

        started_all = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(connections)))
        elapsed = time.perf_counter() - started_all
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[max(0, min(len(latencies) - 1, round(p / 100 * len(latencies)) - 1))] if latencies else 0.0

    return {"requests": len(latencies), "duration_us": elapsed * 1e6, "errors": errors + status_errors,
            "status_errors": status_errors, "p50_us": pct(50) * 1e6, "p99_us": pct(99) * 1e6,
            "tool": "httpx (async, separate process)"}


def main() -> None:
    parser = argparse.ArgumentParser(description="HTTP load at a fixed concurrency (the fallback when wrk is missing)")
    parser.add_argument("--url", required=True)
    parser.add_argument("--method", choices=["GET", "POST"], required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--connections", type=int, required=True)
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--key-prefix", required=True)
    parser.add_argument("--header", action="append", default=[], help="NAME: VALUE, sent with every request")
    args = parser.parse_args()
    headers = dict(tuple(part.strip() for part in header.split(":", 1)) for header in args.header)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        result = runner.run(_httpx_load(args.url, args.method, args.token, args.connections, args.duration_s,
                                        args.key_prefix, headers))
    sys.stdout.write(_RESULT_MARK + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

