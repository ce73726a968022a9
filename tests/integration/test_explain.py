"""The claim reads only the pending jobs' turn index and the sweeper only the live-jobs index,
whatever the history and however stale the planner's statistics; so does the autoscaler's count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from shared.queries import QUERIES
from shared.ratelimit import NO_LIMITS, RateLimits, claim_params

CLAIM_PARAMS = {**claim_params(NO_LIMITS, None, default_max_tokens=1000), "worker_id": "w", "claim_limit": 1, "provider": "offline", "model": "m"}
# the same claim with every kind of rate limit configured
LIMITED_CLAIM_PARAMS = {**CLAIM_PARAMS, **claim_params(
    RateLimits(requests_rate=1.0, requests_capacity=5.0, input_tokens_rate=1000.0, input_tokens_capacity=5000.0,
               output_tokens_rate=1000.0, output_tokens_capacity=5000.0), None, default_max_tokens=1000)}
ADMISSION_PARAMS = {
    "requests": '[{"ord": 0, "client_id": 1, "idempotency_key": "new", "request_fingerprint": "00", '
                '"request": {"prompt": "x"}}]',
    "queue_max": 1000, "client_queue_max": 1000, "batch_queue_max": 1000, "client_batch_queue_max": 1000,
    "budget_usd": None, "client_budget_usd": None,
}
SWEEP_PARAMS = {"heartbeat_timeout_s": 60, "job_timeout_s": 480, "pending_timeout_s": 1800,
                "judge_running": True, "batch_size": 100, "now": None, "batch_collect_s": 60}


async def _fill(conn: psycopg.AsyncConnection[Any], *, finished: int, pending: int, analyze_first: bool) -> None:
    """`finished` completed jobs followed by `pending` pending ones. With analyze_first the statistics
    are taken while every row was still pending, as in the middle of a drain."""
    await conn.execute("INSERT INTO api_clients (name) VALUES ('explain')")
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn) "
        "SELECT 1, 'k' || g, '\\x00', '{\"prompt\": \"x\"}', g FROM generate_series(1, %s) g",
        (finished + pending,))
    if analyze_first:
        await conn.execute("ANALYZE story_jobs")
    await conn.execute(
        "UPDATE story_jobs SET status = 'completed', started_at = now(), completed_at = now(), "
        "story_id = gen_random_uuid(), worker_id = 'old' WHERE id <= %s", (finished,))
    if not analyze_first:
        await conn.execute("VACUUM ANALYZE story_jobs")


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes.extend(_plan_nodes(child))
    return nodes


def _story_jobs_scans(plan: dict[str, Any]) -> list[str]:
    return [
        f"{node['Node Type']}:{node.get('Index Name', '')}"
        for node in _plan_nodes(plan)
        if node.get("Relation Name") == "story_jobs" and "Scan" in node["Node Type"]
    ]


async def _plan(conn: psycopg.AsyncConnection[Any], query: str, params: dict[str, Any]) -> dict[str, Any]:
    cur = await conn.execute("EXPLAIN (FORMAT JSON) " + QUERIES[query], params)
    row = await cur.fetchone()
    assert row is not None
    document = row[0] if isinstance(row[0], list) else json.loads(row[0])
    plan: dict[str, Any] = document[0]["Plan"]
    return plan


@pytest.mark.parametrize("params", [CLAIM_PARAMS, LIMITED_CLAIM_PARAMS], ids=["unlimited", "rate-limited"])
@pytest.mark.parametrize("analyze_first", [False, True], ids=["fresh-stats", "stale-stats"])
async def test_the_claim_uses_the_turn_index(
    conn: psycopg.AsyncConnection[Any], analyze_first: bool, params: dict[str, Any]
) -> None:
    """With 20,000 finished jobs ahead of the pending ones, the claim finds them in turn order through
    story_jobs_turn_idx, never by walking the primary key or the table, with or without a rate limit."""
    await _fill(conn, finished=20_000, pending=50, analyze_first=analyze_first)
    plan = await _plan(conn, "job_claim", params)
    (claimable,) = [n for n in _plan_nodes(plan) if n.get("Subplan Name") == "CTE claimable"]
    assert _story_jobs_scans(claimable) == ["Index Scan:story_jobs_turn_idx"]
    # everywhere else the statement reaches jobs by id, never by scanning
    assert not any(s.startswith(("Seq Scan", "Bitmap")) for s in _story_jobs_scans(plan))


@pytest.mark.parametrize("analyze_first", [False, True], ids=["fresh-stats", "stale-stats"])
async def test_the_sweeper_gauges_and_admission_read_live_jobs_by_index(
    conn: psycopg.AsyncConnection[Any], analyze_first: bool
) -> None:
    """The sweeper's pass, its queue gauges and the admission count read live jobs through the
    active index, reaching other rows only by id."""
    await _fill(conn, finished=20_000, pending=50, analyze_first=analyze_first)
    queries: list[tuple[str, dict[str, Any]]] = [("job_fail_stale", SWEEP_PARAMS),
                                                 ("job_insert_if_admitted", ADMISSION_PARAMS)]
    if not analyze_first:
        # plain counts, run once per sweeper pass: right with the fresh statistics that
        # story_jobs' autovacuum settings keep, not forced against stale ones
        queries.append(("job_queue_gauges", {"now": None}))
    for query, params in queries:
        plan = await _plan(conn, query, params)
        indexes = {n["Index Name"] for n in _plan_nodes(plan) if n.get("Index Name")}
        # (the admission counts the interactive lane's pending jobs, which the
        # claim's partial index holds alone)
        assert {"story_jobs_active_idx", "story_jobs_turn_idx"} & indexes, (query, indexes)
        assert not any(s.startswith("Seq Scan") for s in _story_jobs_scans(plan)), query
        # other indexes only fetch rows already found, by key (or, for the
        # admission, the first pending turn, and the batch lane's live jobs,
        # counted on their own partial index when a batch job asks; for the
        # sweeper, the batch jobs waiting for a batch, on their own partial index)
        for node in _plan_nodes(plan):
            if node.get("Index Name") not in (None, "story_jobs_active_idx", "story_jobs_turn_idx",
                                              "story_jobs_batch_ready_idx", "message_batches_live_idx",
                                              "story_jobs_batch_live_idx"):
                assert " = " in node.get("Index Cond", ""), (query, node)


def _keda_query() -> str:
    """The query KEDA's postgresql trigger runs to scale the workers (deploy/k8s/20-keda.yaml)."""
    manifest = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "20-keda.yaml"
    (scaled,) = [doc for doc in yaml.safe_load_all(manifest.read_text()) if doc and doc["kind"] == "ScaledObject"]
    (trigger,) = scaled["spec"]["triggers"]
    query: str = trigger["metadata"]["query"]
    return query


