"""What operators see: every metrics endpoint agrees with the database, and
every log line about a job names it."""

from __future__ import annotations

import re
import uuid
from collections import defaultdict
from typing import Any

import httpx
import psycopg
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support.database import create_key_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import System, free_port

pytestmark = pytest.mark.system

_SAMPLE = re.compile(r"^(storyjobs_[a-z_]+)(\{[^}]*\})? (\S+)$")


def scrape(url: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value} for storyjobs_ samples."""
    samples: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def summed(scrapes: list[dict[str, float]], sample: str) -> float:
    return sum(s.get(sample, 0.0) for s in scrapes)


def test_metrics_of_every_process_agree_with_the_database(
    system: System, fake_llm: FakeAnthropicServer, database_url: str
) -> None:
    """api, 2 workers and the sweeper as processes complete and fail jobs; the api's, the workers'
    and the sweeper's metrics then match what the database holds, and every worker log line about
    a job carries job_id and worker_id."""
    fake_llm.fake.default = Plan(chunks=3)
    # two requests the provider refuses: those jobs fail as llm_rejected
    fake_llm.fake.queue(Plan(), Plan(status=400), Plan(), Plan(status=400))
    key = create_key_sync(database_url, "operator")
    api = system.api(QUEUE_MAX=50)
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=api.base_url, headers=auth, timeout=10) as client:
        # one job cancelled before any worker runs
        cancelled = client.post("/stories/generate", json={"prompt": "never mind"},
                                headers={"Idempotency-Key": "cancel-me"}).json()["job_id"]
        assert client.delete(f"/stories/jobs/{cancelled}").status_code == 200
        worker_ports = [free_port(), free_port()]
        llm: dict[str, Any] = {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": fake_llm.base_url}
        workers = [system.worker(METRICS_PORT=port, **llm) for port in worker_ports]
        sweeper_port = free_port()
        system.sweeper(METRICS_PORT=sweeper_port, SWEEPER_INTERVAL_S=0.5)
        for n in range(8):
            answer = client.post("/stories/generate", json={"prompt": f"story {n}"},
                                 headers={"Idempotency-Key": f"job-{n}"})
            assert answer.status_code == 202
        assert client.post("/stories/generate", json={"prompt": "story 0"},
                           headers={"Idempotency-Key": "job-0"}).status_code == 202  # a replay
        assert client.post("/stories/generate", json={"prompt": "other"},
                           headers={"Idempotency-Key": "job-0"}).status_code == 422
        assert client.post("/stories/generate", json={"prompt": ""},
                           headers={"Idempotency-Key": str(uuid.uuid4())}).status_code == 400
        with psycopg.connect(database_url, autocommit=True) as conn:
            wait_until_sync(lambda: conn.execute("SELECT count(*) FILTER (WHERE status IN ('pending', 'running')) "
                                                 "FROM story_jobs").fetchone() == (0,),
                            timeout=60, interval=0.2, what="the jobs to finish")
            jobs: dict[str, int] = dict(conn.execute("SELECT coalesce(error_code, status::text), count(*) FROM story_jobs "
                                     "GROUP BY 1").fetchall())
            claimed = conn.execute("SELECT count(*) FROM story_jobs WHERE started_at IS NOT NULL").fetchone()
            ledger = conn.execute(
                "SELECT count(*) FILTER (WHERE outcome = 'succeeded'), count(*) FILTER (WHERE outcome = 'rejected'),"
                "       sum(input_tokens) FILTER (WHERE billed), sum(output_tokens) FILTER (WHERE billed),"
                "       sum(cost_usd) FILTER (WHERE billed) FROM llm_calls").fetchone()
    assert jobs == {"completed": 6, "llm_rejected": 2, "cancelled": 1}
    assert claimed is not None and ledger is not None

    # the sweeper's gauges come from its next pass
    sweeper_url = f"http://127.0.0.1:{sweeper_port}/metrics"
    first_run = scrape(sweeper_url).get("storyjobs_sweeper_last_run_timestamp_seconds", 0.0)
    wait_until_sync(lambda: scrape(sweeper_url).get("storyjobs_sweeper_last_run_timestamp_seconds", 0.0) > first_run,
                    interval=0.2, what="the sweeper to pass again")
    sweeper = scrape(sweeper_url)
    assert sweeper['storyjobs_jobs{status="pending"}'] == 0 and sweeper['storyjobs_jobs{status="running"}'] == 0
    assert sweeper["storyjobs_oldest_pending_age_seconds"] == 0
    assert summed([sweeper], 'storyjobs_sweeper_reclaimed_total{reason="interrupted"}') == 0

    api_metrics = scrape(f"{api.base_url}/metrics")
    assert api_metrics["storyjobs_jobs_accepted_total"] == 9
    assert api_metrics["storyjobs_jobs_replayed_total"] == 1
    assert api_metrics['storyjobs_jobs_rejected_total{reason="idempotency_mismatch"}'] == 1
    assert api_metrics['storyjobs_jobs_rejected_total{reason="invalid_request"}'] == 1
    assert api_metrics[
        'storyjobs_http_requests_total{method="POST",route="/stories/generate",status="202"}'] == 10

    # a worker counts a job's end, and logs it, once its statement has
    # committed: the database can be seen ahead of both
    def worker_scrapes() -> list[dict[str, float]]:
        return [scrape(f"http://127.0.0.1:{port}/metrics") for port in worker_ports]

    def ends_counted() -> bool:
        counted = worker_scrapes()
        return (summed(counted, 'storyjobs_job_transitions_total{to="completed"}')
                + summed(counted, 'storyjobs_job_transitions_total{to="failed"}') == 8
                and summed(counted, "storyjobs_worker_busy") == 0)

    wait_until_sync(ends_counted, interval=0.2, what="the workers to count the jobs' ends")
    wait_until_sync(lambda: sum(1 for worker in workers for entry in worker.events()
                                if entry.get("event") in ("job.completed", "job.failed")) >= 8,
                    interval=0.2, what="the workers to log the jobs' ends")
    scrapes = worker_scrapes()
    assert summed(scrapes, 'storyjobs_job_transitions_total{to="running"}') == claimed[0] == 8
    assert summed(scrapes, 'storyjobs_job_transitions_total{to="completed"}') == jobs["completed"]
    assert summed(scrapes, 'storyjobs_job_transitions_total{to="failed"}') == jobs["llm_rejected"]
    assert summed(scrapes, 'storyjobs_llm_requests_total{outcome="succeeded"}') == ledger[0]
    assert summed(scrapes, 'storyjobs_llm_requests_total{outcome="rejected"}') == ledger[1]
    assert summed(scrapes, 'storyjobs_llm_tokens_total{direction="input"}') == ledger[2]
    assert summed(scrapes, 'storyjobs_llm_tokens_total{direction="output"}') == ledger[3]
    assert summed(scrapes, "storyjobs_llm_cost_usd_total") == pytest.approx(float(ledger[4]), abs=1e-6)
    assert summed(scrapes, "storyjobs_job_run_seconds_count") == 8
    assert summed(scrapes, "storyjobs_job_queue_wait_seconds_count") == 8
    assert summed(scrapes, "storyjobs_worker_busy") == 0
    assert all(s["storyjobs_worker_last_claim_timestamp_seconds"] > 0 for s in scrapes if
               s['storyjobs_job_transitions_total{to="running"}'] > 0)

    job_lines: dict[str, list[dict[str, object]]] = defaultdict(list)
    for worker in workers:
        for entry in worker.events():
            if str(entry.get("event", "")).startswith("job."):
                job_lines[str(entry["event"])].append(entry)
    assert len(job_lines["job.completed"]) == 6 and len(job_lines["job.failed"]) == 2
    for entries in job_lines.values():
        for entry in entries:
            assert entry.get("job_id") and entry.get("worker_id"), entry
