"""A large history must not change what the services' statements cost: their
connections never JIT-compile, whatever the planner estimates after an
ANALYZE taken during a backlog or over millions of finished rows; reads by
time read their range through an index; the rollup recounts from its last
pass; and what holds VACUUM back (an open snapshot) is seen and warned of."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from api.rows import Admission
from api.store import ApiStore
from shared import db, migrate, store
from shared.console_stats import snapshot_warning
from shared.queries import QUERIES
from shared.rows import SnapshotAges
from sweeper import metrics as sweeper_metrics
from sweeper.store import PgSweeperStore
from sweeper.sweep import Sweeper
from tests.support import ops_seed as seed
from tests.support import postgres_server, private_postgres
from tests.support.api_client import api_client
from tests.support.pgbouncer import PgBouncer
from tests.support.settings import sweeper_settings


class FakeClock:
    def __call__(self) -> float:
        return 1000.0


async def _jit_of_a_new_connection(url: str) -> str:
    """What a connection that sends no startup options (as through a pooler) runs with."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as fresh:
        cur = await fresh.execute("SHOW jit")
        row = await cur.fetchone()
        assert row is not None
        return str(row[0])


async def test_migrate_turns_jit_off_for_direct_and_pooled_connections(
    conn: psycopg.AsyncConnection[Any], database_url: str, database_name: str, pgbouncer: PgBouncer
) -> None:
    """A database copied without its settings compiles again until `storyjobs migrate` runs; after it, a plain
    connection, a pool as the services build it, and one through a transaction pooler all run with jit off."""
    assert await _jit_of_a_new_connection(database_url) == "on"
    await migrate.migrate(conn)
    assert await _jit_of_a_new_connection(database_url) == "off"
    for url, pooler in ((database_url, "none"), (pgbouncer.url(database_name), "transaction")):
        pool = db.make_pool(url, application_name="storyjobs-test", connect_timeout_s=5, statement_timeout_s=30,
                            min_size=1, max_size=1, wait_timeout_s=10, generic_plans=True,
                            pooler=pooler)  # type: ignore[arg-type]
        async with pool, pool.connection() as pooled:
            cur = await pooled.execute("SHOW jit")
            assert await cur.fetchone() == ("off",), pooler


async def test_a_direct_connection_runs_without_jit_on_a_database_that_lost_its_settings(
    database_url: str,
) -> None:
    """A database restored without its settings still never compiles a direct connection's statements: the
    services' direct connections ask for jit off themselves."""
    assert await _jit_of_a_new_connection(database_url) == "on"
    async with await db.connect(database_url, application_name="storyjobs-test", connect_timeout_s=5) as direct:
        cur = await direct.execute("SHOW jit")
        assert await cur.fetchone() == ("off",)


async def test_a_role_that_does_not_own_the_database_sets_jit_off_for_itself(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Migrating as a role that cannot ALTER DATABASE sets jit off for that role in this database, and says so."""
    role = f"storyjobs_not_owner_{os.getpid()}"
    await conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    heard: list[str] = []
    conn.add_notice_handler(lambda notice: heard.append(notice.message_primary or ""))
    try:
        await conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
        await store.database_settings_keep(conn)
        await conn.execute("RESET ROLE")
        cur = await conn.execute(
            "SELECT r.rolname, s.setconfig FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole "
            "WHERE s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())")
        assert await cur.fetchall() == [(role, ["jit=off"])]
        assert any(f"jit = off set for role {role} only" in line for line in heard), heard
    finally:
        await conn.execute("RESET ROLE")
        await conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


async def _statistics_taken_during_a_backlog(conn: psycopg.AsyncConnection[Any], *, finished: int,
                                             backlog: int) -> int:
    """`finished` failed jobs, then `backlog` pending ones of one client, ANALYZE while they wait, then the
    backlog drained: the statistics still say `backlog` jobs wait. Returns the client's id."""
    await conn.execute("INSERT INTO api_clients (name) SELECT 'history ' || g FROM generate_series(1, 100) g")
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, error_code, "
        "completed_at) SELECT 1 + g %% 100, 'f' || g, '\\x00', '{\"prompt\": \"x\"}', 'failed', 'cancelled', now() "
        "FROM generate_series(1, %s) g", (finished,))
    await _analyze_under_a_backlog(conn, backlog=backlog, keys="p")
    return 1


async def _analyze_under_a_backlog(conn: psycopg.AsyncConnection[Any], *, backlog: int, keys: str) -> None:
    """`backlog` pending jobs of client 1 (Idempotency-Keys `keys` || n), VACUUM ANALYZE while they wait, then
    the backlog drained."""
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn) "
        "SELECT 1, %s || g, '\\x00', '{\"prompt\": \"x\"}', g FROM generate_series(1, %s) g", (keys, backlog))
    await conn.execute("VACUUM ANALYZE story_jobs")
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', completed_at = now() "
                       "WHERE status = 'pending'")


