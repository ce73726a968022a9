"""The contract between a job's executor and a story writer (the
``anthropic`` one or the offline one).

A writer only turns a request into a Draft. What it sends is not inferred
afterwards from how it failed: it says so on its JobCall as it happens
(``sending``, then ``refused``, ``accepted`` or nothing when the answer never
comes, then ``finished``), and the ledger row of each attempt is derived from
that record alone (``JobCall.record``). Before every retry it asks the JobCall
for the next attempt's ledger row; ``JobCall.retry`` raises LostOwnership
instead when the job is no longer this worker's, and then no request may be
sent.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from decimal import Decimal
from typing import Protocol

import msgspec

from shared.pricing import FREE, Price
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest
from shared.text import storable
from worker.rows import ClaimedJob, Draft, RetryStart

__all__ = ["FREE", "CallHooks", "CallRecord", "Draft", "JobCall", "LostOwnership", "Price", "Sent",
           "StoryWriter", "StreamedText", "WriteFailed", "job_call"]


class WriteFailed(Exception):
    """The writer gave up; the job fails with ``error_code``. ``outcome`` is
    how the last request ended when it was sent and not refused; whether it
    was billed comes from the JobCall's record, not from here."""

    def __init__(self, error_code: ErrorCode, message: str, *, outcome: LlmOutcome) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.message = message
        self.outcome = outcome


class LostOwnership(Exception):
    """The job was cancelled or swept while its call waited to be retried:
    the previous attempt's row is closed, and no further request may be sent."""


class Sent(enum.Enum):
    """Where the current attempt's request stands."""

    NOT_SENT = "not_sent"  # its ledger row is open; nothing has left
    SENT = "sent"  # it left, and no answer says what came of it: maybe billed
    REFUSED = "refused"  # answered with a refusal before any generation: not billed
    ACCEPTED = "accepted"  # a 200 arrived: billed; usage so far on the call
    FINISHED = "finished"  # the final usage arrived


class StreamedText:
    """The text a call has streamed so far, as the pieces it arrived in,
    each made storable as it arrives (so that a length counted here, in code
    points, is the length Postgres counts of what was stored). Written by
    the writer alone; the draft writer (worker/drafts.py) reads it."""

    __slots__ = ("_pieces", "chars")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self.chars = 0

    def append(self, piece: str) -> None:
        piece = storable(piece)
        if piece:
            self._pieces.append(piece)
            self.chars += len(piece)

    @property
    def pieces(self) -> int:
        return len(self._pieces)

    def after_piece(self, piece: int) -> str:
        """The text after the first ``piece`` pieces."""
        return "".join(self._pieces[piece:])

    def after_char(self, char: int) -> str:
        """The text after character ``char`` (code points)."""
        return "".join(self._pieces)[char:]

    def __str__(self) -> str:
        return "".join(self._pieces)


