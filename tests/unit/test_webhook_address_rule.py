"""The URL rule (shared/webhooks.py check_url, at registration and at each
delivery) and the address check (check_address, on every address a name
resolves to): every range that is not public, however it is written."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from shared import webhooks
from tests.fakes.webhook_receiver import WebhookReceiver
from worker.delivery import send

# one row per range: (what it is, an address in it)
NOT_PUBLIC = [
    ("this network", "0.1.2.3"),
    ("unspecified v4", "0.0.0.0"),
    ("private 10/8", "10.1.2.3"),
    ("private 172.16/12", "172.16.0.1"),
    ("private 192.168/16", "192.168.0.1"),
    ("shared 100.64/10", "100.64.0.1"),
    ("loopback v4", "127.0.0.1"),
    ("link-local v4, cloud metadata", "169.254.169.254"),
    ("IETF protocol assignments v4", "192.0.0.8"),
    ("documentation 192.0.2/24", "192.0.2.1"),
    ("documentation 198.51.100/24", "198.51.100.1"),
    ("documentation 203.0.113/24", "203.0.113.1"),
    ("6to4 relay anycast", "192.88.99.1"),
    ("benchmarking 198.18/15", "198.18.0.1"),
    ("multicast v4", "224.0.0.1"),
    ("reserved 240/4", "240.0.0.1"),
    ("broadcast", "255.255.255.255"),
    ("unspecified v6", "::"),
    ("loopback v6", "::1"),
    ("IPv4-compatible", "::a00:1"),
    ("IPv4-mapped loopback", "::ffff:127.0.0.1"),
    ("IPv4-mapped metadata", "::ffff:169.254.169.254"),
    ("IPv4-translated", "::ffff:0:a00:1"),
    ("NAT64 well-known 64:ff9b::/96", "64:ff9b::a9fe:a9fe"),
    ("NAT64 local-use 64:ff9b:1::/48", "64:ff9b:1::a9fe:a9fe"),
    ("discard 100::/64", "100::1"),
    ("unique local fc00::/7", "fd00::1"),
    ("link-local v6", "fe80::1"),
    ("site-local fec0::/10", "fec0::1"),
    ("multicast v6", "ff02::1"),
    ("Teredo", "2001:0:4136:e378:8000:63bf:3fff:fdd2"),
    ("benchmarking 2001:2::/48", "2001:2::1"),
    ("ORCHID 2001:10::/28", "2001:10::1"),
    ("documentation 2001:db8::/32", "2001:db8::1"),
    ("documentation 3fff::/20", "3fff::1"),
    ("6to4 embedding link-local", "2002:a9fe:a9fe::1"),
    ("6to4 embedding loopback", "2002:7f00:1::1"),
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2a00:1450:4001:80b::200e"]


def _url(address: str) -> str:
    return f"https://[{address}]/hook" if ":" in address else f"https://{address}/hook"


@pytest.mark.parametrize(("what", "address"), NOT_PUBLIC, ids=[what for what, _ in NOT_PUBLIC])
def test_every_non_public_range_is_refused_at_registration_and_at_delivery(what: str, address: str) -> None:
    """An address of the range is refused as a URL's host (registration) and as a resolved address (delivery)."""
    with pytest.raises(webhooks.UnsafeUrl, match="not a public address"):
        webhooks.check_url(_url(address), allow_private=False)
    with pytest.raises(webhooks.UnsafeUrl, match="not a public address"):
        webhooks.check_address(ipaddress.ip_address(address), allow_private=False)
    webhooks.check_address(ipaddress.ip_address(address), allow_private=True)


@pytest.mark.parametrize("address", PUBLIC)
def test_a_public_address_passes_both_checks(address: str) -> None:
    """A public address literal is accepted as a URL's host and as a resolved address."""
    assert webhooks.check_url(_url(address), allow_private=False).address == ipaddress.ip_address(address)
    webhooks.check_address(ipaddress.ip_address(address), allow_private=False)


