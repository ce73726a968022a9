"""What the batch lane asks of the database, as one typed interface.

``BatchStore`` is everything the lane's loop needs (worker/batch/lane.py);
``PgBatchStore`` runs it on the lane's own pool with the named queries of
sql/batch.sql, each through one small typed function below. It keeps no
state. Every method may raise any of ``shared.db.DB_ERRORS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

import msgspec
from psycopg_pool import AsyncConnectionPool

from shared.queries import QUERIES as Q
from shared.store import Conn, fetch_all, fetch_one, fetch_scalars, jsonb
from worker.batch.rows import (
    BatchItemRow,
    IngestAnswer,
    Intent,
    IntentItem,
    LeaseTaken,
    LiveBatch,
    LostAnswer,
    ReadySummary,
    RefusedAnswer,
    ResultRecord,
    WorstCase,
)


class BatchStore(Protocol):
    async def lease_take(self, holder: str, lease_s: float) -> LeaseTaken | None: ...

    async def lease_release(self, holder: str, token: int) -> None: ...

    async def ready_summary(self, max_requests: int) -> ReadySummary: ...

    async def intent_create(self, holder: str, token: int, lease_s: float, *, max_requests: int, model: str,
                            provider: str) -> Intent | None:
        """The lease renewed and a batch's intent committed, its jobs moved
        into it; None: the lease is not ours, or no job waits."""
        ...

    async def items_drop(self, batch_id: int, job_ids: Sequence[int], error_text: str) -> list[int]: ...

    async def sent(self, batch_id: int, provider_batch_id: str, expires_at: datetime,
                   processing_status: str) -> bool: ...

    async def refused(self, batch_id: int, *, outcome: str, error_code: str, error_text: str,
                      max_attempts: int) -> RefusedAnswer: ...

    async def lost(self, batch_id: int, worst_cases: Sequence[WorstCase]) -> LostAnswer: ...

    async def stray_record(self, provider_batch_id: str, *, model: str, request_count: int, created_at: datetime,
                           expires_at: datetime, processing_status: str, lost_batch_id: int) -> int | None: ...

    async def live(self) -> list[LiveBatch]: ...

    async def known(self, provider_batch_ids: Sequence[str]) -> set[str]: ...

    async def seen(self, batch_id: int, *, processing_status: str, request_counts: dict[str, int],
                   expires_at: datetime | None) -> None: ...

    async def cancel_asked(self, batch_id: int) -> None: ...

    async def items_of(self, batch_id: int) -> list[BatchItemRow]: ...

    async def ingest(self, batch_id: int, results: Sequence[ResultRecord], *, max_attempts: int,
                     free: bool = False) -> IngestAnswer:
        """A chunk of results of the batch whose items they are, in one
        transaction; idempotent. ``free``: the provider bills nothing (offline)."""
        ...

    async def results_read(self, batch_id: int) -> bool: ...

    async def stray_read(self, batch_id: int) -> bool: ...


class PgBatchStore:
    """BatchStore on the lane's own connection pool."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self._pool = pool

    async def _one(self, row_type: type[Any], name: str, params: dict[str, Any]) -> Any:
        async with self._pool.connection() as conn:
            return await fetch_one(conn, row_type, name, params)

    async def lease_take(self, holder: str, lease_s: float) -> LeaseTaken | None:
        taken: LeaseTaken | None = await self._one(LeaseTaken, "batch_lease_take",
                                                   {"holder": holder, "lease_s": lease_s})
        return taken

    async def lease_release(self, holder: str, token: int) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(Q["batch_lease_release"], {"holder": holder, "token": token})

    async def ready_summary(self, max_requests: int) -> ReadySummary:
        summary: ReadySummary | None = await self._one(ReadySummary, "batch_ready_summary",
                                                       {"max_requests": max_requests})
        assert summary is not None
        return summary

    async def intent_create(self, holder: str, token: int, lease_s: float, *, max_requests: int, model: str,
                            provider: str) -> Intent | None:
        async with self._pool.connection() as conn:
            return await batch_intent_create(conn, holder=holder, token=token, lease_s=lease_s,
                                             max_requests=max_requests, model=model, provider=provider)

    async def items_drop(self, batch_id: int, job_ids: Sequence[int], error_text: str) -> list[int]:
        async with self._pool.connection() as conn:
            return [int(v) for v in await fetch_scalars(conn, "batch_items_drop", {
                "batch_id": batch_id, "job_ids": list(job_ids), "error_text": error_text})]

    async def sent(self, batch_id: int, provider_batch_id: str, expires_at: datetime,
                   processing_status: str) -> bool:
        async with self._pool.connection() as conn:
            return bool(await fetch_scalars(conn, "batch_sent", {
                "batch_id": batch_id, "provider_batch_id": provider_batch_id, "expires_at": expires_at,
                "processing_status": processing_status}))

    async def refused(self, batch_id: int, *, outcome: str, error_code: str, error_text: str,
                      max_attempts: int) -> RefusedAnswer:
        answer: RefusedAnswer | None = await self._one(RefusedAnswer, "batch_refused", {
            "batch_id": batch_id, "outcome": outcome, "error_code": error_code, "error_text": error_text,
            "max_attempts": max_attempts})
        assert answer is not None
        return answer

    async def lost(self, batch_id: int, worst_cases: Sequence[WorstCase]) -> LostAnswer:
        answer: LostAnswer | None = await self._one(LostAnswer, "batch_lost", {
            "batch_id": batch_id, "worst_cases": jsonb(list(worst_cases))})
        assert answer is not None
        return answer

    async def stray_record(self, provider_batch_id: str, *, model: str, request_count: int, created_at: datetime,
                           expires_at: datetime, processing_status: str, lost_batch_id: int) -> int | None:
        async with self._pool.connection() as conn:
            found = await fetch_scalars(conn, "batch_stray_record", {
                "provider_batch_id": provider_batch_id, "model": model, "request_count": request_count,
                "created_at": created_at, "expires_at": expires_at, "processing_status": processing_status,
                "lost_batch_id": lost_batch_id})
        return int(found[0]) if found else None

    async def live(self) -> list[LiveBatch]:
        async with self._pool.connection() as conn:
            return await fetch_all(conn, LiveBatch, "batch_live_list", {})

    async def known(self, provider_batch_ids: Sequence[str]) -> set[str]:
        async with self._pool.connection() as conn:
            return {str(v) for v in await fetch_scalars(conn, "batch_known",
                                                        {"provider_batch_ids": list(provider_batch_ids)})}

    async def seen(self, batch_id: int, *, processing_status: str, request_counts: dict[str, int],
                   expires_at: datetime | None) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(Q["batch_seen"], {
                "batch_id": batch_id, "processing_status": processing_status,
                "request_counts": jsonb(request_counts), "expires_at": expires_at})

    async def cancel_asked(self, batch_id: int) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(Q["batch_cancel_asked"], {"batch_id": batch_id})

    async def items_of(self, batch_id: int) -> list[BatchItemRow]:
        async with self._pool.connection() as conn:
            return await fetch_all(conn, BatchItemRow, "batch_items_of", {"batch_id": batch_id})

    async def ingest(self, batch_id: int, results: Sequence[ResultRecord], *, max_attempts: int,
                     free: bool = False) -> IngestAnswer:
        answer: IngestAnswer | None = await self._one(IngestAnswer, "batch_results_ingest", {
            "batch_id": batch_id, "results": jsonb(list(results)), "max_attempts": max_attempts, "free": free})
        assert answer is not None
        return answer

    async def results_read(self, batch_id: int) -> bool:
        async with self._pool.connection() as conn:
            return bool(await fetch_scalars(conn, "batch_results_read", {"batch_id": batch_id}))

    async def stray_read(self, batch_id: int) -> bool:
        async with self._pool.connection() as conn:
            return bool(await fetch_scalars(conn, "batch_stray_read", {"batch_id": batch_id}))


_items_decoder = msgspec.json.Decoder(list[IntentItem])


async def batch_intent_create(conn: Conn, *, holder: str, token: int, lease_s: float, max_requests: int,
                              model: str, provider: str) -> Intent | None:
    cur = await conn.execute(Q["batch_intent_create"], {
        "holder": holder, "token": token, "lease_s": lease_s, "max_requests": max_requests, "model": model,
        "provider": provider})
    row = await cur.fetchone()
    if row is None:
        return None
    batch_id, fence_at, items = row
    return Intent(id=batch_id, fence_at=fence_at, items=_items_decoder.decode(items) if items else [])
