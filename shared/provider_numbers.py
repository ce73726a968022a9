"""Numbers from the LLM provider, checked before anything uses them.

Usage counts, ``retry-after`` and the ``anthropic-ratelimit-*`` headers come
from outside: a proxy, a provider bug or a new format can send ``nan``, a
negative count or three billion tokens. Each reader here answers None for
such a value (the caller then treats it as absent), logs it once where it is
read, and never raises.
"""

from __future__ import annotations

import math

import structlog

log = structlog.get_logger()

# what an integer column of the ledger holds
INT32_MAX = 2**31 - 1


def _odd(what: str, value: object) -> None:
    log.warning("llm.odd_value", what=what, value=repr(value)[:80],
                detail="a number from the provider was not usable; treated as absent")


def token_count(value: object, *, what: str, upper: int = INT32_MAX, quiet: bool = False) -> int | None:
    """A whole number of tokens in [0, upper], or None. ``quiet``: a count
    that the final one repeats (a stream's running usage) is not logged,
    so that one odd value makes one line."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= upper:
        if value is not None and not quiet:
            _odd(what, value)
        return None
    return value


def header_number(text: str | None, *, what: str) -> float | None:
    """A finite, non-negative number from a header, or None."""
    if text is None:
        return None
    try:
        number = float(text)
    except ValueError:
        _odd(what, text)
        return None
    if not math.isfinite(number) or number < 0:
        _odd(what, text)
        return None
    return number
