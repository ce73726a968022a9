"""What an error of the ``anthropic`` SDK means for the bill, and so for a
retry (worker/anthropic_writer.py): ``NotBilled`` (a 429 or 529 answered
instead of a stream, a connection never made) may be retried; ``Refused``
(a 4xx, or a 429 that says not to retry) fails the job, nothing billed;
anything else fails the job as a call that may have been billed. Every
number the provider sends (retry-after) is checked by
shared.provider_numbers before it is used.
"""

from __future__ import annotations

import anthropic
import httpx2

from shared.provider_numbers import header_number
from shared.status import ErrorCode, LlmOutcome
from worker.writing import WriteFailed

# Retry-After is honoured up to this; beyond it the deadline decides
_MAX_RETRY_AFTER_S = 60.0


class Refused(WriteFailed):
    """A final refusal before any generation (a 4xx, or a 429 that says not
    to retry): the job fails, and nothing was billed."""


class NotBilled(Exception):
    """The provider certainly did not bill this request: safe to retry."""

    def __init__(self, outcome: LlmOutcome, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.retry_after_s = retry_after_s


def _retry_after_s(response: httpx2.Response) -> float | None:
    """The answer's retry-after, in seconds, when it is a usable number (an
    HTTP date or ``nan`` is not: then the backoff decides)."""
    for header, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = header_number(response.headers.get(header), what=header)
        if value is not None:
            return min(value * scale, _MAX_RETRY_AFTER_S)
    return None


def classify_before_stream(exc: anthropic.APIError) -> Exception:
    """An error raised before any event arrived: NotBilled if certainly
    unbilled and worth retrying, else the WriteFailed that fails the job."""
    classified = _classify_status(exc)
    if (
        isinstance(classified, NotBilled)
        and isinstance(exc, anthropic.APIStatusError)
        and exc.response.headers.get("x-should-retry", "").strip().lower() == "false"
    ):
        return Refused(
            ErrorCode.LLM_REJECTED,
            f"the LLM provider refused the request ({exc.status_code}) and asked not to retry it: "
            f"{_provider_message(exc)}",
            outcome=classified.outcome,
        )
    return classified


def _classify_status(exc: anthropic.APIError) -> Exception:
    if isinstance(exc, anthropic.RateLimitError):
        return NotBilled(LlmOutcome.RATE_LIMITED, "429 rate limited", _retry_after_s(exc.response))
    if isinstance(exc, anthropic.APIStatusError) and exc.status_code == 529:
        return NotBilled(LlmOutcome.OVERLOADED, "529 overloaded", _retry_after_s(exc.response))
    if isinstance(exc, anthropic.APIConnectionError) and isinstance(
        exc.__cause__, (httpx2.ConnectError, httpx2.ConnectTimeout)
    ):
        return NotBilled(LlmOutcome.CONNECT_FAILED, f"could not connect: {exc.__cause__}")
    if isinstance(exc, anthropic.APIStatusError) and 400 <= exc.status_code < 500:
        return Refused(
            ErrorCode.LLM_REJECTED,
            f"the LLM provider rejected the request ({exc.status_code}): {_provider_message(exc)}",
            outcome=LlmOutcome.REJECTED,
        )
    return WriteFailed(
        ErrorCode.LLM_ERROR,
        f"the LLM call failed and was not retried, as it may have been billed: {describe(exc)}",
        outcome=LlmOutcome.FAILED,
    )


def _provider_message(exc: anthropic.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return message[:500]
    return exc.message[:500]


def describe(exc: BaseException) -> str:
    if isinstance(exc, anthropic.APITimeoutError):
        return "timed out waiting for the provider"
    if isinstance(exc, anthropic.APIStatusError):
        return f"provider answered {exc.status_code}: {_provider_message(exc)}"
    if isinstance(exc, anthropic.APIConnectionError):
        return f"connection to the provider failed ({type(exc.__cause__).__name__})"
    if isinstance(exc, httpx2.TimeoutException):
        return f"no data from the provider for LLM_READ_TIMEOUT_S ({type(exc).__name__})"
    if isinstance(exc, httpx2.HTTPError):
        return f"the connection to the provider broke ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"[:500]


def retry_wait(exc: BaseException) -> bool | float:
    """stamina hook: retry NotBilled only, after the provider's Retry-After if
    it sent one, else after stamina's jittered exponential backoff."""
    if not isinstance(exc, NotBilled):
        return False
    if exc.retry_after_s is not None:
        return max(exc.retry_after_s, 0.01)
    return True


def request_id(exc: anthropic.APIError) -> str | None:
    if isinstance(exc, anthropic.APIStatusError):
        return exc.request_id or exc.response.headers.get("request-id")
    return None
