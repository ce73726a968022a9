"""``python -m tests.bench``: run the benchmarks, write the results under
tests/bench/results/ (JSON and Markdown) and print the table.

    python -m tests.bench                      # every benchmark, 3 runs each
    python -m tests.bench --only drain,pickup  # a subset, by name
    python -m tests.bench --quick --runs 1     # sizes and durations in seconds
    HISTORY_JOBS=3000000 python -m tests.bench --only history --runs 1   # a month's history
    STORY_MOVE_JOBS=10000000 python -m tests.bench --only story_move --runs 1   # stories moved under partitions

The Postgres server is tests/support/postgres_server.py's: TEST_DATABASE_URL, else a Docker
container, else the embedded Postgres. Every database and process a run
creates is dropped or stopped at its end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

from shared import logs
from tests.bench import (
    api_load,
    batch_lane,
    ceiling,
    drafts,
    drain,
    fair_claim,
    history,
    idle,
    in_flight,
    in_flight_pooler,
    model,
    ops_list,
    peers,
    pickup,
    poll,
    provider_limit,
    report,
    scale,
    statement_cost,
    stop,
    story_move,
    tracing,
    webhooks,
)
from tests.bench.harness import RESULTS_DIR, BenchContext, BenchResult
from tests.support import postgres_server

BENCHMARKS: dict[str, ModuleType] = {
    module.NAME: module
    for module in (drain, pickup, idle, api_load, poll, scale, in_flight, in_flight_pooler, ceiling, ops_list, peers,
                   stop, statement_cost, model, webhooks, fair_claim, provider_limit, tracing, batch_lane, drafts,
                   history, story_move)
}
SERVER_SETTINGS = ("shared_buffers", "synchronous_commit", "fsync", "autovacuum", "max_connections")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help=f"comma-separated benchmarks to run, of: {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure; the median is reported (default 3)")
    parser.add_argument("--quick", action="store_true", help="small sizes and short durations (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"results directory (default {RESULTS_DIR})")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    args.only = [name.strip().replace("-", "_") for name in args.only.split(",") if name.strip()]
    unknown = [name for name in args.only if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def _stop_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    # unwinds like Ctrl-C, so every finally stops its processes and drops its database
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logs.configure("warning", "json", process="bench")
    args.out.mkdir(parents=True, exist_ok=True)
    log_root = args.out / "logs"
    shutil.rmtree(log_root, ignore_errors=True)
    started_at = datetime.now(UTC)
    started = time.monotonic()
    load_before = os.getloadavg()
    results: list[BenchResult] = []
    with postgres_server.server_url() as server_url:
        server = _server_info(server_url)
        context = BenchContext(server_url, runs=args.runs, quick=args.quick, log_root=log_root,
                               verbose=not args.quiet)
        try:
            for name in args.only:
                context.progress(f"{name}: starting")
                results.append(_run_one(context, name))
        finally:
            context.close()
    document = {
        "suite": "storyjobs benchmarks",
        "command": shlex.join([Path(sys.executable).name, "-m", "tests.bench", *(argv or sys.argv[1:])]),
        "started_at": started_at.isoformat(timespec="seconds"),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "runs": args.runs,
        "quick": args.quick,
        "only": args.only,
        "machine": {
            "cpus": os.cpu_count(),
            "load_before": [round(v, 2) for v in load_before],
            "load_after": [round(v, 2) for v in os.getloadavg()],
        },
        "server": server,
        "benchmarks": {result.name: result.as_json() for result in results},
        "table": report.table_rows(results),
    }
    table = report.markdown(document)
    stamp = started_at.strftime("%Y%m%d-%H%M%S")
    for name in (f"bench-{stamp}", "latest"):
        (args.out / f"{name}.json").write_text(json.dumps(document, indent=2) + "\n")
        (args.out / f"{name}.md").write_text(table)
    sys.stdout.write(table)
    sys.stdout.write(f"\nresults: {args.out / f'bench-{stamp}.json'} and .md\n")
    return 1 if any(result.error for result in results) else 0


def _run_one(context: BenchContext, name: str) -> BenchResult:
    """A benchmark that fails is reported as such, with the runs it finished;
    the others still run."""
    module = BENCHMARKS[name]
    result = BenchResult(name, module.SPECS)
    try:
        module.run(context, result)
    except Exception as exc:  # noqa: BLE001 - one broken benchmark must not lose the others' results
        result.error = f"{type(exc).__name__}: {exc}"[:2000]
        context.progress(f"{name}: failed: {result.error}")
    return result


def _server_info(server_url: str) -> dict[str, Any]:
    with postgres_server.admin(server_url) as conn:
        version_row = conn.execute("SHOW server_version").fetchone()
        settings = dict(conn.execute(
            "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s)",
            (list(SERVER_SETTINGS),),
        ).fetchall())
    return {"version": version_row[0] if version_row else "unknown", "settings": settings}


if __name__ == "__main__":
    sys.exit(main())
