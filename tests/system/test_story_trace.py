"""One story's trace through the real processes: the api and a worker
export to an OTLP/HTTP receiver on loopback, as they would to a collector.
The client's POST carries a traceparent; the api's server span continues it,
the worker's run of the job and the SDK's call to the provider (the fake,
through the real ``anthropic`` SDK) and the webhook's first attempt are all
in that one trace. Without an OTLP endpoint, nothing is sent at all."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer
from tests.fakes.otlp_receiver import OtlpReceiverServer, ReceivedSpan
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.database import create_key_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import ApiProc, System

pytestmark = pytest.mark.system

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
PROMPT = "a hedgehog who counts the stars"


@pytest.fixture
def otlp() -> Iterator[OtlpReceiverServer]:
    with OtlpReceiverServer() as server:
        yield server


@pytest.fixture
def hooks() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as started:
        yield started


def _one_story(system: System, database_url: str, fake_llm: FakeAnthropicServer, hooks: WebhookReceiver,
               **env: Any) -> tuple[ApiProc, list[Any]]:
    """An api and a worker (with ``env``), a webhook endpoint, one story posted with a traceparent and
    delivered; the processes then stopped, so that what they batched is flushed."""
    common = {"WEBHOOK_ALLOW_PRIVATE": "true", **env}
    api = system.api(**common)
    worker = system.worker(ANTHROPIC_API_KEY="test", ANTHROPIC_BASE_URL=fake_llm.base_url,
                           WEBHOOK_POLL_INTERVAL_S=0.1, **common)
    key = create_key_sync(database_url, "parent")
    with httpx.Client(base_url=api.base_url, timeout=10, headers={"Authorization": f"Bearer {key}"}) as client:
        endpoint = client.post("/webhook-endpoints", json={"url": hooks.url})
        assert endpoint.status_code == 201, endpoint.text
        hooks.secrets.append(endpoint.json()["secret"])
        answer = client.post("/stories/generate", json={"prompt": PROMPT},
                             headers={"Idempotency-Key": str(uuid.uuid4()),
                                      "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert answer.status_code == 202, answer.text
        wait_until_sync(lambda: len(hooks.deliveries()) == 1, timeout=30, what="the story's webhook")
    # (uvicorn ends on the signal it was stopped with, once its lifespan has flushed the spans)
    assert worker.stop() == 0 and api.stop() in (0, -15)
    return api, hooks.deliveries()


def _named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [span for span in spans if span.name == name]


def test_one_story_is_one_trace_from_the_post_to_the_llm_call_and_the_webhook(
    system: System, database_url: str, fake_llm: FakeAnthropicServer, hooks: WebhookReceiver,
    otlp: OtlpReceiverServer,
) -> None:
    """The api's server span (child of the client's span), the worker's run span and the SDK's chat span
    under it, and the webhook's attempt: one trace id, each from its service, no prompt in any attribute."""
    _one_story(system, database_url, fake_llm, hooks, OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint,
               OTEL_BSP_SCHEDULE_DELAY=200)
    spans = otlp.wait_for_spans(lambda got: bool(_named(got, "storyjobs.webhook.attempt"))
                                and bool(_named(got, "POST /stories/generate")), what="the story's spans")
    story = [span for span in spans if span.trace_id == TRACE_ID]
    (server,) = _named(story, "POST /stories/generate")
    (run,) = _named(story, "storyjobs.job.run")
    (chat,) = _named(story, "anthropic.messages.create")
    (attempt,) = _named(story, "storyjobs.webhook.attempt")
    assert (server.service_name, server.parent_span_id) == ("storyjobs-api", CLIENT_SPAN)
    assert (run.service_name, attempt.service_name) == ("storyjobs-worker", "storyjobs-worker")
    assert chat.parent_span_id == run.span_id
    assert chat.attributes["gen_ai.request.model"] and chat.attributes["gen_ai.usage.output_tokens"] > 0
    assert run.attributes["gen_ai.response.finish_reasons"] == ["end_turn"]
    assert attempt.attributes["http.response.status_code"] == 204
    assert PROMPT not in repr([span.attributes for span in spans])


def test_without_an_endpoint_the_api_and_the_worker_send_nothing(
    system: System, database_url: str, fake_llm: FakeAnthropicServer, hooks: WebhookReceiver,
    otlp: OtlpReceiverServer,
) -> None:
    """OTEL_SERVICE_NAME and a sampler set, the metrics endpoint at the receiver, no traces endpoint: the
    story is written and delivered, and nothing reaches the receiver."""
    _one_story(system, database_url, fake_llm, hooks, OTEL_SERVICE_NAME="stories", OTEL_TRACES_SAMPLER="always_on",
               OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=otlp.endpoint)
    assert otlp.receiver.received() == []
