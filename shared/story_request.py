"""The body of POST /stories/generate: what a story is about, bounded.

Unknown fields are rejected rather than ignored: a misspelt option (``lenght``)
would otherwise be dropped silently and the client billed for a story it did
not ask for. The fingerprint is SHA-256 of the canonical form (defaults
filled in, keys sorted, no whitespace), so key order, whitespace and spelling
out a default do not make a request different.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Literal

import msgspec

PROMPT_MAX_CHARS = 2000
NAME_MAX_CHARS = 60

# C0 controls other than tab, newline and carriage return, and lone UTF-16
# surrogates: Postgres cannot store NUL, UTF-8 cannot encode a lone surrogate.
_UNSTORABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff]")

StoryLength = Literal["short", "medium", "long"]


class StoryRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=False):
    prompt: Annotated[
        str,
        msgspec.Meta(min_length=1, max_length=PROMPT_MAX_CHARS,
                     description="What the story is about.", examples=["a dragon who can't sleep"]),
    ]
    child_name: Annotated[
        str, msgspec.Meta(min_length=1, max_length=NAME_MAX_CHARS,
                          description="The listener's name, woven into the story.")
    ] | None = None
    age: Annotated[int, msgspec.Meta(ge=2, le=12, description="The listener's age, 2-12.")] | None = None
    length: StoryLength = "medium"
    language: Annotated[
        str,
        msgspec.Meta(pattern=r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8}){0,3}$",
                     description="BCP 47 language tag of the story, e.g. en, fr, pt-BR."),
    ] = "en"

    def __post_init__(self) -> None:
        for field in ("prompt", "child_name"):
            value = getattr(self, field)
            if value is None:
                continue
            if _UNSTORABLE.search(value):
                raise ValueError(f"`{field}` contains a control character or an unpaired surrogate")
            if not value.strip():
                raise ValueError(f"`{field}` is blank")


def canonical_json(request: StoryRequest) -> bytes:
    return msgspec.json.encode(request, order="sorted")


def fingerprint(request: StoryRequest) -> bytes:
    return hashlib.sha256(canonical_json(request)).digest()
