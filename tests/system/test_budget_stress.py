"""Admissions, cancellations and completions of budgeted jobs at once, across
two api processes and a worker, with budget_days analysed into the sequential
scan that locks its rows in page order: Postgres reports no deadlock, and no
request is answered 5xx."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import psycopg
import pytest

from tests.support.database import create_key_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import ApiProc, System

pytestmark = pytest.mark.system

DURATION_S = 15.0
SESSIONS = 3


def _deadlocks(database_url: str) -> int:
    """The database's deadlock count, once every other backend on it has
    exited: a backend's statistics reach pg_stat_database at the latest
    when it exits, and a stopped process's backends exit a little after it."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        wait_until_sync(lambda: conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                             "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
                                             ).fetchone() == (0,),
                        timeout=30, interval=0.1, what="the stopped processes' backends to exit")
        row = conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()
        assert row is not None
        return int(row[0])


def test_admissions_cancels_and_completions_under_budgets_never_deadlock(
    system: System, database_url: str, record_property: Any
) -> None:
    """Three sessions admitting and three cancelling, for 15 s on two api processes while a worker
    completes jobs, all under a day's and a client's budget: hundreds of jobs are cancelled and completed,
    Postgres counts
    no deadlock and no answer is a 5xx."""
    keys = [create_key_sync(database_url, f"stress-{n}") for n in range(SESSIONS)]
    apis = [system.api(QUEUE_MAX=100_000, CLIENT_QUEUE_MAX=100_000, BUDGET_USD_PER_DAY=1_000_000,
                       CLIENT_BUDGET_USD_PER_DAY=1_000_000) for _ in range(2)]
    answers: Counter[int] = Counter()
    accepted: queue.Queue[tuple[str, str]] = queue.Queue()
    lock = threading.Lock()

    def post(client: httpx.Client, key: str) -> httpx.Response:
        return client.post("/stories/generate", json={"prompt": "a fox"}, headers={
            "Authorization": f"Bearer {key}", "Idempotency-Key": str(uuid.uuid4())})

    for n, key in enumerate(keys):  # every client's budget row exists, then the planner sees a small table
        with httpx.Client(base_url=apis[n % 2].base_url, timeout=30) as client:
            assert post(client, key).status_code == 202
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("ANALYZE budget_days")
    system.worker(WORKER_CONCURRENCY=4, OFFLINE_DELAY_S=0.02, WORKER_POLL_INTERVAL_S=0.2)
    deadline = time.monotonic() + DURATION_S

    def admit(n: int) -> None:
        key = keys[n]
        with httpx.Client(base_url=apis[n % 2].base_url, timeout=30) as client:
            while time.monotonic() < deadline:
                answer = post(client, key)
                with lock:
                    answers[answer.status_code] += 1
                    # every other job is left for the worker to complete
                    to_cancel = answer.status_code == 202 and answers[202] % 2 == 1
                if to_cancel:
                    accepted.put((key, answer.json()["job_id"]))

    def cancel(api: ApiProc) -> None:
        with httpx.Client(base_url=api.base_url, timeout=30) as client:
            while time.monotonic() < deadline:
                try:
                    key, job_id = accepted.get(timeout=0.1)
                except queue.Empty:
                    continue
                answer = client.delete(f"/stories/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
                with lock:
                    answers[answer.status_code] += 1

    threads = [threading.Thread(target=admit, args=(n,)) for n in range(SESSIONS)]
    threads += [threading.Thread(target=cancel, args=(apis[(n + 1) % 2],)) for n in range(SESSIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    system.stop_all()

    with psycopg.connect(database_url, autocommit=True) as conn:
        statuses: dict[str, int] = dict(conn.execute("SELECT coalesce(error_code, status::text), count(*) FROM story_jobs "
                                     "GROUP BY 1").fetchall())
    deadlocks = _deadlocks(database_url)
    server_errors = sum(count for status, count in answers.items() if status >= 500)
    record_property("answers", dict(answers))
    record_property("jobs", statuses)
    record_property("deadlocks", deadlocks)
    record_property("server_errors", server_errors)
    figures = f"deadlocks={deadlocks} 5xx={server_errors} answers={dict(answers)} jobs={statuses}"
    assert deadlocks == 0 and server_errors == 0, figures
    assert statuses.get("cancelled", 0) > 50 and statuses.get("completed", 0) > 50, figures
