"""The operators' commands, run as the installed CLI against a real database."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from decimal import Decimal

import psycopg
import pytest

from api.store import ApiStore
from shared import keys, webhooks
from shared.console_store import ConsoleStore
from shared.status import ErrorCode, LlmOutcome
from tests.support import ops_seed as seed
from tests.support import worker_statements
from tests.support.database import client_id_of, count, enqueue
from tests.system.procs import REPO
from worker.rows import Completion, Failure

pytestmark = pytest.mark.system


def storyjobs(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "", "DATABASE_URL": database_url}, timeout=60)


@pytest.fixture
def history(database_url: str) -> dict[str, str]:
    """One completed job, one failed job and one pending job, with their ledger rows."""

    async def make() -> dict[str, str]:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            client = await client_id_of(conn, "ops")
            done = await enqueue(conn, client, "a story that gets written")
            failed = await enqueue(conn, client, "a story the provider refuses")
            claimed = await worker_statements.job_claim(conn, worker_id="w-1", claim_limit=2,
                                                       provider="anthropic", model="claude-sonnet-5-5")
            ids = {job.public_id: job.id for job in claimed.claimed}
            await worker_statements.job_settle(conn, worker_id="w-1", completions=[Completion(
                job_id=ids[done], client_id=client, attempt=1, title="T", body="B", model="claude-sonnet-5-5",
                prompt_version="bedtime-v1", input_tokens=1000, output_tokens=2000, cost_usd=Decimal("0.022"),
                request_id="req_1")])
            await worker_statements.job_fail_running(conn, worker_id="w-1", failures=[Failure(
                job_id=ids[failed], attempt=1, error_code=ErrorCode.LLM_REJECTED, error_text="the provider said no",
                call_outcome=LlmOutcome.REJECTED, billed=False)])
            waiting = await enqueue(conn, client, "a story still waiting")
        return {"done": str(done), "failed": str(failed), "waiting": str(waiting)}

    return asyncio.run(make())


def test_jobs_list_filters_by_status(database_url: str, history: dict[str, str]) -> None:
    """`jobs list --status failed` lists the failed job with its error code and nothing else."""
    result = storyjobs(database_url, "jobs", "list", "--status", "failed")
    assert result.returncode == 0, result.stderr
    assert history["failed"] in result.stdout and "llm_rejected" in result.stdout
    assert history["done"] not in result.stdout and history["waiting"] not in result.stdout
    everything = storyjobs(database_url, "jobs", "list").stdout
    assert all(job_id in everything for job_id in history.values())


def test_jobs_show_gives_timings_and_the_ledger(database_url: str, history: dict[str, str]) -> None:
    """`jobs show ID` prints the status, timings, worker and every ledger row of the job."""
    result = storyjobs(database_url, "jobs", "show", history["done"])
    assert result.returncode == 0, result.stderr
    for expected in ("status     completed", "worker     w-1", "waited", "ran", "LLM calls (1; billed: 1)",
                     "succeeded", "0.022000", "anthropic/claude-sonnet-5-5"):
        assert expected in result.stdout, expected
    refused = storyjobs(database_url, "jobs", "show", history["failed"]).stdout
    assert "llm_rejected: the provider said no" in refused and "billed: 0" in refused


def test_jobs_show_of_an_unknown_job_says_so(database_url: str, history: dict[str, str]) -> None:
    """An unknown or malformed job id is one clear line and a non-zero exit."""
    unknown = storyjobs(database_url, "jobs", "show", "00000000-0000-0000-0000-000000000000")
    assert unknown.returncode == 1 and "no job" in unknown.stderr
    malformed = storyjobs(database_url, "jobs", "show", "not-a-job")
    assert malformed.returncode == 2 and "not a job id" in malformed.stderr


def test_stats_sum_the_last_hour(database_url: str, history: dict[str, str]) -> None:
    """`stats` shows the queue, the stories written, the jobs failed, the billed requests, tokens and spend."""
    result = storyjobs(database_url, "stats")
    assert result.returncode == 0, result.stderr
    assert "1 pending, 0 running" in result.stdout
    assert "1 written" in result.stdout and "1 jobs failed" in result.stdout
    assert "1 requests, 1000 input + 2000 output tokens" in result.stdout
    assert "$0.022000" in result.stdout


def test_a_database_that_is_behind_is_refused_with_one_line(database_url: str) -> None:
    """The commands that need the schema name the fix when the database is behind."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM schema_migrations")
    result = storyjobs(database_url, "keys", "create", "someone")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "storyjobs migrate" in result.stderr


