"""The rate limiter's arithmetic, without a database: limits from settings,
the provider's headers, and how long a held-back claim waits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from shared.config import WorkerSettings
from shared.prompt import INPUT_TOKENS_ESTIMATE_MAX
from shared.ratelimit import LimiterState, ProviderView, RateLimits, claim_params, over_limit


def test_a_minutes_limit_becomes_a_rate_and_a_burst_of_a_few_seconds() -> None:
    """120 requests a minute refill at 2 a second into a bucket of LLM_RATE_BURST_S (5 s) of them, less
    the quarter second kept for requests in flight; an unset limit is none."""
    limits = RateLimits.from_settings(WorkerSettings(llm_requests_per_minute=120, metrics_port=0))
    assert (limits.requests_rate, limits.requests_capacity) == (2.0, 9.5)
    assert limits.output_tokens_rate is None and limits.output_tokens_capacity is None
    assert limits.limited and not RateLimits.from_settings(WorkerSettings(metrics_port=0)).limited


def test_a_bucket_always_holds_the_largest_single_job() -> None:
    """A limit so low that five seconds of it would not cover one job's max_tokens or its input still
    lets that job start: the bucket holds at least one largest job, up to the minute's limit itself
    (a larger job is refused at admission)."""
    limits = RateLimits.from_settings(WorkerSettings(llm_output_tokens_per_minute=6000,
                                                     llm_input_tokens_per_minute=2 * INPUT_TOKENS_ESTIMATE_MAX,
                                                     llm_max_tokens=4000, metrics_port=0))
    assert limits.output_tokens_capacity == 4000 and limits.input_tokens_capacity == INPUT_TOKENS_ESTIMATE_MAX
    tiny = RateLimits.from_settings(WorkerSettings(llm_output_tokens_per_minute=600, llm_input_tokens_per_minute=60,
                                                   llm_max_tokens=4000, metrics_port=0))
    assert tiny.output_tokens_capacity == 600 and tiny.input_tokens_capacity == 60


def _headers(requests_left: int, output_left: int) -> dict[str, str]:
    return {
        "anthropic-ratelimit-requests-limit": "60", "anthropic-ratelimit-requests-remaining": str(requests_left),
        "anthropic-ratelimit-requests-reset": "2026-11-30T12:01:00Z",
        "anthropic-ratelimit-output-tokens-limit": "60000",
        "anthropic-ratelimit-output-tokens-remaining": str(output_left),
        "anthropic-ratelimit-output-tokens-reset": "2026-11-30T12:00:30.500Z",
    }


def test_the_providers_headers_are_read_and_nothing_else() -> None:
    """Remaining, limit and reset are read per kind; an answer without them (or with unreadable ones)
    says nothing."""
    view = ProviderView.from_headers(_headers(3, 5000), seen_at=10.0)
    assert view is not None
    assert view.remaining == {"requests": 3.0, "output_tokens": 5000.0}
    assert view.resets["output_tokens"] == datetime(2026, 11, 30, 12, 0, 30, 500000, tzinfo=UTC)
    assert ProviderView.from_headers({"content-type": "text/event-stream"}, seen_at=1.0) is None
    assert ProviderView.from_headers({"anthropic-ratelimit-requests-remaining": "lots"}, seen_at=1.0) is None


def test_the_provider_saying_too_little_is_left_pauses_until_enough_has_refilled() -> None:
    """No request left at 60 a minute: a pause of one second, not until the bucket is whole again;
    2,000 output tokens short at 60,000 a minute: two seconds; enough of everything: no pause."""
    view = ProviderView.from_headers(_headers(0, 5000), seen_at=10.0)
    assert view is not None
    assert view.pause_s(output_tokens_need=1600, now=10.0) == pytest.approx(1.0)
    short = ProviderView.from_headers(_headers(3, 0), seen_at=10.0)
    assert short is not None
    assert short.pause_s(output_tokens_need=2000, now=10.0) == pytest.approx(2.0)
    # half a second later, half a second is left to wait
    assert short.pause_s(output_tokens_need=2000, now=10.5) == pytest.approx(1.5)
    plenty = ProviderView.from_headers(_headers(3, 5000), seen_at=10.0)
    assert plenty is not None and plenty.pause_s(output_tokens_need=1600, now=10.0) is None
    # exactly one job's worth left (one request, its output tokens) is enough for that job
    exactly = ProviderView.from_headers(_headers(1, 1600), seen_at=10.0)
    assert exactly is not None and exactly.pause_s(output_tokens_need=1600, now=10.0) is None


def test_what_the_provider_said_is_refilled_to_now_where_a_limit_is_configured() -> None:
    """The provider's remaining requests, seen 3 s ago at 2 a second, cap the bucket at 3 + 6; output
    tokens, with no limit configured here, do not cap it."""
    limits = RateLimits.from_settings(WorkerSettings(llm_requests_per_minute=120, metrics_port=0))
    view = ProviderView.from_headers(_headers(3, 5000), seen_at=10.0)
    params = claim_params(limits, view, default_max_tokens=1600, clock=lambda: 13.0)
    assert params["provider_requests"] == pytest.approx(9.0)
    assert params["provider_output_tokens"] is None and params["limited"] is True


def test_a_held_back_claim_waits_until_the_scarcest_kind_covers_the_next_job() -> None:
    """1 request short at 2 a second is half a second; 800 output tokens short at 400 a second is two;
    the wait is the longer, and a pause counts whole; nothing held back and no pause: no wait."""
    limits = RateLimits(requests_rate=2.0, requests_capacity=10.0, input_tokens_rate=None, input_tokens_capacity=None,
                        output_tokens_rate=400.0, output_tokens_capacity=8000.0)
    held = LimiterState(requests=0.0, output_tokens=800.0, next_input_tokens=100, next_output_tokens=1600)
    assert held.wait_s(limits) == pytest.approx(2.0)
    assert LimiterState(paused_s=7.5, requests=5.0, output_tokens=8000.0).wait_s(limits) == 7.5
    assert LimiterState(requests=5.0, output_tokens=8000.0).wait_s(limits) == 0.0


@pytest.mark.parametrize("host_clock_off_s", [0.0, 600.0, -600.0], ids=["right", "10-min-fast", "10-min-slow"])
def test_a_reset_becomes_a_duration_bounded_by_its_minute_whatever_the_host_clock(host_clock_off_s: float) -> None:
    """With no limit given, nothing left pauses until the reset, sent as a duration (the database adds
    it to its own clock): 20 s with a right clock; a host clock 10 minutes fast pauses nobody, one 10
    minutes slow at most the minute the reset falls within."""
    reset = datetime(2026, 11, 30, 12, 0, 20, tzinfo=UTC)
    view = ProviderView(seen_at=10.0, seen_wall=datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
                        + timedelta(seconds=host_clock_off_s),
                        remaining={"requests": 0.0}, limits={}, resets={"requests": reset})
    expected = {0.0: 20.0, 600.0: 0.0, -600.0: 60.0}[host_clock_off_s]
    assert view.pause_s(output_tokens_need=1000, now=10.0) == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["input", "output"])
def test_a_job_of_exactly_a_minutes_limit_is_served_and_one_token_more_is_refused(kind: str) -> None:
    """The provider serves a call of up to its limit per minute: a job needing exactly the configured limit
    is admitted; one token more can never be served, and the api names the limit it exceeds."""
    settings = (WorkerSettings(llm_input_tokens_per_minute=1000) if kind == "input"
                else WorkerSettings(llm_output_tokens_per_minute=1000))
    exactly = {"input_tokens": 1, "output_tokens": 1, f"{kind}_tokens": 1000}
    more = {**exactly, f"{kind}_tokens": 1001}
    assert over_limit(settings, **exactly) is None
    assert over_limit(settings, **more) == f"LLM_{kind.upper()}_TOKENS_PER_MINUTE"


def test_a_kind_without_a_rate_is_not_waited_for_whatever_the_bucket_said_of_it() -> None:
    """Only the kinds with a known rate refill at a pace to wait for: a bucket that still reports half a request
    while only output tokens are limited makes the worker wait for the output tokens alone."""
    limits = RateLimits(requests_rate=None, requests_capacity=None, input_tokens_rate=None,
                        input_tokens_capacity=None, output_tokens_rate=100.0, output_tokens_capacity=8000.0)
    held = LimiterState(requests=0.5, output_tokens=800.0, next_output_tokens=1000)
    assert held.wait_s(limits) == pytest.approx(2.0)
