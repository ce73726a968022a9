"""The provider's rate limits as the worker sees them: the configured limits
(a continuously refilling bucket per kind, shared through Postgres), what the
provider's ``anthropic-ratelimit-*`` headers last said, and what a claim
round's answer says about when claiming is worth trying again.

The bucket itself lives in the claim statement (sql/worker.sql, job_claim),
and a claim without a limit is the same statement given NO_LIMITS; this
module only turns settings and headers into its parameters, and its answer
into a wait.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog

from shared.config import BaseSettings
from shared.prompt import INPUT_TOKENS_ESTIMATE_MAX
from shared.provider_numbers import header_number

log = structlog.get_logger()

KINDS = ("requests", "input_tokens", "output_tokens")


# Requests claimed one after another reach the provider up to about this
# long out of order (the round's commit, the ledger row, the connection):
# the bucket holds this much less refill than the provider's, so that the
# provider's, drained in step with ours, still has it to cover two requests
# arriving closer together than they were claimed.
IN_FLIGHT_S = 0.25


class RateLimits(msgspec.Struct, frozen=True):
    """Per kind (requests, input tokens, output tokens): the refill rate per
    second and the capacity, or None where no limit is configured."""

    requests_rate: float | None
    requests_capacity: float | None
    input_tokens_rate: float | None
    input_tokens_capacity: float | None
    output_tokens_rate: float | None
    output_tokens_capacity: float | None
    # LLM_RATE_BURST_S: also how long a job the bucket does not cover lets
    # the jobs behind it pass before the bucket is kept for it
    burst_s: float = 5.0

    @classmethod
    def from_settings(cls, settings: BaseSettings) -> RateLimits:
        """A minute's limit refills continuously; the bucket holds at most
        LLM_RATE_BURST_S of refill (less IN_FLIGHT_S), since the provider enforces the limit over
        shorter intervals too (60 a minute may mean one a second), but never
        less than the largest single job the api accepts needs (up to the
        minute's limit: more is refused at admission, see over_limit), or
        that job could never start."""
        return cls.paced({"requests": settings.llm_requests_per_minute,
                          "input_tokens": settings.llm_input_tokens_per_minute,
                          "output_tokens": settings.llm_output_tokens_per_minute},
                         burst_s=settings.llm_rate_burst_s, max_tokens=settings.llm_max_tokens)

    @classmethod
    def paced(cls, per_minute_by_kind: Mapping[str, float | None], *, burst_s: float,
              max_tokens: int) -> RateLimits:
        """The bucket of each kind with a limit per minute: its rate, and a
        capacity of ``burst_s`` of refill less IN_FLIGHT_S, though never less
        than the largest single job needs (up to the minute's limit)."""
        largest_need = {"requests": 1, "input_tokens": INPUT_TOKENS_ESTIMATE_MAX, "output_tokens": max_tokens}
        values: dict[str, float | None] = {}
        for kind in KINDS:
            per_minute = per_minute_by_kind.get(kind)
            rate = None if per_minute is None else per_minute / 60.0
            values[f"{kind}_rate"] = rate
            values[f"{kind}_capacity"] = (
                None if per_minute is None or rate is None
                else max(rate * (burst_s - IN_FLIGHT_S), float(min(largest_need[kind], per_minute))))
        return cls(**values, burst_s=burst_s)

    def learned(self, view: ProviderView | None, *, max_tokens: int) -> RateLimits:
        """Without a configured limit, the limits the provider's headers
        announced (``anthropic-ratelimit-*-limit``) as the bucket's, held as
        configured ones are (LLM_RATE_BURST_S of refill, at least the largest
        job); with a configured limit, or nothing announced, these limits."""
        if self.limited or view is None:
            return self
        return self.announced(view.limits, max_tokens=max_tokens)

    def announced(self, per_minute_by_kind: Mapping[str, float | None], *, max_tokens: int) -> RateLimits:
        """These limits, or, where none is configured and some are given
        (per minute, by kind), those."""
        if self.limited or not any(per_minute_by_kind.get(kind) for kind in KINDS):
            return self
        return RateLimits.paced(per_minute_by_kind, burst_s=self.burst_s, max_tokens=max_tokens)

    @property
    def limited(self) -> bool:
        return any(self.rate(kind) is not None for kind in KINDS)

    def rate(self, kind: str) -> float | None:
        value: float | None = getattr(self, f"{kind}_rate")
        return value


def over_limit(settings: BaseSettings, *, input_tokens: int, output_tokens: int) -> str | None:
    """The configured limit a single job's call would exceed on its own (the
    variable's name), or None: the provider never serves such a call, so the
    api refuses it rather than let it wait in the queue for good."""
    if settings.llm_input_tokens_per_minute is not None and input_tokens > settings.llm_input_tokens_per_minute:
        return "LLM_INPUT_TOKENS_PER_MINUTE"
    if settings.llm_output_tokens_per_minute is not None and output_tokens > settings.llm_output_tokens_per_minute:
        return "LLM_OUTPUT_TOKENS_PER_MINUTE"
    return None


class ProviderView(msgspec.Struct, frozen=True):
    """What the provider's ``anthropic-ratelimit-*`` headers said, per kind:
    the limit per minute, how much was left, and when it is whole again.
    ``seen_at`` is this process's monotonic clock when the answer arrived,
    ``seen_wall`` the same moment in UTC."""

    seen_at: float
    seen_wall: datetime
    remaining: dict[str, float]
    limits: dict[str, float]
    resets: dict[str, datetime]

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], *, seen_at: float) -> ProviderView | None:
        remaining: dict[str, float] = {}
        limits: dict[str, float] = {}
        resets: dict[str, datetime] = {}
        for kind, header in _HEADER_KINDS.items():
            prefix = f"anthropic-ratelimit-{header}"
            # a value we cannot use says nothing (provider_numbers logs it)
            left = header_number(headers.get(f"{prefix}-remaining"), what=f"{prefix}-remaining")
            if left is not None:
                remaining[kind] = left
            limit = header_number(headers.get(f"{prefix}-limit"), what=f"{prefix}-limit")
            if limit is not None and limit >= 1:
                limits[kind] = limit
            if (reset := headers.get(f"{prefix}-reset")) is not None:
                try:
                    at = datetime.fromisoformat(reset.replace("Z", "+00:00"))
                except ValueError:
                    at = None
                if at is not None and at.tzinfo is not None:
                    resets[kind] = at
                else:
                    log.warning("llm.odd_value", what=f"{prefix}-reset", value=reset[:80])
        if not remaining:
            return None
        return cls(seen_at=seen_at, seen_wall=datetime.now(UTC), remaining=remaining, limits=limits,
                   resets=resets)

    def pause_s(self, *, output_tokens_need: int, now: float) -> float | None:
        """How long from ``now`` (this process's monotonic clock) claiming
        should pause, if the provider said too little is left for one more
        job: for each kind short of it, until enough has refilled at its
        limit's pace (a minute's limit refills continuously), or, with no
        limit given, until its reset; the longest of them. A duration, which
        the database adds to its own clock: a reset is read against the
        moment the answer arrived and bounded by the minute it resets within,
        so a host clock off by minutes cannot pause anyone for long."""
        needs = {"requests": 1.0, "input_tokens": 1.0, "output_tokens": float(output_tokens_need),
                 "tokens": float(output_tokens_need)}
        waits = []
        for kind, left in self.remaining.items():
            if left >= needs[kind]:
                continue
            if kind in self.limits:
                # both validated, so finite; at most the minute a limit refills in
                waits.append(min((needs[kind] - left) / (self.limits[kind] / 60.0), 60.0))
            elif kind in self.resets:
                # a minute's limit is whole again within the minute: a later reset is not believed
                waits.append(min(max((self.resets[kind] - self.seen_wall).total_seconds(), 0.0), 60.0))
        if not waits:
            return None
        return max(max(waits) - max(now - self.seen_at, 0.0), 0.0)