def _admission(client_id: int, key: str) -> Admission:
    return Admission(client_id=client_id, idempotency_key=key, request_fingerprint=b"\x00",
                     request_json='{"prompt": "x"}', max_tokens=100, input_tokens_estimate=10,
                     worst_case_usd=Decimal("0.001"), model="m", input_usd_per_mtok=Decimal(1),
                     output_usd_per_mtok=Decimal(1))


async def test_admission_never_compiles_after_statistics_taken_during_a_backlog(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """With statistics that still count a drained backlog of 5,000, the admission statement is estimated past
    jit_above_cost and a connection with jit on compiles it; the api's admission runs it without JIT and on
    partial indexes only, on the same connection."""
    cur = await conn.execute("SELECT pg_jit_available()")
    if await cur.fetchone() != (True,):
        pytest.skip("this Postgres cannot JIT-compile (built without LLVM), so nothing here could compile")
    client = await _statistics_taken_during_a_backlog(conn, finished=50_000, backlog=5_000)
    # this database is a copy without its settings: jit is on here, as on a restored database
    plans = await _plans_logged(conn, analyze=True)
    params = {"requests": json.dumps([{"ord": 0, "client_id": client, "idempotency_key": "bare",
                                       "request_fingerprint": "00", "lane": "interactive", "request": {"prompt": "x"},
                                       "worst_case_usd": 0, "max_tokens": 10, "input_tokens_estimate": 1,
                                       "model": "m", "input_usd_per_mtok": 1, "output_usd_per_mtok": 1}]),
              "queue_max": 5000, "client_queue_max": 5000, "batch_queue_max": 5000, "client_batch_queue_max": 5000,
              "budget_usd": None, "client_budget_usd": None}
    async with conn.transaction(force_rollback=True):
        await conn.execute(QUERIES["job_insert_if_admitted"], params)
    (bare,) = plans
    assert bare["Plan"]["Total Cost"] > 100_000 and "JIT" in bare, "the statistics no longer mislead the planner"
    plans.clear()
    (result,) = await ApiStore(conn).job_insert_if_admitted(admissions=[_admission(client, "kept")],
                                                            queue_max=5000, client_queue_max=5000)
    assert result.outcome == "inserted"
    admission = [p for p in plans if "story_jobs" in json.dumps(p["Plan"])]
    assert admission, plans
    for plan in admission:
        assert "JIT" not in plan
        seq_scanned = {n.get("Relation Name") for n in _nodes(plan["Plan"]) if n["Node Type"] == "Seq Scan"}
        assert "story_jobs" not in seq_scanned


async def test_admission_runs_its_connections_one_plan_whatever_the_statistics(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Each admission on a connection runs the plan the connection made for it (a generic plan), from its first,
    after statistics taken during a backlog as before them: left to the cost estimates, Postgres plans the first
    five executions anew, and later ones whenever the statistics make the kept plan look dearer."""
    client = await _statistics_taken_during_a_backlog(conn, finished=2_000, backlog=500)
    conn.prepare_threshold = 0
    store = ApiStore(conn)
    for n in range(4):
        (result,) = await store.job_insert_if_admitted(admissions=[_admission(client, f"before-{n}")],
                                                       queue_max=5000, client_queue_max=5000)
        assert result.outcome == "inserted"
    await _analyze_under_a_backlog(conn, backlog=500, keys="again-")
    for n in range(4):
        (result,) = await store.job_insert_if_admitted(admissions=[_admission(client, f"after-{n}")],
                                                       queue_max=5000, client_queue_max=5000)
        assert result.outcome == "inserted"
    cur = await conn.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                             "WHERE statement LIKE '%keys_recorded AS (%' AND statement NOT LIKE '%pg_prepared%'")
    assert await cur.fetchall() == [(8, 0)]


async def _plans_logged(conn: psycopg.AsyncConnection[Any], *, analyze: bool = False) -> list[dict[str, Any]]:
    """auto_explain on conn: the list it returns gets each statement's plan (JSON, with its run's figures
    when analyze) as the statements run."""
    plans: list[dict[str, Any]] = []

    def heard(notice: psycopg.errors.Diagnostic) -> None:
        text = notice.message_primary or ""
        if text.startswith("duration:") and "{" in text:
            plans.append(json.loads(text[text.index("{"):]))

    conn.add_notice_handler(heard)
    for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                    f"SET auto_explain.log_analyze = {'on' if analyze else 'off'}",
                    "SET auto_explain.log_format = json", "SET auto_explain.log_level = notice"):
        await conn.execute(setting)
    return plans


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found.extend(_nodes(child))
    return found


async def _ledger_of_a_month(conn: psycopg.AsyncConnection[Any], rows: int) -> None:
    """`rows` ended ledger rows spread evenly over the last 30 days, written in a shuffled order, as rows land
    in free space left on old pages."""
    await conn.execute(
        "INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at, finished_at, outcome, "
        "input_tokens, output_tokens, cost_usd) "
        "SELECT g, 1, 'w' || g %% 7, 'offline', 'm', now() - (g * interval '30 days') / %(rows)s, "
        "now() - (g * interval '30 days') / %(rows)s + interval '80 seconds', 'succeeded', 300, 900, 0.02 "
        "FROM generate_series(1, %(rows)s) g ORDER BY random()", {"rows": rows})
    await conn.execute("VACUUM ANALYZE llm_calls")


async def test_every_read_of_the_ledger_by_time_reads_its_range_on_the_started_at_index(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The rollup, the overview (and `storyjobs stats`), the workers screen and the writers list read the ledger
    through llm_calls_started_at_idx, for the hour or the day they show, never the whole month it holds."""
    await _ledger_of_a_month(conn, 60_000)
    now_minute = "date_trunc('minute', now())"
    cur = await conn.execute(f"SELECT {now_minute} - interval '3 minutes'")
    row = await cur.fetchone()
    assert row is not None
    reads: list[tuple[str, dict[str, Any]]] = [
        ("rollup_minutes", {"from_minute": row[0], "from_id": 1, "ending_from_id": 1, "bounds_s": [1.0, 2.0],
                            "pending": 0, "running": 0}),
        ("ops_overview", {"day_from_id": 1}),
        ("ops_workers", {}),
        ("ops_writers_recent", {}),
    ]
    for query, params in reads:
        cur = await conn.execute("EXPLAIN (FORMAT JSON) " + QUERIES[query], params)
        row = await cur.fetchone()
        assert row is not None
        ledger_scans = [n for n in _nodes(row[0][0]["Plan"]) if n.get("Relation Name") == "llm_calls"
                        or n.get("Index Name", "").startswith("llm_calls")]
        by_time = [n for n in ledger_scans if "started_at" in n.get("Index Cond", "")]
        assert by_time and all(n["Index Name"] == "llm_calls_started_at_idx" for n in by_time), (query, ledger_scans)
        assert not any(n["Node Type"] == "Seq Scan" for n in ledger_scans), query


async def test_a_pass_after_an_outage_fills_the_minutes_the_sweeper_missed(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The last pass wrote two hours ago; a job finished an hour ago lands in its minute at the next pass,
    which reads the ledger and the jobs from that last minute on, not the whole history."""
    acme, _ = await seed.client(conn, "acme")
    await seed.insert_jobs(conn, [seed.completed(acme, 3600), seed.completed(acme, 60)])
    await conn.execute("INSERT INTO minute_rollup (minute, jobs_from_id) "
                       "VALUES (date_trunc('minute', now()) - interval '2 hours', 1)")
    await PgSweeperStore(conn).record_minutes(sweeper_settings(sweeper_interval_s=30.0), pending=0, running=0)
    cur = await conn.execute(
        "SELECT sum(completed), sum(spend_usd), count(*) FROM minute_rollup "
        "WHERE minute >= date_trunc('minute', now()) - interval '2 hours'")
    assert await cur.fetchone() == (2, Decimal("0.040000"), 121)


async def test_a_pass_after_an_outage_fills_the_minutes_missed_since_a_rollup_from_before_migration_24(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The last pass, by a sweeper from before migration 024 (its rows without jobs_from_id), wrote two days ago:
    the next pass recounts from that minute, not only the last 25 hours, so every minute since holds its jobs, one
    finished 30 hours ago among them."""
    acme, _ = await seed.client(conn, "acme")
    await seed.insert_jobs(conn, [seed.completed(acme, 30 * 3600), seed.completed(acme, 60)])
    await conn.execute("INSERT INTO minute_rollup (minute, completed) "
                       "VALUES (date_trunc('minute', now()) - interval '2 days', 0)")
    await PgSweeperStore(conn).record_minutes(sweeper_settings(sweeper_interval_s=30.0), pending=0, running=0)
    # no minute missing between the one two days ago and now's
    cur = await conn.execute("SELECT sum(completed), count(*) = extract(epoch FROM max(minute) - min(minute)) / 60 + 1 "
                             "FROM minute_rollup")
    assert await cur.fetchone() == (2, True)


async def test_a_snapshot_held_open_shows_its_age_in_the_gauges_and_a_warning_in_the_console(
    conn: psycopg.AsyncConnection[Any], database_url: str, pool: AsyncConnectionPool,
) -> None:
    """A session left in a transaction with its snapshot: the sweeper's gauges show its age and the console's
    overview warns once it passes XMIN_HORIZON_WARN_S; after it ends, nothing is held and nothing warns."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder:
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.execute("SELECT count(*) FROM story_jobs")
        # the database's clock moves on while the snapshot stays held
        await conn.execute("SELECT pg_sleep(0.2)")
        sweeper = Sweeper(sweeper_settings(), PgSweeperStore(pool), clock=FakeClock())
        await sweeper.sweep_once()
        assert sweeper_metrics.SNAPSHOT_AGES_KNOWN._value.get() == 1
        assert sweeper_metrics.OLDEST_SNAPSHOT_AGE._value.get() >= 0.2
        assert sweeper_metrics.OLDEST_TRANSACTION_AGE._value.get() >= 0.2
        key = await seed.operator_key(conn)
        async with api_client(pool, key, xmin_horizon_warn_s=0.1) as client:
            held = (await client.get("/ops/api/overview")).json()["snapshots"]
        assert held["known"] and held["oldest_snapshot_age_s"] >= 0.2 and held["warn_after_s"] == 0.1
        assert held["warning"].startswith("a transaction or snapshot has been open for")
        async with api_client(pool, key) as client:
            assert (await client.get("/ops/api/overview")).json()["snapshots"]["warning"] is None
        await holder.execute("COMMIT")
    await sweeper.sweep_once()
    assert sweeper_metrics.OLDEST_SNAPSHOT_AGE._value.get() == 0
    ages = await store.database_snapshot_ages(conn)
    assert ages.known and ages.oldest_snapshot_age_s is None


async def test_without_pg_monitor_the_snapshot_ages_are_unknown(conn: psycopg.AsyncConnection[Any]) -> None:
    """A role that cannot read other roles' sessions gets `known` false, and the console no warning."""
    role = f"storyjobs_no_monitor_{os.getpid()}"
    await conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    try:
        await conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
        ages = await store.database_snapshot_ages(conn)
        await conn.execute("RESET ROLE")
        assert not ages.known
        assert snapshot_warning(ages, 0.001) is None
        await conn.execute(sql.SQL("GRANT pg_monitor TO {}").format(sql.Identifier(role)))
        await conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
        assert (await store.database_snapshot_ages(conn)).known
    finally:
        await conn.execute("RESET ROLE")
        await conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_the_oldest_transaction_counts_a_prepared_transaction_of_this_database_and_none_of_another() -> None:
    """A prepared transaction holds VACUUM back until it is committed or rolled back, with no session open: the
    oldest transaction's age counts this database's and not another database's. Prepared transactions are off
    by default (max_prepared_transactions = 0), so this runs on a private server that allows them."""
    bindirs = private_postgres.server_bindirs()
    if not bindirs:
        pytest.skip("no Postgres server binaries (initdb) on this machine")
    with private_postgres.private_server(bindirs[0], settings={"max_prepared_transactions": "2"},
                                         what="a Postgres that allows prepared transactions") as server:
        ours = postgres_server.create_migrated_database(server.url, "storyjobs")
        elsewhere = postgres_server.create_migrated_database(server.url, "elsewhere")

        def prepare(url: str, name: str) -> None:
            with psycopg.connect(url, autocommit=True) as held:
                held.execute("BEGIN")
                held.execute("SELECT pg_current_xact_id()")
                held.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(name)))

        async def ages() -> SnapshotAges:
            async with await psycopg.AsyncConnection.connect(ours, autocommit=True) as conn:
                return await store.database_snapshot_ages(conn)

        prepare(elsewhere, "elsewhere")
        try:
            assert asyncio.run(ages()).oldest_transaction_age_s is None
            prepare(ours, "ours")
            try:
                age = asyncio.run(ages()).oldest_transaction_age_s
                assert age is not None and 0 <= age < 60
            finally:
                with psycopg.connect(ours, autocommit=True) as conn:
                    conn.execute("ROLLBACK PREPARED 'ours'")
            assert asyncio.run(ages()).oldest_transaction_age_s is None
        finally:
            with psycopg.connect(elsewhere, autocommit=True) as conn:
                conn.execute("ROLLBACK PREPARED 'elsewhere'")


