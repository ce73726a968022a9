"""A pytest plugin for the mutation runs' coverage map: each test's id in
the environment (the query layer's trace and the processes the test starts
read it), coverage's context switched to it, and its duration and outcome
written down.

Loaded only by tests/mutants/coverage_map.py (``-p tests.mutants.trace_plugin``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator

import coverage
import pytest

_failed: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _failed.add(report.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    os.environ["STORYJOBS_TEST_ID"] = item.nodeid
    measuring = coverage.Coverage.current()
    if measuring is not None:
        measuring.switch_context(item.nodeid)
    started = time.monotonic()
    try:
        return (yield)
    finally:
        outcomes = os.environ.get("STORYJOBS_TEST_OUTCOMES")
        if outcomes:
            outcome = "failed" if item.nodeid in _failed else "passed"
            with open(outcomes, "a", encoding="utf-8") as out:
                out.write(f"{item.nodeid}\t{time.monotonic() - started:.3f}\t{outcome}\n")
        if measuring is not None:
            measuring.switch_context("")
        os.environ.pop("STORYJOBS_TEST_ID", None)
