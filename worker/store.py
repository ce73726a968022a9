"""What the worker's job loop asks of the database, as one typed interface.

``WorkerStore`` is everything the round, the job tasks, the heartbeat and
the listener need; ``PgWorkerStore`` does it with a connection pool and the
worker's named queries (sql/worker.sql), each run by one small typed
function below. A recording fake of the same interface
(tests/fakes/recording_worker_store.py) lets the coordinator's rules be
tested without a database. Every method may raise any of
``shared.db.DB_ERRORS``. The webhook deliveries have a store of their own
(worker/delivery/store.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from decimal import Decimal
from typing import Any, Protocol

import msgspec
from psycopg_pool import AsyncConnectionPool

from shared import db
from shared.queries import QUERIES as Q
from shared.ratelimit import (
    NO_LIMITS,
    UNLIMITED,
    LimiterState,
    ProviderView,
    RateLimits,
    claim_params,
)
from shared.status import LlmOutcome
from shared.store import Conn, fetch_all, fetch_one, jsonb
from worker.rows import (
    ClaimedJob,
    ClaimResult,
    Completion,
    DraftPiece,
    Failure,
    HeartbeatRow,
    RetryStart,
    SettleResult,
)


class WorkerStore(Protocol):
    """What the round, the job tasks, the heartbeat and the listener ask of
    the database. It keeps no state: the rate limits the round holds are
    passed to each statement that needs them."""

    @property
    def worker_id(self) -> str: ...

    async def settle(self, completions: Sequence[Completion], limits: RateLimits) -> SettleResult:
        """Completes the written stories' jobs where they are still ours,
        their stories stored; with a rate limit, the shared bucket gets back
        what their claims reserved and their calls did not use. One
        transaction of its own: a refusal is the stories' own."""
        ...

    async def claim(self, claim_limit: int, provider_view: ProviderView | None, limits: RateLimits) -> ClaimResult:
        """Claims up to claim_limit pending jobs that the shared rate bucket
        covers (kept in step with provider_view, what the provider's headers
        last said), writing each one's first ledger row. One transaction of
        its own: a refusal never touches a settled story."""
        ...

    async def fail_running(self, failures: Sequence[Failure], limits: RateLimits) -> list[int]:
        """running -> failed for these jobs where they are still ours; their
        ledger rows closed. Returns the ids that were ours."""
        ...

    async def claims_of_lost_answer(self, known_ids: Sequence[int]) -> list[ClaimedJob]:
        """Jobs running under this worker, not in known_ids, whose first
        call's row is still open and no retry's row exists: claimed by a
        statement whose answer was lost (the caller holds every job it
        began, so known_ids rules out a job that was begun)."""
        ...

    async def heartbeat(self, progress: Mapping[int, int]) -> list[HeartbeatRow]:
        """Refreshes the jobs still ours; a row per job, alive or not."""
        ...

    async def call_retry(
        self, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome, previous_error: str,
        limits: RateLimits,
    ) -> RetryStart:
        """Closes an unbilled attempt's ledger row and opens the next one if
        the job is still ours and the rate bucket is not paused. Idempotent:
        run again, it answers the row it opened."""
        ...

    async def pause(self, pause_s: float, limits: RateLimits) -> None:
        """No claim and no retry, by any worker, for pause_s (a 429)."""
        ...

    async def call_finish(
        self, job_id: int, attempt: int, *, outcome: LlmOutcome, billed: bool, input_tokens: int,
        output_tokens: int, cost_usd: Decimal, error_text: str | None, request_id: str | None = None,
    ) -> None:
        """Closes a ledger row outside a job transition (a stream we stopped
        for a job no longer ours), and any later attempt's row as not sent."""
        ...

    def notifications(self) -> AsyncIterator[None]:
        """Yields once when listening starts (what was sent before is lost)
        and once per NOTIFY of a new pending job; raises when the connection
        breaks."""
        ...


