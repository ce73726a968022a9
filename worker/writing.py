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

import asyncio
from collections.abc import Mapping
from decimal import Decimal
from typing import Protocol

from shared.pricing import FREE, Price
from shared.rows import Draft, RetryStart
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest

__all__ = ["FREE", "CallHooks", "Draft", "JobCall", "LostOwnership", "Price", "StoryWriter", "WriteFailed"]


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


class CallHooks(Protocol):
    """What a JobCall asks of the worker that runs it."""

    async def next_attempt(self, attempt: int, previous: LlmOutcome, error: str) -> RetryStart:
        """Closes attempt's ledger row as ``previous`` and opens the next one
        (see shared.rows.RetryStart)."""
        ...

    async def rate_limited(self, pause_s: float) -> None:
        """A 429: every worker holds its requests for pause_s."""
        ...

    def provider_said(self, headers: Mapping[str, str]) -> None:
        """An answer's headers, for the provider's view of its rate limits."""
        ...


class JobCall:
    """One job's LLM call as it happens: which attempt (ledger row) is under
    way, the usage so far (what heartbeats report as progress), and the
    max_tokens fixed when the job was accepted (None: the writer's own)."""

    __slots__ = ("attempt", "input_tokens", "output_tokens", "price", "max_tokens", "_hooks")

    def __init__(self, price: Price, hooks: CallHooks, *, max_tokens: int | None = None) -> None:
        # attempt 1's ledger row was written by the claim
        self.attempt = 1
        self.input_tokens = 0
        self.output_tokens = 0
        self.price = price
        self.max_tokens = max_tokens
        self._hooks = hooks

    async def retry(self, previous: LlmOutcome, error: str) -> None:
        """Closes the current ledger row as certainly unbilled and writes the
        next attempt's row, before its request is sent; waits first while
        another worker's 429 holds every request; raises LostOwnership when
        the job is no longer ours."""
        while True:
            started = await self._hooks.next_attempt(self.attempt, previous, error)
            if not started.owned:
                raise LostOwnership(f"the job was ended elsewhere while attempt {self.attempt} waited to be retried")
            if started.attempt is not None:
                break
            await asyncio.sleep(started.paused_s)
        self.attempt = started.attempt
        self.input_tokens = 0
        self.output_tokens = 0

    async def rate_limited(self, pause_s: float) -> None:
        await self._hooks.rate_limited(pause_s)

    def provider_said(self, headers: Mapping[str, str]) -> None:
        self._hooks.provider_said(headers)

    @property
    def cost_usd(self) -> Decimal:
        return self.price.cost(self.input_tokens, self.output_tokens)


class StoryWriter(Protocol):
    provider: str
    model: str
    price: Price

    async def write(self, request: StoryRequest, call: JobCall) -> Draft: ...

    async def aclose(self) -> None: ...
