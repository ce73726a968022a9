"""The story writer that calls the LLM through the official ``anthropic`` SDK.

Never bill twice: the SDK's own retries are off (it would retry read timeouts
and 5xx, and a retried request after the provider started generating is a
second bill). We retry only what was certainly not billed, decided where we
know whether the stream had started:

* 429 (rate limited) and 529 (overloaded) answered instead of a stream,
  unless the provider says ``x-should-retry: false`` (as it does when a spend
  limit is reached): that answer is final;
* a connection that could not be made, so nothing was sent.

Everything else fails the job: a provider 4xx as ``llm_rejected`` (nothing was
billed; retrying cannot help), a timeout, a dropped stream or a 5xx as
``llm_error`` (it may have been billed). Retries use stamina (jittered
exponential backoff, ``retry-after`` honoured, bounded attempts and deadline),
and each one gets its own ledger row before it is sent. What each error of
the SDK means for the bill is decided in worker/anthropic_errors.py.

What was sent is said on the JobCall as it happens (sending, then refused,
accepted or nothing, then finished), never inferred from an exception, and
every number the provider sends (usage, retry-after) is checked by
shared.provider_numbers before it is used.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import anthropic
import httpx2
import stamina
import structlog
from anthropic import OpenTelemetryOptions
from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from shared import prompt, telemetry
from shared.config import WorkerSettings
from shared.provider_numbers import token_count
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest
from worker.anthropic_errors import (
    NotBilled,
    Refused,
    classify_before_stream,
    describe,
    request_id,
    retry_wait,
)
from worker.writing import Draft, JobCall, WriteFailed

log = structlog.get_logger()

# a streamed answer's progress is counted in tokens; while streaming only text
# arrives, so it is estimated from characters until the final usage comes
_CHARS_PER_TOKEN = 4
# how long a 429 that says nothing of when to come back holds every worker
_DEFAULT_429_PAUSE_S = 1.0
# no prompt of ours comes near this many input tokens: a larger count is absurd
_INPUT_TOKENS_MAX = 1_000_000


def sdk_tracing(tracer_provider: TracerProvider | None = None) -> OpenTelemetryOptions | Literal[False]:
    """The SDK's own tracing, always set explicitly, so that no environment
    variable (ANTHROPIC_OPEN_TELEMETRY_TRACES_CONTENT_MODE included) can put a
    prompt or a story in a span: a span per attempt with its metadata only,
    when traces are on; none at all otherwise. The trace context is not sent
    to the provider: it would tell them nothing they need, and our trace ids
    are ours (docs/operations.md, "Traces")."""
    if tracer_provider is None and not telemetry.tracing_enabled():
        return False
    options: OpenTelemetryOptions = {"traces": {"enabled": True, "content_mode": "metadata_only"},
                                     "propagation": False}
    if tracer_provider is not None:
        options["tracer_provider"] = tracer_provider
    return options


class AnthropicWriter:
    provider = "anthropic"

    def __init__(self, settings: WorkerSettings, *, client: anthropic.AsyncAnthropic | None = None,
                 tracer_provider: TracerProvider | None = None) -> None:
        self.model = settings.llm_model
        self.price = settings.price()
        self._settings = settings
        self._client = client or anthropic.AsyncAnthropic(
            api_key=settings.anthropic_api_key,
            base_url=settings.anthropic_base_url,
            max_retries=0,
            timeout=anthropic.Timeout(settings.llm_read_timeout_s, connect=5.0),
            open_telemetry=sdk_tracing(tracer_provider),
        )

    async def aclose(self) -> None:
        await self._client.close()

    async def write(self, request: StoryRequest, call: JobCall) -> Draft:
        unbilled: NotBilled | None = None
        try:
            async with asyncio.timeout(self._settings.llm_timeout_s):
                async for attempt in stamina.retry_context(
                    on=retry_wait,
                    attempts=self._settings.llm_retry_attempts,
                    timeout=self._settings.llm_retry_deadline_s,
                    wait_initial=0.5,
                    wait_max=20.0,
                    wait_jitter=0.5,
                ):
                    with attempt:
                        if unbilled is not None:
                            await call.retry(unbilled.outcome, unbilled.message)
                        try:
                            return await self._stream_once(request, call)
                        except NotBilled as exc:
                            unbilled = exc
                            log.info("llm.retryable", outcome=exc.outcome.value, attempt=call.attempt,
                                     retry_after_s=exc.retry_after_s)
                            # the wait before the next attempt, on the job's run span
                            trace.get_current_span().add_event("storyjobs.llm.retry_wait", {
                                "storyjobs.llm.outcome": exc.outcome.value, "storyjobs.llm.attempt": call.attempt,
                                **({"storyjobs.llm.retry_after_s": exc.retry_after_s}
                                   if exc.retry_after_s is not None else {})})
                            if exc.outcome is LlmOutcome.RATE_LIMITED:
                                # every worker holds its requests, not only this one
                                await call.rate_limited(exc.retry_after_s or _DEFAULT_429_PAUSE_S)
                            raise
        except NotBilled as exc:
            raise WriteFailed(
                ErrorCode.LLM_UNAVAILABLE,
                f"the LLM provider stayed unavailable after {call.attempt} attempts: {exc.message}",
                outcome=exc.outcome,
            ) from None
        except TimeoutError:
            # billed or not as the call's record says: a timeout during a
            # retry's wait bills nothing
            raise WriteFailed(
                ErrorCode.LLM_ERROR,
                f"the LLM call took longer than LLM_TIMEOUT_S ({self._settings.llm_timeout_s:g} s)",
                outcome=LlmOutcome.FAILED,
            ) from None
        raise AssertionError("unreachable: stamina either returns or raises")

    async def _stream_once(self, request: StoryRequest, call: JobCall) -> Draft:
        streamed_chars = 0
        call.sending()
        try:
            manager = self._client.messages.stream(
                model=call.model,
                max_tokens=call.max_tokens,
                system=prompt.SYSTEM,
                messages=[{"role": "user", "content": prompt.user_message(request)}],
            )
            stream = await manager.__aenter__()
        except anthropic.APIError as exc:
            if isinstance(exc, anthropic.APIStatusError):
                call.provider_said(exc.response.headers)
            classified = classify_before_stream(exc)
            if isinstance(classified, (NotBilled, Refused)):
                call.refused(classified.outcome, request_id(exc))
            else:
                call.answered_with_error(request_id(exc))
            raise classified from None
        call.accepted(stream.request_id)
        call.provider_said(stream.response.headers)
        # From here on the provider is generating: any failure may have billed.
        try:
            async for event in stream:
                if event.type == "message_start":
                    call.input_tokens = _input_tokens(event.message.usage.input_tokens, call, final=False)
                elif event.type == "text":
                    streamed_chars += len(event.text)
                    call.text.append(event.text)
                    call.output_tokens = min(max(call.output_tokens, streamed_chars // _CHARS_PER_TOKEN),
                                             call.max_tokens)
                elif event.type == "message_delta":
                    call.output_tokens = _output_tokens(event.usage.output_tokens, call, final=False)
            message = await stream.get_final_message()
        except (anthropic.APIError, httpx2.HTTPError) as exc:
            # inside a stream the SDK lets transport errors (read timeout,
            # dropped connection) through as they are
            raise WriteFailed(
                ErrorCode.LLM_ERROR,
                f"the LLM stream broke after it started, so it was not retried: {describe(exc)}",
                outcome=LlmOutcome.FAILED,
            ) from None
        finally:
            await manager.__aexit__(None, None, None)
        call.finished(_input_tokens(message.usage.input_tokens, call, final=True),
                      _output_tokens(message.usage.output_tokens, call, final=True))
        if message.stop_reason:
            # what the GenAI conventions ask of the call and the SDK's span lacks
            trace.get_current_span().set_attribute("gen_ai.response.finish_reasons", [message.stop_reason])
        text = "".join(block.text for block in message.content if block.type == "text")
        title, body = prompt.split_title(text)
        if not body:
            raise WriteFailed(ErrorCode.LLM_ERROR, "the LLM answered with no story text", outcome=LlmOutcome.FAILED)
        return Draft(
            title=title,
            body=body,
            model=message.model or call.model,
            prompt_version=prompt.PROMPT_VERSION,
            input_tokens=call.input_tokens,
            output_tokens=call.output_tokens,
            cost_usd=call.cost_usd,
            request_id=call.request_id,
        )


def _input_tokens(reported: object, call: JobCall, *, final: bool) -> int:
    """The provider's input count; absent or absurd: the bound on it (the
    final message repeats the count of its start: logged once, there)."""
    counted = token_count(reported, what="usage.input_tokens", upper=_INPUT_TOKENS_MAX, quiet=not final)
    return call.input_tokens_at_most if counted is None else counted


def _output_tokens(reported: object, call: JobCall, *, final: bool) -> int:
    """The provider's output count, never above the max_tokens it was asked
    for; absent or absurd: the worst case, max_tokens, once final (while
    streaming, the estimate so far stands)."""
    counted = token_count(reported, what="usage.output_tokens", upper=call.max_tokens, quiet=not final)
    if counted is None:
        return call.max_tokens if final else call.output_tokens
    return counted
