"""Fixtures for system tests: real processes, the fake LLM provider."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer
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
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for proc in started.procs:
            # pytest shows a failed test's output: the processes' last log lines
            print(f"----- {proc.log_path.name} -----\n{proc.output()[-4000:]}")  # noqa: T201


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
