"""A batch's times as the provider describes them (worker.batch.anthropic_reading
batch_info): a creation time left out is read from the expiry, a day
earlier, so that the reconciler compares it with an intent's fence as it
was, not as the moment it was read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from worker.batch.anthropic_reading import batch_info
from worker.batch.provider_structs import BATCH_LIFETIME


def test_a_batch_without_its_creation_time_was_made_a_lifetime_before_its_expiry() -> None:
    """A batch that expires in 20 hours and does not say when it was made was made 4 hours ago."""
    now = datetime.now(UTC)
    expires = now + timedelta(hours=20)
    info = batch_info({"id": "msgbatch_1", "processing_status": "in_progress", "expires_at": expires.isoformat()},
                      now)
    assert info is not None
    assert (info.created_at, info.expires_at) == (expires - BATCH_LIFETIME, expires)
