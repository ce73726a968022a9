"""GET /: the small page a parent uses, and GET /ops/: the operators'
console (static files under api/static/).

No build step: index.html, app.js and style.css for the parents; ops.html,
ops.js (with its screens' modules, ops-*.js, and format.js) and ops.css for
the operators; base.css and http.js (an ES module
both scripts import) for both; an icon. They are read once at import
and served with a Content-Security-Policy that lets a page run only its own
script and style: stories and error texts are LLM and provider output, and
both pages insert them, like every value from the api, as text only.

The console's page itself holds no data and needs no key (a browser cannot
send a header when it navigates); everything it shows comes from
/ops/api, which does (api/ops/).
"""

from __future__ import annotations

from pathlib import Path

from litestar import Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath

from api.problems import ProblemError

STATIC_DIR = Path(__file__).parent / "static"

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # no versioned file names: revalidate, so a deploy shows at once
    "Cache-Control": "no-cache",
}

# Litestar adds "; charset=utf-8" to text/* itself
_MEDIA_TYPES = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "http.js": "text/javascript",
    "base.css": "text/css",
    "style.css": "text/css",
    "icon.svg": "image/svg+xml",
    "ops.html": "text/html",
    "ops.js": "text/javascript",
    "ops-ui.js": "text/javascript",
    "ops-overview.js": "text/javascript",
    "ops-jobs.js": "text/javascript",
    "ops-batches.js": "text/javascript",
    "ops-job.js": "text/javascript",
    "ops-clients.js": "text/javascript",
    "ops-workers.js": "text/javascript",
    "ops-actions.js": "text/javascript",
    "ops-webhooks.js": "text/javascript",
    "format.js": "text/javascript",
    "ops.css": "text/css",
}
# pages, served at their own paths, not under /static/
_PAGES = {"index.html", "ops.html"}
_FILES = {name: (STATIC_DIR / name).read_bytes() for name in _MEDIA_TYPES}


def _file(name: str) -> Response[bytes]:
    return Response(_FILES[name], media_type=_MEDIA_TYPES[name], headers=SECURITY_HEADERS)


@get("/", include_in_schema=False)
async def index() -> Response[bytes]:
    return _file("index.html")


@get(["/ops", "/ops/"], include_in_schema=False)
async def ops_console() -> Response[bytes]:
    return _file("ops.html")


@get("/static/{name:str}", include_in_schema=False)
async def static_file(name: FromPath[str]) -> Response[bytes]:
    # only the files above: a name is a key, never a path
    if name not in _FILES or name in _PAGES:
        raise ProblemError(404, "Not Found", "no such file")
    return _file(name)


ROUTES: list[BaseRouteHandler] = [index, ops_console, static_file]
