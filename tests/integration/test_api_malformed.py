"""Hostile and malformed requests: each gets its one expected 4xx, as a
problem, and none of them stores a job."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client, assert_problem, stored_jobs

GOOD_BODY = {"prompt": "a dragon who cannot sleep"}
VALID_KEY = "<valid key>"  # replaced by the test's own API key
SOME_ID = "8f14e45f-ceea-467f-a0e6-a8d3c1f0b3b4"


@dataclass(frozen=True)
class Bad:
    """One malformed request and the answer it must get."""

    name: str
    status: int
    method: str = "POST"
    path: str = "/stories/generate"
    body: Any = field(default_factory=lambda: GOOD_BODY)
    # raw bytes instead of `body` encoded as JSON
    content: bytes | None = None
    headers: dict[str, str | bytes] = field(default_factory=dict)
    auth: str | None = VALID_KEY
    idempotency_key: str | bytes | None = "key-1"
    # the field a 400 must name
    field: str | None = None
    # sent in chunks, without a Content-Length
    chunked: bool = False


def _text(prompt: str) -> bytes:
    return b'{"prompt": "' + prompt.encode() + b'"}'


CASES = [
    # -- bodies ------------------------------------------------------------------
    Bad("not json", 400, content=b'{"prompt": "a fox"', field="body"),
    Bad("empty body", 400, content=b"", field="body"),
    Bad("json array", 400, body=[GOOD_BODY], field="body"),
    Bad("json null", 400, content=b"null", field="body"),
    Bad("json string", 400, body="a dragon", field="body"),
    Bad("form encoded", 400, content=b"prompt=a+fox", headers={"Content-Type": "application/x-www-form-urlencoded"},
        field="body"),
    Bad("trailing garbage", 400, content=b'{"prompt": "a fox"} {}', field="body"),
    Bad("invalid utf-8", 400, content=b'{"prompt": "a \xff fox"}', field="body"),
    Bad("deeply nested", 400, content=b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", field="body"),
    Bad("number out of range", 400, content=b'{"prompt": "a fox", "age": 1e400}', field="body"),
    Bad("body too large", 413, body={"prompt": "x" * 40_000}),
    Bad("body too large, chunked", 413, content=b'{"prompt": "' + b"x" * 40_000 + b'"}', chunked=True),
    Bad("no prompt", 400, body={}, field="prompt"),
    Bad("empty prompt", 400, body={"prompt": ""}, field="prompt"),
    Bad("blank prompt", 400, body={"prompt": " \n\t\u00a0"}, field="prompt"),
    Bad("prompt too long", 400, body={"prompt": "x" * 2001}, field="prompt"),
    Bad("prompt not text", 400, body={"prompt": 42}, field="prompt"),
    Bad("NUL in prompt", 400, content=_text("a \\u0000 fox"), field="prompt"),
    Bad("control character in prompt", 400, content=_text("a \\u0007 fox"), field="prompt"),
    Bad("lone surrogate in prompt", 400, content=_text("a \\ud800 fox"), field="body"),
    Bad("child_name too long", 400, body={**GOOD_BODY, "child_name": "M" * 61}, field="child_name"),
    Bad("NUL in child_name", 400, content=b'{"prompt": "a fox", "child_name": "M\\u0000"}', field="child_name"),
    Bad("age too low", 400, body={**GOOD_BODY, "age": 1}, field="age"),
    Bad("age too high", 400, body={**GOOD_BODY, "age": 13}, field="age"),
    Bad("age as text", 400, body={**GOOD_BODY, "age": "5"}, field="age"),
    Bad("age as float", 400, body={**GOOD_BODY, "age": 5.5}, field="age"),
    Bad("age as boolean", 400, body={**GOOD_BODY, "age": True}, field="age"),
    Bad("age beyond 64 bits", 400, content=b'{"prompt": "a fox", "age": 1' + b"0" * 40 + b"}", field="age"),
    Bad("unknown length", 400, body={**GOOD_BODY, "length": "epic"}, field="length"),
    Bad("language not a tag", 400, body={**GOOD_BODY, "language": "english please"}, field="language"),
    Bad("language with a newline", 400, body={**GOOD_BODY, "language": "en\n"}, field="language"),
    Bad("misspelt option", 400, body={**GOOD_BODY, "lenght": "long"}, field="lenght"),
    # -- Idempotency-Key -------------------------------------------------------------
    Bad("no idempotency key", 400, idempotency_key=None, field="Idempotency-Key"),
    Bad("empty idempotency key", 400, idempotency_key="", field="Idempotency-Key"),
    Bad("idempotency key of 256 characters", 400, idempotency_key="k" * 256, field="Idempotency-Key"),
    Bad("idempotency key not ascii", 400, idempotency_key="clé".encode("latin-1"), field="Idempotency-Key"),
    Bad("idempotency key with DEL", 400, idempotency_key="a\x7fb", field="Idempotency-Key"),
    # -- Authorization -----------------------------------------------------------------
    Bad("no authorization", 401, auth=None),
    Bad("basic scheme", 401, headers={"Authorization": "Basic dXNlcjpwYXNz"}, auth=None),
    Bad("bearer without key", 401, headers={"Authorization": "Bearer "}, auth=None),
    Bad("key of the wrong shape", 401, auth="not-a-key"),
    Bad("right prefix, wrong secret", 401, auth="<wrong secret>"),
    Bad("unknown prefix", 401, auth="sj_000000000000_" + "A" * 43),
    Bad("key with junk appended", 401, auth="<valid key>x"),
    Bad("key not ascii", 401, headers={"Authorization": "Bearer sj_é".encode("latin-1")}, auth=None),
    Bad("bad key and bad body", 401, auth="not-a-key", content=b"{"),
    # -- paths and methods ------------------------------------------------------------
    Bad("GET on generate", 405, method="GET"),
    Bad("PATCH on generate", 405, method="PATCH"),
    Bad("POST on a job", 405, path=f"/stories/jobs/{SOME_ID}"),
    Bad("PUT on a job", 405, method="PUT", path=f"/stories/jobs/{SOME_ID}"),
    Bad("unknown path", 404, path="/stories/generate/now"),
    Bad("unknown job", 404, method="GET", path=f"/stories/jobs/{SOME_ID}"),
    Bad("job id not a uuid", 404, method="GET", path="/stories/jobs/not-a-uuid"),
    Bad("job id with NUL", 404, method="GET", path="/stories/jobs/%00"),
    Bad("job id with SQL", 404, method="GET", path="/stories/jobs/1'%20OR%20'1'='1"),
    Bad("job id of 8000 characters", 404, method="GET", path="/stories/jobs/" + "a" * 8000),
    Bad("cancel a job id not a uuid", 404, method="DELETE", path="/stories/jobs/not-a-uuid"),
    Bad("story id not a uuid", 404, method="GET", path="/stories/not-a-uuid"),
    Bad("unknown story", 404, method="GET", path=f"/stories/{SOME_ID}"),
    Bad("job without a key", 401, method="GET", path=f"/stories/jobs/{SOME_ID}", auth=None),
    Bad("story without a key", 401, method="GET", path=f"/stories/{SOME_ID}", auth=None),
]


def _authorization(case: Bad, api_key: str) -> dict[str, str]:
    if case.auth is None:
        return {}
    if case.auth == "<wrong secret>":
        return {"Authorization": f"Bearer {api_key[:-4]}AAAA"}
    return {"Authorization": "Bearer " + case.auth.replace(VALID_KEY, api_key)}


async def _chunks(content: bytes, size: int = 4096) -> AsyncIterator[bytes]:
    for start in range(0, len(content), size):
        yield content[start:start + size]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_malformed_request_gets_its_status_and_stores_nothing(
    case: Bad, pool: AsyncConnectionPool, api_key: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Every malformed request is answered with its expected problem (naming the field for a 400), never 5xx,
    and no job reaches the database."""
    headers: dict[str, Any] = {**_authorization(case, api_key), **case.headers}
    if case.idempotency_key is not None and case.method == "POST":
        headers["Idempotency-Key"] = case.idempotency_key
    content = case.content
    if content is None and case.method == "POST":
        content = json.dumps(case.body).encode()
        headers.setdefault("Content-Type", "application/json")
    sent: bytes | AsyncIterator[bytes] | None = _chunks(content) if case.chunked and content else content
    async with api_client(pool) as client:
        answer = await client.request(case.method, case.path, content=sent, headers=headers)
    problem = assert_problem(answer, case.status)
    if case.field is not None:
        assert case.field in {error["field"] for error in problem["errors"]}, problem
    if case.status == 401:
        assert answer.headers["www-authenticate"].startswith('Bearer realm="storyjobs"')
    if case.status == 405:
        assert answer.headers["allow"]
    assert await stored_jobs(conn) == 0


