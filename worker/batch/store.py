"""What the batch lane asks of the database: ``BatchStore``, one method per
named query of sql/batch.sql, on the lane's own pool. It keeps no state.

Every method of the holder that changes what others read takes the
``Lease`` it holds: its statement checks the lease in the same statement and
changes nothing once the lease is no longer the holder's (a holder paused
past it). Every method may raise any of ``shared.db.DB_ERRORS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec
from psycopg_pool import AsyncConnectionPool

from shared.queries import QUERIES as Q
from shared.store import fetch_all, fetch_one, fetch_scalars, jsonb
from worker.batch.rows import (
    BatchItemRow,
    IngestAnswer,
    Intent,
    IntentItem,
    Lease,
    LeaseTaken,
    LiveBatch,
    LostAnswer,
    ReadySummary,
    RefusedAnswer,
    ResultRecord,
    SentAnswer,
)

_items_decoder = msgspec.json.Decoder(list[IntentItem])


class BatchStore:
    """The batch lane's statements on its own connection pool."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self._pool = pool

    # -- the lease ----------------------------------------------------------------------

    async def lease_take(self, holder: str, lease_s: float) -> LeaseTaken | None:
        """The submitter's lease, renewed or taken; None: another holds it."""
        async with self._pool.connection() as conn:
            return await fetch_one(conn, LeaseTaken, "batch_lease_take", {"holder": holder, "lease_s": lease_s})

    async def lease_release(self, lease: Lease) -> None:
        await _execute(self._pool, "batch_lease_release", _fence(lease))

    # -- submitting ---------------------------------------------------------------------

    async def ready_summary(self, max_requests: int) -> ReadySummary:
        answer: ReadySummary = await _one(self._pool, ReadySummary, "batch_ready_summary", {"max_requests": max_requests})
        return answer

    async def intent_create(self, lease: Lease, lease_s: float, *, max_requests: int, model: str,
                            provider: str) -> Intent | None:
        """The lease renewed, a batch's intent committed, its jobs moved into
        it, then their items and ledger rows, in one transaction of two
        statements (sql/batch.sql, batch_intent_items, says why two). None:
        the lease is not ours, or no job waits."""
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute(Q["batch_intent_create"], {
                **_fence(lease), "lease_s": lease_s, "max_requests": max_requests, "model": model})
            row = await cur.fetchone()
            if row is None:
                return None
            batch_id, fence_at, job_ids = row
            cur = await conn.execute(Q["batch_intent_items"], {
                **_fence(lease), "batch_id": batch_id, "job_ids": list(job_ids), "model": model,
                "provider": provider})
            items_row = await cur.fetchone()
        assert items_row is not None
        return Intent(id=batch_id, fence_at=fence_at, items=_items_decoder.decode(items_row[0]))

    async def items_drop(self, lease: Lease, batch_id: int, job_ids: Sequence[int], error_text: str) -> list[int]:
        return [int(v) for v in await _scalars(self._pool, "batch_items_drop", {
            **_fence(lease), "batch_id": batch_id, "job_ids": list(job_ids), "error_text": error_text})]

    async def sent(self, lease: Lease, batch_id: int, provider_batch_id: str, expires_at: datetime,
                   processing_status: str) -> SentAnswer:
        """The intent adopted as the provider's batch; a provider batch id a
        row already records is answered, not raised."""
        answer: SentAnswer = await _one(self._pool, SentAnswer, "batch_sent", {
            **_fence(lease), "batch_id": batch_id, "provider_batch_id": provider_batch_id,
            "expires_at": expires_at, "processing_status": processing_status})
        return answer

    async def refused(self, lease: Lease, batch_id: int, *, outcome: str, error_code: str, error_text: str,
                      max_attempts: int) -> RefusedAnswer:
        answer: RefusedAnswer = await _one(self._pool, RefusedAnswer, "batch_refused", {
            **_fence(lease), "batch_id": batch_id, "outcome": outcome, "error_code": error_code,
            "error_text": error_text, "max_attempts": max_attempts})
        return answer

    # -- reconciling ----------------------------------------------------------------------

    async def lost(self, lease: Lease, batch_id: int) -> LostAnswer:
        answer: LostAnswer = await _one(self._pool, LostAnswer, "batch_lost", {**_fence(lease), "batch_id": batch_id})
        return answer

    async def stray_record(self, lease: Lease, provider_batch_id: str, *, model: str, request_count: int,
                           created_at: datetime, expires_at: datetime, processing_status: str,
                           lost_batch_id: int) -> int | None:
        found = await _scalars(self._pool, "batch_stray_record", {
            **_fence(lease), "provider_batch_id": provider_batch_id, "model": model, "request_count": request_count,
            "created_at": created_at, "expires_at": expires_at, "processing_status": processing_status,
            "lost_batch_id": lost_batch_id})
        return int(found[0]) if found else None

    async def live(self) -> list[LiveBatch]:
        async with self._pool.connection() as conn:
            return await fetch_all(conn, LiveBatch, "batch_live_list", {})

    async def known(self, provider_batch_ids: Sequence[str]) -> set[str]:
        return {str(v) for v in await _scalars(self._pool, "batch_known", {"provider_batch_ids": list(provider_batch_ids)})}

    # -- collecting ---------------------------------------------------------------------

    async def seen(self, lease: Lease, batch_id: int, *, processing_status: str, request_counts: dict[str, int],
                   expires_at: datetime | None) -> None:
        await _execute(self._pool, "batch_seen", {
            **_fence(lease), "batch_id": batch_id, "processing_status": processing_status,
            "request_counts": jsonb(request_counts), "expires_at": expires_at})

    async def cancel_asked(self, lease: Lease, batch_id: int) -> None:
        await _execute(self._pool, "batch_cancel_asked", {**_fence(lease), "batch_id": batch_id})

    async def items_of(self, batch_id: int) -> list[BatchItemRow]:
        async with self._pool.connection() as conn:
            return await fetch_all(conn, BatchItemRow, "batch_items_of", {"batch_id": batch_id})

    async def ingest(self, lease: Lease, batch_id: int, results: Sequence[ResultRecord], *, max_attempts: int,
                     free: bool) -> IngestAnswer:
        """A chunk of results of the batch whose items they are, in one
        transaction; idempotent. ``free``: the provider bills nothing
        (offline); no default, so that no caller charges by omission."""
        answer: IngestAnswer = await _one(self._pool, IngestAnswer, "batch_results_ingest", {
            **_fence(lease), "batch_id": batch_id, "results": jsonb(list(results)), "max_attempts": max_attempts,
            "free": free})
        return answer

    async def results_read(self, lease: Lease, batch_id: int) -> bool:
        return bool(await _scalars(self._pool, "batch_results_read", {**_fence(lease), "batch_id": batch_id}))

    async def stray_read(self, lease: Lease, batch_id: int) -> bool:
        return bool(await _scalars(self._pool, "batch_stray_read", {**_fence(lease), "batch_id": batch_id}))


def _fence(lease: Lease) -> dict[str, Any]:
    """The lease a statement checks before it changes anything."""
    return {"holder": lease.holder, "token": lease.token}


async def _one(pool: AsyncConnectionPool, row_type: type[Any], name: str, params: dict[str, Any]) -> Any:
    """The one row a statement always answers."""
    async with pool.connection() as conn:
        answer = await fetch_one(conn, row_type, name, params)
    assert answer is not None
    return answer


async def _scalars(pool: AsyncConnectionPool, name: str, params: dict[str, Any]) -> list[Any]:
    async with pool.connection() as conn:
        return await fetch_scalars(conn, name, params)


async def _execute(pool: AsyncConnectionPool, name: str, params: dict[str, Any]) -> None:
    async with pool.connection() as conn:
        await conn.execute(Q[name], params)
