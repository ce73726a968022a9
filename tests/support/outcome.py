"""Whether a fixture's test failed, so that the fixture shows what it saw."""

from __future__ import annotations

from typing import Any


def failed_in_call(request: Any) -> bool:
    """Whether the test of a fixture's ``request`` failed (set by the hook in tests/conftest.py)."""
    report = getattr(request.node, "rep_call", None)
    return report is not None and bool(report.failed)
