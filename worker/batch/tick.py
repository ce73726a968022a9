"""What one tick of the batch lane did (``TickResult``), and the links to
the jobs' traces that the spans a tick opens carry (the create, each
ingestion)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry.trace import Link

from shared import telemetry

# the links a span keeps (the SDK's default OTEL_SPAN_LINK_COUNT_LIMIT)
_LINKS_MAX = 128


@dataclass
class TickResult:
    """What one tick did: each part of the lane adds what it did."""

    holding: bool = False
    submitted: int = 0  # requests in the batch created
    adopted: int = 0  # intents reconciled to a batch found at the provider
    lost: int = 0  # intents given up: their jobs failed as unknown
    strays: int = 0
    refused: int = 0  # creates the provider refused before anything was made
    completed: int = 0
    failed: int = 0
    waiting: int = 0  # jobs put back to wait for a later batch
    database_error: str | None = None


def links(carriers: Iterable[object]) -> list[Link]:
    """Links to the jobs' traces, as many as a span keeps."""
    found = (telemetry.link_from_carrier(carrier) for carrier in carriers)
    return list(itertools.islice((link for link in found if link is not None), _LINKS_MAX))
