"""Prices (shared/pricing.py): a call's cost from its tokens."""

from __future__ import annotations

from decimal import Decimal

from shared.pricing import Price


def test_cost_is_priced_per_million_tokens_to_the_micro_dollar() -> None:
    """1,000 input and 2,000 output tokens at $2/$10 per million cost $0.022."""
    assert Price(Decimal(2), Decimal(10)).cost(1000, 2000) == Decimal("0.022000")
