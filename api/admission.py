"""Admitting new jobs in batches.

A strict QUEUE_MAX needs one lock around every admission, and with one
commit per admission the api could admit no faster than the disk flushes.
So each api process sends the POSTs that arrived while its previous batch was
being written as one batch: one admission lock, one statement, one commit
(ApiStore.job_insert_if_admitted). Under light load a batch is a single
POST and waits for nothing; under heavy load the batches grow.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

from opentelemetry import trace
from opentelemetry.trace import Tracer
from psycopg_pool import AsyncConnectionPool

from api.rows import Admission, EnqueueResult
from api.store import ApiStore
from shared import prompt, telemetry
from shared.config import BaseSettings
from shared.status import Lane
from shared.story_request import StoryRequest, canonical_json, fingerprint

# the most POSTs one transaction carries
MAX_BATCH = 256
# the links a span keeps (the SDK's default OTEL_SPAN_LINK_COUNT_LIMIT)
_LINKS_MAX = 128

_Key = tuple[int, str]


def admission(client_id: int, idempotency_key: str, request: StoryRequest, settings: BaseSettings) -> Admission:
    """A new job as admission sees it, with what its call may cost: the
    max_tokens its length allows, its input tokens estimated (for the rate
    limiter) and bounded (for its worst case, which a spend budget reserves)."""
    max_tokens = prompt.max_tokens(request, settings.llm_max_tokens)
    lane = Lane(request.lane)
    # a batch job keeps the batch price it is reserved at, and is charged at it
    price = settings.price().batch() if lane is Lane.BATCH else settings.price()
    return Admission(
        client_id=client_id, idempotency_key=idempotency_key, request_fingerprint=fingerprint(request),
        request_json=canonical_json(request).decode(), max_tokens=max_tokens,
        input_tokens_estimate=prompt.input_tokens_estimate(request),
        worst_case_usd=price.worst_case(prompt.input_tokens_at_most(request), max_tokens),
        model=settings.llm_model, input_usd_per_mtok=price.input_usd_per_mtok,
        output_usd_per_mtok=price.output_usd_per_mtok, lane=lane,
        trace_context=telemetry.current_context_carrier(),
    )


class AdmissionBatcher:
    def __init__(
        self, pool: AsyncConnectionPool, *, queue_max: int, client_queue_max: int, batch_queue_max: int,
        client_batch_queue_max: int, connection_wait_s: float, budget_usd: Decimal | None = None,
        client_budget_usd: Decimal | None = None, tracer: Tracer | None = None,
    ) -> None:
        self._pool = pool
        # one span per batch written, linked to each admitted job's trace
        self._tracer = tracer or trace.get_tracer("storyjobs.api")
        self._queue_max = queue_max
        self._client_queue_max = client_queue_max
        self._batch_queue_max = batch_queue_max
        self._client_batch_queue_max = client_batch_queue_max
        self._budget_usd = budget_usd
        self._client_budget_usd = client_budget_usd
        self._connection_wait_s = connection_wait_s
        self._waiting: list[tuple[Admission, asyncio.Future[EnqueueResult]]] = []
        # runs only while there is something to admit, so nothing outlives its loop
        self._writer: asyncio.Task[None] | None = None
        self.batches_written = 0

    async def admit(self, admission: Admission) -> EnqueueResult:
        """The admission's result once its batch is committed. A caller that
        gives up (its deadline) does not stop the batch: a retry with the same
        key then finds the job."""
        future: asyncio.Future[EnqueueResult] = asyncio.get_running_loop().create_future()
        self._waiting.append((admission, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_batches(), name="admissions")
        return await future

    async def _write_batches(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            try:
                results = await self._write(batch)
            except BaseException as exc:  # noqa: BLE001 - every waiting request must hear of it
                # a database error reaches each request (a 503); a cancelled
                # writer (the app stopping) must not leave requests waiting
                failure = exc if isinstance(exc, Exception) else RuntimeError("the api is stopping")
                for _, future in batch:
                    _settle(future, error=failure)
                if not isinstance(exc, Exception):
                    raise
                continue
            for (_, future), result in zip(batch, results, strict=True):
                _settle(future, result=result)

    async def _write(self, batch: list[tuple[Admission, asyncio.Future[EnqueueResult]]]) -> list[EnqueueResult]:
        # the same (client, key) twice in one batch is one job: the first asks,
        # the others answer as replays of it
        first: dict[_Key, int] = {}
        unique: list[Admission] = []
        for admission, _ in batch:
            key = (admission.client_id, admission.idempotency_key)
            if key not in first:
                first[key] = len(unique)
                unique.append(admission)
        links = [link for a in unique
                 if (link := telemetry.link_from_carrier(a.trace_context)) is not None][:_LINKS_MAX]
        with self._tracer.start_as_current_span("storyjobs.admission", links=links,
                                                attributes={"storyjobs.admission.requests": len(unique)}):
            async with self._pool.connection(timeout=self._connection_wait_s) as conn:
                answered = await ApiStore(conn).job_insert_if_admitted(
                    admissions=unique, queue_max=self._queue_max, client_queue_max=self._client_queue_max,
                    budget_usd=self._budget_usd, client_budget_usd=self._client_budget_usd,
                    batch_queue_max=self._batch_queue_max, client_batch_queue_max=self._client_batch_queue_max,
                )
        self.batches_written += 1
        results = []
        seen: set[_Key] = set()
        for admission, _ in batch:
            key = (admission.client_id, admission.idempotency_key)
            result = answered[first[key]]
            if key in seen and result.outcome == "inserted":
                result = EnqueueResult(
                    ord=result.ord, outcome="existing", public_id=result.public_id, status=result.status,
                    request_fingerprint=result.request_fingerprint, created_at=result.created_at,
                    notified=result.notified,
                )
            seen.add(key)
            results.append(result)
        return results


def _settle(future: asyncio.Future[EnqueueResult], *, result: EnqueueResult | None = None,
            error: Exception | None = None) -> None:
    if future.done():  # its request may have given up already
        return
    if error is not None:
        future.set_exception(error)
    elif result is not None:
        future.set_result(result)
