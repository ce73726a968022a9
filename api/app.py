"""The Litestar application: ``create_app(settings, pool)``.

The app holds no state of its own beyond a short cache of drain statistics:
any number of replicas can serve behind a load balancer. Handlers receive
what they need by dependency injection (api/deps.py): ``api_state``
(settings, pool, admissions), ``store`` (the api's queries on a pooled
connection under the request's deadline) and ``slots`` (the same, taken and
given back within the answer) everywhere; on the routes that act for a client
a ``store`` that checked the client's key and ``client`` (api/auth.py), on the
console's one that checked the operator's and ``operator``
(api/ops/guard.py). The pool is the caller's: ``python -m api`` opens and
closes it in a lifespan context manager (api/__main__.py), a test passes one
it already opened.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import psycopg
from litestar import Litestar, MediaType, Response, get
from litestar.di import NamedDependency, Provide
from litestar.enums import ScopeType
from litestar.openapi.config import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry import trace
from opentelemetry.trace import TracerProvider
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from psycopg_pool import AsyncConnectionPool

from api import docs_pages, metrics, openapi, ops, pacing, page, webhooks
from api.admission import AdmissionBatcher
from api.deps import ApiState, ConnectionSlots, provide_api_state, provide_slots
from api.jobs import ROUTES
from api.problems import EXCEPTION_HANDLERS, OUTAGE_RETRY_AFTER_S, ProblemError, problem_responses
from api.schemas import Health
from shared import db
from shared.config import ApiSettings

# a story request is a prompt of at most 2000 characters and a few options
MAX_BODY_BYTES = 32 * 1024
# how long /readyz waits for the database before it says "not ready"
READY_TIMEOUT_S = 2.0


# the methods the api's routes answer; any other is counted as OTHER, so that
# a client cannot add series by inventing methods
_ROUTED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _record_http_metrics(app: ASGIApp) -> ASGIApp:
    """Counts and times every HTTP answer, by method, route and status.

    It wraps the app's whole handler (``app.asgi_handler``, outside the
    exception handler that turns errors into answers), not each route: as a
    route middleware it would also make Litestar put a second exception
    handler around every route, and the two cost the poll, the hottest path,
    about a tenth of its time in the api's code."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_recording_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_recording_status)
        finally:
            method = scope["method"] if scope["method"] in _ROUTED_METHODS else "OTHER"
            route = scope.get("path_template") or "unmatched"
            requests, duration = metrics.http_series(method, route, str(status))
            requests.inc()
            duration.observe(time.perf_counter() - started)

    return middleware


@get("/healthz", summary="Liveness: the process serves requests", include_in_schema=True)
async def healthz() -> Health:
    return Health(status="ok")


@get(
    "/readyz",
    summary="Readiness: the database answers",
    responses=problem_responses(503),
)
async def readyz(api_state: NamedDependency[ApiState], slots: NamedDependency[ConnectionSlots]) -> Response[Health]:
    # ``slots``: a connection that cannot be made is the
    # answer's subject here, and this handler must see the failure to say why
    try:
        async with asyncio.timeout(READY_TIMEOUT_S), slots.store() as store:
            await store.ping()
    except (psycopg.OperationalError, TimeoutError) as exc:
        detail = f"the database does not answer ({type(exc).__name__})"
        if await _refused_by_pooler(api_state.pool):
            detail = db.POOLER_REFUSED_OPTIONS
        raise ProblemError(503, "Service Unavailable", detail,
                           headers={"Retry-After": str(OUTAGE_RETRY_AFTER_S)}) from None
    return Response(Health(status="ok"))


async def _refused_by_pooler(pool: AsyncConnectionPool) -> bool:
    """Whether the pool cannot connect because a transaction pooler refuses
    its startup options: a pool's timeout does not say why its connections
    fail, so one is tried here, as the pool makes them."""
    if not isinstance(pool.conninfo, str) or not isinstance(pool.kwargs, dict):
        return False
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            conn = await pool.connection_class.connect(pool.conninfo, **pool.kwargs)
            await conn.close()
    except (psycopg.OperationalError, TimeoutError) as exc:
        return db.refused_by_pooler(exc)
    return False