async def test_the_same_requests_done_right_are_accepted(pool: AsyncConnectionPool, api_key: str) -> None:
    """Control: a well-formed request with every option, a quoted Idempotency-Key and any Content-Type is 202."""
    body = {"prompt": "a dragon who cannot sleep\n", "child_name": "Zoë", "age": 5, "length": "short",
            "language": "pt-BR"}
    async with api_client(pool, api_key) as client:
        answer = await client.post("/stories/generate", content=json.dumps(body).encode(),
                                   headers={"Idempotency-Key": '"key \\"1\\""', "Content-Type": "text/plain"})
        assert answer.status_code == 202, answer.text
        assert answer.headers["cache-control"] == "no-store"
        again = await client.post("/stories/generate", json=body, headers={"Idempotency-Key": '"key \\"1\\""'})
    assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["job_id"] == answer.json()["job_id"]


async def test_a_structured_field_key_and_its_bare_form_are_one_key(pool: AsyncConnectionPool, api_key: str) -> None:
    """Idempotency-Key "abc" (an sf-string) and abc name the same job."""
    async with api_client(pool, api_key) as client:
        quoted = await client.post("/stories/generate", json=GOOD_BODY, headers={"Idempotency-Key": '"abc"'})
        bare = await client.post("/stories/generate", json=GOOD_BODY, headers={"Idempotency-Key": "abc"})
    assert quoted.status_code == bare.status_code == 202
    assert bare.json()["job_id"] == quoted.json()["job_id"] and bare.headers["idempotent-replayed"] == "true"


async def test_a_job_id_is_a_random_uuid(pool: AsyncConnectionPool, api_key: str) -> None:
    """Job ids are version 4 UUIDs: nothing in one tells the next."""
    async with api_client(pool, api_key) as client:
        answers = [await client.post("/stories/generate", json=GOOD_BODY, headers={"Idempotency-Key": f"k{n}"})
                   for n in range(2)]
    first, second = (uuid.UUID(answer.json()["job_id"]) for answer in answers)
    assert first.version == second.version == 4 and first != second
