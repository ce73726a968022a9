"""What a client sees of the fair share and the limiter: a story no bucket could ever cover is
refused at admission, and a poll's queue position counts the jobs ahead in the claim's order."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from shared import prompt
from shared.config import WorkerSettings
from shared.ratelimit import RateLimits
from shared.story_request import NAME_MAX_CHARS, PROMPT_MAX_CHARS, StoryRequest
from tests.support.api_client import api_client, assert_problem, new_key, stored_jobs
from tests.support.database import create_key

# the largest body the api accepts: every character four bytes in UTF-8, the longest language tag
LARGEST: dict[str, Any] = {"prompt": "\U0001f319" * PROMPT_MAX_CHARS, "child_name": "\U0001f319" * NAME_MAX_CHARS, "age": 12,
           "length": "long", "language": "zzz-abcdefgh-abcdefgh-abcdefgh"}


async def test_a_story_above_the_minutes_limit_is_refused_at_admission_naming_the_limit(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """With LLM_INPUT_TOKENS_PER_MINUTE below the largest request's estimate, that request gets a 422
    naming the variable and nothing is stored; a short one is accepted."""
    key = await create_key(conn, "alice")
    largest_estimate = prompt.input_tokens_estimate(StoryRequest(**LARGEST))
    async with api_client(pool, key, llm_input_tokens_per_minute=largest_estimate - 1) as client:
        refused = await client.post("/stories/generate", json=LARGEST, headers=new_key())
        body = assert_problem(refused, 422)
        assert "LLM_INPUT_TOKENS_PER_MINUTE" in body["detail"]
        assert await stored_jobs(conn) == 0
        accepted = await client.post("/stories/generate", json={"prompt": "a sleepy owl"}, headers=new_key())
        assert accepted.status_code == 202, accepted.text


def test_the_bucket_holds_the_largest_request_the_api_accepts_under_a_low_limit() -> None:
    """At 30,000 input tokens a minute with a 5 s burst (2,500 of refill), the bucket still holds the
    estimate of the largest request the api accepts, 30-character language tag included, so that job
    is not left pending for good."""
    limits = RateLimits.from_settings(WorkerSettings(llm_input_tokens_per_minute=30_000, metrics_port=0))
    assert limits.input_tokens_capacity is not None
    assert limits.input_tokens_capacity >= prompt.input_tokens_estimate(StoryRequest(**LARGEST))


async def test_a_polls_queue_position_counts_the_jobs_ahead_in_turn_order(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A client with 10 jobs queued, then another with one: the second client's job is second in the
    queue, not eleventh."""
    heavy, light = await create_key(conn, "heavy"), await create_key(conn, "light")
    async with api_client(pool, queue_max=100) as client:
        for n in range(10):
            answer = await client.post("/stories/generate", json={"prompt": f"story {n}"},
                                       headers={"Authorization": f"Bearer {heavy}", **new_key()})
            assert answer.status_code == 202
        answer = await client.post("/stories/generate", json={"prompt": "mine"},
                                   headers={"Authorization": f"Bearer {light}", **new_key()})
        poll = await client.get(answer.headers["location"], headers={"Authorization": f"Bearer {light}"})
    assert poll.json()["queue_position"] == 2