def _metrics_registry() -> CollectorRegistry:
    """This process's metrics, or every api process's when several share a
    port (API_WORKERS > 1 sets PROMETHEUS_MULTIPROC_DIR)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return REGISTRY
    registry = CollectorRegistry()
    # prometheus_client ships no annotations for this constructor
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


@get("/metrics", media_type=MediaType.TEXT, include_in_schema=False)
async def prometheus_metrics() -> Response[bytes]:
    return Response(generate_latest(_metrics_registry()), media_type=CONTENT_TYPE_LATEST)


def create_app(
    settings: ApiSettings,
    pool: AsyncConnectionPool,
    *,
    lifespan: Sequence[Callable[[Litestar], AbstractAsyncContextManager[None]]] = (),
    tracer_provider: TracerProvider | None = None,
) -> Litestar:
    """The api around ``pool``; ``lifespan`` wraps the server's life (the
    process's own pool is opened and closed there); ``tracer_provider``:
    traces on (api/tracing.py), else none at all."""
    plugins: list[Any] = []
    middleware: list[Any] = []
    if tracer_provider is not None:
        # imported only then: without traces nothing of the instrumentation is loaded
        from api import tracing

        plugins.append(tracing.plugin(tracer_provider))
        middleware.append(tracing.route_span_name)
    app = Litestar(
        plugins=plugins,
        middleware=middleware,
        route_handlers=[ROUTES, webhooks.ROUTES, ops.ROUTES, healthz, readyz, prometheus_metrics,
                        *page.ROUTES, *(docs_pages.ROUTES if settings.api_docs_pages else [])],
        dependencies={
            "api_state": Provide(provide_api_state, sync_to_thread=False),
            "slots": Provide(provide_slots),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=list(lifespan),
        request_max_body_size=MAX_BODY_BYTES,
        # logging is structlog's (shared/logs.py); Litestar's default set-up
        # would add a queue-listener thread of its own
        logging_config=None,
        openapi_config=OpenAPIConfig(
            title="storyjobs",
            version="1",
            description="Bedtime stories written by an LLM, as background jobs: start one, then poll it.",
            path="/schema",
            # the document only: Litestar's pages load their viewers from
            # public CDNs; ours are api/docs_pages.py's
            render_plugins=[JsonRenderPlugin()],
            components=Components(
                security_schemes={
                    "BearerAuth": SecurityScheme(type="http", scheme="bearer",
                                                 description="An API key from `storyjobs keys create`."),
                    "OperatorKey": SecurityScheme(
                        type="http", scheme="bearer",
                        description="An operator key from `storyjobs keys create NAME --operator`: the /ops "
                                    "endpoints take no other."),
                }
            ),
        ),
        debug=False,
    )
    app.state.storyjobs = ApiState(
        settings=settings,
        pool=pool,
        connection_slots=ConnectionSlots(pool, settings.api_db_wait_s),
        drain_stats=pacing.DrainStatsCache(pool, model=settings.llm_model),
        admissions=AdmissionBatcher(
            pool, queue_max=settings.queue_max, client_queue_max=settings.effective_client_queue_max,
            connection_wait_s=settings.api_db_wait_s, budget_usd=settings.budget_usd_per_day,
            client_budget_usd=settings.client_budget_usd_per_day, batch_queue_max=settings.batch_queue_max,
            client_batch_queue_max=settings.effective_client_batch_queue_max,
            tracer=trace.get_tracer("storyjobs.api", tracer_provider=tracer_provider),
        ),
    )
    app.asgi_handler = _record_http_metrics(app.asgi_handler)
    openapi.refine(app.openapi_schema)
    return app
