"""What an LLM call costs: prices per million tokens, and a job's worst case,
which a spend budget reserves when the job is accepted."""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_HALF_UP, Decimal

import msgspec

_MICRO_USD = Decimal("0.000001")


class Price(msgspec.Struct, frozen=True):
    """USD per million tokens."""

    input_usd_per_mtok: Decimal
    output_usd_per_mtok: Decimal

    def cost(self, input_tokens: int, output_tokens: int) -> Decimal:
        return self._usd(input_tokens, output_tokens).quantize(_MICRO_USD, rounding=ROUND_HALF_UP)

    def worst_case(self, input_tokens_at_most: int, max_tokens: int) -> Decimal:
        """The most a call can cost: rounded up, so that a reservation is
        never below what the ledger later records for the same call."""
        return self._usd(input_tokens_at_most, max_tokens).quantize(_MICRO_USD, rounding=ROUND_CEILING)

    def _usd(self, input_tokens: int, output_tokens: int) -> Decimal:
        return (input_tokens * self.input_usd_per_mtok + output_tokens * self.output_usd_per_mtok) / 1_000_000


    def batch(self) -> Price:
        """The price of a request sent in a message batch (the batch lane)."""
        return Price(self.input_usd_per_mtok * BATCH_PRICE_FACTOR, self.output_usd_per_mtok * BATCH_PRICE_FACTOR)


FREE = Price(Decimal(0), Decimal(0))
# What a message batch's request costs against the same request sent on its
# own: half, as the provider's Message Batches API charges. Admission
# reserves a batch job's worst case at it, and the job keeps the prices it
# was admitted with, so every later charge is at it too.
BATCH_PRICE_FACTOR = Decimal("0.5")


def saved_by_batch(cost_at_batch_price: Decimal) -> Decimal:
    """What a cost paid at the batch price saved against the same requests
    at the interactive price: cost × (1 / BATCH_PRICE_FACTOR − 1), to the
    micro-dollar."""
    return (cost_at_batch_price * (1 / BATCH_PRICE_FACTOR - 1)).quantize(_MICRO_USD, rounding=ROUND_HALF_UP)
