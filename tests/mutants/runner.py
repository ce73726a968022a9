"""Applies each named mutant in a scratch copy of the repository and runs the
tests meant to kill it there.

A mutant is killed when its tests fail (pytest exit 1); it survived when they
pass. Any other ending (a collection error, an interrupted run, no test
collected) is an error: it proves nothing, so it fails the run as loudly as a
survivor. Every target is checked before anything runs: a target that is not
found exactly once means the code moved and the list must move with it.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tests.mutants.catalog import MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[2]

Verdict = Literal["killed", "survived", "error"]


class TargetMissing(Exception):
    """A mutant's target text is not found exactly once in its file."""


@dataclass(frozen=True)
class Result:
    mutant: Mutant
    verdict: Verdict
    seconds: float
    detail: str


def check_targets(mutants: Iterable[Mutant], root: Path = REPO) -> None:
    """Raises TargetMissing naming every mutant whose target is not found
    exactly once in its file."""
    problems = []
    for mutant in mutants:
        path = root / mutant.file
        if not path.is_file():
            problems.append(f"{mutant.name}: no file {mutant.file}")
            continue
        text = path.read_text()
        for target, _ in mutant.edits:
            found = text.count(target)
            if found != 1:
                problems.append(f"{mutant.name}: a target is found {found} times in {mutant.file}: {target[:60]!r}")
    if problems:
        raise TargetMissing("; ".join(problems))


def tracked_files(root: Path) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, check=True, capture_output=True).stdout
    return [name for name in listed.decode().split("\0") if name]


@contextmanager
def scratch_copy(root: Path) -> Iterator[Path]:
    """The repository's files (tracked, and untracked but not ignored) in a
    temporary folder, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="storyjobs-mutants-"))
    try:
        for name in tracked_files(root):
            source = root / name
            if source.is_file():
                target = folder / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_one(mutant: Mutant, scratch: Path) -> Result:
    """The mutant applied in ``scratch``, its tests run there, the file put back."""
    path = scratch / mutant.file
    original = path.read_text()
    mutated = original
    for target, replacement in mutant.edits:
        mutated = mutated.replace(target, replacement, 1)
    path.write_text(mutated)
    # the scratch copy first on the path: the editable install's finder comes
    # after sys.path, so the mutated code is what the tests (and the processes
    # they start) import
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1",
           # a counterexample is a kill: no time spent shrinking it (tests/conftest.py)
           "STORYJOBS_HYPOTHESIS_PROFILE": "mutants"}
    started = time.monotonic()
    try:
        finished = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
            cwd=scratch, env=env, capture_output=True, text=True, timeout=mutant.timeout_s)
    except subprocess.TimeoutExpired:
        return Result(mutant, "error", time.monotonic() - started, f"no end within {mutant.timeout_s:g} s")
    finally:
        path.write_text(original)
    seconds = time.monotonic() - started
    tail = "\n".join(finished.stdout.strip().splitlines()[-3:])
    if finished.returncode == 1:
        return Result(mutant, "killed", seconds, tail)
    if finished.returncode == 0:
        return Result(mutant, "survived", seconds, tail)
    return Result(mutant, "error", seconds, f"pytest exited {finished.returncode}: {tail}")


def run(mutants: list[Mutant], *, jobs: int, root: Path = REPO, report: bool = True) -> list[Result]:
    """Every mutant, ``jobs`` at a time, each in a scratch copy of its own."""
    check_targets(mutants, root)
    if not mutants:
        return []
    with ExitStack() as stack:
        free: queue.SimpleQueue[Path] = queue.SimpleQueue()
        slots = max(1, min(jobs, len(mutants)))
        for _ in range(slots):
            free.put(stack.enter_context(scratch_copy(root)))

        def one(mutant: Mutant) -> Result:
            scratch = free.get()
            try:
                result = run_one(mutant, scratch)
            finally:
                free.put(scratch)
            if report:
                line = f"{result.verdict:<9}{result.seconds:6.1f} s  {mutant.name}  [{mutant.tier}]\n"
                if result.verdict != "killed":
                    line += f"         attacks: {mutant.invariant}\n         {result.detail}\n"
                sys.stdout.write(line)
                sys.stdout.flush()
            return result

        with ThreadPoolExecutor(max_workers=slots) as pool:
            return list(pool.map(one, mutants))


def selected(names: list[str]) -> list[Mutant]:
    if not names:
        return list(MUTANTS)
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"no mutant named {', '.join(unknown)}; `python -m tests.mutants --list` lists them")
    return [by_name[n] for n in names]
