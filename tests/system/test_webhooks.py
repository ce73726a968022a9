"""Webhooks through the real processes: the api registers endpoints, workers
deliver to a receiver that checks every signature with the standardwebhooks
package, and nothing is lost when the receiver is down or a worker is killed."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest
from standardwebhooks.webhooks import Webhook

from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.database import create_key_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import ApiProc, System

pytestmark = pytest.mark.system

# fast and permissive: the receiver listens on 127.0.0.1
WORKER: dict[str, Any] = {"OFFLINE_DELAY_S": 0, "WORKER_CONCURRENCY": 4, "WEBHOOK_ALLOW_PRIVATE": "true",
          "WEBHOOK_POLL_INTERVAL_S": 0.1, "WEBHOOK_CONCURRENCY": 4}


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as started:
        yield started


def _client(api: ApiProc, key: str) -> httpx.Client:
    return httpx.Client(base_url=api.base_url, timeout=10, headers={"Authorization": f"Bearer {key}"})


def _register(client: httpx.Client, receiver: WebhookReceiver, url: str | None = None) -> dict[str, Any]:
    answer = client.post("/webhook-endpoints", json={"url": url or receiver.url})
    assert answer.status_code == 201, answer.text
    endpoint: dict[str, Any] = answer.json()
    receiver.secrets.append(endpoint["secret"])
    return endpoint


def _enqueue(client: httpx.Client, n: int) -> list[str]:
    job_ids = []
    for i in range(n):
        answer = client.post("/stories/generate", json={"prompt": f"story number {i}"},
                             headers={"Idempotency-Key": str(uuid.uuid4())})
        assert answer.status_code == 202, answer.text
        job_ids.append(answer.json()["job_id"])
    return job_ids


def _wait(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    wait_until_sync(check, timeout=timeout, what=what, interval=0.05)


def _scalar(database_url: str, query: str) -> Any:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def _assert_each_job_delivered_once(receiver: WebhookReceiver, job_ids: list[str], event: str) -> None:
    delivered = receiver.deliveries()
    assert all(r.verified for r in receiver.deliveries(None)), "a delivery failed standardwebhooks' verification"
    by_job: dict[str, set[str]] = {}
    for r in delivered:
        assert r.body["type"] == event
        by_job.setdefault(r.body["data"]["job_id"], set()).add(r.msg_id)
    assert sorted(by_job) == sorted(job_ids)
    # duplicates only ever with the same webhook-id
    assert all(len(ids) == 1 for ids in by_job.values()), by_job


def test_fifty_jobs_each_deliver_one_verified_event(system: System, database_url: str,
                                                     receiver: WebhookReceiver) -> None:
    """50 jobs of a client with an endpoint: one verified job.completed per job, one webhook-id each, no prompt."""
    key = create_key_sync(database_url, "hooked")
    api = system.api(QUEUE_MAX=100, WEBHOOK_ALLOW_PRIVATE="true")
    system.worker(**WORKER)
    with _client(api, key) as client:
        _register(client, receiver)
        job_ids = _enqueue(client, 50)
    _wait(lambda: len(receiver.delivered_ids()) >= 50, "50 deliveries")
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM webhook_deliveries WHERE state = 'delivered'") == 50,
          "the deliveries recorded")
    _assert_each_job_delivered_once(receiver, job_ids, "job.completed")
    first = receiver.deliveries()[0]
    assert first.body["data"]["links"]["job"] == f"/stories/jobs/{first.body['data']['job_id']}"
    assert first.body["data"]["story_id"] and "prompt" not in str(first.body) and len(str(first.body)) < 20_000


def test_a_receiver_down_for_a_while_gets_everything_when_it_is_back(
        system: System, database_url: str, receiver: WebhookReceiver) -> None:
    """Deliveries refused while the receiver is down are retried on the (shortened) schedule and all arrive."""
    key = create_key_sync(database_url, "hooked")
    api = system.api(QUEUE_MAX=100, WEBHOOK_ALLOW_PRIVATE="true")
    # the schedule at 1/2000: 2.5 ms, 0.15 s, 0.9 s, 3.6 s, 9 s, ...
    system.worker(WEBHOOK_RETRY_SCALE=0.0005, **WORKER)
    with _client(api, key) as client:
        _register(client, receiver)
        receiver.stop()
        job_ids = _enqueue(client, 10)
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM webhook_deliveries WHERE attempts >= 3") == 10,
          "three refused attempts of each delivery")
    assert _scalar(database_url, "SELECT count(*) FROM webhook_deliveries WHERE state <> 'pending'") == 0
    receiver.start()
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM webhook_deliveries WHERE state = 'delivered'") == 10,
          "every delivery once the receiver is back")
    _assert_each_job_delivered_once(receiver, job_ids, "job.completed")


def test_a_worker_killed_during_deliveries_loses_none(system: System, database_url: str,
                                                       receiver: WebhookReceiver) -> None:
    """SIGKILL while the receiver holds its requests: another worker sends them all after their leases."""
    key = create_key_sync(database_url, "hooked")
    api = system.api(QUEUE_MAX=100, WEBHOOK_ALLOW_PRIVATE="true")
    # A timeout longer than the jobs take to complete, so the four held
    # deliveries are still in flight at the kill (a shorter one times them out
    # and pushes their retries minutes away); their lease is that + 5 s.
    settings = {**WORKER, "WEBHOOK_TIMEOUT_S": 10}
    worker = system.worker(**settings)
    receiver.answer("hang")
    with _client(api, key) as client:
        _register(client, receiver)
        job_ids = _enqueue(client, 12)
    # every job ended (no sweeper runs here to end one the kill would leave running)
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM story_jobs WHERE status = 'completed'") == 12,
          "the jobs completed")
    _wait(lambda: receiver.hanging >= 4, "four deliveries in flight")
    worker.kill()
    # checked before the held requests are let go: the receiver then answers them 204, to no one
    assert receiver.deliveries() == []
    receiver.answer("ok")
    system.worker(**settings)
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM webhook_deliveries WHERE state = 'delivered'") == 12,
          "every delivery, the leased ones after their lease")
    _assert_each_job_delivered_once(receiver, job_ids, "job.completed")


def test_a_410_disables_the_endpoint(system: System, database_url: str, receiver: WebhookReceiver) -> None:
    """A 410 disables the endpoint (the client sees disabled_at) and nothing more is sent to it."""
    key = create_key_sync(database_url, "hooked")
    api = system.api(QUEUE_MAX=100, WEBHOOK_ALLOW_PRIVATE="true")
    system.worker(**WORKER)
    receiver.answer("gone")
    with _client(api, key) as client:
        _register(client, receiver)
        _enqueue(client, 1)
        _wait(lambda: client.get("/webhook-endpoints").json()["endpoints"][0]["disabled_at"] is not None,
              "the endpoint disabled")
        _enqueue(client, 3)
        _wait(lambda: _scalar(database_url, "SELECT count(*) FROM story_jobs WHERE status = 'completed'") == 4,
              "the later jobs completed")
    assert len(receiver.deliveries(None)) == 1
    assert _scalar(database_url, "SELECT count(*) FROM webhook_deliveries") == 1


def test_retry_after_is_honoured(system: System, database_url: str, receiver: WebhookReceiver) -> None:
    """A 503 with Retry-After: 1 is tried again after about a second, not after the schedule's 5 s."""
    key = create_key_sync(database_url, "hooked")
    api = system.api(QUEUE_MAX=100, WEBHOOK_ALLOW_PRIVATE="true")
    system.worker(**WORKER)
    receiver.answer("retry_after")
    receiver.retry_after = "1"
    with _client(api, key) as client:
        _register(client, receiver)
        _enqueue(client, 1)
    # The receiver sees the 503 before the worker records it, and while an
    # attempt is in flight its row holds the attempt's lease (20 s): read the
    # wait only from a row whose answer is recorded and not leased again.
    # It runs from the attempt's claim, so it includes the send; the
    # schedule would have made it 5 s and more.
    # The value is kept from the read that saw it: a second read could find
    # the retry leased already.
    recorded_wait = ("SELECT coalesce(max(extract(epoch FROM next_attempt_at - last_attempt_at)), 0)::float8 "
                     "FROM webhook_deliveries WHERE last_status_code = 503 "
                     "AND next_attempt_at - last_attempt_at < interval '10 s'")
    waits: list[float] = []

    def recorded() -> bool:
        waits.append(_scalar(database_url, recorded_wait))
        return waits[-1] > 0

    _wait(recorded, "the first attempt recorded")
    assert 0.9 <= waits[-1] < 4.0, waits[-1]
    receiver.answer("ok")
    _wait(lambda: len(receiver.deliveries()) == 1, "the retry", timeout=10)


