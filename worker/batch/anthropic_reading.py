"""Reading what the Anthropic provider answers (worker/batch/anthropic_batches.py
makes the calls): a batch as the SDK built it into our ``BatchInfo``, a page
of the list into our ``BatchPage``, a results line into our
``BatchItemResult``.

The SDK builds its objects from the provider's JSON without validating
them (a count can arrive as ``"lots"``, a time as ``12``), and a results
line is read here from the raw stream, so one unreadable line cannot stop
the others. Every value is checked before it reaches a Struct: counts and
usage through shared.provider_numbers (absent or absurd: None, logged once),
times within a plausible window (else a fallback that errs towards "recent",
so that a walk back to a fence never stops early), text made storable.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import structlog

from shared import prompt
from shared.provider_numbers import token_count
from shared.text import storable
from worker.batch.provider import BatchUnavailable
from worker.batch.provider_structs import (
    BATCH_LIFETIME,
    CUSTOM_ID,
    INPUT_TOKENS_MAX,
    MAX_REQUESTS,
    BatchCounts,
    BatchInfo,
    BatchItemResult,
    BatchPage,
    BatchState,
    ResultKind,
)

log = structlog.get_logger()

# the earliest time a batch can plausibly carry, and how far ahead of our
# clock (an expiry is a day ahead; the rest is clock skew)
_EARLIEST = datetime(2024, 1, 1, tzinfo=UTC)
_AHEAD = BATCH_LIFETIME + timedelta(days=1)
# what is kept of provider text that only describes (ids, error types and messages)
_ID_CHARS = 200
_ERROR_TYPE_CHARS = 100
ERROR_MESSAGE_CHARS = 500
_STATES = frozenset(state.value for state in BatchState)


def _odd(what: str, value: object) -> None:
    log.warning("llm.odd_value", what=what, value=repr(value)[:80],
                detail="a value from the provider was not usable; treated as absent")


def field(obj: object, name: str) -> object:
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
    batch_id = _batch_id(field(batch, "id"))
    if batch_id is None:
        _odd("batch.id", field(batch, "id"))
        return None
    status = field(batch, "processing_status")
    if isinstance(status, str) and status in _STATES:
        state = BatchState(status)
    else:
        _odd("batch.processing_status", status)
        state = BatchState.IN_PROGRESS
    counts_obj = field(batch, "request_counts")
    counts = {}
    for name in ("processing", "succeeded", "errored", "canceled", "expired"):
        counted = token_count(field(counts_obj, name), what=f"batch.request_counts.{name}", upper=MAX_REQUESTS)
        counts[name] = 0 if counted is None else counted
    created = _time(field(batch, "created_at"), "batch.created_at", now)
    expires = _time(field(batch, "expires_at"), "batch.expires_at", now)
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
        ended_at=_time(field(batch, "ended_at"), "batch.ended_at", now),
        cancel_initiated_at=_time(field(batch, "cancel_initiated_at"), "batch.cancel_initiated_at", now),
        archived_at=_time(field(batch, "archived_at"), "batch.archived_at", now),
    )


def batch_page(page: object, now: datetime) -> BatchPage:
    """Our BatchPage from what the SDK built of a page of the list; the
    batches without a usable id left out."""
    data = field(page, "data")
    if not isinstance(data, list):
        raise BatchUnavailable("list: the answer holds no list of batches")
    batches = tuple(info for item in data if (info := batch_info(item, now)) is not None)
    has_more = field(page, "has_more")
    if not isinstance(has_more, bool):
        if has_more is not None:
            _odd("list.has_more", has_more)
        # the SDK's own reading: go on while pages have batches
        has_more = bool(data)
    first_id = _batch_id(field(page, "first_id")) or (batches[0].id if batches else None)
    last_id = _batch_id(field(page, "last_id")) or (batches[-1].id if batches else None)
    return BatchPage(batches=batches, has_more=has_more, first_id=first_id, last_id=last_id)


def result_of(line: bytes, batch_id: str) -> BatchItemResult | None:
    """One results line as our BatchItemResult; None (logged) when it names
    no request. A result of a kind we do not know is UNKNOWN: it may have
    been billed."""
    try:
        document = json.loads(line)
    except (ValueError, RecursionError):
        document = None
    custom_id = field(document, "custom_id") if isinstance(document, dict) else None
    if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
        log.warning("batch.result_unreadable", batch_id=batch_id, line=line[:120].decode("utf-8", "replace"),
                    detail="a results line that names no request; skipped")
        return None
    result = field(document, "result")
    kind = field(result, "type")
    if kind == "succeeded":
        return _succeeded(custom_id, field(result, "message"))
    if kind == "errored":
        outer = field(result, "error")
        inner = field(outer, "error")
        return BatchItemResult(custom_id=custom_id, kind=ResultKind.ERRORED,
                               error_type=_text(field(inner, "type"), _ERROR_TYPE_CHARS),
                               error_message=_text(field(inner, "message"), ERROR_MESSAGE_CHARS),
                               provider_id=_text(field(outer, "request_id"), _ID_CHARS))
    if kind == "canceled":
        return BatchItemResult(custom_id=custom_id, kind=ResultKind.CANCELED)
    if kind == "expired":
        return BatchItemResult(custom_id=custom_id, kind=ResultKind.EXPIRED)
    _odd("batch.result.type", kind)
    return BatchItemResult(custom_id=custom_id, kind=ResultKind.UNKNOWN)


def _succeeded(custom_id: str, message: object) -> BatchItemResult:
    blocks = field(message, "content")
    text = "".join(
        block_text for block in (blocks if isinstance(blocks, list) else [])
        if field(block, "type") == "text" and isinstance(block_text := field(block, "text"), str)
    )
    title, body = prompt.split_title(storable(text))
    usage = field(message, "usage")
    return BatchItemResult(
        custom_id=custom_id,
        kind=ResultKind.SUCCEEDED,
        title=title,
        body=body,
        model=_text(field(message, "model"), _ID_CHARS),
        provider_id=_text(field(message, "id"), _ID_CHARS),
        input_tokens=token_count(field(usage, "input_tokens"), what="batch.usage.input_tokens",
                                 upper=INPUT_TOKENS_MAX),
        output_tokens=token_count(field(usage, "output_tokens"), what="batch.usage.output_tokens"),
    )
