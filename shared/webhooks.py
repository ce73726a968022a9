"""Webhooks as Standard Webhooks (standardwebhooks.com) define them: the
events, the secrets, the signed body, the retry schedule and which addresses
a delivery may reach. Shared by the api (endpoints), the worker (deliveries)
and the CLI; no I/O here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
import uuid
from datetime import datetime
from urllib.parse import urlsplit

import msgspec

EVENTS = ("job.completed", "job.failed", "job.cancelled")
SECRET_PREFIX = "whsec_"
# the spec's schedule: after the first attempt fails, retry after each of
# these; when the last retry fails too, the delivery is dead
RETRY_SCHEDULE_S = (5.0, 5 * 60.0, 30 * 60.0, 2 * 3600.0, 5 * 3600.0, 10 * 3600.0, 10 * 3600.0)
MAX_ATTEMPTS = len(RETRY_SCHEDULE_S) + 1
# the longest Retry-After honoured: the schedule's longest wait
MAX_RETRY_AFTER_S = max(RETRY_SCHEDULE_S)
MAX_URL_CHARS = 2000


def new_secret() -> str:
    """``whsec_`` and 32 random bytes in base64, as the spec writes them."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def message_id(job_public_id: uuid.UUID, event: str) -> str:
    """The ``webhook-id``: the same for every attempt and every endpoint of
    one event, so a receiver can drop duplicates. A job ends once, so its id
    and the event name one event."""
    return f"msg_{event.removeprefix('job.')}_{job_public_id.hex}"


def event_of(status: str, error_code: str | None) -> str:
    if status == "completed":
        return "job.completed"
    return "job.cancelled" if error_code == "cancelled" else "job.failed"


class EventLinks(msgspec.Struct, frozen=True):
    # paths on the api, for the client to poll with its own key
    job: str
    story: str | None


class EventData(msgspec.Struct, frozen=True):
    job_id: uuid.UUID
    status: str
    error_code: str | None
    story_id: uuid.UUID | None
    links: EventLinks


class EventBody(msgspec.Struct, frozen=True):
    """What a delivery says: never the prompt, never the story."""

    type: str
    timestamp: datetime
    data: EventData


def body(*, job_public_id: uuid.UUID, status: str, error_code: str | None, story_id: uuid.UUID | None,
         occurred_at: datetime) -> bytes:
    links = EventLinks(job=f"/stories/jobs/{job_public_id}",
                       story=None if story_id is None else f"/stories/{story_id}")
    return msgspec.json.encode(EventBody(
        type=event_of(status, error_code), timestamp=occurred_at,
        data=EventData(job_id=job_public_id, status=status, error_code=error_code, story_id=story_id,
                       links=links)))


def signature(secret: str, msg_id: str, timestamp: int, payload: bytes) -> str:
    """``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` with the
    secret's base64 bytes as the key."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{msg_id}.{timestamp}.".encode() + payload
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")


def headers(secrets_: list[str], msg_id: str, timestamp: int, payload: bytes) -> dict[str, str]:
    """The spec's three headers; several secrets (during a rotation) give
    several signatures, space-separated."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, msg_id, timestamp, payload) for s in secrets_),
        "content-type": "application/json",
    }


def retry_in_s(attempt: int, retry_after_s: float | None, *, scale: float) -> float | None:
    """How long after failed attempt ``attempt`` (1-based) to try again;
    None: that was the last. A receiver's Retry-After replaces the schedule's
    wait, up to its longest (``scale`` shortens both, for tests)."""
    if attempt >= MAX_ATTEMPTS:
        return None
    wait = RETRY_SCHEDULE_S[attempt - 1] if retry_after_s is None else min(retry_after_s, MAX_RETRY_AFTER_S)
    return wait * scale


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After in seconds; a date or garbage: None."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


class UnsafeUrl(ValueError):
    """A URL or address a delivery must not reach."""


def check_url(url: str, *, allow_private: bool) -> None:
    """What can be known without resolving: an absolute https URL (http too
    when private addresses are allowed), with a host, without credentials,
    and not an address literal that is not public. A name is resolved and
    checked at each delivery (``check_address``)."""
    if len(url) > MAX_URL_CHARS:
        raise UnsafeUrl(f"the URL is longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeUrl(f"not a URL: {exc}") from None
    schemes = ("https", "http") if allow_private else ("https",)
    if parts.scheme not in schemes:
        raise UnsafeUrl("the URL must use https")
    if not parts.hostname:
        raise UnsafeUrl("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise UnsafeUrl("the URL must not carry credentials")
    if port == 0:
        raise UnsafeUrl("the URL's port must not be 0")
    try:
        literal = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return
    check_address(literal, allow_private=allow_private)


def check_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address, *, allow_private: bool) -> None:
    """Public (globally routable) addresses only, unless allowed: no
    loopback, private, link-local (cloud metadata at 169.254.169.254),
    shared, reserved or multicast address, also when written as IPv6."""
    if allow_private:
        return
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            check_address(embedded, allow_private=False)
    if not address.is_global or address.is_multicast:
        raise UnsafeUrl(f"{address} is not a public address")
