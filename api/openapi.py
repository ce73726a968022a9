"""What the OpenAPI document (GET /schema/openapi.json, Litestar's own) says
beyond what Litestar derives from the handlers: the headers of answers, and
request bodies that refuse unknown fields. Applied once, when the app is
built; tests/system/test_api_schema.py holds the api to the document."""

from __future__ import annotations

from litestar.openapi.spec import (
    OpenAPI,
    OpenAPIHeader,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Reference,
    Schema,
)

from api.webhooks import EndpointCreate
from shared.story_request import StoryRequest

_SECONDS = Schema(type=OpenAPIType.INTEGER, minimum=0)
_RETRY_AFTER = OpenAPIHeader(schema=_SECONDS, required=True, description="Seconds to wait before trying again.")

# the success answers' headers, by (path, method)
SUCCESS_HEADERS: dict[tuple[str, str], dict[str, OpenAPIHeader]] = {
    ("/stories/generate", "post"): {
        "Location": OpenAPIHeader(schema=Schema(type=OpenAPIType.STRING), required=True,
                                  description="Where to poll the job."),
        "Retry-After": OpenAPIHeader(schema=_SECONDS, required=True,
                                     description="Seconds until polling the job is worth it."),
        "Idempotent-Replayed": OpenAPIHeader(
            schema=Schema(type=OpenAPIType.STRING, enum=["true"]), required=False,
            description="`true` when this answers an earlier request with the same Idempotency-Key.",
        ),
    },
    ("/stories/jobs/{job_id}", "get"): {
        "Retry-After": OpenAPIHeader(schema=_SECONDS, required=False,
                                     description="While the job is pending or running: seconds until "
                                                 "polling again is worth it (while drafts are on, at most two "
                                                 "draft intervals for a running job)."),
        "ETag": OpenAPIHeader(schema=Schema(type=OpenAPIType.STRING), required=True,
                              description="A weak validator over what a client shows of the job (status, queue "
                                          "position, progress, the draft's length, the story or error), not "
                                          "the estimate: send it back in If-None-Match."),
        "Cache-Control": OpenAPIHeader(schema=Schema(type=OpenAPIType.STRING, enum=["private, no-cache"]),
                                       required=True,
                                       description="A browser may keep the answer, and revalidates it on "
                                                   "every poll."),
    },
}
# the statuses besides 2xx whose answers carry a route's success headers
# (a 304 carries the validators and the pacing of the 200 it stands for)
REVALIDATED = ("304",)
# the headers of error answers, by status, on every route
HEADERS_BY_STATUS: dict[str, dict[str, OpenAPIHeader]] = {
    "401": {
        "WWW-Authenticate": OpenAPIHeader(
            schema=Schema(type=OpenAPIType.STRING), required=True,
            description='`Bearer realm="storyjobs"`, with `error="invalid_token"` when a key was refused.',
        ),
    },
    "429": {"Retry-After": _RETRY_AFTER},
    "503": {"Retry-After": _RETRY_AFTER},
}
# request bodies decoded with forbid_unknown_fields
CLOSED_BODIES = (StoryRequest, EndpointCreate)


def _operations(openapi: OpenAPI) -> dict[tuple[str, str], Operation]:
    found = {}
    for path, item in (openapi.paths or {}).items():
        for method in ("get", "put", "post", "delete", "options", "head", "patch", "trace"):
            operation = getattr(item, method, None)
            if operation is not None:
                found[(path, method)] = operation
    return found


def _add_headers(response: OpenAPIResponse | Reference, headers: dict[str, OpenAPIHeader]) -> None:
    if isinstance(response, OpenAPIResponse):
        response.headers = {**(response.headers or {}), **headers}


def refine(openapi: OpenAPI) -> None:
    operations = _operations(openapi)
    for where, headers in SUCCESS_HEADERS.items():
        if where not in operations:
            raise LookupError(f"no operation {where} to document the headers of")
        responses = operations[where].responses or {}
        for status in (s for s in responses if s.startswith("2") or s in REVALIDATED):
            _add_headers(responses[status], headers)
    for operation in operations.values():
        for status, response in (operation.responses or {}).items():
            if status in HEADERS_BY_STATUS:
                _add_headers(response, HEADERS_BY_STATUS[status])
    schemas = openapi.components.schemas if openapi.components else {}
    for body in CLOSED_BODIES:
        schema = schemas.get(body.__name__)
        if isinstance(schema, Schema):
            schema.additional_properties = False
