"""The provider's rate limits and the spend budgets, with the real processes:
workers share one bucket through Postgres, a 429 holds every worker, and a
budget holds across api replicas."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import httpx
import psycopg
import pytest

from api.admission import admission
from shared.config import ApiSettings
from shared.story_request import StoryRequest
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support.database import create_key_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import ApiProc, System

pytestmark = pytest.mark.system

TIMINGS = {"HEARTBEAT_INTERVAL_S": 1, "HEARTBEAT_TIMEOUT_S": 5, "SWEEPER_INTERVAL_S": 1,
           "WORKER_POLL_INTERVAL_S": 0.5, "LLM_TIMEOUT_S": 60, "JOB_TIMEOUT_S": 120}


def _llm(server: FakeAnthropicServer, **env: Any) -> dict[str, Any]:
    return {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": server.base_url, **TIMINGS, **env}


def _post(api: ApiProc, key: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{api.base_url}/stories/generate", json={"prompt": prompt}, timeout=30,
                      headers={"Authorization": f"Bearer {key}", "Idempotency-Key": str(uuid.uuid4())})


def _statuses(database_url: str) -> dict[str, int]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return dict(conn.execute("SELECT status::text, count(*) FROM story_jobs GROUP BY 1").fetchall())


def _wait_finished(database_url: str, total: int, timeout: float) -> None:
    def finished() -> bool:
        statuses = _statuses(database_url)
        return statuses.get("completed", 0) + statuses.get("failed", 0) == total

    wait_until_sync(finished, timeout=timeout, what=f"{total} jobs to finish", interval=0.2)


def test_workers_sharing_the_configured_limit_drain_without_a_429(
    system: System, database_url: str, record_property: Any
) -> None:
    """4 workers × concurrency 4, with the limit configured at the provider's (120 requests and
    200,000 output tokens a minute, enforced over 5 s): 30 jobs drain with no 429 at the provider, at
    no less than 80 % of the limit's rate."""
    fake = FakeAnthropic(default=Plan(chunks=3, duration_s=0.3), requests_per_minute=120,
                         output_tokens_per_minute=200_000, limit_burst_s=5)
    with FakeAnthropicServer(fake) as server:
        env = _llm(server, WORKER_CONCURRENCY=4, LLM_REQUESTS_PER_MINUTE=120,
                   LLM_OUTPUT_TOKENS_PER_MINUTE=200_000)
        workers = [system.worker(**env) for _ in range(4)]
        api = system.api(QUEUE_MAX=100)
        key = create_key_sync(database_url, "limits")
        for n in range(30):
            assert _post(api, key, f"limited story {n}").status_code == 202
        _wait_finished(database_url, 30, timeout=90)
    assert _statuses(database_url) == {"completed": 30}
    assert fake.rate_limited == [] and len(fake.calls) == 30
    arrivals = sorted(call.received_at for call in fake.calls)
    per_minute = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) * 60
    record_property("requests_per_minute", round(per_minute, 1))
    record_property("provider_429s", len(fake.rate_limited))
    assert per_minute >= 0.8 * 120, f"{per_minute:.0f} requests a minute"
    assert any(e["event"] == "worker.started" for w in workers for e in w.events())


def test_without_a_configured_limit_a_429_holds_every_worker_until_its_retry_after(
    system: System, database_url: str, record_property: Any
) -> None:
    """No limit configured, 20 jobs for 16 slots, a provider that allows 10 requests at once then one a
    second, answers its 429s with a retry-after of 3 s, and says nothing of its limits otherwise: after
    the first 429, no request arrives until its retry-after has passed (the requests already under way
    when it was answered aside), and every job completes."""
    retry_after = 3.0
    fake = FakeAnthropic(default=Plan(chunks=2, duration_s=0.1), requests_per_minute=60, limit_burst_s=10,
                         send_limit_headers=False, limit_retry_after_s=int(retry_after))
    with FakeAnthropicServer(fake) as server:
        env = _llm(server, WORKER_CONCURRENCY=4, LLM_RETRY_ATTEMPTS=20, LLM_RETRY_DEADLINE_S=80)
        for _ in range(4):
            system.worker(**env)
        api = system.api(QUEUE_MAX=100)
        key = create_key_sync(database_url, "no-limits")
        for n in range(20):
            assert _post(api, key, f"unlimited story {n}").status_code == 202
        _wait_finished(database_url, 20, timeout=150)
    assert _statuses(database_url) == {"completed": 20}
    first = min(fake.rate_limited, key=lambda call: call.received_at)
    # requests already on their way when the 429 was answered cannot be held
    # back (a second: a worker that read no pause just before it was stored
    # may be slow to send on a loaded machine)
    under_way_s = 1.0
    held = [call for call in fake.calls
            if first.received_at + under_way_s <= call.received_at < first.received_at + retry_after]
    record_property("provider_429s", len(fake.rate_limited))
    record_property("requests_in_the_pause", len(held))
    assert held == [], [round(c.received_at - first.received_at, 3) for c in held]
    assert len(fake.billed) == 20


def test_a_budget_holds_across_two_api_replicas(system: System, database_url: str, record_property: Any) -> None:
    """BUDGET_USD_PER_DAY covering 7 worst cases: 100 concurrent POSTs across two api processes admit
    exactly 7, the rest are 429 budget-exhausted with nothing stored; once those 7 complete, costing a
    fraction of their worst case, more are admitted; spent + reserved never passes the budget."""
    worst = admission(1, "k", StoryRequest(prompt="budget story 00"), ApiSettings()).worst_case_usd
    budget = worst * 7 + worst / 2
    key = create_key_sync(database_url, "budget")
    apis = [system.api(QUEUE_MAX=500, BUDGET_USD_PER_DAY=budget) for _ in range(2)]
    samples: list[Decimal] = []
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            while not done.is_set():
                row = conn.execute("SELECT coalesce(sum(spent_usd + reserved_usd), 0) FROM budget_days "
                                   "WHERE client_id = 0").fetchone()
                assert row is not None
                samples.append(row[0])

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(max_workers=20) as pool:
            answers = list(pool.map(lambda n: _post(apis[n % 2], key, f"budget story {n:02d}"), range(100)))
        accepted = [a for a in answers if a.status_code == 202]
        refused = [a for a in answers if a.status_code != 202]
        assert len(accepted) == 7
        assert {a.status_code for a in refused} == {429}
        assert {a.json()["type"] for a in refused} == {"/problems/budget-exhausted"}
        assert all(int(a.headers["retry-after"]) >= 1 for a in refused)
        assert _statuses(database_url) == {"pending": 7}

        with FakeAnthropicServer(FakeAnthropic(default=Plan(chunks=2))) as server:
            system.worker(**_llm(server, WORKER_CONCURRENCY=7))
            _wait_finished(database_url, 7, timeout=60)
            more = [_post(apis[n % 2], key, f"budget story {n:02d}") for n in range(7)]
    finally:
        done.set()
        sampler.join()
    record_property("budget_usd", str(budget))
    record_property("accepted_of_100", len(accepted))
    record_property("accepted_after_completion_of_7", sum(1 for a in more if a.status_code == 202))
    record_property("highest_spent_plus_reserved_usd", str(max(samples)))
    record_property("samples", len(samples))
    assert sum(1 for a in more if a.status_code == 202) >= 6
    assert samples and max(samples) <= budget
