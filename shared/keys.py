"""API keys: ``sj_<prefix>_<secret>``, a client's or an operator's.

The prefix (12 hex digits) is not secret: it finds the key's row and names the
key in logs and listings (``storyjobs keys list``). Only SHA-256 of the whole
key is stored; keys are long random secrets, so a slow password hash would
add nothing. Hashes are compared in constant time, and a key whose prefix
finds no row is compared too (against a hash no key has), so that the answer
takes as long either way.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from decimal import Decimal
from typing import Any

import msgspec
from psycopg import AsyncConnection

from shared import store

_KEY = re.compile(r"sj_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
_PREFIX = re.compile(r"[0-9a-f]{12}")
# the hash of no key: what a key with an unknown prefix is compared against
_NO_KEY_HASH = bytes(32)


class NewKey(msgspec.Struct, frozen=True):
    key: str
    prefix: str
    hash: bytes

    def __repr__(self) -> str:
        return f"NewKey(prefix={self.prefix!r})"


def generate() -> NewKey:
    prefix = secrets.token_hex(6)
    key = f"sj_{prefix}_{secrets.token_urlsafe(32)}"
    return NewKey(key=key, prefix=prefix, hash=hash_key(key))


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("ascii")).digest()


def prefix_of(key: str) -> str | None:
    """The key's prefix, or None when the string is not shaped like a key."""
    match = _KEY.fullmatch(key)
    return match.group(1) if match else None


def is_prefix(text: str) -> bool:
    """Whether ``text`` is shaped like a key's prefix."""
    return _PREFIX.fullmatch(text) is not None


def matches(key: str, stored_hash: bytes | None) -> bool:
    """Whether ``key`` hashes to ``stored_hash`` (None: no stored key), in
    time that does not depend on where they differ."""
    equal = hmac.compare_digest(hash_key(key), stored_hash or _NO_KEY_HASH)
    return equal and stored_hash is not None


async def create(
    conn: AsyncConnection[Any], client_name: str, *, budget_usd_per_day: Decimal | None = None,
    weight: int | None = None,
) -> NewKey:
    """A new key for client ``client_name`` (created if new: a second key is
    how a client's key is rotated), and, if given, the client's own spend
    budget per UTC day and its weight in the claim's round robin. Only the
    key's hash is stored."""
    client_id = await store.api_client_upsert(conn, name=client_name)
    if budget_usd_per_day is not None:
        await store.api_client_budget_set(conn, client_id=client_id, budget_usd_per_day=budget_usd_per_day)
    if weight is not None:
        await store.api_client_weight_set(conn, client_id=client_id, weight=weight)
    new = generate()
    await store.api_key_insert(conn, client_id=client_id, key_prefix=new.prefix, key_hash=new.hash)
    return new


async def create_operator(conn: AsyncConnection[Any], name: str) -> NewKey:
    """A new key of the operators' console for ``name`` (the person or team
    holding it). It opens /ops only: it is no client's key."""
    new = generate()
    await store.operator_key_insert(conn, name=name, key_prefix=new.prefix, key_hash=new.hash)
    return new
