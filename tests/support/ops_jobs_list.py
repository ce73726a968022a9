"""The console's jobs list as its tests walk it: a history of two clients'
jobs in every state, the ids a filter should list, and every page of the
list followed through next_cursor."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import httpx
import psycopg

from tests.support import ops_seed as seed

OPS = "/ops/api"


async def history(conn: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    """Two clients' jobs in every state over the last two days, oldest first."""
    acme, _ = await seed.client(conn, "acme")
    globex, _ = await seed.client(conn, "globex")
    jobs = []
    for n in range(40):
        owner = acme if n % 3 else globex
        ago = 2 * 86400 - n * 4000
        if n % 7 == 0:
            jobs.append(seed.failed(owner, ago, "llm_error", calls=[seed.Call("failed", cost_usd=Decimal("0.01"))]))
        elif n % 11 == 0:
            jobs.append(seed.failed(owner, ago, "queue_timeout"))
        else:
            jobs.append(seed.completed(owner, ago))
    jobs += [seed.running(acme, 30), seed.running(globex, 20)]
    jobs += [seed.pending(owner, 15 - n) for n, owner in enumerate([acme, globex, acme, acme, globex])]
    await seed.insert_jobs(conn, jobs)
    return {"acme": acme, "globex": globex}


async def expected_ids(conn: psycopg.AsyncConnection[Any], where: str, params: dict[str, Any], live: bool) -> list[str]:
    order = "created_at DESC, id DESC" if live else "id DESC"
    cur = await conn.execute(f"SELECT public_id::text FROM story_jobs WHERE {where} ORDER BY {order}",  # noqa: S608
                             params)
    return [row[0] for row in await cur.fetchall()]


async def every_page(client: httpx.AsyncClient, params: dict[str, Any], limit: int) -> tuple[list[str], int]:
    """The job ids of every page, following next_cursor; and how many requests that took."""
    found: list[str] = []
    cursor = None
    for requests in range(1, 200):
        answer = await client.get(f"{OPS}/jobs", params={**params, "limit": limit,
                                                           **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        assert answer.headers["cache-control"] == "no-store"
        page = answer.json()
        assert len(page["jobs"]) <= limit
        found += [job["job_id"] for job in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return found, requests
    raise AssertionError("the list never ended")
