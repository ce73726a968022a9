"""The console's jobs (api/ops/jobs.py, api/ops/batches.py, ``storyjobs jobs``
and ``storyjobs batches``): the jobs list, a job's page and its calls, the
cancel by filter and the count before it, the message batches. One method
per query of sql/console.sql, its name the query's. An operator's cancel of
one job is the common job_cancel (shared/store.py), with no client."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import msgspec

from shared.console_rows import (
    JobFilter,
    LlmCallRow,
    OpsBatchRow,
    OpsJobDetail,
    OpsJobRow,
    PendingCount,
)
from shared.store import Conn, fetch_all, fetch_one, fetch_scalars, job_admission_lock


def _filter_params(filters: JobFilter) -> dict[str, Any]:
    return msgspec.structs.asdict(filters)


class ConsoleJobs:
    """The jobs' queries, on the console's connection (ConsoleStore.jobs).
    Every method may raise any of ``shared.db.DB_ERRORS``."""

    __slots__ = ("conn",)

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    async def ops_job_list(
        self, *, filters: JobFilter, live: bool, before_id: int | None, limit: int, floor_id: int | None = None,
        before_created_at: datetime | None = None,
    ) -> list[OpsJobRow]:
        """Jobs matching filters, newest first. History (not ``live``): by id,
        floor_id <= id < before_id. ``live``: jobs of one live status
        (filters.status) by (created_at, id) below (before_created_at,
        before_id); None: from the newest."""
        params = {**_filter_params(filters), "live": live, "before_id": before_id, "floor_id": floor_id,
                  "before_created_at": before_created_at, "limit": limit}
        return await fetch_all(self.conn, OpsJobRow, "ops_job_list", params)

    async def ops_job_get(self, *, job_id: uuid.UUID) -> OpsJobDetail | None:
        return await fetch_one(self.conn, OpsJobDetail, "ops_job_get", {"job_id": job_id})

    async def llm_call_list_for_job(self, *, job_id: int) -> list[LlmCallRow]:
        return await fetch_all(self.conn, LlmCallRow, "llm_call_list_for_job", {"job_id": job_id})

    async def ops_job_count_pending(self, *, filters: JobFilter) -> PendingCount:
        # status and error_code are not read: the count is of pending jobs
        row = await fetch_one(self.conn, PendingCount, "ops_job_count_pending", _filter_params(filters))
        assert row is not None
        return row

    async def ops_job_cancel_pending(self, *, filters: JobFilter, through_id: int) -> list[uuid.UUID]:
        """Cancels the pending jobs matching filters (client and time range)
        up to through_id, under the admission lock (their turns are given
        back); returns the job ids it cancelled."""
        async with self.conn.transaction():
            await job_admission_lock(self.conn)
            return await fetch_scalars(self.conn, "ops_job_cancel_pending",
                                       {**_filter_params(filters), "through_id": through_id})

    async def ops_batch_list(self, *, before_id: int | None, limit: int) -> list[OpsBatchRow]:
        """Message batches newest first, below before_id (None: from the newest)."""
        return await fetch_all(self.conn, OpsBatchRow, "ops_batch_list", {"before_id": before_id, "limit": limit})
