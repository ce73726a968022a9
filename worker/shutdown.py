"""The worker's shutdown, once SIGTERM asked for it: no more claims, held
jobs finish within WORKER_SHUTDOWN_GRACE_S, then their streams are stopped
and they fail as ``interrupted``; SHUTDOWN_FLUSH_S later, what could still
not be recorded is left to the sweeper. The round (worker/coordinator.py)
asks this object what is due, and alone acts on it.
"""

from __future__ import annotations

import structlog

from worker.held import SHUTDOWN, HeldJobs

log = structlog.get_logger()

# after the grace period, how long shutdown still tries to record the
# interrupted jobs before it gives up and leaves them to the sweeper
SHUTDOWN_FLUSH_S = 10.0


class Shutdown:
    """Asked by SIGTERM: no more claims, held jobs finish within the grace."""

    __slots__ = ("give_up_at", "grace_ends_at", "streams_stopped")

    def __init__(self, now: float, grace_s: float) -> None:
        self.grace_ends_at = now + grace_s
        self.give_up_at = now + grace_s + SHUTDOWN_FLUSH_S
        self.streams_stopped = False

    def due(self, now: float, held: HeldJobs) -> bool:
        """Stops every held stream once the grace is over; True once the
        shutdown gives up on what it could not record."""
        if now >= self.grace_ends_at and not self.streams_stopped:
            self.streams_stopped = True
            held.stop_all(SHUTDOWN)
        if now < self.give_up_at:
            return False
        log.error("worker.shutdown_abandoned", job_ids=[h.public_id for h in held],
                  detail="could not record these jobs; the sweeper will fail them")
        return True

    def deadlines(self) -> list[float]:
        """When the round must look again without a report."""
        return [self.give_up_at] if self.streams_stopped else [self.give_up_at, self.grace_ends_at]
