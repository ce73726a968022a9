"""schemathesis against a real api process and its own OpenAPI document
(GET /schema/openapi.json): generated requests, valid and invalid, never get
a 5xx, and every answer is one the document describes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.result import Err

from tests.support.database import create_key_sync
from tests.system.procs import ApiProc, System, wait_while_running

pytestmark = pytest.mark.system

# per operation and generation mode: a few hundred requests in all
EXAMPLES = 40
# positive data may also be refused for what the schema cannot say: its
# Idempotency-Key was used with another body (422), or the queue is full (429)
POSITIVE_STATUSES = ["2xx", "401", "404", "409", "422", "429"]


def _seed_jobs(system: System, api: ApiProc, key: str) -> dict[str, str]:
    """A completed job (written by an offline worker), a pending one and a cancelled one; returns their ids
    and the completed job's story id, for operations to be called on things that exist."""
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        worker = system.worker(OFFLINE_DELAY_S=0)
        completed = client.post("/stories/generate", json={"prompt": "a sleepy owl"},
                                headers={"Idempotency-Key": "seed-completed"}).json()["job_id"]
        wait_while_running(lambda: client.get(f"/stories/jobs/{completed}").json()["status"] == "completed",
                           [worker], what="the seed job to complete", timeout=20)
        job = client.get(f"/stories/jobs/{completed}").json()
        worker.stop()
        pending, cancelled = (client.post("/stories/generate", json={"prompt": f"seed {n}"},
                                          headers={"Idempotency-Key": f"seed-{n}"}).json()["job_id"]
                              for n in range(2))
        assert client.delete(f"/stories/jobs/{cancelled}").status_code == 200
    return {"completed": completed, "pending": pending, "cancelled": cancelled, "story": job["story"]["story_id"]}


def _has_inputs(operation: Any) -> bool:
    return bool(operation.path_parameters or operation.headers or operation.query or operation.body)


def _check(cases: st.SearchStrategy[schemathesis.Case[Any]], api: ApiProc, headers: dict[str, str]) -> int:
    """Calls the API with EXAMPLES cases and validates every answer; returns how many were sent."""
    sent = 0

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def call(case: schemathesis.Case[Any]) -> None:
        nonlocal sent
        sent += 1
        case.call_and_validate(base_url=api.base_url, headers=headers, timeout=10)

    call()
    return sent


def test_the_api_answers_as_its_openapi_document_says(system: System, database_url: str) -> None:
    """Valid and invalid requests to every documented operation (schemathesis's default checks: no 5xx; status
    codes, content types, bodies and headers as documented; invalid data refused, valid data accepted; auth not
    ignored; undocumented methods 405), with the job and story ids that exist mixed in."""
    key = create_key_sync(database_url, "schemathesis")
    api = system.api(QUEUE_MAX=30)
    seeds = _seed_jobs(system, api, key)
    config = schemathesis.Config.from_dict(
        {"checks": {"positive_data_acceptance": {"expected-statuses": POSITIVE_STATUSES}}})
    schema = schemathesis.openapi.from_url(f"{api.base_url}/schema/openapi.json", config=config)
    known_ids = {"job_id": [seeds["completed"], seeds["pending"], seeds["cancelled"]],
                 "story_id": [seeds["story"], seeds["completed"]]}
    sent: dict[str, int] = {}
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        operation = result.ok()
        modes = list(GenerationMode) if _has_inputs(operation) else [GenerationMode.POSITIVE]
        for mode in modes:
            strategies = [operation.as_strategy(generation_mode=mode)]
            for name, values in known_ids.items():
                if mode.is_positive and name in operation.path_parameters:
                    strategies += [operation.as_strategy(generation_mode=mode, path_parameters={name: value})
                                   for value in values]
            sent[f"{operation.label} ({mode.value})"] = _check(
                st.one_of(strategies), api, {"Authorization": f"Bearer {key}"})
    assert len(sent) >= 10 and all(sent.values()) and sum(sent.values()) >= 300, sent
    assert api.popen.poll() is None
    assert not [event for event in api.events() if event.get("level") == "error"]
