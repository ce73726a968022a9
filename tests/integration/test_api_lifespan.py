"""The api process's pool lives exactly as long as its server: opened by the
lifespan before the first request, closed after the last."""

from __future__ import annotations

from litestar.testing import AsyncTestClient

from api.__main__ import pool_lifespan
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
