"""What a receiver's answer and a URL without a port mean to a webhook's
attempt (worker.delivery.loop, worker.delivery.send): every 2xx is
delivered, 200 as much as 204; a name is resolved for its scheme's port."""

from __future__ import annotations

import ssl

import pytest

from shared.webhooks import Address, UnsafeUrl
from tests.fakes.recording_delivery_store import Finished
from tests.support.deliveries import deliver_one
from worker.delivery import send


async def test_a_300_answer_is_no_delivery() -> None:
    """300 Multiple Choices is not a 2xx: the attempt is retried, never recorded as delivered."""
    store, delivery_id, receiver = await deliver_one(lease=3, answer="multiple_choices")
    assert len(receiver.deliveries(status=300)) == 1
    assert [(f.delivery_id, f.outcome, f.status_code) for f in store.finished] == [(delivery_id, "retry", 300)]


async def test_a_200_answer_is_delivered() -> None:
    """A receiver answering 200 OK (the most common answer) has its event recorded as delivered, once."""
    store, delivery_id, receiver = await deliver_one(lease=3, answer="ok_200")
    assert len(receiver.deliveries(status=200)) == 1
    assert store.finished == [Finished(delivery_id, 3, "delivered", 200, None)]


@pytest.mark.parametrize(("url", "port"), [("http://hooks.example/hook", 80), ("https://hooks.example/hook", 443)])
async def test_a_url_without_a_port_is_resolved_for_its_schemes_port(url: str, port: int) -> None:
    """http (allowed where private addresses are) is resolved, and so connected, on port 80; https on 443."""
    asked: list[tuple[str, int]] = []

    async def nowhere(host: str, asked_port: int) -> list[Address]:
        asked.append((host, asked_port))
        return []

    with pytest.raises(UnsafeUrl, match="resolves to no address"):
        await send.post(url, {}, b"{}", allow_private=True, timeout_s=5.0, ssl_context=ssl.create_default_context(),
                        resolver=nowhere)
    assert asked == [("hooks.example", port)]
