"""The batch provider over the official ``anthropic`` SDK (Message Batches).

Never bill twice: the SDK's own retries are off (``max_retries=0``). A
create is not idempotent: the SDK would retry it after a timeout or a 5xx,
and a lost answer retried is a second batch, billed twice. So every call
here sends its request once, and what came of it is classified where we know
it (see worker.batch.provider for what each error lets the lane conclude):

* a create refused with a 4xx (429 included) or 529, or a connection that
  could not be made: ``BatchNotCreated``; a timeout, a dropped connection,
  another 5xx or an answer we cannot read: ``BatchCreateUnknown``;
* a read: 404 ``BatchNotFound``, another 4xx ``BatchRefused``, anything
  without an answer (429, 5xx, timeout, connection) ``BatchUnavailable``.

Every call is bounded as a whole (``asyncio.timeout``), not only per read,
so that ``create_timeout_s`` is the longest a create can take: the
submitter's lease is sized on it. The results stream is bounded per read
only (it can be long); a stream that breaks raises ``ResultsInterrupted``.

What it answers is read, every value checked, by
worker/batch/anthropic_reading.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import anthropic
import httpx2
import structlog

from shared.config import WorkerSettings
from shared.provider_numbers import header_number
from worker.batch.anthropic_reading import (
    ERROR_MESSAGE_CHARS,
    batch_info,
    batch_page,
    field,
    result_of,
)
from worker.batch.provider import (
    BatchCreateUnknown,
    BatchError,
    BatchNotCreated,
    BatchNotEnded,
    BatchNotFound,
    BatchRefused,
    BatchUnavailable,
    ResultsInterrupted,
)
from worker.batch.provider_structs import (
    LIST_LIMIT_MAX,
    BatchInfo,
    BatchItemResult,
    BatchPage,
    BatchRequest,
    check_batch,
)

log = structlog.get_logger()

T = TypeVar("T")

# Retry-After is passed on up to this; beyond it the lane's own interval decides
_MAX_RETRY_AFTER_S = 600.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _retry_after_s(exc: anthropic.APIStatusError) -> float | None:
    for header, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = header_number(exc.response.headers.get(header), what=header)
        if value is not None:
            return min(value * scale, _MAX_RETRY_AFTER_S)
    return None


def _never_connected(exc: BaseException) -> bool:
    return isinstance(exc, anthropic.APIConnectionError) and isinstance(
        exc.__cause__, (httpx2.ConnectError, httpx2.ConnectTimeout))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, anthropic.APIStatusError):
        return f"the provider answered {exc.status_code}: {exc.message[:ERROR_MESSAGE_CHARS]}"
    if isinstance(exc, (anthropic.APITimeoutError, TimeoutError, httpx2.TimeoutException)):
        return "no answer from the provider in time"
    if isinstance(exc, anthropic.APIConnectionError):
        return f"the connection to the provider failed ({type(exc.__cause__).__name__})"
    return f"{type(exc).__name__}: {exc}"[:ERROR_MESSAGE_CHARS]


def _classify_create(exc: BaseException) -> BatchError:
    if isinstance(exc, anthropic.APIStatusError):
        status = exc.status_code
        if status in (429, 529):
            final = exc.response.headers.get("x-should-retry", "").strip().lower() == "false"
            return BatchNotCreated(f"the create was refused: {_describe(exc)}", retryable=not final,
                                   retry_after_s=_retry_after_s(exc))
        if 400 <= status < 500:
            return BatchNotCreated(f"the create was refused: {_describe(exc)}", retryable=False)
    if _never_connected(exc):
        return BatchNotCreated(f"the create was not sent: {_describe(exc)}", retryable=True)
    return BatchCreateUnknown(f"the create's answer was lost, a batch may exist: {_describe(exc)}")


def _classify_call(exc: BaseException, what: str) -> BatchError:
    if isinstance(exc, anthropic.NotFoundError):
        return BatchNotFound(f"{what}: {_describe(exc)}")
    if isinstance(exc, anthropic.APIStatusError):
        if exc.status_code == 429 or exc.status_code >= 500:
            return BatchUnavailable(f"{what}: {_describe(exc)}", retry_after_s=_retry_after_s(exc))
        return BatchRefused(f"{what}: {_describe(exc)}")
    return BatchUnavailable(f"{what}: {_describe(exc)}")


class _NoResults(Exception):
    """The SDK found no results_url on the batch."""


# what a call through the SDK can raise besides a bug: its own errors, a
# transport error it let through, and our overall timeout
_CALL_ERRORS = (anthropic.AnthropicError, httpx2.HTTPError, TimeoutError)


class AnthropicBatches:
    provider = "anthropic"

    def __init__(self, *, api_key: str | None, base_url: str | None = None, timeout_s: float = 60.0,
                 create_timeout_s: float = 120.0, connect_timeout_s: float = 5.0,
                 client: anthropic.AsyncAnthropic | None = None,
                 clock: Callable[[], datetime] = _utcnow) -> None:
        """``timeout_s`` bounds each call but a create (and each read of the
        results stream); ``create_timeout_s`` bounds a create as a whole.
        ``base_url`` None: the SDK's own (ANTHROPIC_BASE_URL, else the API)."""
        self.create_timeout_s = create_timeout_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._client = client or anthropic.AsyncAnthropic(
            api_key=api_key,
            base_url=base_url,
            max_retries=0,
            timeout=anthropic.Timeout(timeout_s, connect=connect_timeout_s),
        )
        self._create_timeout = anthropic.Timeout(create_timeout_s, connect=connect_timeout_s)

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> AnthropicBatches:
        return cls(api_key=settings.anthropic_api_key, base_url=settings.anthropic_base_url,
                   timeout_s=settings.llm_read_timeout_s, create_timeout_s=settings.batch_create_timeout_s)

    async def aclose(self) -> None:
        await self._client.close()

    async def create(self, requests: Sequence[BatchRequest]) -> BatchInfo:
        check_batch(requests)
        body: list[Any] = [{"custom_id": r.custom_id, "params": r.params()} for r in requests]
        try:
            async with asyncio.timeout(self.create_timeout_s):
                batch = await self._client.messages.batches.create(requests=body, timeout=self._create_timeout)
        except _CALL_ERRORS as exc:
            raise _classify_create(exc) from None
        info = batch_info(batch, self._clock())
        if info is None:
            raise BatchCreateUnknown("the create was answered without a usable batch id: a batch may exist")
        return info

    async def retrieve(self, batch_id: str) -> BatchInfo:
        return await self._batch_call(f"retrieve {batch_id}",
                                      lambda: self._client.messages.batches.retrieve(batch_id))

    async def cancel(self, batch_id: str) -> BatchInfo:
        return await self._batch_call(f"cancel {batch_id}", lambda: self._client.messages.batches.cancel(batch_id))

    async def delete(self, batch_id: str) -> None:
        await self._call(f"delete {batch_id}", lambda: self._client.messages.batches.delete(batch_id))

    async def list_page(self, *, after_id: str | None = None, before_id: str | None = None,
                        limit: int = 20) -> BatchPage:
        if not 1 <= limit <= LIST_LIMIT_MAX:
            raise ValueError(f"limit {limit} is not within 1..{LIST_LIMIT_MAX}")

        async def first_page() -> object:
            return await self._client.messages.batches.list(
                after_id=anthropic.omit if after_id is None else after_id,
                before_id=anthropic.omit if before_id is None else before_id,
                limit=limit)

        return batch_page(await self._call("list", first_page), self._clock())

    async def results(self, batch_id: str) -> AsyncIterator[BatchItemResult]:
        async def open_stream() -> object:
            try:
                return await self._client.messages.batches.results(batch_id)
            except anthropic.APIError:
                raise
            except anthropic.AnthropicError as exc:
                # the SDK's own refusal, before it asks for the results: the
                # batch it read first has no results_url yet
                raise _NoResults from exc

        try:
            decoder = await self._call(f"results of {batch_id}", open_stream)
        except _NoResults:
            raise BatchNotEnded(f"results of {batch_id}: the batch has not ended") from None
        response = field(decoder, "http_response")
        if not isinstance(response, httpx2.Response):
            raise BatchUnavailable(f"results of {batch_id}: no stream to read")
        lines = 0
        buffer = b""
        try:
            async for chunk in response.aiter_bytes():
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for line in complete:
                    if line.strip():
                        result = result_of(line, batch_id)
                        lines += 1
                        if result is not None:
                            yield result
            if buffer.strip():
                result = result_of(buffer, batch_id)
                lines += 1
                if result is not None:
                    yield result
        except (httpx2.HTTPError, anthropic.APIError) as exc:
            raise ResultsInterrupted(
                f"results of {batch_id}: the stream broke after {lines} lines ({_describe(exc)}); read them again",
                lines_read=lines) from None
        finally:
            await response.aclose()

    async def _batch_call(self, what: str, call: Callable[[], Awaitable[object]]) -> BatchInfo:
        info = batch_info(await self._call(what, call), self._clock())
        if info is None:
            raise BatchUnavailable(f"{what}: the answer named no usable batch")
        return info

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await call()
        except _CALL_ERRORS as exc:
            classified = _classify_call(exc, what)
            raise classified from exc
