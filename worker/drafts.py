"""The draft writer: every DRAFT_INTERVAL_S, one statement appends the text
streamed since the last write of every job this process holds to that job's
draft (sql/worker.sql, draft_append), which the poll shows while the job
runs. Only new text is sent; a job whose text did not grow is left out, and
with none the statement is not sent at all.

Drafts are best effort, the story is not: this task reads what the held
jobs' calls streamed (their StreamedText) and writes nothing any other task
reads, so a draft write that fails or waits never fails, stops or delays a
job. It runs on a pool of its own (worker/draft_store.py) and on
the worker's one periodic runner (worker/helpers.py): a database error is
logged once per episode, with the jobs the write was for, and the next
interval sends what this one could not. Anything else ends the task, and
the worker with it, as for every helper.

What it keeps per job, its own: how long the draft is as the database last
answered, and how many of the text's pieces that was. The answer is the
truth: a draft shorter than what was sent (emptied by a crash of Postgres:
the table is unlogged) is sent again from where it stands.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog

from shared import db
from worker import metrics
from worker.held import HeldJobs
from worker.helpers import every
from worker.rows import DraftPiece

log = structlog.get_logger()


class DraftStore(Protocol):
    async def draft_append(self, pieces: Sequence[DraftPiece]) -> dict[int, int]:
        """Appends the pieces where their jobs are still this worker's;
        answers each such job's draft length (code points)."""
        ...


class _Sent:
    """How far a job's draft is written: ``chars`` as the database answered,
    and ``pieces``, how many of its StreamedText's pieces that is (None:
    not a whole number of them, so the next piece is cut by characters)."""

    __slots__ = ("chars", "pieces")

    def __init__(self) -> None:
        self.chars = 0
        self.pieces: int | None = 0


class DraftWriter:
    def __init__(
        self,
        store: DraftStore,
        held: HeldJobs,
        *,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._held = held
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._sent: dict[int, _Sent] = {}

    async def once(self) -> int:
        """One write of every held job's new text; how many jobs had some."""
        texts = self._held.texts()
        # jobs no longer running: their draft ends with the job
        for job_id in [job_id for job_id in self._sent if job_id not in texts]:
            del self._sent[job_id]
        pieces, upto = [], {}
        for job_id, text in texts.items():
            sent = self._sent.setdefault(job_id, _Sent())
            if text.chars <= sent.chars:
                continue
            upto[job_id] = (text.pieces, text.chars)
            new = text.after_piece(sent.pieces) if sent.pieces is not None else text.after_char(sent.chars)
            pieces.append(DraftPiece(job_id, sent.chars, new))
        if not pieces:
            return 0
        try:
            lengths = await self._store.draft_append(pieces)
        except db.DB_ERRORS:
            metrics.DRAFT_WRITES_FAILED.inc()
            raise
        metrics.DRAFT_WRITES.inc()
        for job_id, (piece_count, chars) in upto.items():
            sent = self._sent[job_id]
            written = lengths.get(job_id)
            if written is None:
                # no longer ours: the heartbeat reports it, the round stops its call; nothing more is sent
                sent.chars, sent.pieces = chars, piece_count
            elif written == chars:
                sent.chars, sent.pieces = chars, piece_count
            else:
                # shorter (emptied by a crash) or otherwise not what was sent
                log.info("job.draft_resent", job_id=job_id, draft_chars=written, text_chars=chars)
                sent.chars, sent.pieces = min(written, chars), None
        return len(pieces)

    async def run(self) -> None:
        await every(self._interval_s, self.once, db.ErrorEpisode("worker", clock=self._clock, task="drafts"),
                    sleep=self._sleep, context=lambda: {"job_ids": sorted(self._held.texts())})
