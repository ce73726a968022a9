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
import re
import secrets
import uuid
from datetime import datetime

import httpx
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


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class CheckedUrl(msgspec.Struct, frozen=True):
    """A URL ``check_url`` let through: as httpx parsed it (what is sent),
    and, when its host is an address however written, that address (the
    sender connects to it without asking the resolver)."""

    url: httpx.URL
    address: Address | None


# a host the api stores and the worker resolves: lower-case letters, digits,
# dots, hyphens and underscores (httpx has made an IDN its xn-- form already)
_HOST_NAME = re.compile(r"[a-z0-9_.-]+")
# the parts inet_aton reads: hexadecimal 0x.., octal 0.., decimal
_NUMBER_PART = re.compile(r"0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*")


def numeric_host(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address the system resolver reads ``host`` as (inet_aton's
    forms: 1 to 4 parts, each decimal, 0-octal or 0x-hexadecimal, the last
    filling the remaining bytes: 2130706433, 0177.0.0.1, 0x7f.0.0.1, 127.1),
    None if it is not a number to it."""
    parts = host.split(".")
    if len(parts) > 4 or not all(_NUMBER_PART.fullmatch(part) for part in parts):
        return None
    values = [int(part, 0) if part[:2].lower() == "0x" else int(part, 8 if part.startswith("0") else 10)
              for part in parts]
    *leading, last = values
    if any(value > 0xFF for value in leading) or last >= 1 << (8 * (5 - len(values))):
        return None
    number = last
    for n, value in enumerate(leading):
        number |= value << (8 * (3 - n))
    return ipaddress.IPv4Address(number)


def check_url(url: str, *, allow_private: bool) -> CheckedUrl:
    """The URL rule, the api's at registration and the worker's at each
    attempt: what can be known without resolving. An absolute https URL
    (http too when private addresses are allowed) that httpx parses, with a
    host, without credentials, and whose host, if it is an address in any
    spelling the resolver reads as one (``numeric_host``; a trailing dot is
    the same host), is public (``check_address``). A name is resolved and
    its addresses checked at each delivery."""
    if len(url) > MAX_URL_CHARS:
        raise UnsafeUrl(f"the URL is longer than {MAX_URL_CHARS} characters")
    try:
        parsed = httpx.URL(url)
        # read here: httpx decodes an IDN host (xn--) when it is asked for
        host, port = parsed.host, parsed.port
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        # InvalidURL, and the idna codec's UnicodeError (a ValueError) for a bad IDN
        raise UnsafeUrl(f"not a URL: {exc}") from None
    schemes = ("https", "http") if allow_private else ("https",)
    if parsed.scheme not in schemes:
        raise UnsafeUrl("the URL must use https")
    if not host:
        raise UnsafeUrl("the URL has no host")
    if parsed.userinfo:
        raise UnsafeUrl("the URL must not carry credentials")
    if port is not None and not 0 < port < 65536:
        raise UnsafeUrl("the URL's port must be between 1 and 65535")
    address = host_address(parsed.raw_host.decode("ascii"))
    if address is not None:
        check_address(address, allow_private=allow_private)
    return CheckedUrl(url=parsed, address=address)


def host_address(host: str) -> Address | None:
    """The address a URL's host (as httpx gives it: IPv6 without brackets)
    names, or None for a name; UnsafeUrl for a host that is neither."""
    if ":" in host:
        if "%" in host:
            # a zone ("fe80::1%25eth0"): only a link-local address needs one
            raise UnsafeUrl(f"the URL's host {host!r} names a zone")
        try:
            return ipaddress.IPv6Address(host)
        except ValueError:
            raise UnsafeUrl(f"the URL's host {host!r} is not an IPv6 address") from None
    if not _HOST_NAME.fullmatch(host):
        raise UnsafeUrl(f"the URL's host {host!r} is not a host name")
    # "127.0.0.1." is 127.0.0.1; an empty label is no host
    bare = host.removesuffix(".")
    if not bare or "" in bare.split("."):
        raise UnsafeUrl(f"the URL's host {host!r} is not a host name")
    return numeric_host(bare)


# The addresses no delivery may reach, whatever this Python's ipaddress
# tables say (IANA's special-purpose registries). IPv6 is allowed only in
# 2000::/3 (global unicast): that alone refuses ::/96 (unspecified, loopback,
# IPv4-compatible), ::ffff:0:0/96 (IPv4-mapped), ::ffff:0:0:0/96
# (IPv4-translated), 64:ff9b::/96 and 64:ff9b:1::/48 (NAT64), 100::/64
# (discard), fc00::/7 (unique local), fe80::/10 (link-local), fec0::/10
# (site-local) and ff00::/8 (multicast).
_V6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
_NOT_PUBLIC = tuple(ipaddress.ip_network(net) for net in (
    "0.0.0.0/8",  # this network, unspecified
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # private
    "100.64.0.0/10",  # shared (carrier-grade NAT)
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local, cloud metadata at 169.254.169.254
    "192.0.0.0/24",  # IETF protocol assignments
    "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24",  # documentation
    "192.88.99.0/24",  # 6to4 relay anycast
    "198.18.0.0/15",  # benchmarking
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, and the broadcast 255.255.255.255
    "2001::/23",  # IETF protocol assignments: Teredo, benchmarking, ORCHID
    "2001:db8::/32", "3fff::/20",  # documentation
))


def check_address(address: Address, *, allow_private: bool) -> None:
    """Public (globally routable) addresses only, unless allowed: no
    loopback, private, link-local (cloud metadata at 169.254.169.254),
    shared, reserved, documentation, multicast or unspecified address, nor
    one written as IPv6 (IPv4-mapped, -compatible or -translated, NAT64,
    6to4 or Teredo embedding one), nor site-local IPv6."""
    if allow_private:
        return
    if isinstance(address, ipaddress.IPv6Address):
        if address not in _V6_GLOBAL_UNICAST:
            raise UnsafeUrl(f"{address} is not a public address")
        embedded = [address.sixtofour, *(address.teredo or ())]
        for v4 in embedded:
            if v4 is not None:
                check_address(v4, allow_private=False)
    if (any(address in net for net in _NOT_PUBLIC if net.version == address.version)
            or not address.is_global or address.is_multicast):
        raise UnsafeUrl(f"{address} is not a public address")
