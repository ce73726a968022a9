"""The ``storyjobs`` command: migrations, API keys and operators' views.

    storyjobs migrate
    storyjobs keys create NAME [--operator] [--weight N] | keys list | keys revoke PREFIX
    storyjobs jobs list [--status S] [--limit N] | jobs show JOB_ID
    storyjobs batches [--limit N]
    storyjobs stats
    storyjobs webhooks endpoints [--client-id N] | webhooks deliveries [--endpoint ID] [--state S] [--limit N]
    storyjobs generate PROMPT [--wait] [--json] [--lane batch]      (see tools/client.py)

The database commands read DATABASE_URL (unset: the embedded Postgres);
``migrate`` holds a session advisory lock, so it connects to
DATABASE_LISTEN_URL when that is set (required behind a transaction pooler).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from decimal import Decimal
from typing import Any

import msgspec
import psycopg

from shared import db, keys, migrate, store, webhooks
from shared.config import ApiSettings, BaseSettings, ConfigError, SweeperSettings
from shared.config_load import load
from shared.console_rows import JobFilter
from shared.console_stats import finished_since, snapshot_warning
from shared.console_store import ConsoleStore
from shared.pricing import BATCH_PRICE_FACTOR, saved_by_batch
from shared.ratelimit import KINDS, RateLimits
from shared.status import JobStatus
from sweeper import partitions


def _usd(text: str) -> Decimal:
    try:
        value = Decimal(text)
        within = Decimal(0) < value <= Decimal(10_000_000)
    except ArithmeticError:  # not a number, or NaN
        raise argparse.ArgumentTypeError(f"not an amount in USD: {text!r}") from None
    if not within:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 10000000: {text!r}")
    return value


def _weight(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be from 1 to 1000: {text!r}")
    return value


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


async def _connect() -> psycopg.AsyncConnection[Any]:
    settings = load(BaseSettings)
    return await db.connect(db.database_url(settings), application_name="storyjobs-cli",
                            connect_timeout_s=settings.db_connect_timeout_s, pooler=settings.database_pooler)


@contextlib.asynccontextmanager
async def _console() -> AsyncIterator[ConsoleStore]:
    """What operators read and do, on a connection of their own."""
    async with await _connect() as conn:
        yield ConsoleStore(conn)


async def _connect_session() -> psycopg.AsyncConnection[Any]:
    """A connection that keeps its session (DATABASE_LISTEN_URL, else DATABASE_URL)."""
    settings = load(BaseSettings)
    return await db.connect(db.session_url(settings), application_name="storyjobs-migrate",
                            connect_timeout_s=settings.db_connect_timeout_s)


async def cmd_migrate(_: argparse.Namespace) -> int:
    retention_s = load(SweeperSettings).job_retention_s
    async with await _connect_session() as conn:
        applied = await migrate.migrate(conn)
        version = await store.schema_version_get(conn)
        # the sweeper's care of the stories' partitions, here on a session
        # without a statement timeout: after migration 029 its first pass
        # reads the stories that were there (sweeper/partitions.py)
        kept = await partitions.keep(conn, retention_s=retention_s)
    for migration in applied:
        _out(f"applied {migration.version:03d}_{migration.name}")
        for notice in migration.notices:
            _out(f"  {notice}")
    _out(f"schema at version {version}" + ("" if applied else " (nothing to apply)"))
    if kept.added or kept.dropped:
        _out(f"stories' partitions: {kept.added} added, {kept.dropped} dropped")
    return 0


async def cmd_keys_create(args: argparse.Namespace) -> int:
    async with await _connect() as conn:
        await db.require_schema(conn)
        if args.operator:
            new = await keys.create_operator(conn, args.name)
        else:
            new = await keys.create(conn, args.name, budget_usd_per_day=args.budget_usd_per_day,
                                    weight=args.weight)
    if args.operator:
        what = f"operator key {new.prefix} for {args.name!r} (the console, /ops/)"
    else:
        what = f"API key {new.prefix} for client {args.name!r}"
    sys.stderr.write(f"{what}; it is shown once, store it now:\n")
    _out(new.key)
    return 0


async def cmd_keys_list(_: argparse.Namespace) -> int:
    async with _console() as console:
        clients = await console.clients.ops_client_list()
        operator_rows = await console.clients.operator_key_list()
    # the console's list of clients with their keys, oldest key first
    listed = sorted(((key.key_prefix, client.name, key.created_at, key.revoked_at)
                     for client in clients for key in client.keys), key=lambda row: row[2])
    # operators' keys are named by who holds them, marked as such
    listed += [(row.key_prefix, f"{row.name} (operator)", row.created_at, row.revoked_at) for row in operator_rows]
    _out(f"{'PREFIX':<14} {'CLIENT':<24} {'CREATED':<26} REVOKED")
    for prefix, name, created_at, revoked_at in listed:
        revoked = revoked_at.isoformat(timespec="seconds") if revoked_at else "-"
        _out(f"{prefix:<14} {name:<24} {created_at.isoformat(timespec='seconds'):<26} {revoked}")
    return 0


async def cmd_keys_revoke(args: argparse.Namespace) -> int:
    prefix = keys.prefix_of(args.prefix) or args.prefix
    async with _console() as console:
        revoked = await console.clients.api_key_revoke(key_prefix=prefix)
        revoked = await console.clients.operator_key_revoke(key_prefix=prefix) or revoked
    if not revoked:
        sys.stderr.write(f"storyjobs: no active key with prefix {prefix!r}\n")
        return 1
    _out(f"revoked {prefix}")
    return 0


# above every job's id: the jobs list walks down from here
_NO_ID_ABOVE = 2**63 - 1


def _when(value: Any) -> str:
    return value.isoformat(timespec="seconds") if value is not None else "-"


async def cmd_jobs_list(args: argparse.Namespace) -> int:
    async with _console() as console:
        # the console's jobs list, over every id
        rows = await console.jobs.ops_job_list(filters=JobFilter(status=args.status), live=False,
                                               before_id=_NO_ID_ABOVE, floor_id=0, limit=args.limit)
    _out(f"{'JOB_ID':<36}  {'STATUS':<9} {'LANE':<11} {'ERROR':<14} {'CLIENT':<16} {'CREATED':<25} COMPLETED")
    for row in rows:
        _out(f"{row.public_id!s:<36}  {row.status:<9} {row.lane:<11} {row.error_code or '-':<14} "
             f"{row.client_name[:16]:<16} {_when(row.created_at):<25} {_when(row.completed_at)}")
    return 0


async def cmd_jobs_show(args: argparse.Namespace) -> int:
    try:
        job_id = uuid.UUID(args.job_id)
    except ValueError:
        sys.stderr.write(f"storyjobs: {args.job_id!r} is not a job id\n")
        return 2
    async with _console() as console:
        job = await console.jobs.ops_job_get(job_id=job_id)
        if job is None:
            sys.stderr.write(f"storyjobs: no job {job_id}\n")
            return 1
        calls = await console.jobs.llm_call_list_for_job(job_id=job.id)
    _out(f"job        {job.public_id}")
    _out(f"client     {job.client_name}")
    _out(f"status     {job.status}" + (f" ({job.error_code}: {job.error_text})" if job.error_code else ""))
    _out(f"lane       {job.lane}")
    if job.batch_id is not None:
        _out(f"batch      #{job.batch_id} {job.batch_state}, {job.batch_provider_id or 'not sent'}, "
             f"expires {_when(job.batch_expires_at)}")
    if job.batch_ready_at is not None and job.status in (JobStatus.PENDING, JobStatus.RUNNING):
        _out(f"waiting    for a batch since {_when(job.batch_ready_at)}")
    _out(f"created    {_when(job.created_at)}")
    _out(f"started    {_when(job.started_at)}")
    _out(f"heartbeat  {_when(job.heartbeat_at)}")
    _out(f"finished   {_when(job.completed_at)}")
    if job.started_at and job.created_at:
        _out(f"waited     {(job.started_at - job.created_at).total_seconds():.3f} s")
    if job.completed_at and job.started_at:
        _out(f"ran        {(job.completed_at - job.started_at).total_seconds():.3f} s")
    _out(f"worker     {job.worker_id or '-'}")
    _out(f"progress   {job.progress} output tokens")
    _out(f"story      {job.story_id or '-'}")
    _out(f"request    {msgspec.json.encode(job.request).decode()}")
    _out()
    _out(f"LLM calls ({len(calls)}; billed: {sum(1 for c in calls if c.billed)}):")
    _out(f"  {'#':<3}{'OUTCOME':<15}{'BILLED':<8}{'IN':>7}{'OUT':>7}{'COST_USD':>12}  {'STARTED':<26}{'PROVIDER/MODEL'}")
    for call in calls:
        _out(f"  {call.attempt:<3}{call.outcome:<15}{'yes' if call.billed else 'no':<8}{call.input_tokens:>7}"
             f"{call.output_tokens:>7}{call.cost_usd!s:>12}  {_when(call.started_at):<26}{call.provider}/{call.model}")
        if call.error_text:
            _out(f"     {call.error_text}")
    return 0


async def cmd_stats(_: argparse.Namespace) -> int:
    settings = load(ApiSettings)
    async with _console() as console:
        bounds = await store.job_id_bounds(
            console.conn, created_after=finished_since(settings, timedelta(days=1)), created_before=None)
        stats = await console.stats.ops_overview(day_from_id=bounds.lo_id)
        budgets = await store.budget_days_today(console.conn)
        buckets = await console.stats.llm_rate_bucket_list(limits=RateLimits.from_settings(settings))
        ages = await store.database_snapshot_ages(console.conn)
    warning = snapshot_warning(ages, settings.xmin_horizon_warn_s)
    if warning:
        _out(f"WARNING    {warning}")
    _out(f"queue      {stats.pending} pending, {stats.running} running; "
         f"batch lane {stats.batch_live} waiting for or in a batch")
    _out("last hour")
    # hour_failed counts cancellations too: the console shows them apart
    _out(f"  stories  {stats.hour_completed} written ({stats.hour_completed / 60:.1f}/min), "
         f"{stats.hour_failed - stats.hour_cancelled} jobs failed, {stats.hour_cancelled} cancelled")
    _out(f"  billed   {stats.hour_billed_calls} requests, {stats.hour_input_tokens} input + "
         f"{stats.hour_output_tokens} output tokens")
    _out(f"  spend    ${stats.hour_spend_usd}")
    _out("today (UTC), spent + reserved against each budget")
    if not budgets:
        _out("  nothing reserved today")
    for day in budgets:
        budget = settings.budget_usd_per_day if day.client_id == 0 else (
            day.client_budget_usd or settings.client_budget_usd_per_day)
        # the api's budgets live in its environment: this shell may not have them
        unset = "BUDGET_USD_PER_DAY" if day.client_id == 0 else "CLIENT_BUDGET_USD_PER_DAY"
        headroom = (f"no {unset} in this environment (the api's may set one)" if budget is None
                    else f"budget ${budget}, ${budget - day.spent_usd - day.reserved_usd} left")
        _out(f"  {day.scope[:16]:<16} ${day.spent_usd} spent + ${day.reserved_usd} reserved; {headroom}")
    limits = RateLimits.from_settings(settings)
    _out("provider rate limits (shared bucket, refilled to now)")
    if not buckets:
        _out("  no bucket: no limit configured, and no 429 heard")
    for bucket in buckets:
        paused = f"paused {bucket.paused_s:.1f} s; " if bucket.paused_s > 0 else ""
        left = [f"{kind} {_refilled(getattr(bucket, kind), limits, kind)}"
                for kind in KINDS if getattr(bucket, kind) is not None]
        _out(f"  {bucket.model}: {paused}{', '.join(left) or 'no configured limit'}")
    return 0


def _batch_counts(counts: dict[str, int] | None, request_count: int) -> str:
    """What the provider last counted of a batch's requests (the console's words)."""
    if counts is None:
        return f"{request_count} requests"
    shown = [f"{counts.get(name, 0)} {name}" for name in ("succeeded", "errored", "expired", "canceled", "processing")
             if counts.get(name, 0)]
    return ", ".join(shown) or f"{request_count} requests"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


async def cmd_batches(args: argparse.Namespace) -> int:
    async with _console() as console:
        # the console's batches screen, its first page
        rows = await console.jobs.ops_batch_list(before_id=None, limit=args.limit)
    _out(f"{'BATCH':>7}  {'STATE':<8} {'PROVIDER_ID':<36} {'AGE':>8}  {'EXPIRES':<25} {'COST_USD':>11} "
         f"{'SAVED_USD':>11}  REQUESTS")
    for row in rows:
        _out(f"{row.id:>7}  {row.state:<8} {row.provider_batch_id or '-':<36} {_age(row.age_s):>8}  "
             f"{_when(row.expires_at):<25} {row.cost_usd!s:>11} {saved_by_batch(row.cost_usd)!s:>11}  "
             f"{_batch_counts(row.request_counts, row.request_count)}")
    cost = sum((row.cost_usd for row in rows), Decimal(0))
    _out(f"{len(rows)} batches: ${cost} at {BATCH_PRICE_FACTOR:.0%} of the interactive price, "
         f"${saved_by_batch(cost)} saved")
    return 0


def _refilled(refilled: float, limits: RateLimits, kind: str) -> str:
    capacity: float | None = getattr(limits, f"{kind}_capacity")
    return f"{refilled:.0f}" if capacity is None else f"{refilled:.0f} of {capacity:.0f}"


async def cmd_webhooks_endpoints(args: argparse.Namespace) -> int:
    async with _console() as console:
        rows = await console.webhooks.webhook_endpoint_list(client_id=args.client_id)
    _out(f"{'ENDPOINT':<36}  {'CLIENT':<16} {'STATE':<8} {'PENDING':>7} {'DEAD':>5}  URL")
    for row in rows:
        state = "disabled" if row.disabled_at else "failing" if row.failing_since else "active"
        _out(f"{row.id!s:<36}  {row.client_name[:16]:<16} {state:<8} {row.pending:>7} {row.dead:>5}  {row.url}")
    return 0


async def cmd_webhooks_deliveries(args: argparse.Namespace) -> int:
    endpoint_id = None
    if args.endpoint is not None:
        try:
            endpoint_id = uuid.UUID(args.endpoint)
        except ValueError:
            sys.stderr.write(f"storyjobs: not an endpoint id: {args.endpoint!r}\n")
            return 2
    async with _console() as console:
        rows = await console.webhooks.webhook_delivery_list(endpoint_id=endpoint_id, state=args.state, limit=args.limit)
    _out(f"{'ID':>8}  {'JOB_ID':<36}  {'EVENT':<13} {'STATE':<9} {'TRIES':>5} {'LAST':>4} {'LAST_ATTEMPT':<25} "
         "ERROR")
    for row in rows:
        event = webhooks.event_of(row.job_status, row.error_code)
        _out(f"{row.id:>8}  {row.job_id!s:<36}  {event:<13} {row.state:<9} {row.attempts:>5} "
             f"{row.last_status_code or '-':>4} {_when(row.last_attempt_at):<25} {row.last_error or '-'}")
    return 0


async def cmd_actions(args: argparse.Namespace) -> int:
    async with _console() as console:
        rows = await console.operator_action_list(limit=args.limit)
    _out(f"{'WHEN':<25} {'OPERATOR':<16} {'KEY':<14} {'ACTION':<18} {'TOUCHED':>7}  ON")
    for row in rows:
        _out(f"{_when(row.acted_at):<25} {row.operator[:16]:<16} {row.operator_key_prefix:<14} {row.action:<18} "
             f"{row.touched:>7}  {row.job_id or row.filter or '-'}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="storyjobs", description="storyjobs: LLM stories as background jobs.")
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("migrate", help="apply the schema migrations the database lacks").set_defaults(
        run=cmd_migrate)

    key_commands = commands.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", help="create a key for client NAME; prints it once, last line")
    create.add_argument("name")
    create.add_argument("--operator", action="store_true",
                        help="a key of the operators' console (/ops/) held by NAME, instead of a client's key")
    create.add_argument("--budget-usd-per-day", type=_usd, metavar="USD",
                        help="the client's own spend budget per UTC day (instead of CLIENT_BUDGET_USD_PER_DAY)")
    create.add_argument("--weight", type=_weight, metavar="N",
                        help="the client's share of the workers: N jobs to a weight-1 client's one (default 1)")
    create.set_defaults(run=cmd_keys_create)
    key_commands.add_parser("list", help="list keys by prefix").set_defaults(run=cmd_keys_list)
    revoke = key_commands.add_parser("revoke", help="revoke a key (by prefix or whole key); effective at once")
    revoke.add_argument("prefix")
    revoke.set_defaults(run=cmd_keys_revoke)

    job_commands = commands.add_parser("jobs", help="inspect jobs").add_subparsers(dest="jobs_command", required=True)
    listing = job_commands.add_parser("list", help="newest jobs first")
    listing.add_argument("--status", choices=[s.value for s in JobStatus])
    listing.add_argument("--limit", type=int, default=50)
    listing.set_defaults(run=cmd_jobs_list)
    show = job_commands.add_parser("show", help="one job: status, timings, LLM ledger")
    show.add_argument("job_id")
    show.set_defaults(run=cmd_jobs_show)

    commands.add_parser("stats", help="queue depth, throughput and spend over the last hour").set_defaults(
        run=cmd_stats)

    batches = commands.add_parser("batches", help="the batch lane's message batches, newest first: state, "
                                                  "provider id, age, expiry, cost, saving, requests")
    batches.add_argument("--limit", type=int, default=50)
    batches.set_defaults(run=cmd_batches)

    hook_commands = commands.add_parser("webhooks", help="webhook endpoints and deliveries").add_subparsers(
        dest="webhooks_command", required=True)
    endpoints = hook_commands.add_parser("endpoints", help="every endpoint, its client and its deliveries by state")
    endpoints.add_argument("--client-id", type=int)
    endpoints.set_defaults(run=cmd_webhooks_endpoints)
    deliveries = hook_commands.add_parser("deliveries", help="the last deliveries, newest first")
    deliveries.add_argument("--endpoint", help="only this endpoint's (its id)")
    deliveries.add_argument("--state", choices=["pending", "delivered", "dead"])
    deliveries.add_argument("--limit", type=int, default=50)
    deliveries.set_defaults(run=cmd_webhooks_deliveries)

    actions = commands.add_parser("actions", help="what operators did from the console, newest first")
    actions.add_argument("--limit", type=int, default=50)
    actions.set_defaults(run=cmd_actions)

    from tools import client

    client.add_generate_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        code = asyncio.run(args.run(args))
    except ConfigError as exc:
        sys.stderr.write(f"storyjobs: configuration error: {exc}\n")
        code = 2
    except db.SchemaBehind as exc:
        sys.stderr.write(f"storyjobs: {exc}\n")
        code = 1
    except psycopg.OperationalError as exc:
        sys.stderr.write(f"storyjobs: cannot reach the database: {str(exc).strip().splitlines()[0]}\n")
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
