"""RFC 9457 problem details for every error the api answers.

Handlers raise ``ProblemError``; exception handlers turn it, Litestar's own
HTTP exceptions, database outages and timeouts (503 with Retry-After) and
anything unexpected (500, logged once, no traceback in the answer) into
``application/problem+json``.

Log lines about failures carry the route, never the request: a prompt may hold
a child's name and a header an API key, so neither exception messages nor
tracebacks with local variables are logged, only the exception's type and
where it was raised.
"""

from __future__ import annotations

import traceback
from typing import Any

import msgspec
import psycopg
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi.datastructures import ResponseSpec
from psycopg_pool import PoolTimeout

from api import metrics
from shared import db

log = structlog.get_logger()

PROBLEM_JSON = "application/problem+json"
# how long a client should wait after a 503 before trying again
OUTAGE_RETRY_AFTER_S = 5


class FieldError(msgspec.Struct, frozen=True):
    field: str
    message: str


class Problem(msgspec.Struct, frozen=True, omit_defaults=True):
    """An error answer (RFC 9457)."""

    title: str
    status: int
    type: str = "about:blank"
    detail: str | None = None
    errors: list[FieldError] | None = None


class ProblemError(Exception):
    def __init__(
        self,
        status: int,
        title: str,
        detail: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        errors: list[FieldError] | None = None,
        reason: str | None = None,
        type: str = "about:blank",  # noqa: A002 - RFC 9457 names it so
    ) -> None:
        super().__init__(detail or title)
        self.problem = Problem(type=type, title=title, status=status, detail=detail, errors=errors)
        self.headers = headers or {}
        # the storyjobs_jobs_rejected_total label, for POST rejections
        self.reason = reason


_DESCRIPTIONS = {
    400: "The request is malformed; `errors` names the fields.",
    401: "No API key, or an invalid or revoked one (`WWW-Authenticate`).",
    404: "No such job or story for this API key.",
    409: "The job has already finished.",
    413: "The body is larger than allowed.",
    422: "This Idempotency-Key was used with a different body.",
    429: ("A queue is full, or a spend budget is (type `/problems/budget-exhausted`, until the UTC day "
          "ends); nothing was stored. Retry later (`Retry-After`) with the same key."),
    503: "The job store is unreachable. Retry later (`Retry-After`).",
}


def problem_responses(*statuses: int, described: dict[int, str] | None = None) -> dict[int, ResponseSpec]:
    """OpenAPI: the problem+json answers a route can give (their headers are
    added by api.openapi); ``described`` words some of them for the route."""
    descriptions = {**_DESCRIPTIONS, **(described or {})}
    return {
        status: ResponseSpec(data_container=Problem, media_type=PROBLEM_JSON,
                             description=descriptions[status], generate_examples=False)
        for status in statuses
    }


def problem_response(problem: Problem, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(
        content=msgspec.json.encode(problem),
        status_code=problem.status,
        media_type=PROBLEM_JSON,
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


def unauthorized(detail: str, *, invalid_key: bool = True) -> ProblemError:
    # RFC 6750: error="invalid_token" when a key was sent but is not accepted
    challenge = 'Bearer realm="storyjobs", error="invalid_token"' if invalid_key else 'Bearer realm="storyjobs"'
    return ProblemError(401, "Unauthorized", detail, headers={"WWW-Authenticate": challenge}, reason="unauthorized")


def _route(request: Request[Any, Any, Any]) -> str:
    return str(request.scope.get("path_template") or "unmatched")


def _raised_at(exc: BaseException, frames: int = 8) -> list[str]:
    """Where ``exc`` was raised: file, line and function of its last frames."""
    summary = traceback.extract_tb(exc.__traceback__)[-frames:]
    return [f"{frame.filename}:{frame.lineno} in {frame.name}" for frame in summary]


def _on_problem(request: Request[Any, Any, Any], exc: ProblemError) -> Response[bytes]:
    if exc.reason is not None and request.scope.get("path_template") == "/stories/generate":
        metrics.JOBS_REJECTED.labels(reason=exc.reason).inc()
    return problem_response(exc.problem, exc.headers)


def _validation_errors(exc: ValidationException) -> list[FieldError]:
    errors = []
    for item in exc.extra if isinstance(exc.extra, list) else []:
        if isinstance(item, dict):
            field = str(item.get("key") or item.get("source") or "body")
            errors.append(FieldError(field=field, message=str(item.get("message", ""))))
    return errors


def _on_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    if isinstance(exc, ValidationException):
        errors = _validation_errors(exc)
        detail = "; ".join(f"{e.field}: {e.message}" if e.field != "body" else e.message for e in errors)
        problem = Problem(title="Invalid request", status=400, detail=detail or exc.detail, errors=errors or None)
        reason = "invalid_request"
    else:
        problem = Problem(title=_TITLES.get(status, exc.detail or "Error"), status=status, detail=exc.detail or None)
        reason = "body_too_large" if status == 413 else "invalid_request"
    if status >= 500:
        log.error("api.unhandled_error", route=_route(request), method=request.method, status=status,
                  error=type(exc).__name__, raised_at=_raised_at(exc))
    elif _route(request) == "/stories/generate":
        metrics.JOBS_REJECTED.labels(reason=reason).inc()
    headers = {k: v for k, v in (exc.headers or {}).items()}
    return problem_response(problem, headers)


def _on_database_unavailable(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.warning("api.database_unavailable", route=_route(request), method=request.method, error=type(exc).__name__)
    if _route(request) == "/stories/generate":
        metrics.JOBS_REJECTED.labels(reason="database_unavailable").inc()
    return problem_response(
        Problem(title="Service Unavailable", status=503, detail="the job store is unreachable; try again shortly"),
        {"Retry-After": str(OUTAGE_RETRY_AFTER_S)},
    )


def _on_database_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """A read-only database during a failover, a serialization failure, a
    lock timeout: the same statement succeeds later, so 503 and Retry-After.
    Anything else the database refuses is a bug: 500."""
    if db.is_transient(exc):
        return _on_database_unavailable(request, exc)
    return _on_unexpected(request, exc)


def _on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.error("api.unhandled_error", route=_route(request), method=request.method, status=500,
              error=type(exc).__name__, raised_at=_raised_at(exc))
    return problem_response(Problem(title="Internal Server Error", status=500))


def _on_exception_group(request: Request[Any, Any, Any], exc: ExceptionGroup[Exception]) -> Response[bytes]:
    """What a generator dependency raised while the handler's exception was
    thrown into it, which Litestar raises in a group: the ``store``
    dependency's deadline (api.deps) turns the cancellation it caused into
    TimeoutError there. Answered as the group's first exception would be."""
    first = exc.exceptions[0]
    handler = next(EXCEPTION_HANDLERS[kind] for kind in type(first).__mro__ if kind in EXCEPTION_HANDLERS)
    response: Response[bytes] = handler(request, first)
    return response


_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

EXCEPTION_HANDLERS: dict[Any, Any] = {
    ProblemError: _on_problem,
    HTTPException: _on_http_exception,
    psycopg.OperationalError: _on_database_unavailable,
    psycopg.Error: _on_database_error,
    PoolTimeout: _on_database_unavailable,
    # the api's own deadline on database work (see api.deps)
    TimeoutError: _on_database_unavailable,
    ExceptionGroup: _on_exception_group,
    Exception: _on_unexpected,
}
