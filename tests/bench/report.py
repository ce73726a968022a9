"""The targets each figure is held to, and the results as JSON and as a
Markdown table (figure, median, min, max, target, met)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.bench.harness import BenchResult


def _number(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 100 or value == int(value):
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.1:
        return f"{value:.2f}"
    return f"{value:.3f}"


@dataclass(frozen=True)
class Target:
    text: str
    check: Callable[[float], bool]


def at_least(bound: float) -> Target:
    return Target(f"≥ {_number(bound)}", lambda value: operator.ge(value, bound))


def at_most(bound: float) -> Target:
    return Target(f"≤ {_number(bound)}", lambda value: operator.le(value, bound))


def below(bound: float) -> Target:
    return Target(f"< {_number(bound)}", lambda value: operator.lt(value, bound))


def exactly(bound: float) -> Target:
    return Target(f"= {_number(bound)}", lambda value: value == bound)


# (benchmark, figure) -> target; judged on the median of the runs
TARGETS: dict[tuple[str, str], Target] = {
    ("drain", "procs4_conc1"): at_least(1_750),
    ("drain", "procs4_conc10"): at_least(7_600),
    ("pickup", "p50_ms"): at_most(3),
    ("pickup", "p99_ms"): at_most(8),
    ("idle", "statements_per_s_per_worker"): at_most(0.25),
    ("api", "post_rps"): at_least(1_500),
    ("api", "get_rps"): at_least(3_000),
    ("api", "post_low_p99_ms"): at_most(50),
    ("api", "get_low_p99_ms"): at_most(50),
    ("api", "post_errors"): exactly(0),
    ("api", "get_errors"): exactly(0),
    # the poll beside a bare Litestar app reading the same row, in one run
    ("poll", "ratio"): at_least(0.8),
    ("poll", "api_errors"): exactly(0),
    ("scale", "claim_p99_ratio"): at_most(1.5),
    ("scale", "sweep_ratio"): at_most(1.5),
    ("in_flight", "db_cpu_pct_of_core"): below(10),
    ("in_flight_pooler", "server_connections_peak"): at_most(25),
    ("in_flight_pooler", "db_cpu_pct_of_core"): below(10),
    # a cancelled job's stream is closed at its worker's next heartbeat
    ("stop", "close_after_cancel_over_interval"): at_most(1.5),
    ("ops_list", "first_p99_ms"): at_most(50),
    ("ops_list", "deep_p99_ms"): at_most(50),
    # storyjobs beside its peers, in one run: ratios storyjobs / peer
    ("peers", "vs_pgqueuer.drain_one_jobs_per_s"): at_least(2),
    ("peers", "vs_bare.drain_one_jobs_per_s"): at_least(0.5),
    ("peers", "vs_pgqueuer.drain_batched_jobs_per_s"): at_least(1.2),
    ("peers", "vs_bare.pickup_p99_ms"): at_most(1),
    ("peers", "storyjobs.drain_one_db_cpu_ms_per_job"): at_most(0.5),
    # every client with pending jobs gets 1/k of each 100 claims, ± 10 %
    ("fair_claim", "share_min_x_k"): at_least(0.9),
    ("fair_claim", "share_max_x_k"): at_most(1.1),
    ("fair_claim", "saturated_share_max_x_k"): at_most(1.1),
    ("fair_claim", "saturated_others_share_min_x_k"): at_least(0.9),
    ("fair_claim", "saturated_others_share_max_x_k"): at_most(1.1),
    ("fair_claim", "claim_p99_ratio"): at_most(1.5),
    ("fair_claim", "drain_ratio"): at_least(0.9),
    # drafts on cost the drain of streaming jobs at most 5 %; a revalidated poll (304) is worth 1.5 full ones
    ("drafts", "drain_cost_pct"): at_most(5),
    ("drafts", "not_modified_vs_full"): at_least(1.5),
    **{("drafts", f"poll_{kind}_errors"): exactly(0) for kind in ("full", "since", "not_modified")},
    # every allowed request used, and no 429 herds
    **{("provider_limit", f"{key}_configured_of_limit"): at_least(0.95) for key in ("rpm30", "rpm45", "otpm24k")},
    **{("provider_limit", f"{key}_configured_429s"): exactly(0) for key in ("rpm30", "rpm45", "otpm24k")},
    **{("provider_limit", f"{key}_learned_of_limit"): at_least(0.9) for key in ("rpm30", "rpm45", "otpm24k")},
    # a pause ends with at most one request refused, not a herd of them
    **{("provider_limit", f"{key}_{mode}_herd"): at_most(1) for key in ("rpm30", "rpm45", "otpm24k")
       for mode in ("configured", "learned")},
}

# drain figures set against the ceiling: (drain figure, ceiling figure, label)
COMPARISONS = [
    ("procs4_conc1", "one_statement_jobs_per_s", "drain 4 × 1 / ceiling (one statement per job)"),
    ("procs4_conc10", "claim_complete_jobs_per_s", "drain 4 × 10 / ceiling (claim, then complete)"),
    ("procs4_conc10", "one_statement_jobs_per_s", "drain 4 × 10 / ceiling (one statement per job)"),
]


def table_rows(results: list[BenchResult]) -> list[dict[str, Any]]:
    """One row per figure (and per drain/ceiling comparison), in run order."""
    rows: list[dict[str, Any]] = []
    by_name = {result.name: result for result in results}
    for result in results:
        if result.error is not None:
            rows.append({"benchmark": result.name, "figure": "(did not complete)", "label": result.error,
                         "unit": "", "median": None, "min": None, "max": None, "target": "", "met": None})
        for key, figure in result.figures().items():
            if not result.specs[key].in_table:
                continue
            target = TARGETS.get((result.name, key))
            rows.append({
                "benchmark": result.name,
                "figure": key,
                "label": figure.label,
                "unit": figure.unit,
                "median": figure.median,
                "min": min(figure.samples),
                "max": max(figure.samples),
                "target": target.text if target else "",
                "met": target.check(figure.median) if target else None,
            })
    drain, ceiling = by_name.get("drain"), by_name.get("ceiling")
    if drain is not None and ceiling is not None:
        drain_figures, ceiling_figures = drain.figures(), ceiling.figures()
        for drain_key, ceiling_key, label in COMPARISONS:
            if drain_key in drain_figures and ceiling_key in ceiling_figures:
                rows.append({
                    "benchmark": "drain / ceiling",
                    "figure": f"{drain_key}/{ceiling_key}",
                    "label": label,
                    "unit": "×",
                    "median": drain_figures[drain_key].median / ceiling_figures[ceiling_key].median,
                    "min": None,
                    "max": None,
                    "target": "",
                    "met": None,
                })
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# storyjobs benchmarks",
        "",
        f"- command: `{report['command']}`",
        f"- started {report['started_at']}, took {report['duration_s'] / 60:.1f} min; "
        f"{report['runs']} run(s) per figure{' (quick mode)' if report['quick'] else ''}",
        f"- machine: {report['machine']['cpus']} CPUs, load average {report['machine']['load_before']} before, "
        f"{report['machine']['load_after']} after (shared machine: figures are noisy)",
        f"- Postgres: {report['server']['version']}; " + ", ".join(
            f"{name}={value}" for name, value in report["server"]["settings"].items()),
        "- each figure is the median of its runs, with min and max; a target is judged on the median",
        "",
        "| Benchmark | Figure | Median | Min | Max | Target | Met |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in report["table"]:
        unit = f" {row['unit']}" if row["unit"] else ""
        met = "" if row["met"] is None else ("met" if row["met"] else "**not met**")
        target = f"{row['target']}{unit}" if row["target"] else "—"
        lines.append(
            f"| {row['benchmark']} | {row['label']} | {_cell(row['median'], unit)} | {_cell(row['min'], unit)} "
            f"| {_cell(row['max'], unit)} | {target} | {met or '—'} |"
        )
    if "peers" in report["benchmarks"]:
        from tests.bench import peers

        lines += peers.markdown_section(report["benchmarks"]["peers"])
    notes = []
    for name, bench in report["benchmarks"].items():
        params = ", ".join(f"{key}={_param(value)}" for key, value in bench["params"].items())
        notes.append(f"- **{name}**: {params}")
        notes.extend(f"  - {note}" for note in bench["notes"])
        if bench["error"]:
            notes.append(f"  - did not complete: {bench['error']}")
    lines += ["", "## Parameters and notes", "", *notes, ""]
    return "\n".join(lines)


def _cell(value: float | None, unit: str) -> str:
    return "" if value is None else f"{_number(value)}{unit}"


def _param(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={v}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_param(v) for v in value) + "]"
    return str(value)