# our kind -> the provider's header name
_HEADER_KINDS = {"requests": "requests", "input_tokens": "input-tokens", "output_tokens": "output-tokens",
                 "tokens": "tokens"}


def claim_params(limits: RateLimits, view: ProviderView | None, *, default_max_tokens: int,
                 clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The limiter's parameters of a claim statement: the limits, and what the
    provider last said, refilled to now at the configured rates (only where a
    limit is configured: elsewhere its headers can only pause)."""
    params: dict[str, Any] = msgspec.structs.asdict(limits)
    params["limited"] = limits.limited
    params["default_max_tokens"] = default_max_tokens
    elapsed = 0.0 if view is None else max(clock() - view.seen_at, 0.0)
    for kind in KINDS:
        rate = limits.rate(kind)
        left = None if view is None else view.remaining.get(kind)
        params[f"provider_{kind}"] = None if rate is None or left is None else left + rate * elapsed
    params["provider_pause_s"] = None if view is None else view.pause_s(output_tokens_need=default_max_tokens,
                                                                        now=clock())
    return params


class LimiterState(msgspec.Struct, frozen=True):
    """The bucket after a claim round took from it (None: no limit of that
    kind), how long it stays paused, and the needs of the first pending job
    it did not cover (None: it held nothing back)."""

    paused_s: float = 0.0
    requests: float | None = None
    input_tokens: float | None = None
    output_tokens: float | None = None
    next_input_tokens: float | None = None
    next_output_tokens: float | None = None
    # the limits the bucket is paced by, per minute, as the round without a
    # limit read them (None: none known)
    requests_per_minute: float | None = None
    input_tokens_per_minute: float | None = None
    output_tokens_per_minute: float | None = None
    # whether this worker wakes for the bucket when it held jobs back, and
    # else in how long the worker that does is overdue (the round without a
    # limit answers neither: every worker wakes for itself)
    waker: bool = True
    waker_in_s: float = 0.0

    def announced(self) -> dict[str, float | None]:
        return {kind: getattr(self, f"{kind}_per_minute") for kind in KINDS}

    def wait_s(self, limits: RateLimits) -> float:
        """How long until the bucket can cover the job it held back (0: it
        held none back). A pause counts whole."""
        if self.next_output_tokens is None:
            return max(self.paused_s, 0.0)
        needs = {"requests": 1.0, "input_tokens": self.next_input_tokens or 0.0,
                 "output_tokens": self.next_output_tokens}
        waits = [self.paused_s]
        for kind, need in needs.items():
            rate, available = limits.rate(kind), getattr(self, kind)
            if rate and available is not None and available < need:
                waits.append((need - available) / rate)
        wait = max(waits)
        # held back, the round must not come straight back
        return max(wait, _LEAST_WAIT_S) if math.isfinite(wait) else _LEAST_WAIT_S

    def claim_again_in_s(self, limits: RateLimits) -> float:
        """When a worker whose claim was held back claims again: when the
        bucket covers the next job if it is the bucket's waker, else when the
        waker is overdue (one worker wakes, not all of them)."""
        wait = self.wait_s(limits)
        return wait if self.waker else max(wait, self.waker_in_s)


_LEAST_WAIT_S = 0.05


# no limit of any kind: the round's limits while none is configured nor learned
NO_LIMITS = RateLimits(None, None, None, None, None, None)
