"""The operators' console's JSON endpoints (/ops/api), in the test's event
loop on a real Postgres: who gets in, what the lists and the overview say
against the tables, and what each action changes."""

from __future__ import annotations

import itertools
import random
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from api.ops import paging
from shared import keys, store
from shared.console_store import ConsoleStore
from sweeper.store import PgSweeperStore
from tests.support import ops_seed as seed
from tests.support.api_client import api_client, assert_problem, new_key
from tests.support.database import count
from tests.support.ops_jobs_list import OPS, every_page, expected_ids, history
from tests.support.settings import sweeper_settings


async def _status(conn: psycopg.AsyncConnection[Any], job: seed.Job) -> tuple[str, str | None, str | None]:
    cur = await conn.execute("SELECT status::text, error_code, error_text FROM story_jobs WHERE id = %s", (job.id,))
    row: tuple[str, str | None, str | None] | None = await cur.fetchone()
    assert row is not None
    return row


def _operations(document: dict[str, Any]) -> list[tuple[str, str]]:
    return [(method.upper(), path) for path, item in document["paths"].items() if path.startswith("/ops/")
            for method in item]


def _concrete(path: str, job: seed.Job, client_id: int, prefix: str) -> str:
    return (path.replace("{job_id}", str(job.public_id)).replace("{client_id}", str(client_id))
            .replace("{key_prefix}", prefix).replace("{delivery_id}", "1"))


