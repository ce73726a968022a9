"""What the batch provider tests share: a settable clock, the fake provider
serving the batch endpoints on that clock and the batch client of it (the
fixtures ``clock``, ``server``, ``provider`` and ``fake``, a plugin of
tests/conftest.py), batch requests made from story
requests, and reading a results stream to the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import pytest

from shared.story_request import StoryRequest
from tests.fakes.anthropic_batches import FakeBatches
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.provider_structs import BatchRequest

T = TypeVar("T")


class SettableClock:
    """A UTC clock that moves only when the test moves it (read from the
    fake provider's thread too: one attribute, replaced whole)."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime.now(UTC).replace(microsecond=0)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now = self.now + timedelta(seconds=seconds)


def batch_requests(count: int, *, prefix: str = "job", model: str = "claude-test",
                   max_tokens: int = 300) -> list[BatchRequest]:
    """``count`` requests, custom_ids ``{prefix}-0``..., each about its own story."""
    return [BatchRequest(custom_id=f"{prefix}-{i}",
                         request=StoryRequest(prompt=f"a lantern numbered {i} for {prefix}", length="short"),
                         model=model, max_tokens=max_tokens)
            for i in range(count)]


async def collect(iterator: AsyncIterator[T]) -> list[T]:
    return [item async for item in iterator]


@pytest.fixture
def clock() -> SettableClock:
    """The fake provider's clock, and the batch client's."""
    return SettableClock()


@pytest.fixture
def server(clock: SettableClock) -> Iterator[FakeAnthropicServer]:
    """The fake Anthropic server, its batches on ``clock``."""
    with FakeAnthropicServer(FakeAnthropic(batches=FakeBatches(clock=clock))) as started:
        yield started


@pytest.fixture
async def provider(server: FakeAnthropicServer, clock: SettableClock) -> AsyncIterator[AnthropicBatches]:
    """The batch client (worker.batch.anthropic_batches) of the fake server, on ``clock``."""
    batches = AnthropicBatches(api_key="test", base_url=server.base_url, timeout_s=5.0, create_timeout_s=3.0,
                               clock=clock)
    yield batches
    await batches.aclose()


@pytest.fixture
def fake(server: FakeAnthropicServer) -> FakeBatches:
    """The fake provider's batches: its faults to set and its record of what it billed."""
    return server.fake.batches
