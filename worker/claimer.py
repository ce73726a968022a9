"""Claiming, for the round: when the next claim is due and how many jobs it
takes, the claim sent with the round's written stories (one transaction),
the rate limits and what the shared limiter answered, and the search for the
jobs of a claim whose answer was lost (adoption).

The round owns the Claimer and is the only caller of its methods; the
limits it holds (configured, or learned from the provider's headers when
none is configured) are the one value every statement that needs them is
given, the job tasks' retries included (read only).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from psycopg_pool import PoolTimeout

from shared import db
from shared.config import WorkerSettings
from shared.ratelimit import KINDS, LimiterState, ProviderView, RateLimits
from worker import metrics
from worker.ends import Counts, EndWriter
from worker.held import HeldJob
from worker.rows import ClaimedJob, ClaimResult
from worker.store import ClaimAsk, WorkerStore

log = structlog.get_logger()

# a claim statement whose answer was lost can still commit on the server
# until its statement timeout; adoption looks for its jobs until then
STATEMENT_TIMEOUT_S = 30.0
_ADOPTION_MARGIN_S = 5.0
# while a lost claim may still commit, how often an idle round looks again
_ADOPTION_RECHECK_S = 1.0


@dataclass
class Claiming:
    """What the round knows about claiming."""

    # a NOTIFY or the fallback poll said there may be pending jobs; a claim
    # that got fewer than it asked for says there are none
    work_may_wait: bool
    # when the next claim is due even without a NOTIFY: pushed back only by
    # a claim, so a busy coordinator that only settles still polls
    poll_due_at: float
    # claim statements that failed without an answer since adoption last
    # settled the question, and until when one of them may still commit
    lost_answers: int = 0
    adopt_until: float = float("-inf")
    adopt_next_at: float = float("-inf")
    # the shared rate limiter held jobs back (or is paused): no claim before
    not_before: float = float("-inf")


class Claimer:
    def __init__(
        self,
        settings: WorkerSettings,
        store: WorkerStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        statement_timeout_s: float = STATEMENT_TIMEOUT_S,
    ) -> None:
        self._settings = settings
        self._store = store
        self._clock = clock
        self._statement_timeout_s = statement_timeout_s
        self._configured = RateLimits.from_settings(settings)
        self.limits = self._configured
        # what the provider's headers last said, and the last one a claim told the shared bucket
        self._heard: ProviderView | None = None
        self._told: ProviderView | None = None
        self.state = Claiming(work_may_wait=True, poll_due_at=clock() + settings.worker_poll_interval_s)

    # -- what the round learned --------------------------------------------------------

    def notified(self) -> None:
        self.state.work_may_wait = True

    def heard(self, view: ProviderView) -> None:
        """An answer's rate limit headers: told to the shared bucket at the
        next claim; with no limit configured, the limits they announce pace
        the claims and the retries from now on."""
        self._heard = view
        if any(kind in view.limits for kind in KINDS):
            self.limits = self._configured.learned(view, max_tokens=self._settings.llm_max_tokens)

    @property
    def has_news(self) -> bool:
        """The provider's headers said something the shared bucket has not been told."""
        return self._heard is not None and self._heard is not self._told

    # -- when, and how many ------------------------------------------------------------

    def limit(self, free_slots: int, *, stopping: bool) -> int:
        """How many jobs the next claim takes: none while stopping, while no
        work may be waiting, or while the rate limiter holds jobs back; else
        the free slots. The fallback poll, once due, says work may wait."""
        now = self._clock()
        if now >= self.state.poll_due_at:
            self.state.work_may_wait = True
        if stopping or not self.state.work_may_wait or now < self.state.not_before:
            return 0
        return free_slots

    def adopting(self, now: float) -> bool:
        return self.state.lost_answers > 0 and now >= self.state.adopt_next_at

    def deadlines(self, *, claiming: bool) -> list[float]:
        """When the round must look again for claiming's sake: the next claim
        (``claiming``: a slot is free and the worker is not stopping), the
        next search for a lost claim's jobs."""
        state = self.state
        found = []
        if claiming:
            # a claim the limiter held back is due when the bucket covers the
            # next job, not at the next poll: the work is known to wait
            found.append(state.not_before if state.work_may_wait else max(state.poll_due_at, state.not_before))
        if state.lost_answers:
            found.append(state.adopt_next_at)
        return found

    def may_exit(self, now: float, grace_ends_at: float) -> bool:
        """Holding nothing, a stopping worker still looks for the jobs of a
        lost claim answer, within its grace: past it, a late commit is left
        to the sweeper, said once."""
        if not self.state.lost_answers:
            return True
        if now < grace_ends_at:
            return False
        log.warning("worker.lost_claim_unsettled", detail="a claim whose answer was lost may still commit; "
                    "its jobs, never begun, are left to the sweeper")
        return True

    # -- the statements ----------------------------------------------------------------

    async def settle_and_claim(self, ends: EndWriter, completions: list[HeldJob], claim_limit: int,
                               counts: Counts) -> list[ClaimedJob]:
        """The round's written stories and its claim, one transaction (with
        news of the provider's headers, a claim of none tells the shared
        bucket): the stories' ends taken by ``ends``, the claimed jobs
        answered. Raises a database error after the bookkeeping of what it
        means: for the stories, and for a claim that may have committed
        unanswered."""
        ask = self.ask(claim_limit) if claim_limit or self.has_news else None
        try:
            written = await self._store.settle_and_claim(ends.stories(completions), ask, self.limits)
        except db.DB_ERRORS as exc:
            if ask is not None:
                self.unanswered(ask, exc)
            if not completions:
                raise
            # raises again unless the one story written alone was refused for
            # good: it is then rewritten as a failure the next round
            ends.settle_refused(exc, completions, counts)
            return []
        if written.settled is not None:
            ends.settled(completions, written.settled, counts)
        if written.claim_refused is not None:
            raise written.claim_refused
        if ask is None or written.claimed is None:
            return []
        return self.answered(ask, written.claimed)

    def ask(self, claim_limit: int) -> ClaimAsk:
        """The round's claim: claim_limit jobs (none: it only tells the
        shared bucket what the provider said), with the provider's headers if
        they are news."""
        return ClaimAsk(claim_limit, self._heard if self.has_news else None)

    def answered(self, ask: ClaimAsk, answer: ClaimResult) -> list[ClaimedJob]:
        """The claim's answer: its jobs, and what the shared limiter said."""
        now = self._clock()
        if ask.limit:
            self.state.poll_due_at = now + self._settings.worker_poll_interval_s
        for job in answer.claimed:
            metrics.CLAIMED.inc()
            metrics.JOB_QUEUE_WAIT.observe(max((job.started_at - job.created_at).total_seconds(), 0.0))
        if answer.claimed:
            metrics.WORKER_LAST_CLAIM.set_to_current_time()
        if ask.view is not None:
            self._told = ask.view
        self._limited(answer.limiter, ask.limit, len(answer.claimed))
        return answer.claimed

    def unanswered(self, ask: ClaimAsk, exc: Exception) -> None:
        """The claim's transaction failed without a known outcome: a claim
        without an answer may have committed, and its jobs are searched for
        (``adopt``). (A claim the server refused committed nothing, and its
        stories were then settled alone: the round does not call this.)"""
        if ask.limit and db.is_transient(exc) and not isinstance(exc, PoolTimeout):
            # no answer, or not one the server sent: it may have committed,
            # and its jobs are ours, never begun. A backend the server
            # ended (57P: a terminated session, a shutdown) runs nothing
            # more, so one search settles it; otherwise the statement may
            # still be running there, until its statement timeout
            self.state.lost_answers += 1
            later = 0.0 if _server_ended(exc) else self._statement_timeout_s + _ADOPTION_MARGIN_S
            self.state.adopt_until = max(self.state.adopt_until, self._clock() + later)

    async def adopt(self, known_ids: Sequence[int], now: float) -> list[ClaimedJob]:
        """A claim whose answer was lost (connection dropped around its
        commit) may have left jobs running under our id that never reached
        us. No call was begun for them, and a job this process began is
        still held (``known_ids``, skipped here): they are ours to run now.
        A statement still running on the server can commit later, so the
        search goes on until its statement timeout has passed, or until the
        one lost claim is found to have committed."""
        found = await self._store.claims_of_lost_answer(known_ids)
        for job in found:
            log.warning("job.adopted", job_id=str(job.public_id), detail="claimed by a statement whose answer was lost")
        if (found and self.state.lost_answers == 1) or now >= self.state.adopt_until:
            self.state.lost_answers = 0
        self.state.adopt_next_at = now + _ADOPTION_RECHECK_S
        return found

    def _limited(self, limiter: LimiterState, claim_limit: int, claimed: int) -> None:
        """What the shared rate limiter said: its gauges, the limits it
        announced, and when a claim is worth trying again if it held jobs back."""
        for kind in KINDS:
            available = getattr(limiter, kind)
            if available is not None:
                metrics.LLM_RATELIMIT_AVAILABLE.labels(kind=kind).set(available)
        if not self.limits.limited:
            # what other workers learned, before this one heard any header
            self.limits = self._configured.announced(limiter.announced(), max_tokens=self._settings.llm_max_tokens)
        held_back = claim_limit > 0 and (limiter.paused_s > 0 or limiter.next_output_tokens is not None)
        if held_back:
            metrics.LLM_RATELIMIT_WAITS.inc()
            self.state.not_before = self._clock() + limiter.claim_again_in_s(self.limits)
        elif claimed < claim_limit:
            self.state.work_may_wait = False


def _server_ended(exc: Exception) -> bool:
    """The server ended the session the statement ran in (57P01 admin
    shutdown, 57P02 crash shutdown): its backend is gone, with whatever it
    was running."""
    return getattr(exc, "sqlstate", None) in ("57P01", "57P02")