async def test_every_ops_endpoint_answers_a_client_key_with_the_same_401_as_a_wrong_key(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A client's key, a revoked operator key, an unknown key and a malformed one all get the very same 401 on
    every documented /ops endpoint, and none of the attempted actions changes anything."""
    client_id, client_key = await seed.client(conn, "acme")
    job = await seed.insert_job(conn, seed.pending(client_id, 60))
    revoked = await seed.operator_key(conn, "gone")
    assert await ConsoleStore(conn).clients.operator_key_revoke(key_prefix=str(keys.prefix_of(revoked)))
    unknown = keys.generate().key
    prefix = str(keys.prefix_of(client_key))
    async with api_client(pool) as client:
        operations = _operations((await client.get("/schema/openapi.json")).json())
        assert len(operations) == 16, operations
        for method, path in operations:
            url = _concrete(path, job, client_id, prefix)
            body = ({"through": "x"} if method == "POST" and path.endswith("cancel-pending")
                    else {"weight": 5} if path.endswith("/weight") else None)
            answers = {}
            for name, key in (("client", client_key), ("revoked", revoked), ("unknown", unknown),
                              ("malformed", "sj_not_a_key")):
                answer = await client.request(method, url, json=body, headers={"Authorization": f"Bearer {key}"})
                assert_problem(answer, 401)
                answers[name] = (answer.json(), answer.headers["www-authenticate"])
            assert len(set(map(repr, answers.values()))) == 1, (method, path, answers)
            assert answers["client"] == ({"title": "Unauthorized", "status": 401,
                                          "detail": "the API key is not valid"},
                                         'Bearer realm="storyjobs", error="invalid_token"')
            assert_problem(await client.request(method, url, json=body), 401)
    assert await _status(conn, job) == ("pending", None, None)
    assert await count(conn, "SELECT count(*) FROM api_keys WHERE revoked_at IS NULL") == 1
    assert await count(conn, "SELECT weight FROM api_clients WHERE id = %s", client_id) == 1


async def test_an_action_is_refused_unless_the_operator_key_is_in_the_authorization_header(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The operator key in a cookie, in the query string or in a form body (what a cross-site page could make a
    browser send) gets 401 and cancels nothing; the same key in the Authorization header cancels the job."""
    client_id, _ = await seed.client(conn, "acme")
    job = await seed.insert_job(conn, seed.pending(client_id, 60))
    key = await seed.operator_key(conn)
    url = f"{OPS}/jobs/{job.public_id}/cancel"
    async with api_client(pool) as client:
        for attempt in (
            client.post(url, headers={"Cookie": f"Authorization=Bearer {key}; key={key}"}),
            client.post(f"{url}?key={key}&authorization=Bearer+{key}"),
            client.post(url, data={"Authorization": f"Bearer {key}"}),
        ):
            assert_problem(await attempt, 401)
            assert await _status(conn, job) == ("pending", None, None)
        answer = await client.post(url, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    assert await _status(conn, job) == ("failed", "cancelled", "cancelled by an operator")


async def test_the_ops_endpoints_are_documented_under_the_ops_tag_with_the_operator_key(
    pool: AsyncConnectionPool,
) -> None:
    """Every /ops/api operation carries the `ops` tag, the OperatorKey scheme and its 401; no other operation
    has the tag, and the console's page is not an operation."""
    async with api_client(pool) as client:
        document = (await client.get("/schema/openapi.json")).json()
    assert document["components"]["securitySchemes"]["OperatorKey"]["scheme"] == "bearer"
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if path.startswith("/ops/api/"):
                assert operation["tags"] == ["ops"], (method, path)
                assert operation["security"] == [{"OperatorKey": []}], (method, path)
                assert "401" in operation["responses"], (method, path)
            else:
                assert "ops" not in operation.get("tags", []), (method, path)
    assert "/ops" not in document["paths"] and "/ops/" not in document["paths"]


# -- the jobs list ---------------------------------------------------------------------


FILTERS = [
    ({}, "true", False),
    ({"status": "completed"}, "status = 'completed'", False),
    ({"status": "failed", "error_code": "llm_error"}, "status = 'failed' AND error_code = 'llm_error'", False),
    ({"error_code": "queue_timeout"}, "error_code = 'queue_timeout'", False),
    ({"client": "globex"}, "client_id = %(globex)s", False),
    ({"client": "acme", "status": "pending"}, "client_id = %(acme)s AND status = 'pending'", True),
    ({"status": "running"}, "status = 'running'", True),
    ({"window": (30, 10)}, "created_at >= now() - interval '30 hours' AND created_at < now() - interval '10 hours'",
     False),
    ({"status": "pending", "window": (1, 0)}, "status = 'pending' AND created_at >= now() - interval '1 hours'", True),
]


@pytest.mark.parametrize(("asked", "where", "live"), FILTERS, ids=[f"filter-{n}" for n in range(len(FILTERS))])
async def test_the_jobs_list_pages_through_exactly_the_matching_jobs_newest_first(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch,
    asked: dict[str, Any], where: str, live: bool,
) -> None:
    """With each request looking at only 7 ids and 3 jobs a page, following next_cursor lists every job the
    filter matches, once, newest first (live statuses by creation time), and then stops."""
    monkeypatch.setattr(paging, "SCAN_IDS", 7)
    clients = await history(conn)
    params: dict[str, Any] = {k: v for k, v in asked.items() if k in ("status", "error_code")}
    if "client" in asked:
        params["client_id"] = clients[asked["client"]]
    if "window" in asked:
        cur = await conn.execute("SELECT now()")
        row = await cur.fetchone()
        assert row is not None
        now: datetime = row[0]
        params["created_after"] = (now - timedelta(hours=asked["window"][0])).isoformat()
        if asked["window"][1]:
            params["created_before"] = (now - timedelta(hours=asked["window"][1])).isoformat()
    expected = await expected_ids(conn, where, clients, live)
    key = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        found, requests = await every_page(client, params, limit=3)
    assert expected, "the filter should match some jobs"
    assert found == expected
    if not live and "window" not in asked:
        # a stretch of 7 ids per request: the history is walked down to its first id
        assert requests >= len(await expected_ids(conn, "true", {}, False)) // 7


async def test_a_time_bound_becomes_an_id_bound_that_misses_no_job(conn: psycopg.AsyncConnection[Any]) -> None:
    """Even when created_at disagrees with the id order by up to a minute, job_id_bounds gives ids below every
    job created at or after the lower time and above every job created before the upper one."""
    client_id, _ = await seed.client(conn, "acme")
    rng = random.Random(14)
    base = datetime(2026, 1, 1, tzinfo=UTC)
    moments = [base + timedelta(seconds=10 * n + rng.uniform(-60, 60)) for n in range(300)]
    for moment in moments:
        await conn.execute(
            "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, created_at, turn) "
            "VALUES (%s, %s, '\\x00', '{}', %s, 0)", (client_id, uuid.uuid4().hex, moment))
    cur = await conn.execute("SELECT id, created_at FROM story_jobs")
    rows = await cur.fetchall()
    for probe in [base + timedelta(seconds=s) for s in (-500, 0, 7, 333, 1500, 2990, 3100, 9000)]:
        bounds = await store.job_id_bounds(conn, created_after=probe, created_before=probe)
        assert all(job_id >= bounds.lo_id for job_id, at in rows if at >= probe), probe
        assert all(job_id < bounds.hi_id for job_id, at in rows if at < probe), probe
    unbounded = await store.job_id_bounds(conn, created_after=None, created_before=None)
    assert (unbounded.lo_id, unbounded.hi_id) == (min(r[0] for r in rows), max(r[0] for r in rows) + 1)


async def test_filters_and_cursors_the_api_did_not_make_are_refused_with_400(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """An unknown status or error code, a limit out of bounds, an id past a bigint, a misspelt parameter, a
    parameter given twice, or a cursor that is not one the api gave is a 400 problem naming the field."""
    key = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        for params, field in (({"status": "lost"}, "status"), ({"error_code": "oops"}, "error_code"),
                              ({"limit": 0}, "limit"), ({"limit": 201}, "limit"), ({"cursor": "!!"}, "cursor"),
                              ({"cursor": "eyJ4IjoxfQ"}, "cursor"), ({"client_id": "acme"}, "client_id"),
                              ({"client_id": 2**63}, "client_id"), ({"stauts": "failed"}, "stauts"),
                              ({"operator": "ada"}, "operator")):
            body = assert_problem(await client.get(f"{OPS}/jobs", params=params), 400)
            assert field in str(body), (params, body)
        body = assert_problem(await client.post(f"{OPS}/cancel-pending", json={"through": "nope"}), 400)
        assert "through" in body["detail"]
        assert_problem(await client.post(f"{OPS}/cancel-pending", json={"through": "x", "status": "failed"}), 400)
        # a filter the cancel does not take is refused, not ignored: it must not cancel more than asked
        body = assert_problem(await client.get(f"{OPS}/cancel-pending", params={"status": "failed"}), 400)
        assert body["detail"] == "unknown query parameter: status"
        # nor is one of two values chosen for a filter given twice
        body = assert_problem(await client.get(f"{OPS}/cancel-pending",
                                               params=[("created_before", "junk"), ("created_before", "53419")]), 400)
        assert body["detail"] == "query parameter given more than once: created_before"
        assert_problem(await client.get(f"{OPS}/overview", params={"window": "week"}), 400)


# -- overview --------------------------------------------------------------------------


async def _scalar(conn: psycopg.AsyncConnection[Any], query: str) -> Any:
    cur = await conn.execute(query)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def test_the_overview_agrees_with_the_database(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Queue, jobs finished, failure ratio, spend, tokens, billed-but-undelivered stories and the provider's 429s
    and 529s, over the last hour and day, are what plain counts over the tables give; older history is left out.
    A request not billed adds no tokens even where it reports some, and one still open spends nothing yet (its
    job's reservation holds its worst case)."""
    acme, _ = await seed.client(conn, "acme")
    # 429s and 529s in unequal numbers, a 529 in the last hour: each counted as itself, in its window
    limited = [seed.Call("rate_limited", billed=False), seed.Call("rate_limited", billed=False),
               seed.Call("rate_limited", billed=False), seed.Call("overloaded", billed=False)]
    jobs = [
        seed.completed(acme, 3 * 86400),  # too old for either window
        seed.failed(acme, 2 * 86400, "llm_error", calls=[seed.Call("failed", cost_usd=Decimal("0.5"))]),
        seed.completed(acme, 5 * 3600, cost="0.030000"),
        seed.failed(acme, 4 * 3600, "llm_error", calls=[
            *limited, seed.Call("failed", input_tokens=10, output_tokens=20, cost_usd=Decimal("0.004"))]),
        seed.failed(acme, 3 * 3600, "cancelled"),
        seed.completed(acme, 1800),
        seed.completed(acme, 600, cost="0.025000"),
        seed.failed(acme, 300, "timed_out", calls=[seed.Call("overloaded", billed=False),
                                                   seed.Call("interrupted", output_tokens=50,
                                                             cost_usd=Decimal("0.002"))]),
        seed.failed(acme, 200, "llm_rejected",
                    calls=[seed.Call("rejected", billed=False, input_tokens=40, output_tokens=5)]),
        seed.failed(acme, 100, "cancelled"),
        seed.running(acme, 40, calls=[seed.Call("started", worst_case_usd=Decimal("0.3"))]),
        seed.pending(acme, 30),
        seed.pending(acme, 10),
    ]
    await seed.insert_jobs(conn, jobs)
    key = await seed.operator_key(conn)
    async with api_client(pool, key, queue_max=12) as client:
        answer = await client.get(f"{OPS}/overview")
    assert answer.status_code == 200, answer.text
    overview = answer.json()

    assert overview["queue"]["pending"] == 2 and overview["queue"]["running"] == 1
    assert overview["queue"]["queue_max"] == 12
    oldest = await _scalar(conn, "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM story_jobs "
                                 "WHERE status = 'pending'")
    assert overview["queue"]["oldest_pending_age_s"] == pytest.approx(oldest, abs=2)
    for window, interval in (("last_hour", "1 hour"), ("last_day", "1 day")):
        finished = f"completed_at >= now() - interval '{interval}'"
        completed = await _scalar(conn, f"SELECT count(*) FROM story_jobs WHERE status = 'completed' AND {finished}")
        failed = await _scalar(conn, f"SELECT count(*) FROM story_jobs WHERE status = 'failed' AND {finished}")
        cancelled = await _scalar(conn, f"SELECT count(*) FROM story_jobs WHERE error_code = 'cancelled' "
                                        f"AND {finished}")
        ratio = round((failed - cancelled) / (completed + failed - cancelled), 4)
        assert overview["jobs"][window] == {"completed": completed, "failed": failed, "cancelled": cancelled,
                                            "failure_ratio": ratio}, window
        sent = f"started_at >= now() - interval '{interval}'"
        spend = await _scalar(conn, f"SELECT coalesce(sum(cost_usd), 0) FROM llm_calls WHERE billed AND {sent}")
        billed = await _scalar(conn, f"SELECT count(*) FROM llm_calls WHERE billed AND {sent}")
        tokens_in = await _scalar(conn, f"SELECT coalesce(sum(input_tokens), 0) FROM llm_calls WHERE billed AND {sent}")
        tokens_out = await _scalar(conn, f"SELECT coalesce(sum(output_tokens), 0) FROM llm_calls "
                                         f"WHERE billed AND {sent}")
        assert overview["spend"][window] == {"usd": f"{spend:.6f}", "billed_calls": billed,
                                             "input_tokens": tokens_in, "output_tokens": tokens_out}, window
        billed_failures = (f"FROM story_jobs j JOIN llm_calls c ON c.job_id = j.id AND c.billed "
                           f"WHERE j.status = 'failed' AND {finished}")
        undelivered = await _scalar(conn, f"SELECT count(DISTINCT j.id) {billed_failures}")
        undelivered_usd = await _scalar(conn, f"SELECT coalesce(sum(c.cost_usd), 0) {billed_failures}")
        assert overview["undelivered"][window] == {"jobs": undelivered, "usd": f"{undelivered_usd:.6f}"}, window
        for outcome, field in (("rate_limited", "rate_limited"), ("overloaded", "overloaded")):
            found = await _scalar(conn, f"SELECT count(*) FROM llm_calls WHERE outcome = '{outcome}' AND {sent}")
            assert overview["provider"][window][field] == found, (window, outcome)
    # the figures the seed was made for, so that the comparisons above compare something
    assert overview["jobs"]["last_day"]["completed"] == 3 and overview["jobs"]["last_hour"]["completed"] == 2
    assert overview["undelivered"]["last_day"] == {"jobs": 2, "usd": "0.006000"}
    assert overview["provider"]["last_day"] == {"rate_limited": 3, "overloaded": 2}
    assert overview["provider"]["last_hour"] == {"rate_limited": 0, "overloaded": 1}
    assert overview["spend"]["last_hour"] == {"usd": "0.047000", "billed_calls": 4, "input_tokens": 600,
                                              "output_tokens": 1850}


async def test_the_history_adds_up_to_the_last_hour_from_the_rollup_the_sweeper_keeps(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """After a sweeper's rollup, /history?range=hour has 60 one-minute buckets, oldest first, whose jobs, spend
    and 429s add up to what the tables hold since the first of them, with the queue depth of the pass and wait
    and run percentiles to their bucket's bound; a day has 96 buckets of 15 minutes, a week 168 of an hour."""
    acme, _ = await seed.client(conn, "acme")
    await seed.insert_jobs(conn, [
        seed.completed(acme, 7200), seed.completed(acme, 2000, cost="0.011000"), seed.completed(acme, 400),
        seed.failed(acme, 90, "llm_error", calls=[seed.Call("rate_limited", billed=False),
                                                 seed.Call("failed", cost_usd=Decimal("0.003"))]),
        seed.pending(acme, 5), seed.pending(acme, 3),
    ])
    gauges = await PgSweeperStore(conn).queue_gauges()
    await PgSweeperStore(conn).record_minutes(sweeper_settings(sweeper_interval_s=3600.0), pending=gauges.pending,
                                              running=gauges.running)
    key = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        history = (await client.get(f"{OPS}/history", params={"range": "hour"})).json()
        day = (await client.get(f"{OPS}/history", params={"range": "day"})).json()
        week = (await client.get(f"{OPS}/history", params={"range": "week"})).json()
        wrong = await client.get(f"{OPS}/history", params={"range": "year"})
    buckets = history["buckets"]
    assert history["bucket_minutes"] == 1 and len(buckets) == 60
    starts = [datetime.fromisoformat(b["at"]) for b in buckets]
    assert all(b - a == timedelta(minutes=1) for a, b in itertools.pairwise(starts))
    since = f"'{starts[0].isoformat()}'::timestamptz"
    assert sum(b["completed"] for b in buckets) == await _scalar(
        conn, f"SELECT count(*) FROM story_jobs WHERE status = 'completed' AND completed_at >= {since}") == 2
    assert sum(b["failed"] for b in buckets) == 1
    spend = await _scalar(conn, f"SELECT sum(cost_usd) FROM llm_calls WHERE billed AND started_at >= {since}")
    assert sum(Decimal(b["spend_usd"]) for b in buckets) == spend
    assert sum(b["rate_limited"] for b in buckets) == 1
    # the pass's depth, in its minute (the last, or the one before if a minute turned since)
    assert max(b["pending_max"] for b in buckets[-2:]) == 2 and max(b["pending_max"] for b in buckets[:-2]) == 0
    # every job claimed in the hour waited 10 s (bucket 10-15 s), every one completed ran 80 s (60-90 s)
    assert history["totals"] == {"wait_p50_s": 15.0, "wait_p95_s": 15.0, "run_p50_s": 90.0, "run_p95_s": 90.0}
    assert day["bucket_minutes"] == 15 and len(day["buckets"]) == 96
    # the first pass recounted the last 25 hours (sweeper.sql, rollup_last_minute): the job of two hours ago too
    assert sum(b["completed"] for b in day["buckets"]) == 3
    assert week["bucket_minutes"] == 60 and len(week["buckets"]) == 168
    assert wrong.status_code == 400


# -- a job -----------------------------------------------------------------------------


async def test_a_jobs_page_has_its_timeline_every_ledger_attempt_and_its_story(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A job retried after a 429 and a 529 shows all three attempts with outcome, billing, tokens, cost and
    request id; a job that failed after its story was written shows the story as not delivered. The jobs list
    counts each job's requests, the billed ones, and what the ended ones cost (one still open costs nothing
    yet)."""
    acme, _ = await seed.client(conn, "acme")
    retried = seed.completed(acme, 60)
    retried.calls = [seed.Call("rate_limited", billed=False, error_text="429 Too Many Requests"),
                     seed.Call("overloaded", billed=False), *retried.calls]
    orphan = seed.failed(acme, 30, "interrupted", calls=[seed.Call("succeeded", cost_usd=Decimal("0.02"))])
    orphan.story = seed.Story("Paid For", "Nobody read it.")
    writing = seed.running(acme, 20, calls=[seed.Call("started", worst_case_usd=Decimal("0.3"))])
    await seed.insert_jobs(conn, [retried, orphan, writing])
    key = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        job = (await client.get(f"{OPS}/jobs/{retried.public_id}")).json()
        lost = (await client.get(f"{OPS}/jobs/{orphan.public_id}")).json()
        assert_problem(await client.get(f"{OPS}/jobs/{uuid.uuid4()}"), 404)
        assert_problem(await client.get(f"{OPS}/jobs/not-a-uuid"), 404)
        rows = [*(await client.get(f"{OPS}/jobs", params={"limit": 10})).json()["jobs"],
                *(await client.get(f"{OPS}/jobs", params={"status": "running"})).json()["jobs"]]
    costs = {row["job_id"]: (row["calls"], row["billed_calls"], row["cost_usd"]) for row in rows}
    assert costs == {str(retried.public_id): (3, 1, "0.020000"), str(orphan.public_id): (1, 1, "0.020000"),
                     str(writing.public_id): (1, 1, "0.000000")}
    assert job["status"] == "completed" and job["client_name"] == "acme" and job["error"] is None
    assert [(c["attempt"], c["outcome"], c["billed"]) for c in job["calls"]] == [
        (1, "rate_limited", False), (2, "overloaded", False), (3, "succeeded", True)]
    assert job["calls"][0]["error_text"] == "429 Too Many Requests"
    assert job["calls"][2]["request_id"] == retried.calls[2].request_id
    assert (job["calls"][2]["input_tokens"], job["calls"][2]["output_tokens"]) == (300, 900)
    assert job["billed_calls"] == 1 and job["cost_usd"] == "0.020000"
    assert set(job["timeline"]) == {"created_at", "claimed_at", "last_heartbeat_at", "finished_at"}
    assert job["timeline"]["created_at"] < job["timeline"]["claimed_at"] < job["timeline"]["finished_at"]
    assert job["story"]["title"] == "The Fox" and job["story"]["delivered"] is True
    assert job["request"]["prompt"] == "a fox who hums"
    assert lost["error"] == {"code": "interrupted", "message": "interrupted happened"}
    assert lost["story"]["title"] == "Paid For" and lost["story"]["delivered"] is False


# -- actions ---------------------------------------------------------------------------


async def test_cancelling_one_job_cancels_it_and_logs_who_did(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A pending and a running job of any client become failed (cancelled by an operator); a finished job is a
    409 and an unknown one a 404; the log names the operator and the key's prefix, never the key."""
    acme, _ = await seed.client(conn, "acme")
    waiting, working, done = await seed.insert_jobs(
        conn, [seed.pending(acme, 10), seed.running(acme, 20), seed.completed(acme, 30)])
    key = await seed.operator_key(conn, "ada")
    async with api_client(pool, key) as client:
        with capture_logs() as logs:
            first = await client.post(f"{OPS}/jobs/{waiting.public_id}/cancel")
            second = await client.post(f"{OPS}/jobs/{working.public_id}/cancel")
        again = await client.post(f"{OPS}/jobs/{waiting.public_id}/cancel")
        finished = await client.post(f"{OPS}/jobs/{done.public_id}/cancel")
        unknown = await client.post(f"{OPS}/jobs/{uuid.uuid4()}/cancel")
    assert first.json() == {"job_id": str(waiting.public_id), "previous_status": "pending", "status": "failed"}
    assert second.json()["previous_status"] == "running"
    for job in (waiting, working):
        assert await _status(conn, job) == ("failed", "cancelled", "cancelled by an operator")
    assert assert_problem(again, 409)["detail"] == "the job already finished (failed)"
    assert_problem(finished, 409)
    assert_problem(unknown, 404)
    assert await _status(conn, done) == ("completed", None, None)
    cancelled = [entry for entry in logs if entry["event"] == "ops.job_cancelled"]
    assert [entry["job_id"] for entry in cancelled] == [str(waiting.public_id), str(working.public_id)]
    assert all(entry["operator"] == "ada" and entry["operator_key_prefix"] == keys.prefix_of(key)
               for entry in cancelled)
    assert key not in repr(logs)


async def test_cancel_by_filter_cancels_exactly_the_pending_jobs_it_counted(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The count shown for confirmation is what the cancel cancels: acme's pending jobs, none of its running or
    finished ones, none of globex's, and none that arrived between the count and the cancel; the queue then
    admits new jobs again."""
    acme, acme_key = await seed.client(conn, "acme")
    globex, _ = await seed.client(conn, "globex")
    jobs = await seed.insert_jobs(conn, [
        seed.pending(acme, 50), seed.pending(globex, 45), seed.pending(acme, 40), seed.running(acme, 30),
        seed.completed(acme, 20), seed.pending(acme, 10),
    ])
    key = await seed.operator_key(conn, "ada")
    async with api_client(pool, key, queue_max=5) as client:
        counted = (await client.get(f"{OPS}/cancel-pending", params={"client_id": acme})).json()
        assert counted["pending"] == 3 and counted["through"]
        late = await seed.insert_job(conn, seed.pending(acme, 0))
        with capture_logs() as logs:
            done = await client.post(f"{OPS}/cancel-pending", json={"client_id": acme, "through": counted["through"]})
        assert done.status_code == 200, done.text
        nothing = (await client.get(f"{OPS}/cancel-pending", params={"client_id": globex,
                                                                      "created_before": "2000-01-01T00:00:00Z"})).json()
    expected = {str(jobs[i].public_id) for i in (0, 2, 5)}
    assert done.json()["cancelled"] == 3 and set(done.json()["job_ids"]) == expected
    for job in jobs:
        status = await _status(conn, job)
        if str(job.public_id) in expected:
            assert status == ("failed", "cancelled", "cancelled by an operator")
        else:
            assert status[0] in ("pending", "running", "completed") and status[1] is None
    assert await _status(conn, late) == ("pending", None, None)
    assert nothing == {"pending": 0, "through": None}
    [entry] = [entry for entry in logs if entry["event"] == "ops.pending_cancelled"]
    assert entry["cancelled"] == 3 and entry["operator_key_prefix"] == keys.prefix_of(key)
    # 2 pending now (globex's and the late one): QUEUE_MAX 5 admits the next three, as the bound is kept
    async with api_client(pool, acme_key, queue_max=5) as client:
        for _ in range(3):
            answer = await client.post("/stories/generate", json={"prompt": "again"}, headers=new_key())
            assert answer.status_code == 202, answer.text


async def test_cancel_by_filter_takes_the_time_range(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Pending jobs created inside the range are cancelled; those before and after it are not."""
    acme, _ = await seed.client(conn, "acme")
    old, inside, new = await seed.insert_jobs(conn, [seed.pending(acme, 3000), seed.pending(acme, 1500),
                                                     seed.pending(acme, 100)])
    now = await _scalar(conn, "SELECT now()")
    window = {"created_after": (now - timedelta(seconds=2000)).isoformat(),
              "created_before": (now - timedelta(seconds=1000)).isoformat()}
    key = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        counted = (await client.get(f"{OPS}/cancel-pending", params=window)).json()
        done = (await client.post(f"{OPS}/cancel-pending", json={**window, "through": counted["through"]})).json()
    assert counted["pending"] == 1 and done["job_ids"] == [str(inside.public_id)]
    assert (await _status(conn, old))[0] == (await _status(conn, new))[0] == "pending"


async def test_revoking_a_clients_keys_refuses_their_next_requests(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Revoking a client's keys revokes each of its active keys (its next request is a 401) and no one else's;
    one key can be revoked by prefix; unknown clients and keys are 404; the log names the operator."""
    acme, first = await seed.client(conn, "acme")
    second = (await keys.create(conn, "acme")).key
    globex, globex_key = await seed.client(conn, "globex")
    spare = (await keys.create(conn, "globex")).key
    key = await seed.operator_key(conn, "ada")
    async with api_client(pool, key) as client:
        listed = (await client.get(f"{OPS}/clients")).json()["clients"]
        with capture_logs() as logs:
            revoked = await client.post(f"{OPS}/clients/{acme}/revoke-keys")
            one = await client.post(f"{OPS}/keys/{keys.prefix_of(spare)}/revoke")
        assert_problem(await client.post(f"{OPS}/keys/{keys.prefix_of(spare)}/revoke"), 404)
        assert_problem(await client.post(f"{OPS}/keys/{keys.prefix_of(key)}/revoke"), 404)
        assert_problem(await client.post(f"{OPS}/clients/999999/revoke-keys"), 404)
        again = (await client.post(f"{OPS}/clients/{acme}/revoke-keys")).json()
    assert [c["name"] for c in listed] == ["acme", "globex"]
    assert [k["key_prefix"] for k in listed[0]["keys"]] == [keys.prefix_of(first), keys.prefix_of(second)]
    first_prefix, second_prefix = keys.prefix_of(first), keys.prefix_of(second)
    assert first_prefix is not None and second_prefix is not None
    assert sorted(revoked.json()["revoked"]) == sorted([first_prefix, second_prefix])
    assert one.json() == {"revoked": [keys.prefix_of(spare)]}
    assert again == {"revoked": []}
    for old in (first, second, spare):
        async with api_client(pool, old) as client:
            assert_problem(await client.get(f"/stories/jobs/{uuid.uuid4()}"), 401)
    async with api_client(pool, globex_key) as client:
        assert (await client.get(f"/stories/jobs/{uuid.uuid4()}")).status_code == 404
    events = {entry["event"]: entry for entry in logs}
    assert events["ops.client_keys_revoked"]["client_id"] == acme
    assert events["ops.key_revoked"]["operator"] == "ada"
    assert globex


async def test_the_clients_screen_lists_a_client_without_keys_and_no_client_at_all(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """With no client yet the clients screen lists none; a client made without a key is listed with no keys,
    beside one with a key, by name."""
    key = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        before = (await client.get(f"{OPS}/clients")).json()["clients"]
        keyless = await store.api_client_upsert(conn, name="keyless")
        _, acme_key = await seed.client(conn, "acme")
        after = (await client.get(f"{OPS}/clients")).json()["clients"]
    assert before == []
    assert [(c["name"], [k["key_prefix"] for k in c["keys"]]) for c in after] == [
        ("acme", [keys.prefix_of(acme_key)]), ("keyless", [])]
    assert after[1]["client_id"] == keyless


async def test_the_overview_shows_todays_budget_and_the_shared_rate_bucket(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Today's spend and reservations against BUDGET_USD_PER_DAY, and what the shared bucket of LLM_MODEL holds
    (refilled to now, capped at its capacity) and how long it is paused, are the tables' own figures."""
    await conn.execute("INSERT INTO budget_days (client_id, day, spent_usd, reserved_usd) "
                       "VALUES (0, (now() AT TIME ZONE 'UTC')::date, 1.25, 0.75)")
    # refilled_at ahead of now: nothing refills while the test runs, however slow the machine
    await conn.execute("INSERT INTO llm_rate_buckets (model, requests, output_tokens, refilled_at, paused_until) "
                       "VALUES ('claude-sonnet-5-5', 3, 100, now() + interval '1 hour', now() + interval '20 seconds')")
    key = await seed.operator_key(conn)
    async with api_client(pool, key, budget_usd_per_day=Decimal("5"), llm_requests_per_minute=60,
                          llm_output_tokens_per_minute=60_000) as client:
        overview = (await client.get(f"{OPS}/overview")).json()
        await conn.execute("UPDATE llm_rate_buckets SET refilled_at = now() - interval '1 second'")
        refilled = (await client.get(f"{OPS}/overview")).json()["provider"]["limiter"]
        await conn.execute("UPDATE llm_rate_buckets SET refilled_at = now() - interval '1 hour'")
        full = (await client.get(f"{OPS}/overview")).json()["provider"]["limiter"]
    assert overview["spend"]["today"] == {"spent_usd": "1.250000", "reserved_usd": "0.750000",
                                          "budget_usd": "5.000000", "left_usd": "3.000000"}
    limiter = overview["provider"]["limiter"]
    assert limiter["model"] == "claude-sonnet-5-5" and 15 < limiter["paused_s"] <= 20
    assert limiter["input_tokens"] is None
    # capacity: LLM_RATE_BURST_S (5 s) of refill less IN_FLIGHT_S (a quarter second)
    assert limiter["requests"] == {"available": 3.0, "capacity": 4.75, "per_minute": 60.0}
    assert limiter["output_tokens"] == {"available": 100.0, "capacity": 4750.0, "per_minute": 60_000.0}
    # a second and more of refill at 1 request and 1,000 tokens a second; an hour's, capped at capacity
    assert refilled["requests"]["available"] >= 4 and refilled["output_tokens"]["available"] >= 1100
    assert full["requests"]["available"] == 4.75 and full["output_tokens"]["available"] == 4750


async def test_an_operator_sets_a_clients_weight_and_the_list_shows_it(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A client's weight (1 by default) is set from the console and listed with the client; a weight outside
    1 to 1,000 is a 400 and changes nothing, an unknown client a 404; the log names the operator."""
    acme, _ = await seed.client(conn, "acme")
    await seed.client(conn, "globex")
    async with api_client(pool, await seed.operator_key(conn, "ada")) as client:
        before = {c["name"]: c["weight"] for c in (await client.get(f"{OPS}/clients")).json()["clients"]}
        with capture_logs() as logs:
            assert (await client.put(f"{OPS}/clients/{acme}/weight", json={"weight": 4})).json() == {"weight": 4}
        for refused in ({"weight": 0}, {"weight": 1001}, {"weight": 2.5}, {}):
            assert_problem(await client.put(f"{OPS}/clients/{acme}/weight", json=refused), 400)
        assert_problem(await client.put(f"{OPS}/clients/999999/weight", json={"weight": 2}), 404)
        after = {c["name"]: c["weight"] for c in (await client.get(f"{OPS}/clients")).json()["clients"]}
    assert before == {"acme": 1, "globex": 1} and after == {"acme": 4, "globex": 1}
    (event,) = [e for e in logs if e["event"] == "ops.client_weight_set"]
    assert (event["client_id"], event["weight"], event["operator"]) == (acme, 4, "ada")


async def test_the_clients_screen_counts_each_clients_jobs_made_today_and_its_failures_among_them(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Each client's jobs created today (UTC), however they were made (admitted through the api or written as
    history), and its failures among them (cancellations aside; yesterday's left out), are what a count of the
    jobs themselves says, before and after an operator cancels one and a job of today fails."""
    acme, acme_key = await seed.client(conn, "acme")
    globex, _ = await seed.client(conn, "globex")
    await seed.client(conn, "initech")
    cur = await conn.execute("SELECT extract(epoch FROM now() - (date_trunc('day', now() AT TIME ZONE 'UTC') "
                             "AT TIME ZONE 'UTC'))::float8")
    row = await cur.fetchone()
    assert row is not None
    today_s: float = row[0]
    jobs = []
    for n in range(30):
        owner = acme if n % 3 else globex
        # ten of them today, in its first nine tenths; the others yesterday, before its last hour
        created = today_s * (n + 1) / 11 if n < 10 else today_s + 3600 * (n - 8)
        made = (seed.failed(owner, 0, "cancelled" if n % 4 == 1 else "llm_error") if n % 2
                else seed.completed(owner, 0) if n % 5 else seed.running(owner, 0))
        jobs.append(replace(made, created_ago_s=created, started_ago_s=None if made.started_ago_s is None
                            else created * 0.9, completed_ago_s=None if made.completed_ago_s is None
                            else created * 0.8))
    pending = seed.pending(globex, today_s / 20)
    # a failure of tomorrow's first minute (a clock ahead), counted on neither side of today
    tomorrow = replace(seed.failed(acme, 0, "llm_error"), created_ago_s=today_s - 86_460, started_ago_s=None,
                       completed_ago_s=today_s - 86_470)
    await seed.insert_jobs(conn, [*jobs, pending, tomorrow])
    async with api_client(pool, acme_key) as client:
        for n in range(3):
            posted = await client.post("/stories/generate", json={"prompt": f"a fox {n}"},
                                       headers=new_key())
            assert posted.status_code == 202, posted.text

    async def screen() -> dict[int, tuple[int, int]]:
        async with api_client(pool, await seed.operator_key(conn)) as client:
            listed = (await client.get(f"{OPS}/clients")).json()["clients"]
        return {c["client_id"]: (c["today"]["jobs"], c["today"]["failed"]) for c in listed}

    async def counted() -> dict[int, tuple[int, int]]:
        cur = await conn.execute(
            "SELECT c.id, count(j.id)::int, (count(j.id) FILTER (WHERE j.status = 'failed' "
            "AND j.error_code IS DISTINCT FROM 'cancelled'))::int FROM api_clients c LEFT JOIN story_jobs j "
            "ON j.client_id = c.id AND budget_day(j.created_at) = budget_day(now()) GROUP BY c.id")
        return {row[0]: (row[1], row[2]) for row in await cur.fetchall()}

    before = await counted()
    assert await screen() == before
    assert before[acme][0] == 9 and before[globex][0] == 5 and before[acme][1] + before[globex][1] > 0
    assert sum(jobs for jobs, _ in before.values()) < await count(conn, "SELECT count(*) FROM story_jobs")
    async with api_client(pool, await seed.operator_key(conn)) as client:
        cancelled = await client.post(f"{OPS}/jobs/{pending.public_id}/cancel")
        assert cancelled.status_code == 200, cancelled.text
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'llm_error', completed_at = now() "
                       "WHERE client_id = %s AND status = 'running' AND created_at >= date_trunc('day', now() "
                       "AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'", (globex,))
    after = await counted()
    assert after != before
    assert await screen() == after

