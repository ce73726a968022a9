"""API keys (shared/keys.py): hashed, and recognised by their shape."""

from __future__ import annotations

from shared import keys


def test_keys_are_hashed_and_recognised_by_shape() -> None:
    """A new key matches its own hash only, and its prefix is read back from the key."""
    new = keys.generate()
    assert keys.prefix_of(new.key) == new.prefix and keys.matches(new.key, new.hash)
    assert not keys.matches(keys.generate().key, new.hash)
    assert keys.prefix_of("sj_short_x") is None and keys.prefix_of(new.key + "x") is None
    assert new.key not in new.hash.hex()