class PgWorkerStore:
    """WorkerStore on a connection pool; LISTEN on a connection of its own."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        *,
        worker_id: str,
        provider: str,
        model: str,
        listen_url: str | None,
        connect_timeout_s: float,
        default_max_tokens: int = 4000,
    ) -> None:
        self._pool = pool
        self._worker_id = worker_id
        self._provider = provider
        self._model = model
        self._default_max_tokens = default_max_tokens
        self._listen_url = listen_url
        self._connect_timeout_s = connect_timeout_s

    @property
    def worker_id(self) -> str:
        return self._worker_id

    async def ensure_rate_bucket(self, limits: RateLimits) -> None:
        """The model's bucket, full, when a limit is configured and it does
        not exist yet (a later claim recreates a deleted one, empty)."""
        if limits.limited:
            async with self._pool.connection() as conn:
                await llm_rate_bucket_ensure(conn, model=self._model, limits=limits)

    async def settle(self, completions: Sequence[Completion], limits: RateLimits) -> SettleResult:
        async with self._pool.connection() as conn:
            return await job_settle(conn, worker_id=self._worker_id, completions=completions, model=self._model,
                                    limited=limits.limited)

    async def claim(self, claim_limit: int, provider_view: ProviderView | None, limits: RateLimits) -> ClaimResult:
        limiter = claim_params(limits, provider_view, default_max_tokens=self._default_max_tokens)
        async with self._pool.connection() as conn:
            return await job_claim(conn, worker_id=self._worker_id, claim_limit=claim_limit,
                                   provider=self._provider, model=self._model, limiter=limiter)

    async def fail_running(self, failures: Sequence[Failure], limits: RateLimits) -> list[int]:
        async with self._pool.connection() as conn:
            return await job_fail_running(conn, worker_id=self._worker_id, failures=failures,
                                          model=self._model, limited=limits.limited)

    async def claims_of_lost_answer(self, known_ids: Sequence[int]) -> list[ClaimedJob]:
        async with self._pool.connection() as conn:
            return await job_adopt_lost_claims(conn, worker_id=self._worker_id, known_ids=known_ids)

    async def heartbeat(self, progress: Mapping[int, int]) -> list[HeartbeatRow]:
        async with self._pool.connection() as conn:
            return await job_heartbeat(conn, worker_id=self._worker_id, progress=progress)

    async def call_retry(
        self, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome, previous_error: str,
        limits: RateLimits,
    ) -> RetryStart:
        async with self._pool.connection() as conn:
            return await llm_call_start(
                conn, worker_id=self._worker_id, job_id=job_id, previous_attempt=previous_attempt,
                previous_outcome=previous_outcome, previous_billed=not previous_outcome.certainly_unbilled,
                previous_error=previous_error, model=self._model, limits=limits,
            )

    async def pause(self, pause_s: float, limits: RateLimits) -> None:
        async with self._pool.connection() as conn:
            await llm_rate_bucket_pause(conn, model=self._model, pause_s=pause_s, limits=limits)

    async def call_finish(
        self, job_id: int, attempt: int, *, outcome: LlmOutcome, billed: bool, input_tokens: int,
        output_tokens: int, cost_usd: Decimal, error_text: str | None, request_id: str | None = None,
    ) -> None:
        async with self._pool.connection() as conn:
            await llm_call_finish(
                conn, model=self._model, job_id=job_id, attempt=attempt, outcome=outcome, billed=billed,
                input_tokens=input_tokens,
                output_tokens=output_tokens, cost_usd=cost_usd, error_text=error_text, request_id=request_id,
            )

    async def notifications(self) -> AsyncIterator[None]:
        if self._listen_url is None:
            return
        conn = await db.connect(self._listen_url, application_name="storyjobs-worker-listen",
                                connect_timeout_s=self._connect_timeout_s)
        async with conn:
            await job_listen_pending(conn)
            yield
            async for _ in conn.notifies():
                yield


class PgDraftStore:
    """The draft writer's statement (worker/drafts.py), on a pool of its own:
    a draft write that waits or fails never holds a connection a job's end
    or heartbeat waits for."""

    def __init__(self, pool: AsyncConnectionPool, *, worker_id: str) -> None:
        self._pool = pool
        self._worker_id = worker_id

    async def draft_append(self, pieces: Sequence[DraftPiece]) -> dict[int, int]:
        async with self._pool.connection() as conn:
            return await draft_append(conn, worker_id=self._worker_id, pieces=pieces)


async def draft_append(conn: Conn, *, worker_id: str, pieces: Sequence[DraftPiece]) -> dict[int, int]:
    """Appends each piece to its job's draft where the job is still running
    under worker_id and its draft is exactly ``from_char`` long; answers how
    long the draft of each job still ours is now."""
    cur = await conn.execute(Q["draft_append"], {
        "worker_id": worker_id,
        "job_ids": [p.job_id for p in pieces],
        "from_chars": [p.from_char for p in pieces],
        "texts": [p.text for p in pieces],
    })
    return {job_id: chars for job_id, chars in await cur.fetchall()}


_claimed_decoder = msgspec.json.Decoder(list[ClaimedJob])
_limiter_decoder = msgspec.json.Decoder(LimiterState)


# -- claims and ledger ---------------------------------------------------------------


class _CompletionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A completion's small fields, one record of the round's JSON; ``n`` is
    the element of the titles, texts and story ids arrays that is its own."""

    n: int
    job_id: int
    client_id: int
    attempt: int
    model: str
    prompt_version: str
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal
    request_id: str | None


