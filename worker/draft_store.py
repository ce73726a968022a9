"""The draft writer's statement (worker/drafts.py, sql/worker.sql's
draft_append), on a pool of its own: a draft write that waits or fails never
holds a connection a job's end or heartbeat waits for."""

from __future__ import annotations

from collections.abc import Sequence

from shared.queries import QUERIES as Q
from shared.store import Connections, connection
from worker.rows import DraftPiece


class PgDraftStore:
    def __init__(self, connections: Connections, *, worker_id: str) -> None:
        self._connections = connections
        self._worker_id = worker_id

    async def draft_append(self, pieces: Sequence[DraftPiece]) -> dict[int, int]:
        """Appends each piece to its job's draft where the job is still
        running under this worker and its draft is exactly ``from_char``
        long; answers how long the draft of each job still ours is now."""
        async with connection(self._connections) as conn:
            cur = await conn.execute(Q["draft_append"], {
                "worker_id": self._worker_id,
                "job_ids": [p.job_id for p in pieces],
                "from_chars": [p.from_char for p in pieces],
                "texts": [p.text for p in pieces],
            })
            return {job_id: chars for job_id, chars in await cur.fetchall()}
