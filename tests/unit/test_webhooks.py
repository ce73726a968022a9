"""Webhook signing, schedule and address rules (shared/webhooks.py), and the
sender (worker/delivery/send.py) against the test receiver on 127.0.0.1."""

from __future__ import annotations

import ipaddress
import ssl
import time
import uuid
from datetime import UTC, datetime

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from shared import webhooks
from tests.fakes.webhook_receiver import WebhookReceiver
from worker.delivery import send

JOB = uuid.UUID("0b6f3c9e-7f3a-4d3c-9c1e-5a7e2b1d9f00")


def _payload() -> bytes:
    return webhooks.body(job_public_id=JOB, status="failed", error_code="cancelled", story_id=None,
                         occurred_at=datetime(2026, 12, 1, tzinfo=UTC))


def test_standardwebhooks_verifies_what_we_sign() -> None:
    """The spec's own library accepts our headers for our body, and refuses them with another secret."""
    secret = webhooks.new_secret()
    headers = webhooks.headers([secret], "msg_1", int(time.time()), _payload())
    assert Webhook(secret).verify(_payload(), headers)["type"] == "job.cancelled"
    with pytest.raises(WebhookVerificationError):
        Webhook(webhooks.new_secret()).verify(_payload(), headers)


def test_two_secrets_give_two_signatures_each_of_which_verifies() -> None:
    """During a rotation the header holds both signatures, space-separated, and either secret verifies."""
    old, new = webhooks.new_secret(), webhooks.new_secret()
    headers = webhooks.headers([new, old], "msg_1", int(time.time()), _payload())
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (old, new):
        Webhook(secret).verify(_payload(), headers)


def test_the_body_says_the_event_and_links_but_not_the_story() -> None:
    """The body names the event, the job and the links to poll, and nothing more."""
    body = webhooks.body(job_public_id=JOB, status="completed", error_code=None, story_id=JOB,
                         occurred_at=datetime(2026, 12, 1, tzinfo=UTC))
    assert body == (b'{"type":"job.completed","timestamp":"2026-12-01T00:00:00Z","data":{"job_id":"' + str(JOB).encode()
                    + b'","status":"completed","error_code":null,"story_id":"' + str(JOB).encode()
                    + b'","links":{"job":"/stories/jobs/' + str(JOB).encode() + b'","story":"/stories/'
                    + str(JOB).encode() + b'"}}}')


def test_the_message_id_is_the_same_for_every_attempt_and_differs_per_event() -> None:
    """webhook-id depends only on the job and the event."""
    assert webhooks.message_id(JOB, "job.failed") == webhooks.message_id(JOB, "job.failed")
    assert webhooks.message_id(JOB, "job.failed") != webhooks.message_id(JOB, "job.cancelled")


def test_the_retry_schedule_is_the_specs_then_dead() -> None:
    """After attempts 1..7 the waits are 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h; after the 8th, none."""
    waits = [webhooks.retry_in_s(attempt, None, scale=1.0) for attempt in range(1, 9)]
    assert waits == [5, 300, 1800, 7200, 18000, 36000, 36000, None]
    assert webhooks.retry_in_s(2, None, scale=0.001) == pytest.approx(0.3)


def test_retry_after_replaces_the_schedule_up_to_its_longest_wait() -> None:
    """A receiver's Retry-After is the wait, capped at 10 h; a date or garbage falls back to the schedule."""
    assert webhooks.retry_in_s(1, 120.0, scale=1.0) == 120
    assert webhooks.retry_in_s(1, 10 ** 9, scale=1.0) == 36000
    assert webhooks.retry_in_s(8, 1.0, scale=1.0) is None
    assert [webhooks.parse_retry_after(v) for v in ("7", " 2.5 ", "Wed, 21 Oct 2026 07:28:00 GMT", "-1", None)] == [
        7.0, 2.5, None, None, None]
    # float() reads these too: a wait with no end is no wait a schedule can keep
    assert [webhooks.parse_retry_after(v) for v in ("inf", "Infinity", "nan")] == [None, None, None]
    # RFC 9110's delay-seconds include 0: try again at once, not after the schedule's wait
    assert webhooks.parse_retry_after("0") == 0.0
    assert webhooks.retry_in_s(1, webhooks.parse_retry_after("0"), scale=1.0) == 0.0


