"""How Litestar resolves the api's dependencies: the ``conn`` dependency
enters its deadline (an asyncio.timeout, bound to the task that enters it) in
the request's own task, never in a task group beside another dependency; and
the poll resolves none at all (they cost 40 of its 300 us of CPU)."""

from __future__ import annotations

from litestar.routes import HTTPRoute
from psycopg_pool import AsyncConnectionPool

from api.app import create_app
from tests.support.settings import api_settings


def _batches() -> dict[tuple[str, str], list[set[str]]]:
    """{(method, path): the names of each batch of dependencies, in order} of every route."""
    app = create_app(api_settings(), AsyncConnectionPool("", open=False))
    found: dict[tuple[str, str], list[set[str]]] = {}
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for method, (_, kwargs_model) in route.route_handler_map.items():
            found[(method, route.path)] = [{dependency.key for dependency in batch}
                                           for batch in kwargs_model.dependency_batches]
    return found


def test_conn_is_resolved_alone_in_its_batch_on_every_route() -> None:
    """Wherever a handler takes ``conn``, nothing else is resolved beside it, so that it runs in the request's task."""
    batches = _batches()
    taking_conn = {where: order for where, order in batches.items() if any("conn" in batch for batch in order)}
    assert ("GET", "/ops/api/jobs") in taking_conn and ("DELETE", "/stories/jobs/{job_id:str}") in taking_conn
    shared = {where: batch for where, order in taking_conn.items() for batch in order if "conn" in batch and len(batch) > 1}
    assert shared == {}


def test_the_poll_resolves_no_dependency() -> None:
    """GET /stories/jobs/{job_id} opens its connection itself: no dependency, no task group, no cleanup group."""
    assert _batches()[("GET", "/stories/jobs/{job_id:str}")] == []
