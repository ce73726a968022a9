"""schemathesis against the console's endpoints with an operator key: generated
requests, valid and invalid, to every operation tagged `ops` never get a 5xx,
and every answer is one the OpenAPI document describes. (tests/system/
test_api_schema.py sends a client's key, which every /ops endpoint refuses.)"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.result import Err

from tests.support import ops_seed as seed
from tests.system.procs import System

pytestmark = pytest.mark.system

EXAMPLES = 30
# valid requests may still find nothing (404) or a finished job (409); a
# cursor or a `through` is opaque: a string of the right shape that the api
# did not give is refused (400)
POSITIVE_STATUSES = ["2xx", "400", "404", "409"]


def test_the_console_endpoints_answer_as_the_openapi_document_says(system: System, database_url: str) -> None:
    """Every ops operation, with generated valid and invalid input and with ids that exist mixed in, answers
    without a 5xx, with documented statuses, content types and bodies."""

    async def history(conn: Any) -> tuple[str, dict[str, list[Any]]]:
        acme, key = await seed.client(conn, "acme")
        jobs = await seed.insert_jobs(conn, [seed.completed(acme, 600), seed.failed(acme, 300, "llm_error"),
                                             seed.running(acme, 60), seed.pending(acme, 10)])
        known: dict[str, list[Any]] = {"job_id": [str(job.public_id) for job in jobs], "client_id": [acme],
                 "key_prefix": [key.split("_")[1]]}
        return await seed.operator_key(conn), known

    key, known = seed.seeded(database_url, history)
    api = system.api()
    # the key as the document's security scheme, so that cases made to go without it go without it
    config = schemathesis.Config.from_dict({
        "auth": {"openapi": {"OperatorKey": {"bearer": key}}},
        "checks": {"positive_data_acceptance": {"expected-statuses": POSITIVE_STATUSES}},
    })
    schema = schemathesis.openapi.from_url(f"{api.base_url}/schema/openapi.json", config=config)
    sent: dict[str, int] = {}
    for result in schema.include(tag="ops").get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        operation = result.ok()
        for mode in GenerationMode:
            strategies = [operation.as_strategy(generation_mode=mode)]
            for name, values in known.items():
                if mode.is_positive and name in operation.path_parameters:
                    strategies += [operation.as_strategy(generation_mode=mode, path_parameters={name: value})
                                   for value in values]
            count = 0

            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=st.one_of(strategies))
            def call(case: schemathesis.Case[Any]) -> None:
                nonlocal count
                count += 1
                case.call_and_validate(base_url=api.base_url, timeout=10)

            call()
            sent[f"{operation.label} ({mode.value})"] = count
    assert len(sent) == 32 and all(sent.values()), sent
    assert api.popen.poll() is None
    assert not [event for event in api.events() if event.get("level") == "error"]