class CallRecord(msgspec.Struct, frozen=True):
    """How one attempt ended, as its ledger row says it."""

    attempt: int
    outcome: LlmOutcome
    billed: bool
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal
    request_id: str | None = None


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
    way, where its request stands, the usage so far (what heartbeats report
    as progress), and the job's worst case as its reservation counts it: the
    max_tokens fixed when the job was accepted, and the bound on its input
    tokens; and the model a writer calls, and the prices it charges at,
    which that reservation assumed (job_call)."""

    __slots__ = ("attempt", "sent", "refusal", "input_tokens", "output_tokens", "request_id", "price", "model",
                 "max_tokens", "input_tokens_at_most", "text", "_hooks")

    def __init__(self, price: Price, hooks: CallHooks, *, model: str, max_tokens: int) -> None:
        # attempt 1's ledger row was written by the claim
        self.attempt = 1
        self.sent = Sent.NOT_SENT
        self.refusal: LlmOutcome | None = None
        self.input_tokens = 0
        self.output_tokens = 0
        self.request_id: str | None = None
        self.price = price
        self.model = model
        self.max_tokens = max_tokens
        # the bound a spend budget reserves for the request (set once it is read)
        self.input_tokens_at_most = 0
        # the story's text as it streams, for the job's draft (only an answer
        # that streamed nothing is retried, so it is one attempt's text)
        self.text = StreamedText()
        self._hooks = hooks

    # -- what a writer says as it happens ------------------------------------------------

    def sending(self) -> None:
        self.sent = Sent.SENT

    def refused(self, outcome: LlmOutcome, request_id: str | None = None) -> None:
        """The provider answered with a refusal that certainly billed nothing."""
        self.sent, self.refusal = Sent.REFUSED, outcome
        self.request_id = request_id or self.request_id

    def accepted(self, request_id: str | None = None) -> None:
        self.sent = Sent.ACCEPTED
        self.request_id = request_id or self.request_id

    def answered_with_error(self, request_id: str | None) -> None:
        """An error answer that says nothing of what was billed (a 5xx): the
        request stays SENT, its outcome unknown; only its id is kept."""
        self.request_id = request_id or self.request_id

    def finished(self, input_tokens: int, output_tokens: int) -> None:
        self.sent = Sent.FINISHED
        self.input_tokens, self.output_tokens = input_tokens, output_tokens

    async def retry(self, previous: LlmOutcome, error: str) -> None:
        """Closes the current, refused attempt's ledger row and writes the
        next attempt's row, before its request is sent; raises
        LostOwnership when the job is no longer ours."""
        started = await self._hooks.next_attempt(self.attempt, previous, error)
        if not started.owned or started.attempt is None:
            raise LostOwnership(f"the job was ended elsewhere while attempt {self.attempt} waited to be retried")
        self.attempt = started.attempt
        self.sent, self.refusal, self.request_id = Sent.NOT_SENT, None, None
        self.input_tokens = 0
        self.output_tokens = 0

    async def rate_limited(self, pause_s: float) -> None:
        await self._hooks.rate_limited(pause_s)

    def provider_said(self, headers: Mapping[str, str]) -> None:
        self._hooks.provider_said(headers)

    # -- what it cost -----------------------------------------------------------------

    @property
    def billed(self) -> bool:
        """True when the provider accepted the request or its outcome cannot
        be known; False when nothing left or it was refused."""
        return self.sent not in (Sent.NOT_SENT, Sent.REFUSED)

    @property
    def cost_usd(self) -> Decimal:
        return self.price.cost(self.input_tokens, self.output_tokens)

    def record(self, outcome: LlmOutcome) -> CallRecord:
        """The ledger row of the current attempt, ended as ``outcome`` says
        where the request stands: nothing sent or refused is not billed and
        keeps its refusal; a finished one costs its usage; any other (a 5xx,
        a stream that broke or that we stopped before its end) cannot be
        known, and is charged the job's worst case, as a sweep would."""
        if self.sent is Sent.NOT_SENT:
            return CallRecord(self.attempt, LlmOutcome.NOT_SENT, False, 0, 0, Decimal(0), self.request_id)
        if self.sent is Sent.REFUSED:
            assert self.refusal is not None
            return CallRecord(self.attempt, self.refusal, False, 0, 0, Decimal(0), self.request_id)
        if self.sent is Sent.FINISHED:
            return CallRecord(self.attempt, outcome, True, self.input_tokens, self.output_tokens, self.cost_usd,
                              self.request_id)
        # sent and never finished (a 5xx, a broken or stopped stream, a
        # timeout): what the provider generated before it noticed is not known
        input_tokens = max(self.input_tokens, self.input_tokens_at_most)
        return CallRecord(self.attempt, outcome, True, input_tokens, self.max_tokens,
                          self.price.worst_case(input_tokens, self.max_tokens), self.request_id)


class StoryWriter(Protocol):
    provider: str
    model: str
    price: Price

    async def write(self, request: StoryRequest, call: JobCall) -> Draft: ...

    async def aclose(self) -> None: ...


def job_call(job: ClaimedJob, writer: StoryWriter, hooks: CallHooks, *, default_max_tokens: int) -> JobCall:
    """The call of a claimed job, on the terms its reservation assumed
    (model, prices, max_tokens) whatever this worker's settings, so that its
    charge stays within what admission reserved. A job accepted before jobs
    carried them, and the offline writer (which calls no model and bills
    nothing), keep the writer's own."""
    max_tokens = job.max_tokens or default_max_tokens
    price = job.price()
    if job.model is None or price is None or writer.provider == "offline":
        return JobCall(writer.price, hooks, model=writer.model, max_tokens=max_tokens)
    return JobCall(price, hooks, model=job.model, max_tokens=max_tokens)