async def test_every_read_of_the_jobs_by_time_reads_an_id_range_on_the_primary_key(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """With 60,000 finished jobs over a month, the overview and the rollup reach jobs only through the primary
    key from the id that job_id_bounds found for their window, and the clients' today through the failed jobs'
    index from that id (the day's jobs are counted as they are made); the history reads the rollup alone
    (eight days of minutes at most, whatever the jobs)."""
    await conn.execute("INSERT INTO api_clients (name) SELECT 'c' || g FROM generate_series(1, 10) g")
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, error_code, "
        "completed_at, created_at) SELECT 1 + g % 10, 'k' || g, '\\x00', '{\"prompt\": \"x\"}', 'failed', "
        "CASE WHEN g % 20 = 0 THEN 'llm_error' ELSE 'cancelled' END, now() - (60000 - g) * interval '43 seconds', "
        "now() - (60000 - g) * interval '43 seconds' "
        "FROM generate_series(1, 60000) g")
    await conn.execute("INSERT INTO minute_rollup (minute) SELECT generate_series(date_trunc('minute', now()) "
                       "- interval '8 days', date_trunc('minute', now()), interval '1 minute')")
    await conn.execute("VACUUM ANALYZE")
    day_ago = await store.job_id_bounds(conn, created_after=datetime.now(UTC) - timedelta(days=1, hours=1),
                                        created_before=None)
    assert 57_000 < day_ago.lo_id < 58_100
    reads: list[tuple[str, dict[str, Any]]] = [
        ("ops_overview", {"day_from_id": day_ago.lo_id}),
        ("ops_client_today", {"from_id": day_ago.lo_id, "day_start": datetime.now(UTC) - timedelta(days=1)}),
        ("rollup_minutes", {"from_minute": datetime.now(UTC) - timedelta(minutes=3), "from_id": day_ago.lo_id,
                            "ending_from_id": day_ago.lo_id, "bounds_s": [1.0, 2.0], "pending": 0, "running": 0}),
        ("ops_history", {"since": datetime.now(UTC) - timedelta(days=7), "step": timedelta(hours=1),
                         "origin": datetime.now(UTC)}),
    ]
    for query, params in reads:
        cur = await conn.execute("EXPLAIN (FORMAT JSON) " + QUERIES[query], params)
        row = await cur.fetchone()
        assert row is not None
        nodes = _nodes(row[0][0]["Plan"])
        if query == "ops_history":
            assert {n.get("Relation Name") for n in nodes} - {None} == {"minute_rollup"}
            continue
        assert not [n for n in nodes if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "story_jobs"], query
        index = "story_jobs_failed_idx" if query == "ops_client_today" else "story_jobs_pkey"
        by_id = [n for n in nodes if n.get("Index Name") == index and "id >=" in n.get("Index Cond", "")]
        assert by_id, (query, [(n["Node Type"], n.get("Index Name")) for n in nodes])


