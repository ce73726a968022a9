"""What the worker asks of the database, as one typed interface.

``WorkerStore`` is everything the coordinator, the job tasks, the heartbeat
and the listener need; ``PgWorkerStore`` does it with a connection pool and
the named queries of shared/store.py. A recording fake of the same interface
(tests/fakes/recording_worker_store.py) lets the coordinator's rules be tested
without a database. Every method may raise any of ``shared.db.DB_ERRORS``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from decimal import Decimal
from typing import Protocol

from psycopg_pool import AsyncConnectionPool

from shared import db, store
from shared.ratelimit import KINDS, NO_LIMITS, ProviderView, RateLimits, claim_params
from shared.rows import ClaimedJob, Completion, Failure, HeartbeatRow, RetryStart, SettleResult
from shared.status import LlmOutcome


class WorkerStore(Protocol):
    @property
    def worker_id(self) -> str: ...

    async def settle_and_claim(
        self, completions: Sequence[Completion], claim_limit: int, provider_view: ProviderView | None,
    ) -> SettleResult:
        """Completes the written stories and claims up to claim_limit pending
        jobs that the shared rate bucket covers (kept in step with
        provider_view, what the provider's headers last said), writing each
        one's first ledger row; one statement."""
        ...

    async def fail_running(self, failures: Sequence[Failure]) -> list[int]:
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
        self, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome, previous_error: str
    ) -> RetryStart:
        """Closes an unbilled attempt's ledger row and opens the next one if
        the job is still ours and the rate bucket is not paused. Idempotent:
        run again, it answers the row it opened."""
        ...

    async def pause(self, pause_s: float) -> None:
        """No claim and no retry, by any worker, for pause_s (a 429)."""
        ...

    def learn(self, view: ProviderView) -> None:
        """What the provider's headers said: with no limit configured, the
        limits they announce pace claims and retries from now on."""
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
        limits: RateLimits = NO_LIMITS,
        default_max_tokens: int = 4000,
    ) -> None:
        self._pool = pool
        self._worker_id = worker_id
        self._provider = provider
        self._model = model
        # the configured limits, or, with none, what the provider's headers
        # last announced (learned from the views claim rounds pass on)
        self._configured = limits
        self._limits = limits
        self._default_max_tokens = default_max_tokens
        self._listen_url = listen_url
        self._connect_timeout_s = connect_timeout_s

    @property
    def worker_id(self) -> str:
        return self._worker_id

    async def ensure_rate_bucket(self) -> None:
        """The model's bucket, full, when a limit is configured and it does
        not exist yet (a later claim recreates a deleted one, empty)."""
        if self._limits.limited:
            async with self._pool.connection() as conn:
                await store.llm_rate_bucket_ensure(conn, model=self._model, limits=self._limits)

    async def settle_and_claim(
        self, completions: Sequence[Completion], claim_limit: int, provider_view: ProviderView | None,
    ) -> SettleResult:
        limiter = claim_params(self._limits, provider_view, default_max_tokens=self._default_max_tokens)
        async with self._pool.connection() as conn:
            settled = await store.job_settle_and_claim(
                conn, worker_id=self._worker_id, completions=completions, claim_limit=claim_limit,
                provider=self._provider, model=self._model, limiter=limiter,
            )
        if not self._limits.limited:
            # what other workers learned, before this one heard any header
            self._limits = self._configured.announced(settled.limiter.announced(),
                                                      max_tokens=self._default_max_tokens)
        return settled

    async def fail_running(self, failures: Sequence[Failure]) -> list[int]:
        async with self._pool.connection() as conn:
            return await store.job_fail_running(conn, worker_id=self._worker_id, failures=failures,
                                                model=self._model, limited=self._limits.limited)

    async def claims_of_lost_answer(self, known_ids: Sequence[int]) -> list[ClaimedJob]:
        async with self._pool.connection() as conn:
            return await store.job_adopt_lost_claims(conn, worker_id=self._worker_id, known_ids=known_ids)

    async def heartbeat(self, progress: Mapping[int, int]) -> list[HeartbeatRow]:
        async with self._pool.connection() as conn:
            return await store.job_heartbeat(conn, worker_id=self._worker_id, progress=progress)

    async def call_retry(
        self, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome, previous_error: str
    ) -> RetryStart:
        async with self._pool.connection() as conn:
            return await store.llm_call_start(
                conn, worker_id=self._worker_id, job_id=job_id, previous_attempt=previous_attempt,
                previous_outcome=previous_outcome, previous_billed=not previous_outcome.certainly_unbilled,
                previous_error=previous_error, model=self._model, limits=self._limits,
            )

    def learn(self, view: ProviderView) -> None:
        if any(kind in view.limits for kind in KINDS):
            self._limits = self._configured.learned(view, max_tokens=self._default_max_tokens)

    async def pause(self, pause_s: float) -> None:
        async with self._pool.connection() as conn:
            await store.llm_rate_bucket_pause(conn, model=self._model, pause_s=pause_s, limits=self._limits)

    async def call_finish(
        self, job_id: int, attempt: int, *, outcome: LlmOutcome, billed: bool, input_tokens: int,
        output_tokens: int, cost_usd: Decimal, error_text: str | None, request_id: str | None = None,
    ) -> None:
        async with self._pool.connection() as conn:
            await store.llm_call_finish(
                conn, job_id=job_id, attempt=attempt, outcome=outcome, billed=billed, input_tokens=input_tokens,
                output_tokens=output_tokens, cost_usd=cost_usd, error_text=error_text, request_id=request_id,
            )

    async def notifications(self) -> AsyncIterator[None]:
        if self._listen_url is None:
            return
        conn = await db.connect(self._listen_url, application_name="storyjobs-worker-listen",
                                connect_timeout_s=self._connect_timeout_s)
        async with conn:
            await store.job_listen_pending(conn)
            yield
            async for _ in conn.notifies():
                yield
