"""Pacing at the provider's limit, with the real processes and the fake provider: a claim the
limiter held back is woken by the bucket, not the poll; a 429's pause ends without a herd; and a
worker host whose clock is 10 minutes fast changes nothing."""

from __future__ import annotations

import glob
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.anthropic_server import Call, FakeAnthropic, FakeAnthropicServer, Plan
from tests.support.waiting import wait_until_sync
from tests.system.procs import System, free_port

pytestmark = pytest.mark.system

TIMINGS: dict[str, Any] = {"HEARTBEAT_INTERVAL_S": 1, "HEARTBEAT_TIMEOUT_S": 5, "LLM_TIMEOUT_S": 60, "JOB_TIMEOUT_S": 120,
           "LLM_RETRY_ATTEMPTS": 20, "LLM_RETRY_DEADLINE_S": 110, "LLM_MAX_TOKENS": 800}
LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))


def _enqueue(database_url: str, jobs: int) -> None:
    """jobs pending short stories, in one statement (a backlog), with their turns."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO api_clients (name) VALUES ('pacing') ON CONFLICT DO NOTHING")
        conn.execute(
            "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, max_tokens, "
            "input_tokens_estimate, turn) "
            "SELECT (SELECT id FROM api_clients WHERE name = 'pacing'), 'k' || n, '\\x00', "
            "jsonb_build_object('prompt', 'paced story ' || n, 'length', 'short'), 800, 50, n "
            "FROM generate_series(1, %s) n", (jobs,))


def _wait_completed(database_url: str, jobs: int, timeout: float) -> None:
    def completed() -> bool:
        with psycopg.connect(database_url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM story_jobs WHERE status = 'completed'").fetchone()
        return row is not None and row[0] == jobs

    wait_until_sync(completed, timeout=timeout, what=f"{jobs} jobs to complete", interval=0.2)


def _served(fake: FakeAnthropic) -> list[Call]:
    return sorted((call for call in fake.calls if not call.limited), key=lambda call: call.received_at)


def _late_429s(fake: FakeAnthropic) -> int:
    """429s after the first burst's pause: from the first request served after the first 429."""
    calls = sorted(fake.calls, key=lambda call: call.received_at)
    first = next((n for n, call in enumerate(calls) if call.limited), None)
    if first is None:
        return 0
    resumed = next((n for n in range(first, len(calls)) if not calls[n].limited), len(calls))
    return sum(call.limited for call in calls[resumed:])


def test_a_drain_at_the_configured_limit_never_waits_for_the_poll(
    system: System, database_url: str, record_property: Any
) -> None:
    """45 requests a minute configured at the provider's (5 s of burst), 2 workers × 2 slots, the
    poll at 20 s: after the first burst, requests reach the provider one every 1.33 s, no gap near a
    poll interval, and none is refused."""
    fake = FakeAnthropic(default=Plan(chunks=3, duration_s=0.3), requests_per_minute=45, limit_burst_s=5)
    _enqueue(database_url, 14)
    with FakeAnthropicServer(fake) as server:
        for _ in range(2):
            system.worker(ANTHROPIC_API_KEY="test", ANTHROPIC_BASE_URL=server.base_url, WORKER_CONCURRENCY=2,
                          WORKER_POLL_INTERVAL_S=20, LLM_REQUESTS_PER_MINUTE=45, **TIMINGS)
        _wait_completed(database_url, 14, timeout=90)
    arrivals = [call.received_at for call in _served(fake)][3:]
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
    record_property("largest_gap_s", round(max(gaps), 2))
    # 1.33 s is the pace; two workers claiming only at their polls would leave
    # gaps of 10 s and more, whatever their phase
    assert max(gaps) < 4.0, [round(gap, 2) for gap in gaps]
    assert fake.rate_limited == []


def test_a_429s_pause_ends_without_a_herd(system: System, database_url: str, record_property: Any) -> None:
    """No limit configured, a provider allowing 30 requests a minute with 5 s of burst and saying so in
    its headers, 4 workers × 4 slots, 16 jobs: after the first burst's pause, at most one more 429
    reaches the provider, the rest is served at its pace, and one worker wakes for the bucket while
    the others sleep until its role ends."""
    fake = FakeAnthropic(default=Plan(chunks=3, duration_s=0.3), requests_per_minute=30, limit_burst_s=5)
    _enqueue(database_url, 16)
    ports = [free_port() for _ in range(4)]
    with FakeAnthropicServer(fake) as server:
        started = time.monotonic()
        for port in ports:
            system.worker(ANTHROPIC_API_KEY="test", ANTHROPIC_BASE_URL=server.base_url, WORKER_CONCURRENCY=4,
                          METRICS_PORT=port, **TIMINGS)
        _wait_completed(database_url, 16, timeout=110)
        elapsed_s = time.monotonic() - started
        waits = [_ratelimit_waits(port) for port in ports]
    record_property("provider_429s", len(fake.rate_limited))
    record_property("late_429s", _late_429s(fake))
    record_property("held_back_rounds", waits)
    assert _late_429s(fake) <= 1
    assert len(_served(fake)) == 16
    # The waker counts two or three held-back rounds a job: the one that claimed it and held back
    # the next, and now and then one woken a few ms early (the heard headers and the bucket are read
    # off two clocks). The others sleep until the role ends, LLM_RATE_BURST_S (5 s): they count by the
    # run's length, not by its jobs. All four waking whenever the bucket covers the next job counted
    # about six a job each (94 for these 16 in one run, about 23 a worker).
    waker, *others = sorted(waits, reverse=True)
    assert waker <= 4 * 16, waits
    assert max(others) <= elapsed_s / 5 + 3, (waits, round(elapsed_s, 1))


def _ratelimit_waits(port: int) -> float:
    """storyjobs_llm_ratelimit_waits_total of the worker serving metrics on port."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "storyjobs_llm_ratelimit_waits"]
    return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))


@pytest.mark.skipif(not LIBFAKETIME, reason="libfaketime is not installed (Debian's faketime; .ci/run installs it)")
def test_a_worker_whose_clock_is_ten_minutes_fast_pauses_nobody(
    system: System, database_url: str, record_property: Any
) -> None:
    """Two workers, one on a host clock 10 minutes fast (libfaketime), no limit configured, a provider
    at 60 requests a minute whose headers say when nothing is left: the pauses they store never reach
    a minute past the database's clock, and 12 jobs complete at the provider's pace."""
    fake = FakeAnthropic(default=Plan(chunks=3, duration_s=0.3), requests_per_minute=60, limit_burst_s=5)
    _enqueue(database_url, 12)
    longest = [0.0]
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            while not done.wait(0.05):
                row = conn.execute("SELECT max(extract(epoch FROM greatest(paused_until, now()) - now()))::float8 "
                                   "FROM llm_rate_buckets").fetchone()
                if row is not None and row[0] is not None:
                    longest[0] = max(longest[0], row[0])

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with FakeAnthropicServer(fake) as server:
            env: dict[str, Any] = {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": server.base_url, "WORKER_CONCURRENCY": 2,
                   **TIMINGS}
            system.worker(LD_PRELOAD=LIBFAKETIME[0], FAKETIME="+10m", FAKETIME_DONT_FAKE_MONOTONIC="1", **env)
            system.worker(**env)
            _wait_completed(database_url, 12, timeout=60)
    finally:
        done.set()
        sampler.join()
    record_property("longest_pause_s", round(longest[0], 2))
    assert longest[0] < 60