def completion_params(completions: Sequence[Completion]) -> dict[str, Any]:
    """The round statement's completions: their small fields as one JSON
    array, their titles and texts as text arrays the statement takes in
    binary (sql/worker.sql, job_settle, says why), and an id for each
    story, made here."""
    return {
        "completions": jsonb([
            _CompletionRecord(n=n, job_id=c.job_id, client_id=c.client_id, attempt=c.attempt, model=c.model,
                              prompt_version=c.prompt_version, input_tokens=c.input_tokens,
                              output_tokens=c.output_tokens, cost_usd=c.cost_usd, request_id=c.request_id)
            for n, c in enumerate(completions, 1)
        ]),
        "titles": [c.title for c in completions],
        "bodies": [c.body for c in completions],
        "story_ids": [uuid.uuid4() for _ in completions],
    }


def claim_query(limiter: Mapping[str, Any]) -> str:
    """The claim's name: without a configured rate limit, the one without
    the limiter's arithmetic."""
    return "job_claim_limited" if limiter["limited"] else "job_claim"


async def job_claim(
    conn: Conn,
    *,
    worker_id: str,
    claim_limit: int,
    provider: str,
    model: str,
    limiter: Mapping[str, Any] = UNLIMITED,
) -> ClaimResult:
    """Claims up to claim_limit pending jobs that the shared rate bucket
    covers (``limiter``: shared.ratelimit's claim_params), each with its
    first ledger row, in one statement."""
    params = {**limiter, "worker_id": worker_id, "claim_limit": claim_limit, "provider": provider, "model": model}
    cur = await conn.execute(Q[claim_query(limiter)], params)
    row = await cur.fetchone()
    assert row is not None
    claimed_json, limiter_json = row
    return ClaimResult(claimed=_claimed_decoder.decode(claimed_json), limiter=_limiter_decoder.decode(limiter_json))


async def job_settle(
    conn: Conn, *, worker_id: str, completions: Sequence[Completion], model: str = "", limited: bool = False,
) -> SettleResult:
    """Completes written stories, claiming nothing; with a rate limit
    configured (``limited``), the model's bucket gets back what their calls
    did not use."""
    params = {"worker_id": worker_id, "model": model, "limited": limited, **completion_params(completions)}
    cur = await conn.execute(Q["job_settle"], params)
    row = await cur.fetchone()
    assert row is not None
    completed_ids, already_completed_ids, _ = row
    return SettleResult(completed_ids=list(completed_ids), already_completed_ids=list(already_completed_ids))