def test_another_clients_endpoint_is_invisible(system: System, database_url: str, receiver: WebhookReceiver) -> None:
    """Another client's endpoint is not listed and is the same 404 as an unknown id to delete or rotate."""
    owner, other = create_key_sync(database_url, "owner"), create_key_sync(database_url, "other")
    api = system.api(WEBHOOK_ALLOW_PRIVATE="true")
    with _client(api, owner) as owner_client, _client(api, other) as other_client:
        endpoint = _register(owner_client, receiver)
        assert "secret" not in str(owner_client.get("/webhook-endpoints").json())
        assert other_client.get("/webhook-endpoints").json() == {"endpoints": []}
        for unknown in (endpoint["id"], str(uuid.uuid4()), "not-an-id"):
            for answer in (other_client.delete(f"/webhook-endpoints/{unknown}"),
                           other_client.post(f"/webhook-endpoints/{unknown}/rotate-secret")):
                assert answer.status_code == 404 and answer.json()["detail"] == "no such webhook endpoint"
        assert len(owner_client.get("/webhook-endpoints").json()["endpoints"]) == 1
        rotated = owner_client.post(f"/webhook-endpoints/{endpoint['id']}/rotate-secret")
        assert rotated.status_code == 200 and rotated.json()["secret"] != endpoint["secret"]
        assert owner_client.delete(f"/webhook-endpoints/{endpoint['id']}").status_code == 204
        assert owner_client.get("/webhook-endpoints").json() == {"endpoints": []}


