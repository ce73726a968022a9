"""provider_limit: how much of the provider's rate limit the workers use.

The fake provider (tests/fakes) enforces an account limit as a bucket of 5 s
of refill, answering 429 with retry-after beyond it and sending the
anthropic-ratelimit-* headers with every answer: 30 requests a minute, 45
(rates at which 5 s do not hold a whole number of requests, so a claim
retried at the poll loses part of the limit), and separately 24,000 output
tokens a minute with stories that use 795 of their 800. 4 workers ×
concurrency 4 drain a backlog, once with the limit configured at the
provider's, once with no limit configured (learned from the headers only).

The rate achieved is counted at the provider, from the requests it served
after the first burst (the bucket starts full): the served rate over the
limit. 429s are counted too: in all, and after the first burst's pause.
"""

from __future__ import annotations

import math
from typing import Any

from tests.bench.harness import BenchContext, BenchResult, FigureSpec
from tests.fakes.anthropic_server import Call, FakeAnthropic, FakeAnthropicServer, Plan

NAME = "provider_limit"
# (key, requests a minute, output tokens a minute)
LIMITS = [("rpm30", 30, None), ("rpm45", 45, None), ("otpm24k", None, 24_000)]
MODES = ("configured", "learned")
SPECS: dict[str, FigureSpec] = {}
for _key, _rpm, _otpm in LIMITS:
    _what = f"{_rpm} requests/min" if _rpm else f"{_otpm:,} output tokens/min"
    for _mode in MODES:
        SPECS[f"{_key}_{_mode}_of_limit"] = FigureSpec(f"{_what}, limit {_mode}: rate achieved / limit", "×")
        SPECS[f"{_key}_{_mode}_429s"] = FigureSpec(f"{_what}, limit {_mode}: 429s at the provider", "")
        SPECS[f"{_key}_{_mode}_late_429s"] = FigureSpec(
            f"{_what}, limit {_mode}: 429s after the first burst's pause", "")
        SPECS[f"{_key}_{_mode}_herd"] = FigureSpec(
            f"{_what}, limit {_mode}: most 429s in a row after the first burst's pause", "")
PROVIDER_BURST_S = 5
# a short story's max_tokens, and what each story uses of it (159 chunks of 5 words)
MAX_TOKENS, USED_TOKENS = 800, 795
STREAM_S = 0.5
WORKERS, CONCURRENCY = 4, 4


def run(ctx: BenchContext, result: BenchResult) -> None:
    seconds = 10 if ctx.quick else 20
    result.params.update({"workers": WORKERS, "concurrency": CONCURRENCY, "provider_burst_s": PROVIDER_BURST_S,
                          "backlog": f"the limit's {seconds} s, plus its burst", "stream_s": STREAM_S,
                          "worker_poll_interval_s": "default (5)"})
    for run_number in range(1, ctx.runs + 1):
        for key, rpm, otpm in LIMITS:
            for mode in MODES:
                fraction, limited, late, herd = _drain(ctx, rpm=rpm, otpm=otpm, configured=mode == "configured",
                                                 seconds=seconds)
                result.add(f"{key}_{mode}_of_limit", fraction)
                result.add(f"{key}_{mode}_429s", limited)
                result.add(f"{key}_{mode}_late_429s", late)
                result.add(f"{key}_{mode}_herd", herd)
                ctx.progress(f"provider_limit run {run_number}/{ctx.runs}: {key} {mode}: {fraction:.2f} of the "
                             f"limit, {limited} 429s ({late} after the first pause, at most {herd} in a row)")


def _drain(ctx: BenchContext, *, rpm: int | None, otpm: int | None, configured: bool,
           seconds: float) -> tuple[float, int, int, int]:
    per_job = 1.0 if rpm else USED_TOKENS
    jobs_per_minute = rpm if rpm else (otpm or 0) / USED_TOKENS
    burst = math.floor(jobs_per_minute / 60 * PROVIDER_BURST_S)
    jobs = burst + math.ceil(jobs_per_minute / 60 * seconds) + 1
    fake = FakeAnthropic(default=Plan(chunks=USED_TOKENS // 5, words_per_chunk=5, duration_s=STREAM_S),
                         requests_per_minute=rpm, output_tokens_per_minute=otpm, limit_burst_s=PROVIDER_BURST_S)
    # LLM_MAX_TOKENS at the stories' size: the bucket holds at least one
    # largest job, which must fit in the provider's 5 s of burst
    env: dict[str, Any] = {"WORKER_CONCURRENCY": CONCURRENCY, "LLM_RETRY_ATTEMPTS": 20, "LLM_RETRY_DEADLINE_S": 300,
                           "LLM_TIMEOUT_S": 60, "JOB_TIMEOUT_S": 400, "LLM_MAX_TOKENS": MAX_TOKENS}
    if configured and rpm:
        env["LLM_REQUESTS_PER_MINUTE"] = rpm
    if configured and otpm:
        env["LLM_OUTPUT_TOKENS_PER_MINUTE"] = otpm
    with FakeAnthropicServer(fake) as server, ctx.database("provider_limit") as bench_db:
        client_id = bench_db.create_client()
        bench_db.insert_pending(client_id, jobs)
        bench_db.reader.execute("UPDATE story_jobs SET max_tokens = %(max_tokens)s, input_tokens_estimate = 50",
                                {"max_tokens": MAX_TOKENS})
        with ctx.processes(bench_db, ANTHROPIC_API_KEY="bench", ANTHROPIC_BASE_URL=server.base_url, **env) as system:
            workers = [system.worker(wait=False) for _ in range(WORKERS)]
            bench_db.wait_drained(workers, timeout_s=120 + seconds * 4)
        failed = bench_db.count_status("failed")
    if failed:
        raise RuntimeError(f"{failed} of {jobs} jobs failed")
    calls = sorted(fake.calls, key=lambda call: call.received_at)
    served = [call for call in calls if not call.limited]
    steady = served[burst:]
    span_s = steady[-1].received_at - steady[0].received_at
    achieved = (len(steady) - 1) * per_job / span_s * 60
    limit = rpm if rpm else otpm
    assert limit is not None
    late = _after_first_pause(calls)
    return achieved / limit, len(fake.rate_limited), sum(call.limited for call in late), _longest_run_limited(late)


def _after_first_pause(calls: list[Call]) -> list[Call]:
    """The calls from the first request served after the first 429 on (none if no 429)."""
    first = next((n for n, call in enumerate(calls) if call.limited), None)
    if first is None:
        return []
    return calls[next((n for n in range(first, len(calls)) if not calls[n].limited), len(calls)):]


def _longest_run_limited(calls: list[Call]) -> int:
    """The most 429s answered in a row: a herd after a pause is several."""
    longest = run = 0
    for call in calls:
        run = run + 1 if call.limited else 0
        longest = max(longest, run)
    return longest
