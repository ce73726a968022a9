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

The SDK builds its objects from the provider's JSON without validating
them (a count can arrive as ``"lots"``, a time as ``12``), and a results
line is read here from the raw stream, so one unreadable line cannot stop
the others. Every value is checked before it reaches a Struct: counts and
usage through shared.provider_numbers (absent or absurd: None, logged once),
times within a plausible window (else a fallback that errs towards "recent",
so that a walk back to a fence never stops early), text made storable.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import anthropic
import httpx2
import structlog

from shared import prompt
from shared.config import WorkerSettings
from shared.provider_numbers import header_number, token_count
from shared.text import storable
from worker.batch.provider import (
    BATCH_LIFETIME,
    CUSTOM_ID,
    INPUT_TOKENS_MAX,
    LIST_LIMIT_MAX,
    MAX_REQUESTS,
    BatchCounts,
    BatchCreateUnknown,
    BatchError,
    BatchInfo,
    BatchItemResult,
    BatchNotCreated,
    BatchNotEnded,
    BatchNotFound,
    BatchPage,
    BatchRefused,
    BatchRequest,
    BatchState,
    BatchUnavailable,
    ResultKind,
    ResultsInterrupted,
    check_batch,
)

log = structlog.get_logger()

T = TypeVar("T")

# Retry-After is passed on up to this; beyond it the lane's own interval decides
_MAX_RETRY_AFTER_S = 600.0
# the earliest time a batch can plausibly carry, and how far ahead of our
# clock (an expiry is a day ahead; the rest is clock skew)
_EARLIEST = datetime(2024, 1, 1, tzinfo=UTC)
_AHEAD = BATCH_LIFETIME + timedelta(days=1)
# what is kept of provider text that only describes (ids, error types and messages)
_ID_CHARS = 200
_ERROR_TYPE_CHARS = 100
_ERROR_MESSAGE_CHARS = 500
_STATES = frozenset(state.value for state in BatchState)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _odd(what: str, value: object) -> None:
    log.warning("llm.odd_value", what=what, value=repr(value)[:80],
                detail="a value from the provider was not usable; treated as absent")


