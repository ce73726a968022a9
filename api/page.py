"""GET /: the small page a parent uses (static files under api/static/)."""

from __future__ import annotations

from litestar.handlers import BaseRouteHandler

ROUTES: list[BaseRouteHandler] = []
