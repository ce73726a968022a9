"""The sender (worker/delivery/send.py) with a name of several addresses: each
checked address in the resolver's order until one accepts the connection,
sent once; none accepting is the connection's error. Real connections on
loopback; the resolver is the test's, so that one name has two addresses."""

from __future__ import annotations

import ipaddress
import ssl

import httpx
import pytest

from shared.webhooks import Address
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.host import free_port
from worker.delivery import send

# nothing listens on 127.0.0.2 (the receiver binds 127.0.0.1 only): it refuses the connection
REFUSING, LISTENING = ipaddress.ip_address("127.0.0.2"), ipaddress.ip_address("127.0.0.1")


async def _two_addresses(host: str, port: int) -> list[Address]:
    return [REFUSING, LISTENING]


async def test_a_name_whose_first_address_refuses_is_delivered_to_the_next_once() -> None:
    """The second address answers after the first refused the connection: one request, its answer returned."""
    with WebhookReceiver() as receiver:
        answer = await send.post(f"http://hooks.example:{receiver.port}/hook", {}, b"{}", allow_private=True,
                                 timeout_s=5.0, ssl_context=ssl.create_default_context(), resolver=_two_addresses)
        assert len(receiver.deliveries(status=None)) == 1
    assert answer.status_code == receiver.deliveries(status=None)[0].status


async def test_a_name_whose_every_address_refuses_raises_the_connection_error() -> None:
    """No address accepts: the last refusal is raised, for the attempt to be recorded as failed."""
    with pytest.raises(httpx.ConnectError):
        await send.post(f"http://hooks.example:{free_port()}/hook", {}, b"{}", allow_private=True, timeout_s=5.0,
                        ssl_context=ssl.create_default_context(), resolver=_two_addresses)