async def test_the_keda_trigger_counts_live_jobs_through_the_active_index(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The autoscaler's query counts the interactive lane's pending and running jobs (not the batch lane's, which
    wait at the provider), reading story_jobs_active_idx and nothing else, on a plain connection like KEDA's."""
    await _fill(conn, finished=20_000, pending=80, analyze_first=False)
    await conn.execute(
        "UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(), worker_id = 'w' "
        "WHERE id IN (SELECT id FROM story_jobs WHERE status = 'pending' ORDER BY id LIMIT 20)")
    # 30 batch jobs: 10 in a batch, 20 waiting for one
    await conn.execute(
        "UPDATE story_jobs SET lane = 'batch', turn = NULL, batch_ready_at = created_at "
        "WHERE id IN (SELECT id FROM story_jobs WHERE status IN ('pending', 'running') ORDER BY id DESC LIMIT 30)")
    await conn.execute(
        "UPDATE story_jobs SET status = 'running', batch_ready_at = NULL, worker_id = 'batch-1', started_at = now(), "
        "heartbeat_at = now(), batch_id = 1 "
        "WHERE id IN (SELECT id FROM story_jobs WHERE lane = 'batch' ORDER BY id LIMIT 10)")
    await conn.execute("VACUUM ANALYZE story_jobs")
    query = _keda_query()
    cur = await conn.execute(query)
    assert await cur.fetchone() == (50,)
    cur = await conn.execute("EXPLAIN (FORMAT JSON) " + query)
    row = await cur.fetchone()
    assert row is not None
    document = row[0] if isinstance(row[0], list) else json.loads(row[0])
    (scan,) = _story_jobs_scans(document[0]["Plan"])
    assert scan in ("Index Only Scan:story_jobs_active_idx", "Index Scan:story_jobs_active_idx")


async def test_the_webhook_claim_reads_only_the_undelivered_deliveries(conn: psycopg.AsyncConnection[Any]) -> None:
    """With 20,000 delivered events behind waiting ones of three clients (one with 5,000 waiting for their
    retry), the fair delivery claim and the sweeper's outbox gauge read the partial indexes of undelivered
    rows, never the whole outbox."""
    await conn.execute("INSERT INTO api_clients (name) SELECT 'explain' || g FROM generate_series(1, 3) g")
    await conn.execute("INSERT INTO webhook_endpoints (client_id, url, events, secret) "
                       "SELECT g, 'https://hooks.example.com/in', '{job.completed}', 'whsec_x' "
                       "FROM generate_series(1, 3) g")
    await conn.execute(
        "INSERT INTO webhook_deliveries (endpoint_id, client_id, job_id, job_public_id, job_status, occurred_at, "
        "state, delivered_at, next_attempt_at) "
        "SELECT (SELECT id FROM webhook_endpoints WHERE client_id = 1 + g % 3), 1 + g % 3, g, gen_random_uuid(), "
        "'completed', now(), CASE WHEN g <= 20000 THEN 'delivered' ELSE 'pending' END, "
        "CASE WHEN g <= 20000 THEN now() END, "
        "CASE WHEN g > 20050 THEN now() + interval '1 hour' ELSE now() END "
        "FROM generate_series(1, 25050) g")
    await conn.execute("UPDATE webhook_deliveries SET client_id = 1, "
                       "endpoint_id = (SELECT id FROM webhook_endpoints WHERE client_id = 1) WHERE id > 20050")
    await conn.execute("VACUUM ANALYZE webhook_deliveries")
    allowed = {"webhook_deliveries_client_due_idx", "webhook_deliveries_in_flight_idx", "webhook_deliveries_pkey",
               "webhook_deliveries_due_idx"}
    for query, params in (("webhook_delivery_claim", {"limit": 4, "lease_s": 20.0, "max_attempts": 8}),
                          ("webhook_delivery_gauges", {"now": None})):
        plan = await _plan(conn, query, params)
        scans = [node["Node Type"] for node in _plan_nodes(plan) if node.get("Relation Name") == "webhook_deliveries"]
        # a bitmap heap scan reads what its index scan found: the indexes are what counts
        indexes = {node["Index Name"] for node in _plan_nodes(plan) if node.get("Index Name")} - {"webhook_endpoints_pkey"}
        assert scans and indexes and indexes <= allowed, (query, scans, indexes)
        assert "Seq Scan" not in scans, (query, scans)
