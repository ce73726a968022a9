"""Text from outside (an LLM provider's story, title, error message or
request id) made storable: Postgres text cannot hold NUL, and UTF-8 cannot
encode an unpaired surrogate (which a JSON decoder may hand over from a
``\\ud800`` escape). A job must never fail, and a worker never die, over one
character, so these are cleaned before anything is stored: NUL is dropped,
an unpaired surrogate becomes U+FFFD."""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str) -> str:
    if "\x00" in text:
        text = text.replace("\x00", "")
    if text.isascii():
        return text
    return _SURROGATE.sub("\ufffd", text)


def storable_or_none(text: str | None) -> str | None:
    return None if text is None else storable(text)
