"""The command-line client's retries (tools/client.py) against a small
in-process api of the test's own, with stamina's testing mode on: the waits
are skipped, the rules are not."""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import httpx
import pytest
import stamina

from tools import client
from tools.client import (
    EXIT_QUEUE_FULL,
    EXIT_UNAVAILABLE,
    ClientError,
    StatusLine,
    StoryPrinter,
    start_job,
    wait_for_job,
)


class ScriptedApi:
    """An ASGI app answering each request with the next (status, body, headers) of its script; it records
    each request's method, path and headers."""

    def __init__(self, *answers: tuple[int, dict[str, Any], dict[str, str]]) -> None:
        self.answers = list(answers)
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any,
                       send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        assert scope["type"] == "http"
        self.requests.append({"method": scope["method"], "path": scope["path"],
                              "query": scope.get("query_string", b"").decode(),
                              "headers": {k.decode(): v.decode() for k, v in scope["headers"]}})
        status, body, headers = self.answers.pop(0)
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                *((k.encode(), v.encode()) for k, v in headers.items())]})
        await send({"type": "http.response.body", "body": payload})


@pytest.fixture(autouse=True)
def stamina_testing() -> Iterator[None]:
    """stamina's testing mode: no waits, at most 10 attempts."""
    with stamina.set_testing(True, attempts=10, cap=True):
        yield


def _client(api: ScriptedApi) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://api.test")


PROBLEM_503 = (503, {"title": "Service Unavailable", "status": 503}, {"retry-after": "1"})
ACCEPTED: tuple[int, dict[str, Any], dict[str, str]] = (202, {"job_id": "j1", "status": "pending"}, {})


async def test_a_post_is_retried_through_503s_with_the_same_idempotency_key() -> None:
    """Two 503s, then 202: three POSTs, each with the one Idempotency-Key, and the accepted job."""
    api = ScriptedApi(PROBLEM_503, PROBLEM_503, ACCEPTED)
    async with _client(api) as http:
        accepted = await start_job(http, {"prompt": "a fox"}, StatusLine(io.StringIO()))
    assert accepted == {"job_id": "j1", "status": "pending"}
    keys = {request["headers"]["idempotency-key"] for request in api.requests}
    assert len(api.requests) == 3 and len(keys) == 1


async def test_a_queue_that_stays_full_ends_with_its_own_exit_code() -> None:
    """429 on every attempt: the POST gives up after its attempts with exit code 5, saying so."""
    full = (429, {"title": "Queue full", "status": 429, "detail": "the queue is full"}, {"retry-after": "2"})
    api = ScriptedApi(*[full] * 10)
    with pytest.raises(ClientError) as ended:
        async with _client(api) as http:
            await start_job(http, {"prompt": "a fox"}, StatusLine(io.StringIO()))
    assert ended.value.exit_code == EXIT_QUEUE_FULL and "the queue is full" in ended.value.message
    assert len(api.requests) == 5  # POST_ATTEMPTS


async def test_polling_rides_out_failures_and_returns_the_finished_job() -> None:
    """A poll that meets a 503 and a 502 tries again, and returns the job once it is completed."""
    done = {"job_id": "j1", "status": "completed", "story": {"title": "T", "text": "B", "output_tokens": 3}}
    api = ScriptedApi(PROBLEM_503, (502, {}, {}), (200, done, {}))
    status = io.StringIO()
    async with _client(api) as http:
        job = await wait_for_job(http, "j1", StatusLine(status))
    assert job == done and len(api.requests) == 3
    assert "the api is unavailable (503), retrying" in status.getvalue()


async def test_a_refused_poll_is_not_retried() -> None:
    """A 404 is an answer, not an outage: one request, and the client ends with the problem's detail."""
    api = ScriptedApi((404, {"title": "Not Found", "status": 404, "detail": "no such job"}, {}))
    with pytest.raises(ClientError) as ended:
        async with _client(api) as http:
            await wait_for_job(http, "nope", StatusLine(io.StringIO()))
    assert "no such job" in ended.value.message and ended.value.exit_code != EXIT_UNAVAILABLE
    assert len(api.requests) == 1


def test_the_time_left_follows_a_jumping_estimate_a_few_seconds_at_a_time() -> None:
    """Estimates of 18, 20, 28, 42, 4, 1, 2 s polled every 2 s are shown as a countdown that rises by at most 3 s
    and falls by at most a quarter per poll, in round words, never "1 s"."""
    now = [0.0]
    remaining = client.Remaining(clock=lambda: now[0])
    shown = []
    for estimate in (18, 20, 28, 42, 4, 1, 2):
        value = remaining.update(estimate)
        assert value is not None
        shown.append(value)
        now[0] += 2
    for before, after in itertools.pairwise(shown):
        counted = before - 2
        assert counted - max(3, counted * 0.25) - 1e-9 <= after <= counted + 3 + 1e-9, shown
    assert remaining.update(None) == pytest.approx(shown[-1] - 2)
    assert [client._wait_text(s) for s in (1, 12, 70, 300)] == [
        "(almost there)", "(about 10 s left)", "(about a minute left)", "(about 5 min left)"]


def _running(text: str, chars: int, etag: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    return (200, {"job_id": "j1", "status": "running", "percent_done": 10,
                  "draft": {"text": text, "chars": chars, "updated_at": None}},
            {"etag": etag, "retry-after": "0.01"})


async def test_waiting_prints_the_story_as_it_is_written_asking_only_for_what_is_new() -> None:
    """Drafts arriving in pieces (a 304 between them, the title line split over two) are printed as they come,
    each poll asking from the characters printed and with the last ETag; the finished story adds only its
    rest, and stdout is exactly what a story printed at once is: title, blank line, text."""
    story = {"title": "The Fox \u00e9", "text": "Once upon a time \U0001f98a slept.\n\nThe end."}
    done = (200, {"job_id": "j1", "status": "completed", "story": story}, {"etag": '"c"'})
    api = ScriptedApi(_running("Title: The Fo", 13, '"a"'), (304, {}, {"etag": '"a"', "retry-after": "0.01"}),
                      _running("x \u00e9\nOnce upon a ", 29, '"b"'),
                      _running("time \U0001f98a slept.\n\n", 44, '"d"'), done)
    out, status = io.StringIO(), io.StringIO()
    printer = StoryPrinter(out)
    async with _client(api) as http:
        job = await wait_for_job(http, "j1", StatusLine(status), printer)
    assert client._report(job, False, printer) == client.EXIT_OK
    assert out.getvalue() == "The Fox \u00e9\n\nOnce upon a time \U0001f98a slept.\n\nThe end.\n"
    assert [r["query"] for r in api.requests] == ["since=0", "since=13", "since=13", "since=29", "since=44"]
    assert [r["headers"].get("if-none-match") for r in api.requests] == [None, '"a"', '"a"', '"b"', '"d"']


def test_a_story_whose_end_differs_from_its_draft_is_printed_whole_after_it() -> None:
    """When the finished text does not continue what was printed, it is printed whole after a blank line,
    never spliced."""
    out = io.StringIO()
    printer = StoryPrinter(out)
    printer.draft({"text": "Title: T\nOnce upon a tine", "chars": 24})
    printer.finish({"title": "T", "text": "Once upon a time."})
    assert out.getvalue() == "T\n\nOnce upon a tine\n\nT\n\nOnce upon a time.\n"
