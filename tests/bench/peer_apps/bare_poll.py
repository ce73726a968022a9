"""``python -m tests.bench.peer_apps.bare_poll --port N``: the floor of the
poll benchmark, the least a Litestar app can do to answer
``GET /stories/jobs/{id}``.

One handler, one pooled connection per request (psycopg_pool, as many as the
api's pool), one statement reading the job's row by ``public_id``, its fields
encoded as JSON by Litestar's msgspec. No key check, no queue position, no
estimate, no headers of our own, no metrics, no logs. Served as the api is:
uvicorn with uvloop and httptools, no access log. DATABASE_URL names the
database.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from datetime import datetime

import msgspec
import uvicorn
from litestar import Litestar, get
from litestar.exceptions import NotFoundException
from psycopg.rows import class_row
from psycopg_pool import AsyncConnectionPool

READ_ONE = """
SELECT public_id, status::text AS status, progress, created_at, started_at, completed_at
FROM story_jobs WHERE public_id = %(public_id)s
"""


class BareJob(msgspec.Struct):
    public_id: uuid.UUID
    status: str
    progress: int | None
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None


def create_app(url: str, pool_size: int) -> Litestar:
    pool = AsyncConnectionPool(url, min_size=pool_size, max_size=pool_size, open=False,
                               kwargs={"autocommit": True})

    @contextlib.asynccontextmanager
    async def pool_open(_: Litestar) -> AsyncIterator[None]:
        await pool.open(wait=True)
        try:
            yield
        finally:
            await pool.close()

    @get("/stories/jobs/{job_id:uuid}")
    async def get_job(job_id: uuid.UUID) -> BareJob:
        async with pool.connection() as conn:
            cur = conn.cursor(row_factory=class_row(BareJob))
            await cur.execute(READ_ONE, {"public_id": job_id})
            job = await cur.fetchone()
        if job is None:
            raise NotFoundException()
        return job

    @get("/healthz")
    async def healthz() -> str:
        return "ok"

    return Litestar(route_handlers=[get_job, healthz], lifespan=[pool_open], logging_config=None, debug=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.peer_apps.bare_poll")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pool-size", type=int, default=10, help="pooled connections (the api's default, 10)")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(os.environ["DATABASE_URL"], args.pool_size), host="127.0.0.1", port=args.port,
                loop="uvloop", http="httptools", lifespan="on", access_log=False, log_level="warning",
                server_header=False)


if __name__ == "__main__":
    main()
