"""The body of POST /stories/generate: what a story is about, bounded.

The body is read strictly (``decode``): JSON whose types are exactly the
documented ones (``"age": "5"`` is refused, not converted), every option
bounded, and text that Postgres and UTF-8 can store. Every refusal names the
field it is about.

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

# Free text (the prompt, the child's name): at least one visible character,
# and no C0 control character other than tab, newline and carriage return.
# The OpenAPI document publishes this very pattern, so it names its blanks
# one by one: `\s` means other characters to Python than to the ECMAScript
# regexes of JSON Schema. Its three parts cannot overlap (leading blanks, one
# visible character, the rest), so matching stays linear in the text's length.
_BLANKS = r"\t\n\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_CONTROLS = r"\x00-\x08\x0b\x0c\x0e-\x1f"
TEXT_PATTERN = f"^[{_BLANKS}]*[^{_BLANKS}{_CONTROLS}][^{_CONTROLS}]*$"
_TEXT = re.compile(TEXT_PATTERN)
# What Postgres cannot store (NUL) and UTF-8 cannot encode (an unpaired
# surrogate), with the other control characters. JSON text cannot carry a
# lone surrogate (the decoder refuses it), so the published pattern leaves
# them out: only a request built in Python can hold one.
_UNSTORABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff]")

StoryLength = Literal["short", "medium", "long"]
StoryLane = Literal["interactive", "batch"]


class FieldValueError(ValueError):
    """A field's value breaks a rule that its type alone cannot state."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"`{field}` {message}")
        self.field = field
        self.message = message


class InvalidStoryRequest(ValueError):
    """A body that is not a story request; ``field`` is the field at fault
    (``body`` when it is the body as a whole)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _text(description: str, max_length: int, examples: list[str] | None = None) -> msgspec.Meta:
    # "extra" is where Litestar looks for more of a field's schema
    return msgspec.Meta(min_length=1, max_length=max_length, description=description, examples=examples,
                        extra_json_schema={"extra": {"pattern": TEXT_PATTERN}})


class StoryRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=False):
    prompt: Annotated[str, _text("What the story is about.", PROMPT_MAX_CHARS, ["a dragon who can't sleep"])]
    child_name: Annotated[str, _text("The listener's name, woven into the story.", NAME_MAX_CHARS)] | None = None
    age: Annotated[int, msgspec.Meta(ge=2, le=12, description="The listener's age, 2-12.")] | None = None
    length: StoryLength = "medium"
    language: Annotated[
        str,
        # (?!\n): a Python "$" would also match before a final newline
        msgspec.Meta(pattern=r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8}){0,3}(?!\n)$",
                     description="BCP 47 language tag of the story, e.g. en, fr, pt-BR."),
    ] = "en"
    # how it reaches the provider: at once, or in a message batch within the
    # day at half the price (docs/batches.md)
    lane: Annotated[StoryLane, msgspec.Meta(
        description="interactive (default): written now; batch: within the day, at half the price, "
                    "usually within the hour.")] = "interactive"

    def __post_init__(self) -> None:
        for field in ("prompt", "child_name"):
            value = getattr(self, field)
            if value is None:
                continue
            if _UNSTORABLE.search(value):
                raise FieldValueError(field, "contains a control character or an unpaired surrogate")
            if not _TEXT.search(value):
                raise FieldValueError(field, "is blank")


# msgspec names the place of a type error as "- at `$.age`"; a missing or
# unknown field is named in backquotes in the message itself
_AT_FIELD = re.compile(r" - at `\$\.(\w+)")
_NAMED_FIELD = re.compile(r"field `(\w+)`")
# what a pattern means, said instead of the pattern itself
_PATTERN_MEANS = {"language": "is not a BCP 47 language tag such as en, fr or pt-BR"}
# what an enumeration allows, said with its values
_ONE_OF = {"lane": 'must be "interactive" (the default) or "batch"',
           "length": 'must be "short", "medium" (the default) or "long"'}
_INTEGER_FIELDS = ("age",)


def decode(body: bytes) -> StoryRequest:
    """The story request in ``body``; raises InvalidStoryRequest naming the field.

    Types are strict (``"5"`` is not an age), except that a number with no
    fraction is an integer whatever its spelling (``5.0``, ``5e0``): JSON
    has one kind of number, and JSON Schema agrees."""
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidStoryRequest("body", f"not JSON ({exc})") from None
    except RecursionError:
        raise InvalidStoryRequest("body", "nested too deeply") from None
    if isinstance(document, dict):
        for name in _INTEGER_FIELDS:
            value = document.get(name)
            if isinstance(value, float) and value.is_integer():
                document[name] = int(value)
    try:
        return msgspec.convert(document, StoryRequest, strict=True)
    except msgspec.ValidationError as exc:
        raise _explain(exc) from None


def _explain(exc: msgspec.ValidationError) -> InvalidStoryRequest:
    if isinstance(exc.__cause__, FieldValueError):
        return InvalidStoryRequest(exc.__cause__.field, exc.__cause__.message)
    message = str(exc)
    if at := _AT_FIELD.search(message):
        field = at.group(1)
        if field in _PATTERN_MEANS and "matching regex" in message:
            return InvalidStoryRequest(field, _PATTERN_MEANS[field])
        if field in _ONE_OF and "Invalid enum value" in message:
            return InvalidStoryRequest(field, _ONE_OF[field])
        return InvalidStoryRequest(field, message[: at.start()])
    if named := _NAMED_FIELD.search(message):
        return InvalidStoryRequest(named.group(1), message)
    return InvalidStoryRequest("body", message)


def canonical_json(request: StoryRequest) -> bytes:
    """The request as stored and fingerprinted: every field, defaults filled
    in, keys sorted; but the lane only when it is not the default, so that
    the fingerprint of an interactive request is what it was before the
    lane existed (a key used then and sent again now is the same request)."""
    if request.lane == "interactive":
        fields = msgspec.structs.asdict(request)
        del fields["lane"]
        return msgspec.json.encode(fields, order="sorted")
    return msgspec.json.encode(request, order="sorted")


def fingerprint(request: StoryRequest) -> bytes:
    return hashlib.sha256(canonical_json(request)).digest()
