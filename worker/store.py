"""What the worker's job loop asks of the database, as one typed interface.

``WorkerStore`` is everything the round, the job tasks, the heartbeat and
the listener need; ``worker.pg_store.PgWorkerStore`` does it with the
worker's named queries (sql/worker.sql). A recording fake of the same
interface (tests/fakes/recording_worker_store.py) lets the coordinator's
rules be tested without a database. Every method may raise any of
``shared.db.DB_ERRORS``. The draft writer and the webhook deliveries have
stores of their own (worker/draft_store.py, worker/delivery/store.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

import msgspec

from shared.ratelimit import ProviderView, RateLimits
from shared.status import LlmOutcome
from worker.rows import (
    ClaimedJob,
    ClaimResult,
    Completion,
    Failure,
    HeartbeatRow,
    RetryStart,
    SettleResult,
)


class ClaimAsk(msgspec.Struct, frozen=True):
    """What a round's claim asks: up to ``limit`` jobs (0: none, the claim
    only tells the shared bucket what was heard), and what the provider's
    headers last said if it is news (``view``)."""

    limit: int
    view: ProviderView | None = None


@dataclass(frozen=True)
class RoundWritten:
    """What a round's one transaction did: its stories settled (None: it
    carried none), its claim's answer (None: none asked, or refused), and
    the error a refused claim was rolled back for while the stories
    committed."""

    settled: SettleResult | None
    claimed: ClaimResult | None
    claim_refused: Exception | None = None


class WorkerStore(Protocol):
    """What the round, the job tasks, the heartbeat and the listener ask of
    the database. It keeps no state: the rate limits the round holds (no
    limit: ``shared.ratelimit.NO_LIMITS``) are passed to each statement that
    needs them."""

    @property
    def worker_id(self) -> str: ...

    async def settle_and_claim(
        self, completions: Sequence[Completion], ask: ClaimAsk | None, limits: RateLimits,
    ) -> RoundWritten:
        """The round's written stories settled (their jobs completed where
        still ours, stories stored; with a rate limit, the shared bucket gets
        back what their claims reserved and their calls did not use), then
        up to ``ask.limit`` pending jobs that the shared bucket covers claimed,
        each with its first ledger row; one transaction, one commit. A claim
        the database refuses takes nothing with it: the stories commit all the
        same, in a transaction of their own (``claim_refused``).
        Raised: the stories' refusal (nothing committed), or an error after
        which neither is known to have committed or not."""
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
