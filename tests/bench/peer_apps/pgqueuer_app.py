"""pgqueuer's side of the peer comparison: a queue manager with one no-op
entrypoint on one asyncpg connection (pgqueuer's first choice of driver) to
``PGQUEUER_BENCH_DSN``. A bare QueueManager, not the PgQueuer application
object, so no scheduler polls beside it: the leanest pgqueuer worker.

    python -m tests.bench.peer_apps.pgqueuer_app --batch-size N

runs it the way ``pgq run tests.bench.peer_apps.pgqueuer_app:create_manager
--batch-size N`` does (pgqueuer.run, its supervisor, on uvloop), with
pgqueuer's own log set-up at warning. ``pgq run`` itself fails at start in
pgqueuer 1.6.0 with current typer: its --log-level option hands a str to a
function that wants the enum, default value included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import AsyncIterator

import asyncpg
import pgqueuer
import uvloop
from pgqueuer import QueueManager
from pgqueuer.core import logconfig
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

from tests.bench.peer_apps import PGQUEUER_APPLICATION_NAME as APPLICATION_NAME
from tests.bench.peer_apps import PGQUEUER_ENTRYPOINT as ENTRYPOINT


@contextlib.asynccontextmanager
async def create_manager() -> AsyncIterator[QueueManager]:
    connection = await asyncpg.connect(os.environ["PGQUEUER_BENCH_DSN"],
                                       server_settings={"application_name": APPLICATION_NAME})
    try:
        manager = QueueManager(Queries(AsyncpgDriver(connection)))

        @manager.entrypoint(ENTRYPOINT)
        async def noop(job: Job) -> None:
            return None

        yield manager
    finally:
        await connection.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.peer_apps.pgqueuer_app")
    parser.add_argument("--batch-size", type=int, default=10, help="jobs one dequeue takes (pgqueuer's default 10)")
    args = parser.parse_args(argv)
    logconfig.setup_fancy_logger(logconfig.LogLevel.WARNING)
    # pgqueuer.run stops on SIGTERM and SIGINT, as pgq run does
    uvloop.run(pgqueuer.run(create_manager, batch_size=args.batch_size))


if __name__ == "__main__":
    main()
