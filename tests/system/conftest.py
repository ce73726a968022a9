"""Fixtures for system tests: real processes, the fake LLM provider."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer
from tests.helpers import failed_in_call
from tests.system.procs import System


@pytest.fixture
def fake_llm() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer(FakeAnthropic()) as server:
        yield server


@pytest.fixture
def system(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[System]:
    """Processes started by the test; all stopped at its end. Their logs stay
    in the test's tmp_path (printed when the test fails)."""
    started = System(database_url, tmp_path)
    yield started
    started.stop_all()
    if failed_in_call(request):
        for proc in started.procs:
            # pytest shows a failed test's output: the processes' last log lines
            print(f"----- {proc.log_path.name} -----\n{proc.output()[-4000:]}")  # noqa: T201