async def test_a_call_that_ends_long_after_its_minute_is_counted_in_the_history_once_its_job_ends(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A call started six minutes before its job ends (past the passes' recount window, 3 minutes here) adds its
    charge to the minute it started at the first pass after the job's end; the minutes' job counts stay."""
    acme, _ = await seed.client(conn, "acme")
    (job,) = await seed.insert_jobs(conn, [seed.running(acme, 360)])
    settings = sweeper_settings(sweeper_interval_s=30.0)
    await PgSweeperStore(conn).record_minutes(settings, pending=0, running=1)
    started = "(SELECT date_trunc('minute', started_at) FROM llm_calls)"
    cur = await conn.execute(f"SELECT spend_usd FROM minute_rollup WHERE minute = {started}")
    assert (await cur.fetchone() or (0,))[0] == 0
    await conn.execute("UPDATE llm_calls SET outcome = 'succeeded', finished_at = now(), cost_usd = 0.5, "
                       "input_tokens = 10, output_tokens = 20")
    await conn.execute("UPDATE story_jobs SET status = 'completed', completed_at = now(), "
                       "story_id = gen_random_uuid() WHERE id = %s", (job.id,))
    await PgSweeperStore(conn).record_minutes(settings, pending=0, running=0)
    cur = await conn.execute(f"SELECT spend_usd, completed FROM minute_rollup WHERE minute = {started}")
    assert await cur.fetchone() == (Decimal("0.500000"), 0)
    cur = await conn.execute("SELECT sum(completed), sum(spend_usd) FROM minute_rollup")
    assert await cur.fetchone() == (1, Decimal("0.500000"))


async def test_a_call_that_ends_after_its_job_was_counted_ended_is_recounted_by_the_next_pass(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A batch job cancelled while its request was out: the rollup counts the request open (billed, nothing
    spent yet) once the job has ended. When its result is read later, in a transaction of its own, the next pass
    recounts the minute the request started, so the history and the overview have its charge and tokens."""
    acme, _ = await seed.client(conn, "acme")
    (job,) = await seed.insert_jobs(conn, [seed.Job(
        client_id=acme, status="failed", error_code="cancelled", created_ago_s=2000, started_ago_s=1900,
        completed_ago_s=600, calls=[seed.Call("started", started_ago_s=1800)])])
    await conn.execute("UPDATE story_jobs SET lane = 'batch' WHERE id = %s", (job.id,))
    settings = sweeper_settings(sweeper_interval_s=30.0)
    await PgSweeperStore(conn).record_minutes(settings, pending=0, running=0)
    started = f"(SELECT date_trunc('minute', started_at) FROM llm_calls WHERE job_id = {job.id})"
    cur = await conn.execute(f"SELECT spend_usd, ended_billed_calls FROM minute_rollup WHERE minute = {started}")
    assert await cur.fetchone() == (0, 1)
    # a request closed in the transaction that ends its job marks nothing: the job's end has its minutes recounted
    (ending,) = await seed.insert_jobs(conn, [seed.running(acme, 300)])
    async with conn.transaction():
        await conn.execute("UPDATE story_jobs SET status = 'completed', completed_at = now(), "
                           "story_id = gen_random_uuid() WHERE id = %s", (ending.id,))
        await conn.execute("UPDATE llm_calls SET outcome = 'succeeded', finished_at = now(), cost_usd = 0.25 "
                           "WHERE job_id = %s", (ending.id,))
    cur = await conn.execute("SELECT count(*) FROM minute_rollup_stale")
    assert await cur.fetchone() == (0,)
    # its result read, as the batch lane closes a request whose job has ended
    await conn.execute("UPDATE llm_calls SET outcome = 'succeeded', finished_at = now(), cost_usd = 0.5, "
                       "input_tokens = 10, output_tokens = 20 WHERE job_id = %s", (job.id,))
    cur = await conn.execute("SELECT count(*) FROM minute_rollup_stale")
    assert await cur.fetchone() == (1,)
    await PgSweeperStore(conn).record_minutes(settings, pending=0, running=0)
    cur = await conn.execute(f"SELECT spend_usd, ended_spend_usd FROM minute_rollup WHERE minute = {started}")
    assert await cur.fetchone() == (Decimal("0.500000"), Decimal("0.500000"))
    from_rollup, whole = await _overview_both_ways(conn)
    # the requests' side; a failed job's charge as a story not delivered stays what it was at the job's end
    requests = [k for k in whole[0] if k.endswith(("_billed_calls", "_spend_usd", "_tokens", "_rate_limited",
                                                   "_overloaded"))]
    assert len(requests) == 12
    assert {k: from_rollup[0][k] for k in requests} == {k: whole[0][k] for k in requests}
    assert from_rollup[0]["day_spend_usd"] == Decimal("0.750000")
    cur = await conn.execute("SELECT count(*) FROM minute_rollup_stale")
    assert await cur.fetchone() == (0,)


async def _overview_both_ways(conn: psycopg.AsyncConnection[Any]) -> tuple[Any, Any]:
    """The overview and the writers as read with the rollup, and as read whole from the jobs and the ledger (the
    rollup's rows deleted), in one transaction: at one now(), on one snapshot."""
    async with conn.transaction(force_rollback=True):
        read = []
        for _ in range(2):
            cur = await conn.execute(QUERIES["ops_overview"], {"day_from_id": 1})
            row = await cur.fetchone()
            assert row is not None and cur.description is not None
            overview = dict(zip([column.name for column in cur.description], row, strict=True))
            writers = await (await conn.execute(QUERIES["ops_writers_recent"])).fetchall()
            read.append((overview, writers))
            await conn.execute("DELETE FROM minute_rollup")
    return read[0], read[1]


async def test_the_overview_summed_from_the_rollup_is_the_overview_read_whole(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The day's minutes before the sweeper's last pass come from the rollup, the rest from the jobs and the
    ledger: the figures equal those read whole from the jobs and the ledger, after a pass, when a job that was
    running at the pass (its calls started 25 minutes ago, past the passes' recount window) has ended since, and
    after the next pass; a batch job that waited and ran for 20 hours counts in the minute it finished. The
    pass counts a 529 of an ended job, a failed job whose requests were not billed as no story paid for, and a
    minute whose one request is still open, in the window and before it (a batch job cancelled between the
    passes while its request is out: the request stays open until its result is read)."""
    acme, _ = await seed.client(conn, "acme")
    await seed.insert_jobs(conn, [
        seed.completed(acme, 20 * 3600), seed.completed(acme, 2 * 3600, cost="0.030000"), seed.completed(acme, 1800),
        seed.completed(acme, 2 * 86400),
        seed.failed(acme, 2400, "llm_error", calls=[seed.Call("overloaded", billed=False),
                                                    seed.Call("failed", cost_usd=Decimal("0.040000"))]),
        seed.failed(acme, 2000, "llm_rejected", calls=[seed.Call("rejected", billed=False)]),
        seed.failed(acme, 3 * 3600, "cancelled"),
        seed.Job(client_id=acme, status="completed", created_ago_s=800, started_ago_s=750, completed_ago_s=600,
                 calls=[seed.Call("rate_limited", billed=False, started_ago_s=700),
                        seed.Call("succeeded", input_tokens=10, output_tokens=20, cost_usd=Decimal("0.010000"))],
                 story=seed.Story("The Fox", "Once upon a time.")),
        seed.Job(client_id=acme, status="running", created_ago_s=1505, started_ago_s=1500,
                 calls=[seed.Call("overloaded", billed=False, started_ago_s=1490),
                        seed.Call("started", started_ago_s=1400)]),
        seed.Job(client_id=acme, status="running", created_ago_s=65, started_ago_s=60,
                 calls=[seed.Call("started", started_ago_s=50)]),
    ])
    (batched,) = await seed.insert_jobs(conn, [seed.Job(
        client_id=acme, status="completed", created_ago_s=20 * 3600, started_ago_s=19 * 3600, completed_ago_s=900,
        calls=[seed.Call("succeeded", input_tokens=5, output_tokens=7, cost_usd=Decimal("0.002000"))],
        story=seed.Story("The Fox", "Once upon a time."))])
    (cancelled,) = await seed.insert_jobs(conn, [seed.Job(
        client_id=acme, status="running", created_ago_s=3000, started_ago_s=2900,
        calls=[seed.Call("started", started_ago_s=2890)])])
    await conn.execute("UPDATE story_jobs SET lane = 'batch' WHERE id = ANY (%s)", ([batched.id, cancelled.id],))
    # an interactive job lives up to these (the sweeper fails it after), as the running one does
    settings = sweeper_settings(sweeper_interval_s=30.0, pending_timeout_s=1800.0, job_timeout_s=480.0)
    await PgSweeperStore(conn).record_minutes(settings, pending=0, running=3)
    from_rollup, whole = await _overview_both_ways(conn)
    assert from_rollup == whole
    overview = from_rollup[0]
    assert (overview["day_completed"], overview["day_failed"], overview["day_cancelled"]) == (5, 3, 1)
    assert (overview["day_undelivered"], overview["day_undelivered_usd"]) == (1, Decimal("0.040000"))
    assert (overview["day_rate_limited"], overview["day_overloaded"]) == (1, 2)
    assert from_rollup[1] == [("anthropic",)]

    # the running jobs end after the pass: their calls, started before it, are read from the ledger; the
    # batch job is cancelled, its request left open
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', completed_at = now() "
                       "WHERE id = %s", (cancelled.id,))
    await conn.execute("UPDATE llm_calls SET outcome = 'succeeded', finished_at = now(), cost_usd = 0.5, "
                       "input_tokens = 10, output_tokens = 20 WHERE outcome = 'started' "
                       "AND job_id IN (SELECT id FROM story_jobs WHERE status = 'running')")
    await conn.execute("UPDATE story_jobs SET status = 'completed', completed_at = now(), "
                       "story_id = gen_random_uuid() WHERE status = 'running'")
    from_rollup, whole = await _overview_both_ways(conn)
    assert from_rollup == whole
    assert from_rollup[0]["day_completed"] == 7

    await PgSweeperStore(conn).record_minutes(settings, pending=0, running=0)
    from_rollup, whole = await _overview_both_ways(conn)
    assert from_rollup == whole


async def test_a_rollup_from_before_migration_25_is_recounted_for_the_day_and_read_around_until_then(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Rows without the overview's columns (written before migration 025): the overview reads the whole day from
    the jobs and the ledger, and the next pass recounts the last 25 hours, after which the rollup's figures hold."""
    acme, _ = await seed.client(conn, "acme")
    await seed.insert_jobs(conn, [seed.completed(acme, 20 * 3600), seed.completed(acme, 600)])
    await conn.execute("INSERT INTO minute_rollup (minute, completed) SELECT generate_series(date_trunc('minute', "
                       "now()) - interval '8 days', date_trunc('minute', now()), interval '1 minute'), 0")
    from_rollup, whole = await _overview_both_ways(conn)
    assert from_rollup == whole
    assert from_rollup[0]["day_completed"] == 2
    written = await PgSweeperStore(conn).record_minutes(sweeper_settings(sweeper_interval_s=30.0), pending=0,
                                                        running=0)
    assert written >= 25 * 60
    cur = await conn.execute("SELECT jobs_from_id IS NOT NULL, sum(completed) OVER () FROM minute_rollup "
                             "ORDER BY minute DESC LIMIT 1")
    assert await cur.fetchone() == (True, 2)
    from_rollup, whole = await _overview_both_ways(conn)
    assert from_rollup == whole


async def test_the_migration_counts_todays_jobs_made_before_it_and_the_trigger_each_one_after(
    server_url: str,
) -> None:
    """Migration 026 counts each client's jobs made today before it (and none of yesterday's, nor of earlier
    days), found from the day's first id, each on its own day (the next day's first jobs too, which a migration
    that waited past midnight for its lock finds); every job inserted after it is counted by its trigger, a
    statement of many jobs of several clients and days at once included."""
    async with postgres_server.database_migrated_before(server_url, f"storyjobs_clients_today_{os.getpid()}",
                                                        "clients_today") as conn:
        await conn.execute("INSERT INTO api_clients (name) SELECT 'c' || g FROM generate_series(1, 4) g")
        # three days of jobs, oldest first as admissions make them: every 7 minutes, client by turn
        await conn.execute(
            "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, "
            "created_at) SELECT 1 + g % 4, 'k' || g, '\\x00', '{\"prompt\": \"x\"}', 'pending', "
            "date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '2 days' "
            "+ g * interval '7 minutes' FROM generate_series(0, 1000) g "
            "WHERE g * interval '7 minutes' < now() - (date_trunc('day', now() AT TIME ZONE 'UTC') "
            "AT TIME ZONE 'UTC' - interval '2 days')")

        async def by_day(table: str) -> dict[tuple[Any, int], int]:
            query = ("SELECT day, client_id, jobs FROM client_days" if table == "client_days" else
                     "SELECT budget_day(created_at), client_id, count(*) FROM story_jobs GROUP BY 1, 2")
            cur = await conn.execute(query)
            return {(day, client): jobs for day, client, jobs in await cur.fetchall()}

        # and jobs of the next day's first minutes, as a migration whose transaction began before
        # midnight finds once it has its lock after it: each is counted on its own day
        await conn.execute(
            "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, "
            "created_at) SELECT 1 + g % 2, 'next' || g, '\\x00', '{\"prompt\": \"x\"}', 'pending', "
            "date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + interval '1 day' + g * interval "
            "'1 minute' FROM generate_series(1, 3) g")
        cur = await conn.execute("SELECT budget_day(now())")
        today = (await cur.fetchone() or [None])[0]
        made = await by_day("story_jobs")
        await migrate.migrate(conn)
        assert await by_day("client_days") == {k: v for k, v in made.items() if k[0] >= today}
        assert {k[0] for k in made} > {today}
        await conn.execute(
            "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, "
            "created_at, turn) SELECT 1 + g % 3, 'later' || g, '\\x00', '{\"prompt\": \"x\"}', 'pending', "
            "now() - (g % 2) * interval '3 days', g FROM generate_series(1, 50) g")
        after = await by_day("story_jobs")
        inserted = {k: after[k] - made.get(k, 0) for k in after if after[k] != made.get(k, 0)}
        assert {k[0] for k in inserted} > {today}, "the later jobs span today and an earlier day"
        before_today = {k: v for k, v in made.items() if k[0] >= today}
        assert await by_day("client_days") == {
            k: before_today.get(k, 0) + inserted.get(k, 0) for k in before_today.keys() | inserted.keys()}


async def test_the_prune_probes_keys_deliveries_and_stories_by_index_whatever_the_history(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """With 30,000 finished jobs, each with its key and story (in the table as it was before the stories'
    ranges) and one in five with a delivery, the sweeper's prune (its generic plan, as the sweeper runs it)
    reaches the keys, the deliveries and the stories only through their indexes, one probe a pruned job: it
    never reads a whole table once a batch."""
    await conn.execute("INSERT INTO api_clients (name) SELECT 'c' || g FROM generate_series(1, 100) g")
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, story_id, "
        "completed_at, created_at) SELECT 1 + g % 100, 'k' || g, '\\x00', '{\"prompt\": \"x\"}', 'completed', "
        "gen_random_uuid(), now() - interval '40 days', now() - interval '40 days' FROM generate_series(1, 30000) g")
    # stories in the table as it was before migration 029, which the prune deletes row by row
    await conn.execute("INSERT INTO stories (id, job_id, client_id, title, body, model, prompt_version, "
                       "input_tokens, output_tokens, cost_usd) SELECT story_id, id, client_id, 'The Fox', "
                       "'Once upon a time.', 'm', 'v1', 1, 1, 0 FROM story_jobs")
    await conn.execute("INSERT INTO job_idempotency_keys (client_id, idempotency_key, job_id) "
                       "SELECT client_id, idempotency_key, id FROM story_jobs")
    await conn.execute("INSERT INTO webhook_endpoints (client_id, url, events, secret) "
                       "SELECT id, 'https://hooks.example.com/' || id, '{job.completed}', 'whsec_x' FROM api_clients "
                       "WHERE id % 5 = 0")
    await conn.execute(
        "INSERT INTO webhook_deliveries (endpoint_id, client_id, job_id, job_public_id, job_status, occurred_at, "
        "state, attempts, next_attempt_at, delivered_at) SELECT e.id, j.client_id, j.id, j.public_id, j.status, "
        "j.completed_at, 'delivered', 1, j.completed_at, j.completed_at FROM story_jobs j "
        "JOIN webhook_endpoints e ON e.client_id = j.client_id")
    await conn.execute("VACUUM ANALYZE")
    async with await db.connect(database_url, application_name="storyjobs-sweeper", connect_timeout_s=5,
                                generic_plans=True) as sweeper_conn:
        plans = await _plans_logged(sweeper_conn)
        pruned = 0
        for _ in range(3):
            pruned += len(await PgSweeperStore(sweeper_conn).prune_finished(retention_s=30 * 86400, batch_size=500))
    assert pruned == 1500
    prunes = [p for p in plans if "webhook_deliveries" in json.dumps(p["Plan"])]
    assert len(prunes) == 3, [p["Query Text"][:80] for p in plans]
    for plan in prunes:
        # the walk on the primary key begins past the last job deleted and ends where job_id_bounds said
        walks = [n for n in _nodes(plan["Plan"]) if n.get("Index Name") == "story_jobs_pkey"
                 and n.get("Index Cond", "").startswith("((id > ") and " AND (id < " in n["Index Cond"]]
        assert walks, [(n["Node Type"], n.get("Index Cond")) for n in _nodes(plan["Plan"])]
        deletes = [n for n in _nodes(plan["Plan"]) if n["Node Type"] == "ModifyTable"
                   and n["Relation Name"] in ("job_idempotency_keys", "webhook_deliveries", "stories_unranged")]
        assert len(deletes) == 3
        for delete in deletes:
            reads = [n for child in delete.get("Plans", []) for n in _nodes(child)
                     if n.get("Relation Name") == delete["Relation Name"]]
            assert reads and all(n["Node Type"] == "Index Scan" and "Index Cond" in n for n in reads), \
                (delete["Relation Name"], [(n["Node Type"], n.get("Index Cond")) for n in reads])
    cur = await conn.execute("SELECT count(*) FROM job_idempotency_keys")
    assert await cur.fetchone() == (28_500,)
    cur = await conn.execute("SELECT count(*) FROM webhook_deliveries")
    assert await cur.fetchone() == (6_000 - 300,)
    cur = await conn.execute("SELECT min(job_id), count(*) FROM stories")
    assert await cur.fetchone() == (1501, 28_500)
