"""The offline provider's list of batches answers a cursor it does not know
as the provider's API does: a refusal (BatchRefused, which the lane handles
as a provider error), whichever way the page goes."""

from __future__ import annotations

import pytest

from worker.batch.offline_batches import OfflineBatches
from worker.batch.provider import BatchRefused


@pytest.mark.parametrize("way", ["after_id", "before_id"])
async def test_paging_from_a_batch_it_does_not_know_is_refused(way: str) -> None:
    """Listing from a batch id that names no batch of the provider is refused, not read as an empty page or
    raised as another error."""
    batches = OfflineBatches(delay_s=0)
    with pytest.raises(BatchRefused, match="no batch msgbatch_unknown"):
        if way == "after_id":
            await batches.list_page(after_id="msgbatch_unknown")
        else:
            await batches.list_page(before_id="msgbatch_unknown")
