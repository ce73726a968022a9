"""What the shared rate bucket holds, as each claim round heard it, on the
worker's /metrics (storyjobs_llm_ratelimit_available, by kind, set by
worker.claimer after each claim), on a recording store: the gauge an
operator watches to see the bucket run dry before the claims stop."""

from __future__ import annotations

from prometheus_client import REGISTRY

from shared.config import WorkerSettings
from shared.ratelimit import LimiterState
from tests.fakes.recording_worker_store import RecordingStore
from worker.coordinator import Coordinator
from worker.offline import OfflineWriter


def _available(kind: str) -> float | None:
    return REGISTRY.get_sample_value("storyjobs_llm_ratelimit_available", {"kind": kind})


async def test_each_limited_kind_shows_what_the_bucket_held_after_the_last_claim() -> None:
    """Each kind the bucket limits is set to what it held after the round's claim, and follows the next
    round's answer."""
    store, now = RecordingStore(), [1000.0]
    settings = WorkerSettings(worker_concurrency=2, metrics_port=0, llm_requests_per_minute=50)
    worker = Coordinator(settings, store, OfflineWriter(0), listen=False, clock=lambda: now[0])
    store.limiter = LimiterState(requests=7.5, input_tokens=12_000.0, output_tokens=3_000.0)
    await worker.round_once()
    assert (_available("requests"), _available("input_tokens"), _available("output_tokens")) == (
        7.5, 12_000.0, 3_000.0)
    store.limiter = LimiterState(requests=2.0, input_tokens=9_000.0, output_tokens=1_500.0)
    now[0] += settings.worker_poll_interval_s  # an idle worker claims again after its poll interval
    await worker.round_once()
    assert (_available("requests"), _available("input_tokens"), _available("output_tokens")) == (
        2.0, 9_000.0, 1_500.0)


async def test_a_claim_the_bucket_held_nothing_back_from_is_no_wait() -> None:
    """storyjobs_llm_ratelimit_waits_total counts the claims the bucket held back; a round whose bucket
    was neither paused nor short of the next job's needs adds nothing to it."""
    def waits() -> float:
        return REGISTRY.get_sample_value("storyjobs_llm_ratelimit_waits_total") or 0.0

    store, now = RecordingStore(), [1000.0]
    settings = WorkerSettings(worker_concurrency=2, metrics_port=0, llm_requests_per_minute=50)
    worker = Coordinator(settings, store, OfflineWriter(0), listen=False, clock=lambda: now[0])
    store.limiter = LimiterState(requests=7.5)
    before = waits()
    await worker.round_once()
    assert waits() == before
    store.limiter = LimiterState(requests=0.2, next_input_tokens=100, next_output_tokens=800)
    now[0] += settings.worker_poll_interval_s
    await worker.round_once()
    assert waits() == before + 1
