"""Prices (shared/pricing.py): a call's cost from its tokens."""

from __future__ import annotations

from decimal import Decimal

from shared.pricing import Price, saved_by_batch


def test_cost_is_priced_per_million_tokens_to_the_micro_dollar() -> None:
    """1,000 input and 2,000 output tokens at $2/$10 per million cost $0.022."""
    assert Price(Decimal(2), Decimal(10)).cost(1000, 2000) == Decimal("0.022000")


def test_what_a_batch_saved_is_the_interactive_price_less_what_it_cost() -> None:
    """A batch request's cost plus what it saved is what the same tokens cost at the interactive price."""
    interactive = Price(Decimal(2), Decimal(10))
    for input_tokens, output_tokens in ((1000, 2000), (333, 777), (0, 1), (123_457, 4000)):
        cost = interactive.batch().cost(input_tokens, output_tokens)
        # each cost is rounded to the micro-dollar on its own
        assert abs(cost + saved_by_batch(cost) - interactive.cost(input_tokens, output_tokens)) <= Decimal("0.000001")
    assert saved_by_batch(Decimal("0.011")) == Decimal("0.011000") and saved_by_batch(Decimal(0)) == Decimal(0)
