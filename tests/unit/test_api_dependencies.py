"""How Litestar resolves the api's dependencies: every route's dependencies
form one chain, so that ``store`` and ``slots`` enter their deadline (an
asyncio.timeout, bound to the task that enters it) in the request's own task,
never in a task group beside another dependency; the operator is read from
the store that checked their key; and a client's routes resolve none at all,
the poll's way (they cost 40 of its 300 us of CPU)."""

from __future__ import annotations

from typing import Any

from litestar import Litestar
from litestar.routes import HTTPRoute
from psycopg_pool import AsyncConnectionPool

from api.app import create_app
from api.deps import provide_slots
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
    assert {("GET", "/ops/api/jobs"), ("POST", "/ops/api/cancel-pending"), ("GET", "/readyz")} <= entering
    shared = {where: order for where, order in batches.items() if any(len(batch) > 1 for batch in order)}
    assert shared == {}


def test_the_operator_is_read_from_the_store_that_checked_their_key() -> None:
    """Wherever a handler takes ``operator``, it is resolved after the ``store`` whose connection checked the key."""
    batches, providers = _batches(), _providers()
    for where, order in batches.items():
        names = [name for batch in order for name in batch]
        if "operator" in names:
            assert "store" in names and names.index("store") < names.index("operator"), (where, names)
            assert providers[where]["store"] is provide_operator_store, where
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


def test_readiness_takes_slots() -> None:
    """/readyz takes ``slots``: it must see the failure to take a connection to say why."""
    assert _providers()[("GET", "/readyz")].get("slots") is provide_slots


def test_every_client_route_resolves_no_dependency() -> None:
    """Each client route takes its store itself, the poll's way: no dependency, no task group, no cleanup group."""
    batches = _batches()
    client_routes = {where for where in batches
                     if where[1].startswith(("/stories/", "/webhook-endpoints")) and where[0] != "OPTIONS"}
    assert {("POST", "/stories/generate"), ("GET", "/stories/jobs/{job_id:str}"),
            ("DELETE", "/stories/jobs/{job_id:str}"), ("GET", "/stories/{story_id:str}"),
            ("POST", "/webhook-endpoints"), ("GET", "/webhook-endpoints"),
            ("DELETE", "/webhook-endpoints/{endpoint_id:str}"),
            ("POST", "/webhook-endpoints/{endpoint_id:str}/rotate-secret")} == client_routes
    assert {where: batches[where] for where in client_routes} == {where: [] for where in client_routes}
