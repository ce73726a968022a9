"""OPTIONS answers that list every method of their resource.

Litestar 2 gives a path its automatic OPTIONS handler when the path's first
handler is registered, and keeps that one when another handler of the same
path is added: its Allow lists the first handler's methods only (litestar
issue 4169, fixed in Litestar 3), so OPTIONS /stories/jobs/{id} left out
DELETE. ``with_options`` gives each path that several handlers serve an
OPTIONS handler of its own, made from all of them and registered first, so
that Litestar makes none.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from litestar import MediaType, Response
from litestar.enums import HttpMethod
from litestar.handlers import HTTPRouteHandler


def with_options(handlers: Sequence[HTTPRouteHandler]) -> list[HTTPRouteHandler]:
    """``handlers``, preceded by an OPTIONS handler for each path that more
    than one of them serves. An OPTIONS handler is owned by the router it is
    registered on, so it answers behind the same guards as its path's
    handlers."""
    methods: dict[str, set[str]] = defaultdict(set)
    served_by: dict[str, int] = defaultdict(int)
    for handler in handlers:
        for path in handler.paths:
            methods[path].update(handler.http_methods)
            served_by[path] += 1
    answers = [_options_handler(path, methods[path]) for path in sorted(methods) if served_by[path] > 1]
    return [*answers, *handlers]


def _options_handler(path: str, methods: set[str]) -> HTTPRouteHandler:
    allow = ", ".join(sorted({*methods, HttpMethod.OPTIONS.value}))

    def options_handler() -> Response[None]:
        # as Litestar's own OPTIONS answer, with every method of the path
        return Response(content=None, status_code=204, headers={"Allow": allow}, media_type=MediaType.TEXT)

    return HTTPRouteHandler(path=path, http_method=[HttpMethod.OPTIONS], include_in_schema=False,
                            sync_to_thread=False)(options_handler)
