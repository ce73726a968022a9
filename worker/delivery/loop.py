"""The delivery loop: ``Deliverer.run()`` until ``stop()``.

Each turn claims as many due deliveries as it has free slots
(WEBHOOK_CONCURRENCY) in one short statement that leases them
(webhook_delivery_claim), sends each in its own task with no transaction
open, and records how the attempt ended in one guarded statement
(webhook_delivery_finish): 2xx delivered; 410 the endpoint disabled; any
other answer, a network error, a timeout or a refused address is retried on
the spec's schedule, or after the receiver's Retry-After, and dead when the
schedule is spent. Whatever else an attempt raises is a failed attempt too,
recorded and logged once (``webhook.attempt_raised``): a delivery always
ends, delivered or dead, and the claim never takes one past the schedule.
The claim shares the slots between clients (see the statement), so one
client's hanging receivers cost another client's event at most one
attempt's timeout. Delivery is at least once: a worker killed mid-attempt,
or one whose record fails, leaves the lease to run out and the delivery to
be sent again with the same ``webhook-id``. Each claim gives the attempt a
new lease number; its end is recorded under that number or not at all.

It reaches Postgres only through its store (worker/delivery/store.py).
Database errors are logged once per episode (shared.db.ErrorEpisode) and
waited out with the worker's one backoff (worker/backoff.py); they never
stop the loop. Crash-only: killed at any line, what it leased is leased
again when the lease runs out. On stop, attempts in flight get their
timeout to finish; any still running are abandoned to their leases.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable

import httpx
import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, StatusCode, Tracer

from shared import db, telemetry, text, webhooks
from shared.config import WorkerSettings
from worker.backoff import Backoff
from worker.delivery import metrics, send
from worker.delivery.rows import DeliveryOutcome, WebhookDeliveryClaim
from worker.delivery.store import DeliveryStore

log = structlog.get_logger()

# what is kept of an error in last_error
_ERROR_CHARS = 500


class Deliverer:
    def __init__(self, settings: WorkerSettings, store: DeliveryStore, *,
                 clock: Callable[[], float] = time.monotonic, tracer: Tracer | None = None) -> None:
        self.settings = settings
        self._store = store
        # traces on: a span per attempt (_traced)
        self._tracer = tracer
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        # built once: loading the trust store costs milliseconds
        self._ssl_context = ssl.create_default_context()
        self._errors = db.ErrorEpisode("webhook", clock=clock, task="deliverer")
        self._backoff = Backoff()
        # the wait after the last claim failed; 0 while the database answers
        self._backoff_s = 0.0

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        log.info("webhook.deliverer_started", concurrency=self.settings.webhook_concurrency,
                 allow_private=self.settings.webhook_allow_private)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while not self._stopping.is_set():
                claimed = await self._claim()
                for delivery in claimed:
                    task = asyncio.create_task(self._traced(delivery) if self._tracer else self._deliver(delivery))
                    self._tasks.add(task)
                    task.add_done_callback(self._task_done)
                free = self.settings.webhook_concurrency - len(self._tasks)
                if claimed and free > 0 and not self._backoff_s:
                    # a full batch: more may be due
                    continue
                wait_s = self._backoff_s or self.settings.webhook_poll_interval_s
                await asyncio.wait({stopping, *self._tasks}, timeout=wait_s,
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=self.settings.webhook_timeout_s + 1.0)
            for task in list(self._tasks):
                task.cancel()
            log.info("webhook.deliverer_stopped", abandoned=len(self._tasks))

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        # _deliver records whatever an attempt raises; this is what raised
        # around it (a defect): said, not lost with the task
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook.delivery_task_failed", error=type(task.exception()).__name__,
                      exc_info=task.exception())

    async def _claim(self) -> list[WebhookDeliveryClaim]:
        free = self.settings.webhook_concurrency - len(self._tasks)
        if free <= 0:
            return []
        try:
            claimed = await self._store.claim(free, self.settings.webhook_lease_s)
        except db.DB_ERRORS as exc:
            self._errors.failed(exc)
            self._backoff_s = self._backoff.next_s()
            return []
        self._errors.succeeded()
        self._backoff.reset()
        self._backoff_s = 0.0
        return claimed

    async def _traced(self, delivery: WebhookDeliveryClaim) -> None:
        """An attempt as the span ``storyjobs.webhook.attempt``: the first
        in the job's trace, a later one (minutes or hours after) in a trace
        of its own, linked to the job's. No URL and no secret in it: the
        endpoint's id says where. The receiver is sent no trace context: its
        traces are not ours to join."""
        assert self._tracer is not None
        carrier = telemetry.carrier_of(delivery.trace_context)
        first = delivery.attempts == 1
        link = None if first else telemetry.link_from_carrier(carrier)
        with self._tracer.start_as_current_span(
                "storyjobs.webhook.attempt", kind=SpanKind.CLIENT,
                context=telemetry.context_from_carrier(carrier) if first else Context(),
                links=[link] if link is not None else [], record_exception=False, set_status_on_exception=False,
                attributes={"storyjobs.webhook.attempt": delivery.attempts,
                            "storyjobs.webhook.delivery_id": delivery.id,
                            "storyjobs.webhook.endpoint_id": str(delivery.endpoint_id),
                            "storyjobs.webhook.event": webhooks.event_of(delivery.job_status, delivery.error_code),
                            "storyjobs.job.id": str(delivery.job_public_id)}):
            await self._deliver(delivery)

    async def _deliver(self, delivery: WebhookDeliveryClaim) -> None:
        bound = log.bind(delivery_id=delivery.id, job_id=str(delivery.job_public_id),
                         endpoint_id=str(delivery.endpoint_id), attempt=delivery.attempts)
        if delivery.endpoint_disabled:
            await self._finish(delivery, "dead", error="the endpoint is disabled", bound=bound)
            return
        status_code: int | None = None
        retry_after_s: float | None = None
        error: str | None = None
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.settings.webhook_timeout_s):
                answer = await self._send(delivery)
            status_code = answer.status_code
            retry_after_s = webhooks.parse_retry_after(answer.retry_after)
        except webhooks.UnsafeUrl as exc:
            metrics.REFUSED.inc()
            error = f"refused: {exc}"
            bound.warning("webhook.refused", detail=str(exc))
        except TimeoutError:
            error = f"no answer within {self.settings.webhook_timeout_s:g} s"
        except (httpx.HTTPError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - whatever an attempt raises is a failed attempt, recorded
            # (an URL httpx cannot parse, a receiver's answer it cannot read): a
            # delivery whose attempts record nothing would be sent again at
            # every lease and never end
            metrics.ATTEMPT_ERRORS.inc()
            error = f"unexpected {type(exc).__name__}: {exc}"
            bound.warning("webhook.attempt_raised", error=type(exc).__name__, detail=str(exc)[:200],
                          exc_info=exc)
        finally:
            metrics.ATTEMPT_DURATION.observe(time.perf_counter() - started)
        if status_code is not None and 200 <= status_code < 300:
            await self._finish(delivery, "delivered", status_code=status_code, bound=bound)
            return
        if status_code == 410:
            await self._finish(delivery, "gone", status_code=status_code,
                               error="410 Gone: the endpoint is disabled", bound=bound)
            return
        if status_code is not None:
            error = f"HTTP {status_code}"
        retry_in = webhooks.retry_in_s(delivery.attempts, retry_after_s, scale=self.settings.webhook_retry_scale)
        if retry_in is None:
            await self._finish(delivery, "dead", status_code=status_code, error=error, bound=bound)
        else:
            await self._finish(delivery, "retry", retry_in_s=retry_in, status_code=status_code, error=error,
                               bound=bound)

    async def _send(self, delivery: WebhookDeliveryClaim) -> send.Answer:
        """The attempt's request, signed, from what the claim returned."""
        event = webhooks.event_of(delivery.job_status, delivery.error_code)
        msg_id = webhooks.message_id(delivery.job_public_id, event)
        payload = webhooks.body(job_public_id=delivery.job_public_id, status=delivery.job_status,
                                error_code=delivery.error_code, story_id=delivery.story_id,
                                occurred_at=delivery.occurred_at)
        signing = [delivery.secret, *([delivery.previous_secret] if delivery.previous_secret else [])]
        headers = webhooks.headers(signing, msg_id, int(time.time()), payload)
        return await send.post(delivery.url, headers, payload, allow_private=self.settings.webhook_allow_private,
                               timeout_s=self.settings.webhook_timeout_s, ssl_context=self._ssl_context)

    async def _finish(self, delivery: WebhookDeliveryClaim, outcome: DeliveryOutcome, *,
                      bound: structlog.typing.FilteringBoundLogger, retry_in_s: float = 0.0,
                      status_code: int | None = None, error: str | None = None) -> None:
        try:
            latency_s = await self._store.finish(
                delivery.id, delivery.lease, outcome, retry_in_s=retry_in_s, status_code=status_code,
                error=None if error is None else text.storable(error[:_ERROR_CHARS]))
        except db.DB_ERRORS as exc:
            # the lease runs out and the delivery is sent again: at least once
            bound.warning("webhook.record_failed", outcome=outcome, sqlstate=getattr(exc, "sqlstate", None),
                          error=db.describe(exc))
            return
        span = trace.get_current_span()
        if status_code is not None:
            span.set_attribute("http.response.status_code", status_code)
        span.set_attribute("storyjobs.webhook.outcome", outcome if latency_s is not None else "lost")
        if outcome != "delivered":
            span.set_attribute("error.type", str(status_code) if status_code is not None else "no_answer")
            span.set_status(StatusCode.ERROR, outcome)
        if latency_s is None:
            metrics.DELIVERIES.labels(outcome="lost").inc()
            bound.info("webhook.lost_race", outcome=outcome)
            return
        label = {"delivered": "delivered", "retry": "retried", "dead": "dead", "gone": "gone"}[outcome]
        metrics.DELIVERIES.labels(outcome=label).inc()
        if outcome == "delivered":
            metrics.LATENCY.observe(latency_s)
            bound.info("webhook.delivered", status_code=status_code)
        elif outcome == "retry":
            bound.info("webhook.retry", status_code=status_code, error=error, retry_in_s=round(retry_in_s, 3))
        else:
            bound.warning(f"webhook.{outcome}", status_code=status_code, error=error)
