"""The worker's store on Postgres: ``WorkerStore`` (worker/store.py) with the
worker's named queries (sql/worker.sql), one method per query, on a
connection pool (or, for a test, one connection); and the round's one
transaction, its stories settled and its claim sent with them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from decimal import Decimal
from typing import Any

import msgspec
from psycopg import pq

from shared import db
from shared.queries import QUERIES as Q
from shared.ratelimit import LimiterState, RateLimits, claim_params
from shared.status import LlmOutcome
from shared.store import Conn, Connections, connection, fetch_all, fetch_one, jsonb
from worker.rows import (
    ClaimedJob,
    ClaimResult,
    Completion,
    Failure,
    HeartbeatRow,
    RetryStart,
    SettleResult,
)
from worker.store import ClaimAsk, RoundWritten


class PgWorkerStore:
    """WorkerStore on a connection pool, or on one connection (a test's,
    whose transactions it then shares); LISTEN on a connection of its own."""

    def __init__(
        self,
        connections: Connections,
        *,
        worker_id: str,
        provider: str,
        model: str,
        default_max_tokens: int,
        listen_url: str | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self._connections = connections
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
            async with connection(self._connections) as conn:
                await conn.execute(Q["llm_rate_bucket_ensure"], {"model": self._model, **msgspec.structs.asdict(limits)})

    async def settle_and_claim(
        self, completions: Sequence[Completion], ask: ClaimAsk | None, limits: RateLimits,
    ) -> RoundWritten:
        settle = ((Q["job_settle"], settle_params(completions, limits, worker_id=self._worker_id, model=self._model))
                  if completions else None)
        claim = (Q["job_claim"], self._claim_params(ask, limits)) if ask is not None else None
        async with connection(self._connections) as conn:
            if settle is not None and claim is not None:
                return await _settle_then_claim(conn, settle, claim)
            # one statement: a transaction of its own
            if settle is not None:
                return RoundWritten(settled=_settled(await _one_row(conn, *settle)), claimed=None)
            if claim is not None:
                return RoundWritten(settled=None, claimed=_claimed(await _one_row(conn, *claim)))
            return RoundWritten(settled=None, claimed=None)

    def _claim_params(self, ask: ClaimAsk, limits: RateLimits) -> dict[str, Any]:
        return {**claim_params(limits, ask.view, default_max_tokens=self._default_max_tokens),
                "worker_id": self._worker_id, "claim_limit": ask.limit, "provider": self._provider,
                "model": self._model}

    async def fail_running(self, failures: Sequence[Failure], limits: RateLimits) -> list[int]:
        """With a rate limit, the model's bucket gets back what the failed
        calls did not use."""
        async with connection(self._connections) as conn:
            cur = await conn.execute(Q["job_fail_running"], {
                "worker_id": self._worker_id, "failures": jsonb(failures), "model": self._model,
                "limited": limits.limited})
            row = await cur.fetchone()
        assert row is not None
        return list(row[0])

    async def claims_of_lost_answer(self, known_ids: Sequence[int]) -> list[ClaimedJob]:
        async with connection(self._connections) as conn:
            return await fetch_all(conn, ClaimedJob, "job_adopt_lost_claims",
                                   {"worker_id": self._worker_id, "known_ids": list(known_ids)})

    async def heartbeat(self, progress: Mapping[int, int]) -> list[HeartbeatRow]:
        beats = jsonb([{"id": job_id, "progress": tokens} for job_id, tokens in progress.items()])
        async with connection(self._connections) as conn:
            return await fetch_all(conn, HeartbeatRow, "job_heartbeat", {"worker_id": self._worker_id, "beats": beats})

    async def call_retry(
        self, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome, previous_error: str | None,
        limits: RateLimits,
    ) -> RetryStart:
        """Opens the next attempt only while ``model``'s rate bucket is not
        paused and holds a request (refilled at ``limits``' rates)."""
        async with connection(self._connections) as conn:
            started = await fetch_one(conn, RetryStart, "llm_call_start", {
                **msgspec.structs.asdict(limits), "model": self._model, "worker_id": self._worker_id,
                "job_id": job_id, "previous_attempt": previous_attempt, "previous_outcome": previous_outcome,
                "previous_billed": not previous_outcome.certainly_unbilled, "previous_error": previous_error})
        assert started is not None
        return started

    async def pause(self, pause_s: float, limits: RateLimits) -> None:
        """At ``limits``' request rate, one request in the bucket when it ends."""
        async with connection(self._connections) as conn:
            await conn.execute(Q["llm_rate_bucket_pause"], {"model": self._model, "pause_s": pause_s,
                                                            "requests_rate": limits.requests_rate})

    async def call_finish(
        self, job_id: int, attempt: int, *, outcome: LlmOutcome, billed: bool, input_tokens: int,
        output_tokens: int, cost_usd: Decimal, error_text: str | None, request_id: str | None = None,
    ) -> None:
        async with connection(self._connections) as conn:
            await conn.execute(Q["llm_call_finish"], {
                "model": self._model, "job_id": job_id, "attempt": attempt, "outcome": outcome, "billed": billed,
                "input_tokens": input_tokens, "output_tokens": output_tokens, "cost_usd": cost_usd,
                "error_text": error_text, "request_id": request_id})

    async def notifications(self) -> AsyncIterator[None]:
        if self._listen_url is None:
            return
        conn = await db.connect(self._listen_url, application_name="storyjobs-worker-listen",
                                connect_timeout_s=self._connect_timeout_s)
        async with conn:
            await conn.execute(Q["job_listen_pending"])
            yield
            async for _ in conn.notifies():
                yield


async def _settle_then_claim(conn: Conn, settle: tuple[str, dict[str, Any]],
                             claim: tuple[str, dict[str, Any]]) -> RoundWritten:
    """The stories and the claim sent as one pipeline: one round trip and one
    transaction, the two statements before its Sync committing together at
    it, or neither. When the server refuses the claim, the stories are sent
    again alone: nothing the claim does wrong is blamed on a story that was
    paid for. (A savepoint between them did the same in the one transaction,
    at four more statements a round, a quarter of its cost on the client.)"""
    # each statement's cursor made before it is sent: which of them the
    # server answered tells, after an error, which one it refused
    settled, claimed = conn.cursor(), conn.cursor()
    try:
        # the pipeline's exit sends the one Sync and reads every answer: a
        # sync() of our own before it cost a second Sync and a round trip
        async with conn.pipeline():
            await settled.execute(*settle)
            await claimed.execute(*claim)
    except db.DB_ERRORS as exc:
        if (not conn.closed and _answered(settled) and not _answered(claimed)
                and conn.info.transaction_status == pq.TransactionStatus.IDLE):
            # the claim was refused and the stories rolled back with it:
            # they stand alone
            settled_alone = _settled(await _one_row(conn, *settle))
            return RoundWritten(settled=settled_alone, claimed=None, claim_refused=exc)
        raise
    settled_row, claimed_row = await settled.fetchone(), await claimed.fetchone()
    assert settled_row is not None and claimed_row is not None
    return RoundWritten(settled=_settled(settled_row), claimed=_claimed(claimed_row))


def settle_params(completions: Sequence[Completion], limits: RateLimits, *, worker_id: str,
                  model: str) -> dict[str, Any]:
    """job_settle's parameters: the stories' small fields as one JSON
    array, their titles and texts as text arrays the statement takes in
    binary (sql/worker.sql, job_settle, says why), and an id for each story,
    made here."""
    return {
        "worker_id": worker_id, "model": model, "limited": limits.limited,
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


async def _one_row(conn: Conn, query: str, params: dict[str, Any]) -> tuple[Any, ...]:
    cur = await conn.execute(query, params)
    row: tuple[Any, ...] | None = await cur.fetchone()
    assert row is not None
    return row


def _answered(cur: Any) -> bool:
    """Whether the server answered this statement of a pipeline with rows."""
    return cur.pgresult is not None and cur.pgresult.status == pq.ExecStatus.TUPLES_OK


class _CompletionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A completion's small fields, one record of job_settle's JSON; ``n`` is
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


_claimed_decoder = msgspec.json.Decoder(list[ClaimedJob])
_limiter_decoder = msgspec.json.Decoder(LimiterState)


def _settled(row: tuple[Any, ...]) -> SettleResult:
    completed_ids, already_completed_ids, _ = row
    return SettleResult(completed_ids=list(completed_ids), already_completed_ids=list(already_completed_ids))


def _claimed(row: tuple[Any, ...]) -> ClaimResult:
    claimed_json, limiter_json = row
    return ClaimResult(claimed=_claimed_decoder.decode(claimed_json), limiter=_limiter_decoder.decode(limiter_json))
