"""Writing the ends of held jobs, for the round: failures, the ledger rows of
calls stopped because their job was no longer ours, and written stories
(each kind its own statement); and what a refusal means.

What was sent is known, never inferred, so an end is never given up
lightly:

* a job this process has begun stays held until its end is written, so
  adoption (which skips held jobs) can never begin it a second time;
* an end the database refuses for its data is written in a form it cannot
  refuse (numbers already checked against what the columns hold, text made
  storable, a fixed error text); if even that is refused the job stays held
  and the write is retried with backoff, never the request;
* a refused batch is taken apart, one end at a time, before one of them is
  blamed; a claim the server refuses with the stories is rolled back
  and the stories sent again alone (worker/pg_store.py), so a claim's
  refusal is never a story's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import structlog

from shared import db
from shared.ratelimit import RateLimits
from shared.text import storable_or_none
from worker import metrics
from worker.held import Close, HeldJob, HeldJobs, safe, unstorable
from worker.rows import Completion, Failure, SettleResult
from worker.store import WorkerStore

log = structlog.get_logger()

# an end refused in every form is tried again at most this often
_END_RETRY_MAX_S = 60.0
# refused as it was, then in its safe form: from then on it is retried, and
# given up once the job is no longer ours
REFUSALS_GIVEN_UP = 3


class Counts(Protocol):
    """What a round counts of the ends it wrote (worker.coordinator.RoundResult)."""

    completed: int
    lost_races: int
    failed: int
    let_go: int
    unstorable: int


class EndWriter:
    def __init__(self, store: WorkerStore, held: HeldJobs, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._held = held
        self._clock = clock
        # after the database refused a batch for its data, write one at a
        # time until the culprit is found
        self.isolating = False

    def due(self, now: float) -> tuple[list[HeldJob], list[HeldJob], list[HeldJob]]:
        """The failures, stopped calls and stories that can be written now."""
        one = self.isolating
        failures = self._held.due(Failure, now, one=one)
        closes = self._held.due(Close, now, one=one)
        completions = self._held.due(Completion, now, one=one)
        if not (failures or closes or completions):
            self.isolating = False  # nothing left to take apart
        return failures, closes, completions

    def give_up_refused(self, counts: Counts) -> None:
        """Lets go of the jobs whose end was refused in every form and that
        the heartbeat found no longer ours: whoever ended them closed their
        row, charged as unknown."""
        for held in self._held:
            if held.end is not None and held.refusals >= REFUSALS_GIVEN_UP and held.found_gone:
                log.error("job.end_given_up", job_id=held.public_id,
                          detail="its end was refused in every form and the job is no longer ours")
                self._held.release(held)
                counts.let_go += 1

    async def write_failures(self, batch: list[HeldJob], limits: RateLimits, counts: Counts) -> None:
        failures = [h.end for h in batch if isinstance(h.end, Failure)]
        try:
            failed_ids = set(await self._store.fail_running(failures, limits))
        except db.DB_ERRORS as exc:
            self._refused(exc, batch, counts)
            return
        self._written(batch)
        for held in batch:
            self._held.release(held)
            assert isinstance(held.end, Failure)
            if held.job.id in failed_ids:
                counts.failed += 1
                metrics.FAILED.inc()
                log.warning("job.failed", job_id=held.public_id, error_code=held.end.error_code,
                            error=held.end.error_text)
            else:
                counts.lost_races += 1
                metrics.LOST_FAILURE.inc()
                log.info("job.lost_race", job_id=held.public_id, transition="running_to_failed",
                         detail="the job had already been failed elsewhere")

    async def write_closes(self, batch: list[HeldJob], counts: Counts) -> None:
        """The ledger rows of calls stopped because their job was no longer
        ours: whoever ended the job closed them as interrupted, not knowing
        what was sent; now it is known."""
        for held in batch:
            close = held.end
            assert isinstance(close, Close)
            record = close.record
            try:
                await self._store.call_finish(
                    held.job.id, record.attempt, outcome=record.outcome, billed=record.billed,
                    input_tokens=record.input_tokens, output_tokens=record.output_tokens,
                    cost_usd=record.cost_usd, error_text=f"the job was {close.reason} while this call was open",
                    request_id=storable_or_none(record.request_id),
                )
            except db.DB_ERRORS as exc:
                if db.is_transient(exc):
                    raise
                # the job is not ours: its row stays as whoever ended it closed
                # it (interrupted, charged the worst case)
                log.error("llm.ledger_write_failed", job_id=held.public_id, attempt=record.attempt,
                          error=db.describe(exc))
            self._held.release(held)
            counts.let_go += 1

    @staticmethod
    def stories(batch: list[HeldJob]) -> list[Completion]:
        """The written stories of a batch ``due`` gave, for the round's settle."""
        return [h.end for h in batch if isinstance(h.end, Completion)]

    def settled(self, batch: list[HeldJob], settled: SettleResult, counts: Counts) -> None:
        """The stories' settle committed: each job completed, or lost to a race."""
        self._written(batch)
        self._settled(batch, settled, counts)

    def settle_refused(self, exc: Exception, batch: list[HeldJob], counts: Counts) -> None:
        """The stories' settle did not commit (see ``_refused``)."""
        self._refused(exc, batch, counts)

    def _settled(self, batch: list[HeldJob], settled: SettleResult, counts: Counts) -> None:
        completed = set(settled.completed_ids).union(settled.already_completed_ids)
        for held in batch:
            self._held.release(held)
            assert isinstance(held.end, Completion)
            if held.job.id in completed:
                counts.completed += 1
                metrics.COMPLETED.inc()
                log.info("job.completed", job_id=held.public_id, output_tokens=held.end.output_tokens,
                         cost_usd=str(held.end.cost_usd))
            else:
                counts.lost_races += 1
                metrics.LOST_COMPLETION.inc()
                log.warning("job.lost_race", job_id=held.public_id, transition="running_to_completed",
                            detail="sweeper raced, story orphaned")

    def _written(self, batch: list[HeldJob]) -> None:
        if len(batch) <= 1:
            self.isolating = False

    def _refused(self, exc: Exception, batch: list[HeldJob], counts: Counts) -> None:
        """After a database error writing a batch of ends: raise it again (a
        transient error is waited out; a batch refused for its data is then
        written one end at a time), unless the one end of a batch written on
        its own was refused for good: that end is then rewritten in a form
        the database cannot refuse, and, refused in that form too, tried
        again later."""
        if db.is_transient(exc) or not batch:
            raise exc
        if len(batch) > 1:
            self.isolating = True
            raise exc
        self.isolating = False
        (held,) = batch
        held.refusals += 1
        end = held.end
        if isinstance(end, Completion):
            counts.unstorable += 1
            log.error("job.completion_unstorable", job_id=held.public_id, error=db.describe(exc))
            held.end = unstorable(end, db.describe(exc))
        elif isinstance(end, Failure) and held.refusals < REFUSALS_GIVEN_UP:
            log.error("job.end_unstorable", job_id=held.public_id, error=db.describe(exc),
                      detail="written again in a form the database cannot refuse")
            held.end = safe(end)
        else:
            # kept, heartbeats and all, until the database takes it or the
            # job is no longer ours; never sent again
            held.retry_at = self._clock() + min(2.0 ** held.refusals, _END_RETRY_MAX_S)
            if held.refusals == REFUSALS_GIVEN_UP:
                log.error("job.end_refused", job_id=held.public_id, error=db.describe(exc),
                          detail="the job stays held; its end is tried again with backoff")
