"""The api's HTTP metrics count every answer, errors and unrouted requests
included, under a bounded set of label values."""

from __future__ import annotations

import uuid

from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client, new_key

_POLL = "/stories/jobs/{job_id}"


def _answered(method: str, route: str, status: int) -> float:
    return REGISTRY.get_sample_value("storyjobs_http_requests_total",
                                     {"method": method, "route": route, "status": str(status)}) or 0.0


def _timed(method: str, route: str) -> float:
    return REGISTRY.get_sample_value("storyjobs_http_request_duration_seconds_count",
                                     {"method": method, "route": route}) or 0.0


async def test_every_answer_of_a_route_is_counted_and_timed_by_its_status(
    pool: AsyncConnectionPool, api_key: str
) -> None:
    """A poll answered 200, one answered 404 and one refused 401 each count once under the poll's route, and all
    three are timed."""
    async with api_client(pool, api_key) as client, api_client(pool, "sj_000000000000_" + "x" * 43) as stranger:
        job_url = (await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
                   ).headers["location"]
        before = {status: _answered("GET", _POLL, status) for status in (200, 404, 401)}
        timed_before = _timed("GET", _POLL)
        assert (await client.get(job_url)).status_code == 200
        assert (await client.get(f"/stories/jobs/{uuid.uuid4()}")).status_code == 404
        assert (await stranger.get(job_url)).status_code == 401
    assert {status: _answered("GET", _POLL, status) - before[status] for status in before} == {
        200: 1, 404: 1, 401: 1}
    assert _timed("GET", _POLL) - timed_before == 3


async def test_an_unrouted_path_and_an_invented_method_are_counted_under_fixed_labels(
    pool: AsyncConnectionPool, api_key: str
) -> None:
    """A path no route serves counts as route "unmatched", a method no route takes as "OTHER": a client cannot
    add series by inventing paths or methods."""
    path = f"/no/such/{uuid.uuid4()}"
    async with api_client(pool, api_key) as client:
        unmatched_before = _answered("GET", "unmatched", 404)
        other_before = sum(_answered("OTHER", route, status) for route in (_POLL, "unmatched")
                           for status in (404, 405))
        assert (await client.get(path)).status_code == 404
        assert (await client.request("BREW", f"/stories/jobs/{uuid.uuid4()}")).status_code in (404, 405)
    assert _answered("GET", "unmatched", 404) - unmatched_before == 1
    assert sum(_answered("OTHER", route, status) for route in (_POLL, "unmatched")
               for status in (404, 405)) - other_before == 1
    assert REGISTRY.get_sample_value("storyjobs_http_requests_total",
                                     {"method": "BREW", "route": _POLL, "status": "405"}) is None
