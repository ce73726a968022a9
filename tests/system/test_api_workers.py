"""Several api processes on one port (API_WORKERS)."""

from __future__ import annotations

import re
import uuid

import httpx
import psutil
import pytest

from tests.support.database import create_key_sync
from tests.system.procs import System

pytestmark = pytest.mark.system


def test_two_api_processes_serve_one_port_and_report_one_set_of_metrics(
    system: System, database_url: str
) -> None:
    """With API_WORKERS=2 both processes answer, and /metrics counts every accepted job whichever
    process serves the scrape."""
    api = system.api(API_WORKERS=2, QUEUE_MAX=100)
    key = create_key_sync(database_url, "workers")
    serving = [p for p in psutil.Process(api.pid).children(recursive=True) if "python" in p.name()]
    assert len(serving) >= 2
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
        for n in range(20):
            answer = client.post("/stories/generate", json={"prompt": f"story {n}"},
                                 headers={"Idempotency-Key": str(uuid.uuid4())})
            assert answer.status_code == 202
        scrapes = []
        for _ in range(6):
            # a new connection each time, so either process may answer
            text = httpx.get(f"{api.base_url}/metrics", timeout=10).text
            match = re.search(r"^storyjobs_jobs_accepted_total (\S+)$", text, re.MULTILINE)
            assert match, text[:500]
            scrapes.append(float(match.group(1)))
    assert scrapes == [20.0] * 6