def test_a_rotated_secret_signs_beside_the_previous_one(system: System, database_url: str,
                                                        receiver: WebhookReceiver) -> None:
    """After a rotation each delivery carries two signatures: the old secret and the new one each verify it."""
    key = create_key_sync(database_url, "hooked")
    api = system.api(QUEUE_MAX=100, WEBHOOK_ALLOW_PRIVATE="true")
    system.worker(**WORKER)
    with _client(api, key) as client:
        endpoint = _register(client, receiver)
        new_secret = client.post(f"/webhook-endpoints/{endpoint['id']}/rotate-secret").json()["secret"]
        _enqueue(client, 1)
    _wait(lambda: len(receiver.deliveries()) == 1, "the delivery")
    (received,) = receiver.deliveries()
    assert len(received.headers["webhook-signature"].split(" ")) == 2
    for secret in (endpoint["secret"], new_secret):
        Webhook(secret).verify(received.raw, received.headers)


def test_unsafe_urls_are_refused_when_private_addresses_are_not_allowed(
        system: System, database_url: str, receiver: WebhookReceiver) -> None:
    """http and address literals are refused at registration; a name resolving to loopback is refused at delivery."""
    key = create_key_sync(database_url, "hooked")
    api = system.api(QUEUE_MAX=100)
    system.worker(**{**WORKER, "WEBHOOK_ALLOW_PRIVATE": "false"})
    with _client(api, key) as client:
        for url in ("http://127.0.0.1:8080/hook", "https://127.0.0.1/hook", "https://169.254.169.254/latest",
                    "https://[::ffff:169.254.169.254]/", "https://10.0.0.8/hook", "https://[::1]/hook",
                    "ftp://example.com/hook"):
            answer = client.post("/webhook-endpoints", json={"url": url})
            assert answer.status_code == 422 and answer.json()["errors"][0]["field"] == "url", (url, answer.text)
        # a name: accepted here, checked by the worker at each delivery
        _register(client, receiver, url=f"https://localhost:{receiver.port}/hook")
        _enqueue(client, 1)
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM webhook_deliveries WHERE attempts >= 1 "
                                        "AND last_error IS NOT NULL") == 1, "the refused attempt")
    error = _scalar(database_url, "SELECT last_error FROM webhook_deliveries")
    assert error.startswith("refused: localhost resolves to") and "not a public address" in error, error
    assert receiver.deliveries(None) == [], "nothing reached the receiver"