@pytest.mark.parametrize("url", [
    "http://example.com/hook", "ftp://example.com/", "https:///nohost", "https://user:pw@example.com/",
    "https://127.0.0.1/", "https://169.254.169.254/latest/meta-data/", "https://10.1.2.3/", "https://192.168.0.1/",
    "https://100.64.0.1/", "https://[::1]/", "https://[fe80::1]/", "https://[fd00::1]/",
    "https://[::ffff:127.0.0.1]/", "https://[2002:a9fe:a9fe::1]/", "https://0.0.0.0/", "https://224.0.0.1/",
    "https://example.com:0/", "https://example.com:65536/", "https://example.com/" + "x" * 2000,
])
def test_unsafe_urls_are_refused(url: str) -> None:
    """Not https, credentials, or an address literal that is not public: UnsafeUrl."""
    with pytest.raises(webhooks.UnsafeUrl):
        webhooks.check_url(url, allow_private=False)


@pytest.mark.parametrize("url", ["https://hooks.example.com/in", "https://8.8.8.8:8443/x",
                                 "https://[2606:4700:4700::1111]/", "https://hooks.example.com:1/",
                                 "https://hooks.example.com:65535/"])
def test_https_names_and_public_addresses_are_accepted(url: str) -> None:
    """A name (checked at delivery) or a public address literal passes."""
    webhooks.check_url(url, allow_private=False)


def test_allowing_private_addresses_lets_http_and_loopback_through() -> None:
    """WEBHOOK_ALLOW_PRIVATE: plain http and loopback pass; other schemes still do not."""
    webhooks.check_url("http://127.0.0.1:8080/hook", allow_private=True)
    webhooks.check_address(ipaddress.ip_address("169.254.169.254"), allow_private=True)
    with pytest.raises(webhooks.UnsafeUrl):
        webhooks.check_url("ftp://127.0.0.1/", allow_private=True)


async def test_a_name_resolving_to_loopback_is_refused_before_connecting() -> None:
    """localhost resolves to loopback: refused, and the receiver listening there sees nothing."""
    with WebhookReceiver() as receiver:
        with pytest.raises(webhooks.UnsafeUrl, match="localhost resolves to .* not a public address"):
            await send.post(f"https://localhost:{receiver.port}/hook", {}, b"{}", allow_private=False,
                            timeout_s=2, ssl_context=ssl.create_default_context())
        assert receiver.deliveries(None) == []


async def test_the_sender_connects_to_the_resolved_address_with_the_original_host_header() -> None:
    """A name is resolved once and the request goes to that address, naming the original host; no redirect is followed."""
    with WebhookReceiver() as receiver:
        receiver.secrets = [webhooks.new_secret()]
        receiver.answer("redirect")
        receiver.redirect_to = f"http://127.0.0.1:{receiver.port}/followed"
        headers = webhooks.headers(receiver.secrets, "msg_1", int(time.time()), _payload())
        answer = await send.post(f"http://localhost:{receiver.port}/hook", headers, _payload(), allow_private=True,
                                 timeout_s=5, ssl_context=ssl.create_default_context())
        assert answer.status_code == 302
        (received,) = receiver.deliveries(None)
    assert received.path == "/hook" and received.verified
    assert received.headers["host"] == f"localhost:{receiver.port}"


def test_the_retries_follow_the_documented_schedule_of_about_28_hours() -> None:
    """docs/webhooks.md: retries after 5 s, 5 min, 30 min, 2 h, 5 h, 10 h and 10 h, eight attempts over about
    28 hours; the waits never shorten, so a receiver that is down for long is not hammered at the end."""
    schedule = webhooks.RETRY_SCHEDULE_S
    assert all(later >= earlier for earlier, later in zip(schedule, schedule[1:], strict=False))
    assert webhooks.MAX_ATTEMPTS == 8
    assert 27 * 3600 < sum(schedule) < 29 * 3600
