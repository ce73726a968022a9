"""Which test executes which named statement and which line: the map that
picks each generated mutant's tests.

The chosen test files run once on the unmutated code with the trace plugin
(tests/mutants/trace_plugin.py): the query layer appends every statement name
it reads, with the test's id, to a file (shared/queries.py, when
STORYJOBS_QUERY_TRACE is set), and coverage records each line under the test
that ran it, in pytest's process (a context switched per test) and in the
processes a test starts (started by coverage's .pth file from
COVERAGE_PROCESS_START, their context the test id they inherit). A test that
fails on the unmutated code is left out of the map: it could kill nothing.

The map is cached under the cache folder by a hash of the test files it ran
and of every file a mutant can change, so it is built again only when one of
them changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import coverage


@dataclass
class CoverageMap:
    # statement name -> the tests that read it
    statements: dict[str, list[str]] = field(default_factory=dict)
    # file (relative) -> line -> the tests that ran it
    lines: dict[str, dict[int, list[str]]] = field(default_factory=dict)
    # test id -> seconds, for the tests that passed
    durations: dict[str, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    test_files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"statements": self.statements,
                           "lines": {f: {str(n): t for n, t in ls.items()} for f, ls in self.lines.items()},
                           "durations": self.durations, "failed": self.failed,
                           "test_files": self.test_files, "seconds": self.seconds}, indent=0, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CoverageMap:
        raw = json.loads(text)
        return cls(statements=raw["statements"],
                   lines={f: {int(n): t for n, t in ls.items()} for f, ls in raw["lines"].items()},
                   durations=raw["durations"], failed=raw["failed"], test_files=raw["test_files"],
                   seconds=raw["seconds"])

    def tests_of_statement(self, name: str) -> list[str]:
        return self._passing(self.statements.get(name, []))

    def tests_of_line(self, file: str, line: int, *, at_import: bool = False) -> list[str]:
        """The tests that ran the line; for a line run at import (a
        signature, a class body, a constant), every test that ran the module:
        which test an import is counted to is an accident (the first to
        import it in its process, a test that starts a process), not a sign
        of which tests read what the line made."""
        lines = self.lines.get(file, {})
        if line not in lines:
            return []
        if lines[line] and not at_import:
            return self._passing(lines[line])
        return self._passing([test for tests in lines.values() for test in tests])

    def _passing(self, tests: list[str]) -> list[str]:
        """The tests that passed unmutated, fastest first."""
        return sorted((t for t in set(tests) if t in self.durations), key=lambda t: (self.durations[t], t))


def fingerprint(root: Path, test_files: list[str], source_files: list[str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(set(test_files)) + ["--"] + sorted(set(source_files)):
        digest.update(name.encode() + b"\0")
        path = root / name
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()[:16]


def _rcfile(folder: Path, root: Path, modules: list[str]) -> Path:
    include = ", ".join(str(root / module) for module in modules)
    rc = folder / "coveragerc"
    # the context is read from the environment by each process as it starts:
    # a process a test starts is that test's; pytest's own switches per test
    rc.write_text("[run]\n"
                  "parallel = true\n"
                  f"data_file = {folder / 'data' / 'coverage'}\n"
                  f"include = {include}\n"
                  "context = ${STORYJOBS_TEST_ID}\n"
                  "sigterm = true\n")
    return rc


def build(root: Path, test_files: list[str], modules: list[str], *, jobs: int = 2,
          timeout_s: float = 3600) -> CoverageMap:
    """Runs ``test_files`` once, unmutated, and maps what each test executed."""
    import time
    with tempfile.TemporaryDirectory(prefix="storyjobs-coverage-map-") as tmp:
        folder = Path(tmp)
        (folder / "data").mkdir()
        rc = _rcfile(folder, root, modules)
        trace = folder / "statements.tsv"
        outcomes = folder / "outcomes.tsv"
        trace.touch()
        outcomes.touch()
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1",
               "COVERAGE_PROCESS_START": str(rc), "STORYJOBS_QUERY_TRACE": str(trace),
               "STORYJOBS_TEST_OUTCOMES": str(outcomes)}
        env.pop("STORYJOBS_TEST_ID", None)
        started = time.monotonic()
        parallel = ["-n", str(jobs)] if jobs > 1 else []
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "tests.mutants.trace_plugin", *parallel, *test_files],
                       cwd=root, env=env, timeout=timeout_s, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds = time.monotonic() - started
        result = CoverageMap(test_files=sorted(test_files), seconds=round(seconds, 1))
        for row in outcomes.read_text().splitlines():
            test, duration, outcome = row.split("\t")
            if outcome == "passed":
                result.durations[test] = float(duration)
            else:
                result.failed.append(test)
        statements: dict[str, set[str]] = defaultdict(set)
        for row in trace.read_text().splitlines():
            test, _, name = row.partition("\t")
            if test:
                statements[name].add(test)
        result.statements = {name: sorted(tests) for name, tests in statements.items()}
        measured = coverage.Coverage(data_file=str(folder / "data" / "coverage"), config_file=str(rc))
        measured.combine(data_paths=[str(folder / "data")], keep=False)
        data = measured.get_data()
        for path in data.measured_files():
            relative = os.path.relpath(path, root)
            by_line: dict[int, list[str]] = {}
            for line, contexts in data.contexts_by_lineno(path).items():
                # no test's: run at import (a def, a class body, a constant)
                by_line[line] = sorted({_test_of(context) for context in contexts} - {""})
            result.lines[relative] = by_line
        return result


def _test_of(context: str) -> str:
    """A context is ``static|dynamic``, either part empty: the test is the non-empty one."""
    parts = [part for part in context.split("|") if part]
    return parts[-1] if parts else ""


def cached(root: Path, cache: Path, test_files: list[str], modules: list[str], sources: list[str],
           *, jobs: int = 2) -> tuple[CoverageMap, bool]:
    """The map for these tests and sources, from the cache when nothing changed; (map, built now)."""
    key = fingerprint(root, test_files, sources)
    path = cache / f"coverage-map-{key}.json"
    if path.is_file():
        return CoverageMap.from_json(path.read_text()), False
    made = build(root, test_files, modules, jobs=jobs)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(made.to_json())
    return made, True