def test_a_redirect_is_not_followed(system: System, database_url: str, receiver: WebhookReceiver) -> None:
    """A 302 to the metadata address is a failed attempt: the sender never goes there."""
    key = create_key_sync(database_url, "hooked")
    api = system.api(QUEUE_MAX=100, WEBHOOK_ALLOW_PRIVATE="true")
    system.worker(**WORKER)
    receiver.answer("redirect")
    receiver.redirect_to = f"http://127.0.0.1:{receiver.port}/followed"
    with _client(api, key) as client:
        _register(client, receiver)
        _enqueue(client, 1)
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM webhook_deliveries WHERE last_status_code = 302") == 1,
          "the redirected attempt recorded")
    assert _scalar(database_url, "SELECT state FROM webhook_deliveries") == "pending"
    assert [r.path for r in receiver.deliveries(None)] == ["/hook"]


def test_one_clients_hanging_receivers_delay_another_clients_webhook_by_one_attempt_at_most(
        system: System, database_url: str, receiver: WebhookReceiver) -> None:
    """Ten endpoints of one client that never answer hold every slot with 60 deliveries; another client's
    webhook still arrives within about one attempt's timeout of its job's end, not after theirs."""
    timeout_s = 2.0
    hung_key, other_key = create_key_sync(database_url, "hung"), create_key_sync(database_url, "other")
    api = system.api(QUEUE_MAX=100, WEBHOOK_ALLOW_PRIVATE="true")
    system.worker(**{**WORKER, "WEBHOOK_TIMEOUT_S": timeout_s})
    receiver.answer("hang")
    with WebhookReceiver() as other_receiver, _client(api, hung_key) as hung, _client(api, other_key) as other:
        for n in range(10):
            _register(hung, receiver, url=f"{receiver.url}/{n}")
        _register(other, other_receiver)
        _enqueue(hung, 6)
        _wait(lambda: _scalar(database_url, "SELECT count(*) FROM webhook_deliveries") == 60, "60 deliveries")
        _wait(lambda: receiver.hanging >= 4, "every slot held by a hanging receiver")
        (job_id,) = _enqueue(other, 1)
        _wait(lambda: len(other_receiver.deliveries()) == 1, "the other client's webhook", timeout=60)
        arrived = _scalar(database_url, "SELECT extract(epoch FROM now())::float8")
        ended = _scalar(database_url, f"SELECT extract(epoch FROM completed_at)::float8 FROM story_jobs "
                                      f"WHERE public_id = '{job_id}'")
        receiver.answer("ok")
    # one attempt of the hanging client's may have begun just before the job ended; the rest is polling
    # and recording, on a shared machine
    assert arrived - ended < timeout_s + 2.0, f"arrived {arrived - ended:.1f} s after the job ended"
