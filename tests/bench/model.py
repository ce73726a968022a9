"""model: the model-based test of the worker's coordinator, with many more
examples than CI runs (tests/model/: recording store and Postgres).

Not a speed figure: the long profile of a test. It reports how many examples
each world ran, how long they took, and whether the invariants held; a
counterexample fails the benchmark with Hypothesis' report in its error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.bench.harness import BenchContext, BenchResult, FigureSpec

NAME = "model"
SPECS = {
    "recording_examples": FigureSpec("examples on the recording store", "n"),
    "postgres_examples": FigureSpec("examples on Postgres", "n"),
    "seconds": FigureSpec("time for both", "s"),
}
RECORDING_EXAMPLES = 3000
POSTGRES_EXAMPLES = 200


def run(ctx: BenchContext, result: BenchResult) -> None:
    recording = 200 if ctx.quick else RECORDING_EXAMPLES
    postgres = 20 if ctx.quick else POSTGRES_EXAMPLES
    result.params.update({"recording_examples": recording, "postgres_examples": postgres})
    env = {**os.environ, "STORYJOBS_MODEL_EXAMPLES": str(postgres),
           "STORYJOBS_MODEL_RECORDING_EXAMPLES": str(recording)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/model", "-q", "-p", "no:cacheprovider",
                           "-o", "timeout=0"], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        result.error = f"the invariants did not hold:\n{done.stdout[-4000:]}"
        return
    result.add("recording_examples", recording)
    result.add("postgres_examples", postgres)
    result.add("seconds", time.monotonic() - started)
    ctx.progress(f"model: {recording} + {postgres} examples in {time.monotonic() - started:.0f} s")
