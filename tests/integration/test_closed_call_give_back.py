"""A call closed after its job was ended elsewhere (llm_call_finish: a cancel
or a sweep ended the job while the stream ran) gives the shared rate bucket
back what it did not use of what its claim took: the input tokens estimated
less those sent, max_tokens less those written."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg

from api.store import ApiStore
from shared.ratelimit import RateLimits
from shared.status import LlmOutcome
from tests.support import worker_statements
from tests.support.database import client_id_of, enqueue

MODEL = "m"
# far from full once a claim took from it, refilling so slowly that no test sees a refill
LIMITS = RateLimits(requests_rate=1e-6, requests_capacity=5.0, input_tokens_rate=1e-6,
                    input_tokens_capacity=100_000.0, output_tokens_rate=1e-6, output_tokens_capacity=8000.0)


async def _bucket(conn: psycopg.AsyncConnection[Any]) -> tuple[float, float]:
    cur = await conn.execute("SELECT input_tokens, output_tokens FROM llm_rate_buckets WHERE model = %s", (MODEL,))
    row = await cur.fetchone()
    assert row is not None
    return row[0], row[1]


async def test_a_call_closed_after_a_cancel_gives_back_what_it_did_not_use(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Claimed with its input estimate and 1,600 max_tokens taken from the bucket, cancelled mid-stream, its
    call then closed having sent 30 input tokens and written 100: the bucket gets back the estimate less 30 and
    1,500 output tokens."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox who hums")
    await worker_statements.llm_rate_bucket_ensure(conn, model=MODEL, limits=LIMITS)
    claimed = await worker_statements.job_claim(conn, worker_id="w", claim_limit=1, provider="anthropic",
                                               model=MODEL, limits=LIMITS,
                                               default_max_tokens=1600)
    (job,) = claimed.claimed
    cur = await conn.execute("SELECT input_tokens_estimate FROM story_jobs WHERE id = %s", (job.id,))
    row = await cur.fetchone()
    assert row is not None and row[0] > 30
    estimate = row[0]
    assert await ApiStore(conn).job_cancel(client_id=client, job_id=job.public_id) is not None
    before = await _bucket(conn)
    await worker_statements.llm_call_finish(conn, model=MODEL, job_id=job.id, attempt=1,
                                            outcome=LlmOutcome.SUCCEEDED, billed=True, input_tokens=30,
                                            output_tokens=100, cost_usd=Decimal("0.001"), error_text=None)
    after = await _bucket(conn)
    assert (after[0] - before[0], after[1] - before[1]) == (estimate - 30, 1500)
