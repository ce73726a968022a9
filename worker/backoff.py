"""The worker's one backoff policy for a database that errs: every loop of
the process (the round, the heartbeat's retries of a ledger row, the
listener, the deliverer) waits the same way, doubling from FIRST_S to MAX_S,
back to the start once the database answers."""

from __future__ import annotations

FIRST_S = 0.5
MAX_S = 5.0


class Backoff:
    __slots__ = ("_next_s",)

    def __init__(self) -> None:
        self._next_s = FIRST_S

    def next_s(self) -> float:
        """How long to wait now; the next wait is twice as long, up to MAX_S."""
        wait_s = self._next_s
        self._next_s = min(wait_s * 2, MAX_S)
        return wait_s

    def reset(self) -> None:
        self._next_s = FIRST_S
