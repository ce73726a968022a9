"""The contract between the worker's runner and a story writer (the
``anthropic`` one or the offline one).

The runner owns the job and its ledger rows; a writer only turns a request
into a Draft. It reports usage as it streams into its JobCall, so that a
stream stopped half-way still records what was billed, and it asks the
JobCall for a new ledger row before every retry: JobCall.retry raises
LostOwnership instead when the job is no longer this worker's, and then no
request may be sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from decimal import ROUND_HALF_UP, Decimal
from typing import Protocol

import msgspec

from shared.rows import Draft
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest

__all__ = ["FREE", "Draft", "JobCall", "LostOwnership", "Price", "StoryWriter", "WriteFailed"]

_MICRO_USD = Decimal("0.000001")


class Price(msgspec.Struct, frozen=True):
    """USD per million tokens."""

    input_usd_per_mtok: Decimal
    output_usd_per_mtok: Decimal

    def cost(self, input_tokens: int, output_tokens: int) -> Decimal:
        total = (input_tokens * self.input_usd_per_mtok + output_tokens * self.output_usd_per_mtok) / 1_000_000
        return total.quantize(_MICRO_USD, rounding=ROUND_HALF_UP)


FREE = Price(Decimal(0), Decimal(0))


class WriteFailed(Exception):
    """The writer gave up; the job fails with ``error_code``.

    ``outcome`` and ``billed`` describe the last request sent, for the ledger.
    """

    def __init__(self, error_code: ErrorCode, message: str, *, outcome: LlmOutcome, billed: bool) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.message = message
        self.outcome = outcome
        self.billed = billed


class LostOwnership(Exception):
    """The job was cancelled or swept while its call waited to be retried:
    the previous attempt's row is closed, and no further request may be sent."""


# (previous attempt, how it ended, its error) -> the next attempt, or None
# when the job is no longer this worker's
NextAttempt = Callable[[int, LlmOutcome, str], Awaitable[int | None]]


class JobCall:
    """One job's LLM call as it happens: which attempt (ledger row) is under
    way, and the usage so far (what heartbeats report as progress)."""

    __slots__ = ("attempt", "input_tokens", "output_tokens", "price", "_next_attempt")

    def __init__(self, price: Price, next_attempt: NextAttempt) -> None:
        # attempt 1's ledger row was written by the claim
        self.attempt = 1
        self.input_tokens = 0
        self.output_tokens = 0
        self.price = price
        self._next_attempt = next_attempt

    async def retry(self, previous: LlmOutcome, error: str) -> None:
        """Closes the current ledger row as certainly unbilled and writes the
        next attempt's row, before its request is sent; raises LostOwnership
        when the job is no longer ours."""
        attempt = await self._next_attempt(self.attempt, previous, error)
        if attempt is None:
            raise LostOwnership(f"the job was ended elsewhere while attempt {self.attempt} waited to be retried")
        self.attempt = attempt
        self.input_tokens = 0
        self.output_tokens = 0

    @property
    def cost_usd(self) -> Decimal:
        return self.price.cost(self.input_tokens, self.output_tokens)


class StoryWriter(Protocol):
    provider: str
    model: str
    price: Price

    async def write(self, request: StoryRequest, call: JobCall) -> Draft: ...

    async def aclose(self) -> None: ...