def test_keys_create_operator_makes_a_console_key_listed_and_revoked_like_the_others(database_url: str) -> None:
    """`keys create NAME --operator` stores an operator key (hashed, in operator_keys, not api_keys) that
    `keys list` marks as an operator's and `keys revoke PREFIX` revokes."""
    created = storyjobs(database_url, "keys", "create", "night shift", "--operator")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    assert "operator key" in created.stderr and "/ops/" in created.stderr
    prefix = key.split("_")[1]
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM api_keys").fetchone() == (0,)
        assert conn.execute("SELECT name, key_prefix, revoked_at FROM operator_keys").fetchall() == [
            ("night shift", prefix, None)]
    listing = storyjobs(database_url, "keys", "list").stdout
    assert f"{prefix}" in listing and "night shift (operator)" in listing and key not in listing
    revoked = storyjobs(database_url, "keys", "revoke", prefix)
    assert revoked.returncode == 0 and f"revoked {prefix}" in revoked.stdout
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT revoked_at IS NOT NULL FROM operator_keys").fetchone()
    assert row == (True,)
    assert storyjobs(database_url, "keys", "revoke", prefix).returncode == 1


def test_stats_without_the_apis_budget_says_it_is_not_in_this_environment(database_url: str) -> None:
    """Run from a shell without BUDGET_USD_PER_DAY, `stats` names the variable missing here rather than claiming
    that no budget is enforced."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO budget_days (client_id, day, spent_usd, reserved_usd) "
                     "VALUES (0, (now() AT TIME ZONE 'UTC')::date, 1.5, 0.25)")
    result = storyjobs(database_url, "stats")
    assert result.returncode == 0, result.stderr
    assert "no BUDGET_USD_PER_DAY in this environment (the api's may set one)" in result.stdout
    assert "no budget" not in result.stdout


def test_webhooks_lists_endpoints_and_their_deliveries(database_url: str, history: dict[str, str]) -> None:
    """`webhooks endpoints` shows each endpoint with its counts; `webhooks deliveries` each event, by state."""

    async def hook() -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            client = await client_id_of(conn, "ops")
            endpoint = await ApiStore(conn).webhook_endpoint_insert(
                client_id=client, url="https://hooks.example.com/in", events=webhooks.EVENTS,
                secret=webhooks.new_secret(), max_per_client=10)
            assert endpoint is not None
            await ApiStore(conn).job_cancel(client_id=client, job_id=uuid.UUID(history["waiting"]))

    asyncio.run(hook())
    endpoints = storyjobs(database_url, "webhooks", "endpoints")
    assert endpoints.returncode == 0, endpoints.stderr
    (line,) = endpoints.stdout.splitlines()[1:]
    assert line.split()[1:5] == ["ops", "active", "1", "0"] and line.endswith("https://hooks.example.com/in")
    deliveries = storyjobs(database_url, "webhooks", "deliveries", "--state", "pending")
    assert deliveries.returncode == 0, deliveries.stderr
    (row,) = deliveries.stdout.splitlines()[1:]
    assert row.split()[1:5] == [history["waiting"], "job.cancelled", "pending", "0"]
    assert storyjobs(database_url, "webhooks", "deliveries", "--state", "dead").stdout.splitlines()[1:] == []


def test_actions_lists_what_operators_did_newest_first(database_url: str) -> None:
    """`storyjobs actions` lists recorded operator actions, newest first, with the operator, the key's prefix,
    what each touched and on what."""

    async def record() -> tuple[str, str]:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            ada = await keys.create_operator(conn, "ada")
            job = await enqueue(conn, await client_id_of(conn, "ops"), "a story")
            key_id = await count(conn, "SELECT id FROM operator_keys WHERE key_prefix = %s", ada.prefix)
            console = ConsoleStore(conn)
            await console.operator_action_insert(operator_key_id=key_id, action="job_cancel", job_id=job, touched=1)
            await console.operator_action_insert(operator_key_id=key_id, action="client_keys_revoke",
                                                 filter={"client_id": 7}, touched=2)
            return ada.prefix, str(job)

    prefix, job = asyncio.run(record())
    result = storyjobs(database_url, "actions")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "client_keys_revoke" in lines[1] and '{"client_id": 7}' in lines[1] and prefix in lines[1]
    assert "job_cancel" in lines[2] and job in lines[2] and "ada" in lines[2]


def test_keys_create_with_a_weight_sets_the_clients_share_and_refuses_a_bad_one(database_url: str) -> None:
    """`keys create acme --weight 3` stores weight 3 for acme (others keep 1); `--weight 0` is refused
    with a line naming the bounds, and nothing is created."""
    assert storyjobs(database_url, "keys", "create", "acme", "--weight", "3").returncode == 0
    assert storyjobs(database_url, "keys", "create", "plain").returncode == 0
    refused = storyjobs(database_url, "keys", "create", "zero", "--weight", "0")
    assert refused.returncode != 0 and "from 1 to 1000" in refused.stderr
    with psycopg.connect(database_url, autocommit=True) as conn:
        weights: dict[str, int] = dict(conn.execute("SELECT name, weight FROM api_clients").fetchall())
    assert weights == {"acme": 3, "plain": 1}


def test_batches_lists_each_batch_newest_first_with_its_counts_cost_and_saving(database_url: str) -> None:
    """`batches` prints the message batches newest first, each with its state, provider id, expiry, what its
    ledger rows cost, what that saved against the interactive price and the provider's counts; then the sums;
    `jobs list` and `jobs show` give a batch job's lane and batch; `stats` counts the lane apart."""

    async def make() -> tuple[int, int, str]:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            acme, _ = await seed.client(conn, "acme")
            done = await seed.insert_jobs(conn, [seed.completed(acme, 4000, cost="0.010000"),
                                                 seed.completed(acme, 4100, cost="0.002500")])
            flying = await seed.insert_jobs(conn, [seed.running(acme, 600)])
            ended = await seed.batch(conn, "ended", done, created_ago_s=7200, provider_batch_id="msgbatch_old",
                                     counts={"succeeded": 2}, processing_status="ended")
            sent = await seed.batch(conn, "sent", flying, created_ago_s=600, provider_batch_id="msgbatch_new",
                                    counts={"processing": 1}, processing_status="in_progress")
            return ended, sent, str(flying[0].public_id)

    ended, sent, flying = asyncio.run(make())
    result = storyjobs(database_url, "batches")
    assert result.returncode == 0, result.stderr
    header, newer, older, sums = result.stdout.splitlines()
    assert header.split() == ["BATCH", "STATE", "PROVIDER_ID", "AGE", "EXPIRES", "COST_USD", "SAVED_USD", "REQUESTS"]
    assert newer.split()[:3] == [str(sent), "sent", "msgbatch_new"] and newer.endswith("1 processing")
    assert newer.split()[-4:-2] == ["0.000000", "0.000000"] and "10 min" in newer
    assert older.split()[:3] == [str(ended), "ended", "msgbatch_old"] and older.endswith("2 succeeded")
    assert older.split()[-4:-2] == ["0.012500", "0.012500"] and "2.0 h" in older
    assert sums == "2 batches: $0.012500 at 50% of the interactive price, $0.012500 saved"
    assert f"{flying}  running   batch" in storyjobs(database_url, "jobs", "list").stdout
    shown = storyjobs(database_url, "jobs", "show", flying).stdout
    assert "lane       batch" in shown and f"batch      #{sent} sent, msgbatch_new, expires " in shown
    assert "0 pending, 0 running; batch lane 1 waiting for or in a batch" in storyjobs(database_url, "stats").stdout
