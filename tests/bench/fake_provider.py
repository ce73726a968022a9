"""``python -m tests.bench.fake_provider``: the fake Anthropic provider of
tests/fakes as a process of its own, so that a benchmark can measure its CPU
apart from the benchmark's. Every request gets the same streamed answer.

FAKE_PROVIDER_CHUNKS and FAKE_PROVIDER_STREAM_S say how many text chunks
each answer streams and over how many seconds; FAKE_PROVIDER_WORDS_PER_CHUNK
(default 5) how many words each chunk holds. It writes one JSON line when
it listens (``fake_provider.listening`` with the port) and one when SIGTERM
stops it (``fake_provider.stopped`` with counts of requests, finished streams
and streams the client closed early).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan


def _say(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def main() -> None:
    chunks = int(os.environ["FAKE_PROVIDER_CHUNKS"])
    stream_s = float(os.environ["FAKE_PROVIDER_STREAM_S"])
    words_per_chunk = int(os.environ.get("FAKE_PROVIDER_WORDS_PER_CHUNK", "5"))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    fake = FakeAnthropic(default=Plan(chunks=chunks, duration_s=stream_s, words_per_chunk=words_per_chunk))
    with FakeAnthropicServer(fake) as server:
        _say("fake_provider.listening", port=server.port, chunks=chunks, stream_s=stream_s)
        while not stop.wait(0.5):
            pass
        calls = list(fake.calls)
    _say("fake_provider.stopped", requests=len(calls), finished=sum(c.finished for c in calls),
         closed_early=sum(c.closed_early for c in calls))


if __name__ == "__main__":
    main()
