"""A rolling deploy that changes the queue limits: api replicas with different
QUEUE_MAX serve one database at once."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest

from tests.support.database import create_key_sync
from tests.system.procs import ApiProc, System

pytestmark = pytest.mark.system


def _post(api: ApiProc, key: str) -> int:
    answer = httpx.post(f"{api.base_url}/stories/generate", json={"prompt": "a fox"}, timeout=20,
                        headers={"Authorization": f"Bearer {key}", "Idempotency-Key": str(uuid.uuid4())})
    return answer.status_code


def _pending(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM story_jobs WHERE status = 'pending'").fetchone()
    assert row is not None
    return int(row[0])


def test_replicas_with_different_queue_limits_never_exceed_the_larger(system: System, database_url: str) -> None:
    """An old replica with QUEUE_MAX=5 beside a new one with 8: once the new one has filled the queue, the
    old one's refusals do not let the new one admit more; under a concurrent burst at both, the pending
    count never passes 8, and ends at 8."""
    key = create_key_sync(database_url, "deploy")
    old, new = system.api(QUEUE_MAX=5), system.api(QUEUE_MAX=8)
    assert [_post(new, key) for _ in range(8)] == [202] * 8
    assert _post(old, key) == 429
    assert _post(new, key) == 429
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM story_jobs WHERE id > 3")
        conn.execute("DELETE FROM job_idempotency_keys WHERE job_id > 3")

    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.append(_pending(database_url))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            answers = list(pool.map(lambda n: _post(old if n % 2 else new, key), range(60)))
    finally:
        done.set()
        sampler.join()
    assert set(answers) == {202, 429}
    assert max(seen) <= 8 and _pending(database_url) == 8
