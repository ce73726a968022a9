"""How Litestar resolves the api's dependencies: every route's dependencies
form one chain, so that ``store`` and ``slots`` enter their deadline (an
asyncio.timeout, bound to the task that enters it) in the request's own task,
never in a task group beside another dependency; the client and the operator
are read from the store that checked their key; and the poll resolves none at
all (they cost 40 of its 300 us of CPU)."""

from __future__ import annotations

from typing import Any

from litestar import Litestar
from litestar.routes import HTTPRoute
from psycopg_pool import AsyncConnectionPool

from api.app import create_app
from api.auth import provide_client_store
from api.deps import provide_slots, provide_store
from api.ops.guard import provide_operator_store, store_checks_the_key
from tests.support.settings import api_settings

# what each dependency that takes a connection enters: the request's deadline
DEADLINE_DEPENDENCIES = {"store", "slots"}


def _app() -> Litestar:
    return create_app(api_settings(), AsyncConnectionPool("", open=False))


def _batches() -> dict[tuple[str, str], list[set[str]]]:
    """{(method, path): the names of each batch of dependencies, in order} of every route."""
    found: dict[tuple[str, str], list[set[str]]] = {}
    for route in _app().routes:
        if not isinstance(route, HTTPRoute):
            continue
        for method, (_, kwargs_model) in route.route_handler_map.items():
            found[(method, route.path)] = [{dependency.key for dependency in batch}
                                           for batch in kwargs_model.dependency_batches]
    return found


def _providers() -> dict[tuple[str, str], dict[str, Any]]:
    """{(method, path): {dependency name: its provider function}} of what each route's handler takes."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for route in _app().routes:
        if not isinstance(route, HTTPRoute):
            continue
        for method, (handler, _) in route.route_handler_map.items():
            taken = set(handler.parsed_fn_signature.parameters)
            found[(method, route.path)] = {name: provide.dependency
                                           for name, provide in handler.resolve_dependencies().items()
                                           if name in taken}
    return found


def test_every_route_resolves_its_dependencies_one_at_a_time() -> None:
    """No route resolves two dependencies in one batch (a task group), so ``store`` and ``slots`` run in the request's task."""
    batches = _batches()
    entering = {where for where, order in batches.items() if any(batch & DEADLINE_DEPENDENCIES for batch in order)}
    assert {("GET", "/ops/api/jobs"), ("DELETE", "/stories/jobs/{job_id:str}"), ("GET", "/stories/{story_id:str}"),
            ("POST", "/stories/generate"), ("GET", "/readyz"), ("POST", "/webhook-endpoints")} <= entering
    shared = {where: order for where, order in batches.items() if any(len(batch) > 1 for batch in order)}
    assert shared == {}


def test_the_client_and_the_operator_are_read_from_the_store_that_checked_their_key() -> None:
    """Wherever a handler takes ``client`` or ``operator``, it is resolved after the ``store`` whose connection checked the key."""
    batches, providers = _batches(), _providers()
    for where, order in batches.items():
        names = [name for batch in order for name in batch]
        for who, checker in (("client", provide_client_store), ("operator", provide_operator_store)):
            if who in names:
                assert "store" in names and names.index("store") < names.index(who), (where, names)
                assert providers[where]["store"] is checker, where
    assert "client" in [n for batch in batches[("DELETE", "/stories/jobs/{job_id:str}")] for n in batch]
    assert "operator" in [n for batch in batches[("POST", "/ops/api/cancel-pending")] for n in batch]


def test_every_console_endpoint_checks_the_operator_key_on_its_own_store() -> None:
    """Each /ops/api handler takes the store that checks the operator's key on its connection; only OPTIONS has the guard check it."""
    app = _app()
    checked: set[tuple[str, str]] = set()
    by_the_guard: set[tuple[str, str]] = set()
    for route in app.routes:
        if not isinstance(route, HTTPRoute) or not route.path.startswith("/ops/api/"):
            continue
        for method, (handler, _) in route.route_handler_map.items():
            (checked if store_checks_the_key(handler) else by_the_guard).add((method, route.path))
    assert len(checked) == 16 and {method for method, _ in checked} == {"GET", "POST", "PUT"}
    assert {method for method, _ in by_the_guard} == {"OPTIONS"}
    assert all(_providers()[where]["store"] is provide_operator_store for where in checked)


def test_the_routes_that_take_a_connection_for_part_of_their_answer_take_slots() -> None:
    """POST /stories/generate (its connection given back before the admission batch's) and /readyz take ``slots``; a story read, ``store``."""
    providers = _providers()
    assert providers[("POST", "/stories/generate")].get("slots") is provide_slots
    assert providers[("GET", "/readyz")].get("slots") is provide_slots
    assert providers[("GET", "/stories/{story_id:str}")].get("store") is provide_store
    assert "store" not in providers[("POST", "/stories/generate")]


def test_the_poll_resolves_no_dependency() -> None:
    """GET /stories/jobs/{job_id} takes its store itself: no dependency, no task group, no cleanup group."""
    assert _batches()[("GET", "/stories/jobs/{job_id:str}")] == []
