"""The OpenAPI document (api.enqueue generate_story) says what the route
enforces: POST /stories/generate requires its Idempotency-Key header, so
that a client generated from the document always sends one."""

from __future__ import annotations

from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client


async def test_the_document_marks_the_idempotency_key_required(pool: AsyncConnectionPool) -> None:
    async with api_client(pool) as client:
        document = (await client.get("/schema/openapi.json")).json()
    parameters = document["paths"]["/stories/generate"]["post"]["parameters"]
    [key] = [p for p in parameters if p["name"] == "Idempotency-Key"]
    assert (key["in"], key["required"]) == ("header", True)
