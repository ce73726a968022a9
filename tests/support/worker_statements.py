"""The worker's statements one at a time on a test's connection, through the
worker's own store (worker/store.py's PgWorkerStore on that connection): for
tests that seed, race or inspect a claim, a settle or a failure by hand.

Defaults here are the tests' (no rate limit, 4,000 max_tokens): the worker's
round always passes its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import Decimal

from shared.ratelimit import NO_LIMITS, ProviderView, RateLimits
from shared.status import LlmOutcome
from shared.store import Conn
from worker.draft_store import PgDraftStore
from worker.pg_store import PgWorkerStore
from worker.rows import (
    ClaimResult,
    Completion,
    DraftPiece,
    Failure,
    HeartbeatRow,
    RetryStart,
    SettleResult,
)
from worker.store import ClaimAsk

DEFAULT_MAX_TOKENS = 4000


def store_on(conn: Conn, *, worker_id: str, provider: str = "anthropic", model: str = "",
             default_max_tokens: int = DEFAULT_MAX_TOKENS) -> PgWorkerStore:
    return PgWorkerStore(conn, worker_id=worker_id, provider=provider, model=model,
                         default_max_tokens=default_max_tokens)


async def job_claim(
    conn: Conn, *, worker_id: str, claim_limit: int, provider: str, model: str, limits: RateLimits = NO_LIMITS,
    view: ProviderView | None = None, default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> ClaimResult:
    store = store_on(conn, worker_id=worker_id, provider=provider, model=model,
                     default_max_tokens=default_max_tokens)
    written = await store.settle_and_claim([], ClaimAsk(claim_limit, view), limits)
    assert written.claimed is not None
    return written.claimed


async def job_settle(
    conn: Conn, *, worker_id: str, completions: Sequence[Completion], model: str = "",
    limits: RateLimits = NO_LIMITS,
) -> SettleResult:
    written = await store_on(conn, worker_id=worker_id, model=model).settle_and_claim(completions, None, limits)
    assert written.settled is not None
    return written.settled


async def job_fail_running(
    conn: Conn, *, worker_id: str, failures: Sequence[Failure], model: str = "", limits: RateLimits = NO_LIMITS,
) -> list[int]:
    return await store_on(conn, worker_id=worker_id, model=model).fail_running(failures, limits)


async def job_heartbeat(conn: Conn, *, worker_id: str, progress: Mapping[int, int]) -> list[HeartbeatRow]:
    return await store_on(conn, worker_id=worker_id).heartbeat(progress)


async def llm_call_start(
    conn: Conn, *, worker_id: str, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome,
    previous_error: str | None, model: str = "", limits: RateLimits = NO_LIMITS,
) -> RetryStart:
    return await store_on(conn, worker_id=worker_id, model=model).call_retry(
        job_id, previous_attempt, previous_outcome, previous_error, limits)


async def llm_rate_bucket_pause(conn: Conn, *, model: str, pause_s: float, limits: RateLimits = NO_LIMITS) -> None:
    await store_on(conn, worker_id="", model=model).pause(pause_s, limits)


async def llm_rate_bucket_ensure(conn: Conn, *, model: str, limits: RateLimits) -> None:
    await store_on(conn, worker_id="", model=model).ensure_rate_bucket(limits)


async def llm_call_finish(
    conn: Conn, *, model: str, job_id: int, attempt: int, outcome: LlmOutcome, billed: bool, input_tokens: int,
    output_tokens: int, cost_usd: Decimal, error_text: str | None, request_id: str | None = None,
) -> None:
    await store_on(conn, worker_id="", model=model).call_finish(
        job_id, attempt, outcome=outcome, billed=billed, input_tokens=input_tokens, output_tokens=output_tokens,
        cost_usd=cost_usd, error_text=error_text, request_id=request_id)


async def draft_append(conn: Conn, *, worker_id: str, pieces: Sequence[DraftPiece]) -> dict[int, int]:
    return await PgDraftStore(conn, worker_id=worker_id).draft_append(pieces)
