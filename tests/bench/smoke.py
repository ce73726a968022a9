"""What the benchmarks' smoke tests share: one quick run of the bench CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.bench.harness import REPO


def run_quick(only: str, server_url: str, out: Path) -> dict[str, Any]:
    """`python -m tests.bench --quick --runs 1 --only ONLY` on the tests' server; asserts that it exits 0 and
    returns the JSON document it wrote, with its Markdown under "markdown"."""
    finished = subprocess.run(
        [sys.executable, "-m", "tests.bench", "--quick", "--runs", "1", "--only", only, "--out", str(out),
         "--quiet"],
        cwd=REPO, env={**os.environ, "TEST_DATABASE_URL": server_url},
        capture_output=True, text=True, timeout=280, check=False,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    document: dict[str, Any] = json.loads((out / "latest.json").read_text())
    document["markdown"] = (out / "latest.md").read_text()
    return document
