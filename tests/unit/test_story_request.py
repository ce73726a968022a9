"""The request body (shared/story_request.py): its fingerprint, and input that
cannot be stored refused naming the field."""

from __future__ import annotations

import msgspec
import pytest

from shared.story_request import StoryRequest, fingerprint


def test_the_fingerprint_ignores_key_order_whitespace_and_spelt_out_defaults() -> None:
    """Equivalent bodies have one fingerprint; a different option another."""
    def of(body: bytes) -> bytes:
        return fingerprint(msgspec.json.decode(body, type=StoryRequest))

    base = of(b'{"prompt": "a fox", "age": 5}')
    assert of(b'{ "age":5,\n "prompt":"a fox" }') == base
    assert of(b'{"prompt": "a fox", "age": 5, "length": "medium", "language": "en"}') == base
    assert of(b'{"prompt": "a fox", "age": 6}') != base


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"prompt": "a\\u0000b"}', "prompt"),
        (b'{"prompt": "ok", "child_name": "\\u0007"}', "child_name"),
        (b'{"prompt": "   "}', "prompt"),
        (b'{"prompt": "ok", "lenght": "long"}', "lenght"),
        (b'{"prompt": "ok", "age": 13}', "age"),
        (b'{"prompt": "ok", "language": "english please"}', "language"),
    ],
)
def test_unstorable_or_unknown_input_is_refused_naming_the_field(body: bytes, field: str) -> None:
    """NUL, lone surrogates, control characters, blank text, unknown fields and out-of-range options fail."""
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.json.decode(body, type=StoryRequest)


def test_a_lone_surrogate_is_refused_by_the_decoder() -> None:
    """JSON text with an unpaired surrogate escape cannot become a storable string."""
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(b'{"prompt": "a\\ud800b"}', type=StoryRequest)
    with pytest.raises(msgspec.ValidationError, match="surrogate"):
        msgspec.convert({"prompt": "a\ud800b"}, StoryRequest)