async def job_fail_running(
    conn: Conn, *, worker_id: str, failures: Sequence[Failure], model: str = "", limited: bool = False,
) -> list[int]:
    """running -> failed for jobs this worker owns; returns those that were.
    With a rate limit configured (``limited``), the model's bucket gets back
    what the failed calls did not use."""
    params = {"worker_id": worker_id, "failures": jsonb(failures), "model": model, "limited": limited}
    cur = await conn.execute(Q["job_fail_running"], params)
    row = await cur.fetchone()
    assert row is not None
    return list(row[0])


async def job_heartbeat(conn: Conn, *, worker_id: str, progress: Mapping[int, int]) -> list[HeartbeatRow]:
    return await fetch_all(
        conn,
        HeartbeatRow,
        "job_heartbeat",
        {
            "worker_id": worker_id,
            "beats": jsonb([{"id": job_id, "progress": tokens} for job_id, tokens in progress.items()]),
        },
    )


async def job_listen_pending(conn: Conn) -> None:
    await conn.execute(Q["job_listen_pending"])


async def job_adopt_lost_claims(conn: Conn, *, worker_id: str, known_ids: Sequence[int]) -> list[ClaimedJob]:
    return await fetch_all(
        conn,
        ClaimedJob,
        "job_adopt_lost_claims",
        {"worker_id": worker_id, "known_ids": list(known_ids)},
    )


async def llm_call_start(
    conn: Conn, *, worker_id: str, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome,
    previous_billed: bool, previous_error: str | None, model: str = "", limits: RateLimits = NO_LIMITS,
) -> RetryStart:
    """Closes the previous attempt's ledger row and, if the job is still
    running under this worker and ``model``'s rate bucket is not paused and
    holds a request (refilled at ``limits``' rates), opens the next (see
    RetryStart)."""
    started = await fetch_one(
        conn,
        RetryStart,
        "llm_call_start",
        {
            **msgspec.structs.asdict(limits),
            "model": model,
            "worker_id": worker_id,
            "job_id": job_id,
            "previous_attempt": previous_attempt,
            "previous_outcome": previous_outcome,
            "previous_billed": previous_billed,
            "previous_error": previous_error,
        },
    )
    assert started is not None
    return started


async def llm_rate_bucket_pause(conn: Conn, *, model: str, pause_s: float, limits: RateLimits = NO_LIMITS) -> None:
    """No claim and no retry for ``model`` for pause_s (a 429's retry-after);
    at ``limits``' request rate, one request in the bucket when it ends."""
    await conn.execute(Q["llm_rate_bucket_pause"], {"model": model, "pause_s": pause_s,
                                                    "requests_rate": limits.requests_rate})


async def llm_rate_bucket_ensure(conn: Conn, *, model: str, limits: RateLimits) -> None:
    """The model's bucket, full, unless it exists."""
    await conn.execute(Q["llm_rate_bucket_ensure"], {"model": model, **msgspec.structs.asdict(limits)})


async def llm_call_finish(
    conn: Conn,
    *,
    model: str,
    job_id: int,
    attempt: int,
    outcome: LlmOutcome,
    billed: bool,
    input_tokens: int,
    output_tokens: int,
    cost_usd: Any,
    error_text: str | None,
    request_id: str | None = None,
) -> None:
    await conn.execute(
        Q["llm_call_finish"],
        {
            "model": model,
            "job_id": job_id,
            "attempt": attempt,
            "outcome": outcome,
            "billed": billed,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cost_usd": cost_usd,
            "error_text": error_text,
            "request_id": request_id,
        },
    )
