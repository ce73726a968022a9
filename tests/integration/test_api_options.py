"""OPTIONS on every path of the api lists every method the path serves, with
the key its other methods take (a client's, an operator's under /ops/api)."""

from __future__ import annotations

import re
from typing import Any

import psycopg
from litestar.routes import HTTPRoute
from psycopg_pool import AsyncConnectionPool

from api.app import create_app
from tests.support import ops_seed as seed
from tests.support.api_client import api_client
from tests.support.settings import api_settings

# a value for each kind of path parameter: OPTIONS looks nothing up
_PARAMETER = re.compile(r"\{(\w+):(\w+)\}")
_VALUES = {"str": "00000000-0000-0000-0000-000000000000", "int": "1", "path": "x"}


def _served() -> dict[str, set[str]]:
    """{path template: the methods its handlers serve, OPTIONS included} of every HTTP route of the app."""
    app = create_app(api_settings(api_docs_pages=True), AsyncConnectionPool("", open=False))
    return {route.path: set(route.route_handler_map) for route in app.routes if isinstance(route, HTTPRoute)}


def _allowed(answer: Any) -> set[str]:
    return {method.strip() for method in answer.headers.get("allow", "").split(",") if method.strip()}


async def test_options_lists_every_method_of_every_path(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str
) -> None:
    """Each path answers OPTIONS 204 with an Allow header equal to the methods it serves, a path of two
    handlers (GET and DELETE /stories/jobs/{id}, POST and GET /webhook-endpoints) included."""
    operator_key = await seed.operator_key(conn)
    served = _served()
    assert served["/stories/jobs/{job_id:str}"] == {"GET", "DELETE", "OPTIONS"}
    assert served["/webhook-endpoints"] == {"GET", "POST", "OPTIONS"}
    async with api_client(pool, api_docs_pages=True) as client:
        for template, methods in served.items():
            path = _PARAMETER.sub(lambda match: _VALUES[match.group(2)], template)
            key = operator_key if template.startswith("/ops/api/") else api_key
            answer = await client.options(path, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 204, (template, answer.status_code, answer.text)
            assert _allowed(answer) == methods, (template, answer.headers.get("allow"))


async def test_options_under_ops_api_takes_an_operator_key(pool: AsyncConnectionPool, api_key: str) -> None:
    """OPTIONS under /ops/api checks the operator key as every other answer there does: a client's key gets 401."""
    async with api_client(pool) as client:
        answer = await client.options("/ops/api/cancel-pending", headers={"Authorization": f"Bearer {api_key}"})
    assert answer.status_code == 401
