"""The API documentation pages, with API_DOCS_PAGES=true (off by default):
/schema/swagger (Swagger UI), /schema/redoc (ReDoc) and /schema/rapidoc
(RapiDoc), each reading /schema/openapi.json.

They share their origin with the operators' console (/ops/), whose key
sits in the browser's storage, so they run nothing this package does not
ship: the viewers' bundles come from the openapi-ui-bundles package (read
once, served under /schema/assets/), Swagger UI is started by a script of
ours (api/static/docs-swagger.js), and a Content-Security-Policy lets them
load nothing from any other origin. Litestar's own render plugins would
load each viewer from a public CDN, unpinned, with an inline script.
/schema/elements is not served: no package ships Stoplight Elements.
"""

from __future__ import annotations

from pathlib import Path

import openapi_ui_bundles
from litestar import Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath

from api.page import STATIC_DIR
from api.problems import ProblemError

# 'unsafe-inline' styles only: the viewers set styles at run time (ReDoc's
# styled components, Swagger UI's and RapiDoc's style attributes); no
# inline script runs, and nothing is loaded from another origin.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

_SWAGGER = Path(openapi_ui_bundles.swagger_ui.static_path)
_REDOC = Path(openapi_ui_bundles.redoc.static_path)
_ASSETS: dict[str, tuple[Path, str]] = {
    "swagger-ui.css": (_SWAGGER / "swagger-ui.css", "text/css"),
    "swagger-ui-bundle.js": (_SWAGGER / "swagger-ui-bundle.js", "text/javascript"),
    "swagger-ui-standalone-preset.js": (_SWAGGER / "swagger-ui-standalone-preset.js", "text/javascript"),
    "redoc.standalone.js": (_REDOC / "redoc.standalone.js", "text/javascript"),
    "logo-mini.svg": (_REDOC / "logo-mini.svg", "image/svg+xml"),
    "rapidoc-min.js": (Path(openapi_ui_bundles.rapidoc.static_path) / "rapidoc-min.js", "text/javascript"),
    "docs-swagger.js": (STATIC_DIR / "docs-swagger.js", "text/javascript"),
}

_HEAD = (
    '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
    '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
    '<link rel="icon" href="/static/icon.svg" type="image/svg+xml">\n'
)
_PAGES = {
    "swagger": (
        f"{_HEAD}<title>storyjobs API: Swagger UI</title>\n"
        '<link rel="stylesheet" href="/schema/assets/swagger-ui.css">\n'
        '<script src="/schema/assets/swagger-ui-bundle.js" defer></script>\n'
        '<script src="/schema/assets/swagger-ui-standalone-preset.js" defer></script>\n'
        '<script src="/schema/assets/docs-swagger.js" defer></script>\n'
        '</head>\n<body>\n<div id="swagger-ui" data-spec-url="/schema/openapi.json"></div>\n</body>\n</html>\n'
    ),
    "redoc": (
        f"{_HEAD}<title>storyjobs API: ReDoc</title>\n"
        '<script src="/schema/assets/redoc.standalone.js" defer></script>\n'
        '</head>\n<body>\n<redoc spec-url="/schema/openapi.json"></redoc>\n</body>\n</html>\n'
    ),
    "rapidoc": (
        f"{_HEAD}<title>storyjobs API: RapiDoc</title>\n"
        '<script src="/schema/assets/rapidoc-min.js" defer></script>\n'
        '</head>\n<body>\n<rapi-doc spec-url="/schema/openapi.json" load-fonts="false" allow-spec-url-load="false" '
        'allow-spec-file-load="false" allow-server-selection="false" update-route="false"></rapi-doc>\n'
        "</body>\n</html>\n"
    ),
}
# ReDoc's one reference to its own CDN (the logo of its sidebar), pointed
# at the copy the package ships
_REWRITES = {
    "redoc.standalone.js": (b"https://cdn.redoc.ly/redoc/logo-mini.svg", b"/schema/assets/logo-mini.svg"),
}
_FILES: dict[str, bytes] = {}


def _asset(name: str) -> bytes:
    # read on first use: an api without the pages never reads them
    if name not in _FILES:
        content = _ASSETS[name][0].read_bytes()
        if name in _REWRITES:
            old, new = _REWRITES[name]
            if content.count(old) != 1:
                raise LookupError(f"{name} no longer refers to {old.decode()} once: check its other origins")
            content = content.replace(old, new)
        _FILES[name] = content
    return _FILES[name]


def _page_handler(viewer: str) -> BaseRouteHandler:
    body = _PAGES[viewer].encode()

    @get(f"/schema/{viewer}", include_in_schema=False, name=f"docs_{viewer}")
    async def page() -> Response[bytes]:
        return Response(body, media_type="text/html", headers=SECURITY_HEADERS)

    return page


@get("/schema/assets/{name:str}", include_in_schema=False)
async def docs_asset(name: FromPath[str]) -> Response[bytes]:
    # only the files above: a name is a key, never a path
    if name not in _ASSETS:
        raise ProblemError(404, "Not Found", "no such file")
    return Response(_asset(name), media_type=_ASSETS[name][1], headers=SECURITY_HEADERS)


ROUTES: list[BaseRouteHandler] = [*(_page_handler(viewer) for viewer in _PAGES), docs_asset]
