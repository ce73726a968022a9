"""The api process's pool lives exactly as long as its server: opened by the
lifespan before the first request, closed after the last; and what the
process made to start is frozen out of the garbage collector's walks."""

from __future__ import annotations

import gc

from litestar.testing import AsyncTestClient

from api.__main__ import pool_lifespan, startup_heap_frozen
from api.app import create_app
from shared import db
from tests.support.settings import api_settings


async def test_the_lifespan_opens_the_pool_for_the_server_and_closes_it_after(database_url: str) -> None:
    """A pool handed to create_app unopened is open while the app serves (readyz answers 200) and closed once
    the app has shut down."""
    pool = db.make_pool(database_url, application_name="storyjobs-test", connect_timeout_s=5,
                        statement_timeout_s=5, min_size=1, max_size=2, wait_timeout_s=5)
    app = create_app(api_settings(), pool, lifespan=[pool_lifespan(pool)])
    assert pool.closed
    async with AsyncTestClient(app) as client:
        assert not pool.closed
        assert (await client.get("/readyz")).status_code == 200
    assert pool.closed


async def test_what_the_app_made_to_start_is_frozen_before_the_first_request(database_url: str) -> None:
    """Once the server has started, the app and its pool are in the collector's permanent generation, which
    a full collection does not walk; an object made by a request afterwards is not."""
    pool = db.make_pool(database_url, application_name="storyjobs-test", connect_timeout_s=5,
                        statement_timeout_s=5, min_size=1, max_size=2, wait_timeout_s=5)
    app = create_app(api_settings(), pool, lifespan=[pool_lifespan(pool), startup_heap_frozen])
    assert any(tracked is app for tracked in gc.get_objects())
    try:
        async with AsyncTestClient(app) as client:
            frozen = gc.get_freeze_count()
            answer = await client.get("/readyz")
            walked = gc.get_objects()
            assert frozen > 0 and answer.status_code == 200
            assert not any(tracked is app or tracked is pool for tracked in walked)
            assert any(tracked is answer for tracked in walked)
    finally:
        gc.unfreeze()
