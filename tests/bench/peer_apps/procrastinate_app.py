"""procrastinate's side of the peer comparison: an app with one no-op task,
run by procrastinate's own CLI:

    python -m procrastinate --app tests.bench.peer_apps.procrastinate_app.app worker --concurrency N

on procrastinate's psycopg connector (a pool) to ``DATABASE_URL``; its schema
is applied with ``procrastinate ... schema --apply``.
"""

from __future__ import annotations

import os

import procrastinate

from tests.bench.peer_apps import PROCRASTINATE_APPLICATION_NAME as APPLICATION_NAME
from tests.bench.peer_apps import PROCRASTINATE_TASK as TASK


def make_app(conninfo: str) -> procrastinate.App:
    connector = procrastinate.PsycopgConnector(conninfo=conninfo, kwargs={"application_name": APPLICATION_NAME})
    app = procrastinate.App(connector=connector)

    @app.task(name=TASK)
    async def noop() -> None:
        return None

    return app


app = make_app(os.environ.get("DATABASE_URL", ""))
