"""Worker ids (worker/coordinator.py): one per start."""

from __future__ import annotations

from worker.coordinator import new_worker_id


def test_every_worker_start_has_a_new_id() -> None:
    """Two starts of a worker on the same host never share an id."""
    assert new_worker_id() != new_worker_id()