# spellings the system resolver reads as a number: (host, the address it means)
NUMERIC = [
    ("2130706433", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("0x7f.0.0.1", "127.0.0.1"),
    ("0X7F.0.0.1", "127.0.0.1"),
    ("0x7f000001", "127.0.0.1"),
    ("127.1", "127.0.0.1"),
    ("127.0.1", "127.0.0.1"),
    ("0xa9.0xfe.0xa9.0xfe", "169.254.169.254"),
    ("169.16689662", "169.254.169.254"),
    ("2852039166", "169.254.169.254"),
    ("012.0.0.1", "10.0.0.1"),
    ("0", "0.0.0.0"),
]


@pytest.mark.parametrize(("host", "meant"), NUMERIC, ids=[host for host, _ in NUMERIC])
def test_a_numeric_spelling_is_the_address_the_resolver_reads(host: str, meant: str) -> None:
    """inet_aton reads the host as the address; so does the rule, which refuses it, with or without a trailing dot."""
    assert ipaddress.IPv4Address(socket.inet_aton(host)) == ipaddress.IPv4Address(meant)
    assert webhooks.numeric_host(host) == ipaddress.IPv4Address(meant)
    for spelled in (host, host + "."):
        with pytest.raises(webhooks.UnsafeUrl):
            webhooks.check_url(f"https://{spelled}/hook", allow_private=False)


@given(st.text(alphabet="0123456789abcdefxX.", max_size=24))
# the last part's bound at each count of parts, at it and one below, which
# random text rarely reaches
@example("4294967295")
@example("4294967296")
@example("0x100000000")
@example("1.16777215")
@example("1.16777216")
@example("1.0x1000000")
@example("1.2.65535")
@example("1.2.65536")
@example("1.2.3.255")
@example("1.2.3.256")
def test_numeric_hosts_are_read_exactly_as_inet_aton_reads_them(host: str) -> None:
    """For any string of digits, hex letters, x and dots, numeric_host and socket.inet_aton agree."""
    try:
        expected: ipaddress.IPv4Address | None = ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        expected = None
    assert webhooks.numeric_host(host) == expected


@pytest.mark.parametrize("url", [
    "https://0177.0.0.1/", "https://09.0.0.1/", "https://xn--/", "https://[::1/", "https://ex ample.com/",
    "https://exa%41mple.com/", "https://[fe80::1%25eth0]/", "https://a..b.example/", "https://./", "https://example.com:99999/",
    "https://\u00ad/", "//example.com/hook", "https://[v1.x]/",
])
def test_a_url_httpx_cannot_send_is_refused_not_raised(url: str) -> None:
    """Whatever httpx.URL raises for bad input, and hosts that are neither names nor addresses: UnsafeUrl, private allowed or not."""
    for allow_private in (False, True):
        with pytest.raises(webhooks.UnsafeUrl):
            webhooks.check_url(url, allow_private=allow_private)


@given(st.text(max_size=40))
def test_the_rule_only_ever_refuses_with_unsafe_url(rest: str) -> None:
    """Any text after https:// is accepted or refused with UnsafeUrl, never another exception."""
    with contextlib.suppress(webhooks.UnsafeUrl):
        webhooks.check_url("https://" + rest, allow_private=False)


def test_a_trailing_dot_is_the_same_host() -> None:
    """127.0.0.1. is loopback, and a name keeps its trailing dot for the resolver."""
    assert webhooks.check_url("http://127.0.0.1./", allow_private=True).address == ipaddress.IPv4Address("127.0.0.1")
    assert webhooks.check_url("https://example.com./hook", allow_private=False).address is None


async def test_the_sender_refuses_a_numeric_loopback_before_resolving_or_connecting() -> None:
    """127.0.0.1. and 2130706433 are refused as loopback by the sender itself; the receiver there sees nothing."""
    with WebhookReceiver() as receiver:
        for host in ("127.0.0.1.", "2130706433", "[::ffff:0:7f00:1]"):
            with pytest.raises(webhooks.UnsafeUrl, match="127.0.0.1 is not a public address|not a public"):
                await send.post(f"https://{host}:{receiver.port}/hook", {}, b"{}", allow_private=False,
                                timeout_s=2, ssl_context=ssl.create_default_context())
        assert receiver.deliveries(None) == []


async def test_with_private_addresses_allowed_a_numeric_host_is_delivered_to_its_address() -> None:
    """http://127.0.0.1.:port reaches the receiver on 127.0.0.1 without a name lookup, naming the host as written."""
    with WebhookReceiver() as receiver:
        answer = await send.post(f"http://127.0.0.1.:{receiver.port}/hook", {}, b"{}", allow_private=True,
                                 timeout_s=5, ssl_context=ssl.create_default_context())
        assert answer.status_code < 500
        (received,) = receiver.deliveries(None)
    assert received.headers["host"] == f"127.0.0.1.:{receiver.port}"