def _field(obj: object, name: str) -> object:
    """An attribute of an SDK object, or a key of a dict (what the SDK
    leaves unbuilt); None when absent."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _text(value: object, limit: int) -> str | None:
    return storable(value[:limit]) if isinstance(value, str) and value else None


def _batch_id(value: object) -> str | None:
    """A batch id we can send back in a path: printable ASCII, no slash."""
    if isinstance(value, str) and 0 < len(value) <= _ID_CHARS and value.isascii() and value.isprintable() \
            and "/" not in value and value.strip() == value:
        return value
    return None


def _time(value: object, what: str, now: datetime) -> datetime | None:
    if value is None:
        return None
    at: datetime | None = None
    if isinstance(value, datetime):
        at = value
    elif isinstance(value, str):
        try:
            at = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            at = None
    if at is not None and at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    if at is None or not _EARLIEST <= at <= now + _AHEAD:
        _odd(what, value)
        return None
    return at.astimezone(UTC)


def batch_info(batch: object, now: datetime) -> BatchInfo | None:
    """Our BatchInfo from what the SDK built of a batch; None when it names
    no usable id (nothing can be done with it). Whatever else is odd is
    logged and replaced: an unknown state by in_progress (results are read
    only once a batch says it ended), a count by 0, a creation time by the
    expiry less a day or else now, an expiry by the creation plus a day."""
    batch_id = _batch_id(_field(batch, "id"))
    if batch_id is None:
        _odd("batch.id", _field(batch, "id"))
        return None
    status = _field(batch, "processing_status")
    if isinstance(status, str) and status in _STATES:
        state = BatchState(status)
    else:
        _odd("batch.processing_status", status)
        state = BatchState.IN_PROGRESS
    counts_obj = _field(batch, "request_counts")
    counts = {}
    for name in ("processing", "succeeded", "errored", "canceled", "expired"):
        counted = token_count(_field(counts_obj, name), what=f"batch.request_counts.{name}", upper=MAX_REQUESTS)
        counts[name] = 0 if counted is None else counted
    created = _time(_field(batch, "created_at"), "batch.created_at", now)
    expires = _time(_field(batch, "expires_at"), "batch.expires_at", now)
    if created is None:
        created = min(expires - BATCH_LIFETIME, now) if expires is not None else now
    if expires is None:
        expires = created + BATCH_LIFETIME
    return BatchInfo(
        id=batch_id,
        state=state,
        counts=BatchCounts(**counts),
        created_at=created,
        expires_at=expires,
        ended_at=_time(_field(batch, "ended_at"), "batch.ended_at", now),
        cancel_initiated_at=_time(_field(batch, "cancel_initiated_at"), "batch.cancel_initiated_at", now),
        archived_at=_time(_field(batch, "archived_at"), "batch.archived_at", now),
    )


def result_of(line: bytes, batch_id: str) -> BatchItemResult | None:
    """One results line as our BatchItemResult; None (logged) when it names
    no request. A result of a kind we do not know is UNKNOWN: it may have
    been billed."""
    try:
        document = json.loads(line)
    except (ValueError, RecursionError):
        document = None
    custom_id = _field(document, "custom_id") if isinstance(document, dict) else None
    if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
        log.warning("batch.result_unreadable", batch_id=batch_id, line=line[:120].decode("utf-8", "replace"),
                    detail="a results line that names no request; skipped")
        return None
    result = _field(document, "result")
    kind = _field(result, "type")
    if kind == "succeeded":
        return _succeeded(custom_id, _field(result, "message"))
    if kind == "errored":
        outer = _field(result, "error")
        inner = _field(outer, "error")
        return BatchItemResult(custom_id=custom_id, kind=ResultKind.ERRORED,
                               error_type=_text(_field(inner, "type"), _ERROR_TYPE_CHARS),
                               error_message=_text(_field(inner, "message"), _ERROR_MESSAGE_CHARS),
                               provider_id=_text(_field(outer, "request_id"), _ID_CHARS))
    if kind == "canceled":
        return BatchItemResult(custom_id=custom_id, kind=ResultKind.CANCELED)
    if kind == "expired":
        return BatchItemResult(custom_id=custom_id, kind=ResultKind.EXPIRED)
    _odd("batch.result.type", kind)
    return BatchItemResult(custom_id=custom_id, kind=ResultKind.UNKNOWN)


def _succeeded(custom_id: str, message: object) -> BatchItemResult:
    blocks = _field(message, "content")
    text = "".join(
        block_text for block in (blocks if isinstance(blocks, list) else [])
        if _field(block, "type") == "text" and isinstance(block_text := _field(block, "text"), str)
    )
    title, body = prompt.split_title(storable(text))
    usage = _field(message, "usage")
    return BatchItemResult(
        custom_id=custom_id,
        kind=ResultKind.SUCCEEDED,
        title=title,
        body=body,
        model=_text(_field(message, "model"), _ID_CHARS),
        provider_id=_text(_field(message, "id"), _ID_CHARS),
        input_tokens=token_count(_field(usage, "input_tokens"), what="batch.usage.input_tokens",
                                 upper=INPUT_TOKENS_MAX),
        output_tokens=token_count(_field(usage, "output_tokens"), what="batch.usage.output_tokens"),
    )


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
        return f"the provider answered {exc.status_code}: {exc.message[:_ERROR_MESSAGE_CHARS]}"
    if isinstance(exc, (anthropic.APITimeoutError, TimeoutError, httpx2.TimeoutException)):
        return "no answer from the provider in time"
    if isinstance(exc, anthropic.APIConnectionError):
        return f"the connection to the provider failed ({type(exc.__cause__).__name__})"
    return f"{type(exc).__name__}: {exc}"[:_ERROR_MESSAGE_CHARS]


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

        page = await self._call("list", first_page)
        data = _field(page, "data")
        if not isinstance(data, list):
            raise BatchUnavailable("list: the answer holds no list of batches")
        now = self._clock()
        batches = tuple(info for item in data if (info := batch_info(item, now)) is not None)
        has_more = _field(page, "has_more")
        if not isinstance(has_more, bool):
            if has_more is not None:
                _odd("list.has_more", has_more)
            # the SDK's own reading: go on while pages have batches
            has_more = bool(data)
        first_id = _batch_id(_field(page, "first_id")) or (batches[0].id if batches else None)
        last_id = _batch_id(_field(page, "last_id")) or (batches[-1].id if batches else None)
        return BatchPage(batches=batches, has_more=has_more, first_id=first_id, last_id=last_id)

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
        response = _field(decoder, "http_response")
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
