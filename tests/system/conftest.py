"""Fixtures for system tests: real processes, the fake LLM provider."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer
from tests.support.outcome import failed_in_call
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


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's headless Chromium through Playwright, one per test module (each test opens its own context).
    Playwright's own browser download does not work here; Debian's chromium does (.ci/run installs it)."""
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: install Debian's chromium package (.ci/run does) to test the pages")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()
