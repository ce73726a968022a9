"""``python -m tests.mutants.generated``: a seeded, stratified sample of the
generated mutants (SQL from the parse tree, Python from cosmic-ray's
operators), each run against the tests that execute its code.

Verdicts: killed (its tests fail), survived (they pass), not covered (no test
executes it: a survivor too), timed out, error (pytest neither passed nor
failed: proves nothing), equivalent (a survivor listed in
tests/mutants/equivalent.toml with why no user can tell).

Results are cached by the mutant's key (its file, place and change) and a
hash of its tests' files, so a second run only runs the mutants whose code
or covering tests changed. The report goes to tests/mutants/report/.

``--ci`` runs a few mutants the report saw killed, chosen by a seed from the
commit, with the tests the report recorded for each: a survivor fails the
run with its diff.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import Any, TypeVar

from tests.mutants import coverage_map, py_mutants, sql_mutants
from tests.mutants.catalog import MUTANTS
from tests.mutants.runner import REPO, scratch_copy

GeneratedMutant = sql_mutants.SqlMutant | py_mutants.PyMutant
T = TypeVar("T")

# the files whose mutants are sampled: the issue's, where money, admission
# and delivery are decided (console.sql's mutants are counted, not sampled)
SQL_FILES: tuple[str, ...] = ("sql/worker.sql", "sql/batch.sql", "sql/common.sql", "sql/sweeper.sql",
                              "sql/api.sql")
TEST_TIERS: tuple[str, ...] = ("tests/unit", "tests/integration", "tests/model", "tests/system")
CACHE = REPO / ".mutants-cache"
REPORT = REPO / "tests" / "mutants" / "report"
EQUIVALENT = REPO / "tests" / "mutants" / "equivalent.toml"
TIMEOUT_S = 300.0
# the longest a mutant CI samples took in the report
CI_MUTANT_S = 60.0
# the last line of a confirmed kill's detail
# a line of pytest's short summary naming a test (not a module that failed to collect)
FAILING = re.compile(r"^(?:FAILED|ERROR) (\S+::.+?)(?: - .*)?$")
CONFIRMED = "confirmed: its failing test, run alone, fails with the mutant and passes without it"


@dataclass
class Outcome:
    key: str
    file: str
    where: str
    operator: str
    verdict: str
    seconds: float
    tests: list[str]
    detail: str
    diff: str


def population(root: Path = REPO, files: Iterable[str] | None = None) -> list[GeneratedMutant]:
    """Every generated mutant of ``files`` (default: every query file and MODULES)."""
    wanted = set(files) if files is not None else None
    made: list[GeneratedMutant] = []
    for block in sql_mutants.blocks(root):
        if (wanted is None or block.file in wanted) and sql_mutants.complete(block):
            made.extend(sql_mutants.mutants_of(block))
    for module in py_mutants.MODULES:
        if wanted is None or module in wanted:
            made.extend(py_mutants.mutants_of(root, module))
    return _unique(made)


def _unique(made: list[GeneratedMutant]) -> list[GeneratedMutant]:
    """One mutant per key: the same change twice in one place is one mutant."""
    seen: set[str] = set()
    kept = []
    for mutant in made:
        if mutant.key not in seen:
            seen.add(mutant.key)
            kept.append(mutant)
    return kept


def stratified_sample(mutants: Sequence[GeneratedMutant], size: int, seed: str) -> list[GeneratedMutant]:
    """``size`` mutants, spread over (file, operator): one from each stratum in
    turn, strata and mutants in an order fixed by the seed."""
    rng = random.Random(seed)
    strata: dict[tuple[str, str], list[GeneratedMutant]] = defaultdict(list)
    for mutant in sorted(mutants, key=lambda m: m.key):
        strata[(mutant.file, mutant.operator)].append(mutant)
    order = sorted(strata)
    rng.shuffle(order)
    for name in order:
        rng.shuffle(strata[name])
    # files first in turn, then operators within a file, so that a small
    # sample still reaches every file
    by_file: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for name in order:
        by_file[name[0]].append(name)
    chosen: list[GeneratedMutant] = []
    depth = 0
    while len(chosen) < size and any(strata.values()):
        for file in sorted(by_file, key=lambda f: rng.random()):
            names = by_file[file]
            if not names:
                continue
            name = names[depth % len(names)]
            if strata[name]:
                chosen.append(strata[name].pop())
                if len(chosen) == size:
                    break
            by_file[file] = [n for n in names if strata[n]]
        depth += 1
    return chosen


# --- which tests -------------------------------------------------------------

def _test_files(root: Path) -> list[Path]:
    return sorted(p for tier in TEST_TIERS for p in (root / tier).rglob("test_*.py"))


def candidate_test_files(root: Path, mutants: Iterable[GeneratedMutant]) -> list[str]:
    """The test files that may execute these mutants: those that name the
    module or the statement mutated, the api's tests for its statements, and
    the named catalog's tests for the file. The coverage map then keeps, for each mutant, the
    tests of these that did execute it."""
    texts = {str(p.relative_to(root)): p.read_text() for p in _test_files(root)}
    patterns: set[str] = set()
    files: set[str] = set()
    for mutant in mutants:
        files.add(mutant.file)
        if isinstance(mutant, sql_mutants.SqlMutant):
            patterns.add(rf"\b{re.escape(mutant.statement)}\b")
        else:
            dotted = mutant.file.removesuffix(".py").replace("/", ".")
            package, _, module = dotted.rpartition(".")
            patterns.add(rf"\b{re.escape(dotted)}\b")
            patterns.add(rf"from {re.escape(package)} import [^\n]*\b{re.escape(module)}\b")
    found = {name for name, text in texts.items() if any(re.search(p, text) for p in patterns)}
    if "sql/api.sql" in files or any(file.startswith("api/") for file in files):
        # the api's statements and handlers run behind its routes, which
        # tests call by URL without importing them
        found.update(name for name, text in texts.items()
                     if name.startswith("tests/integration/test_api_") or '"/stories/' in text)
    for named in MUTANTS:
        if named.file in files:
            found.update(test.split("::", 1)[0] for test in named.tests)
    return sorted(found)


def recorded_test_files(root: Path, recorded: Iterable[dict[str, Any]], keys: set[str]) -> set[str]:
    """The test files the report ran for these mutants' keys, those still there. A run of the report's sample
    over some files maps them too: found by name alone, a statement's tests leave out those that reach it
    through a module (a delivery's end through the deliverer), which the whole sample's other mutants had
    brought in, and the mutants they killed would pass as survivors."""
    files = {test.split("::", 1)[0] for mutant in recorded if mutant["key"] in keys for test in mutant["tests"]}
    return {file for file in files if (root / file).is_file()}


def covering_tests(mutant: GeneratedMutant, cmap: coverage_map.CoverageMap) -> list[str]:
    if isinstance(mutant, sql_mutants.SqlMutant):
        return cmap.tests_of_statement(mutant.statement)
    return cmap.tests_of_line(mutant.file, mutant.line, at_import=runs_at_import(mutant.original, mutant.line))


def runs_at_import(source: str, line: int) -> bool:
    """Whether the line runs when its module is imported: outside every
    function's body (module and class level, signatures, decorators)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            if body[0].lineno <= line <= (node.end_lineno or body[-1].lineno):
                return False
    return True


def collected_tests(root: Path, files: Iterable[str]) -> set[str]:
    """The test ids pytest collects today from those of ``files`` that still exist."""
    present = sorted(f for f in files if (root / f).is_file())
    if not present:
        return set()
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             *present], cwd=root, capture_output=True, text=True, check=False)
    # 5: nothing collected; anything else but 0 is a file that does not
    # import, which must be said, not taken for tests that are gone
    if listed.returncode not in (0, 5):
        raise RuntimeError(f"pytest could not collect the recorded tests' files:\n{listed.stdout[-2000:]}"
                           f"{listed.stderr[-2000:]}")
    return {line for line in listed.stdout.splitlines() if "::" in line}


def tests_now(recorded: list[str], collected: set[str]) -> list[str]:
    """The recorded tests as they are named today, in the recorded order (the
    first to fail ends the run): tests are renamed, merged and parametrized
    after the report, and pytest refuses a whole run for one id it cannot
    find. A test gone from its file gives way to every test of that file (the
    one it became is among them); a gone file to nothing."""
    files = {test.split("::", 1)[0] for test in collected}
    kept: dict[str, None] = {}
    for test in recorded:
        base = test.split("[", 1)[0]
        if test in collected:
            kept[test] = None
        elif base in collected:
            kept[base] = None
        elif family := sorted(t for t in collected if t.startswith(base + "[")):
            kept.update(dict.fromkeys(family))
        elif (file := test.split("::", 1)[0]) in files:
            kept[file] = None
    whole = {t for t in kept if "::" not in t}
    return [t for t in kept if "::" not in t or t.split("::", 1)[0] not in whole]


def tests_hash(root: Path, tests: list[str]) -> str:
    digest = hashlib.sha256()
    for test in sorted(tests):
        digest.update(test.encode() + b"\0")
    for file in sorted({t.split("::", 1)[0] for t in tests}):
        digest.update((root / file).read_bytes())
    return digest.hexdigest()[:16]


# --- running -----------------------------------------------------------------

def _pytest(tests: list[str], scratch: Path, timeout_s: float) -> tuple[int | None, float, str]:
    """(pytest's exit code, or None at the timeout; seconds; the output's last lines) of ``tests`` in ``scratch``."""
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1",
           "STORYJOBS_HYPOTHESIS_PROFILE": "mutants"}
    for name in ("STORYJOBS_QUERY_TRACE", "STORYJOBS_TEST_ID", "COVERAGE_PROCESS_START"):
        env.pop(name, None)
    started = time.monotonic()
    # a session of its own: at the timeout the whole group goes, with the
    # api, workers and sweeper a system test started (left running, they held
    # the server's connections and failed the next mutants' tests)
    with subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as running:
        try:
            stdout, _ = running.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(running.pid, signal.SIGKILL)
            running.wait()
            return None, time.monotonic() - started, f"no end within {timeout_s:g} s"
    lines = stdout.strip().splitlines()
    # the summary's first failing test, kept for ``failing_test``: with CI set
    # in the environment pytest writes an assertion's whole message under it,
    # which pushes it out of the last lines
    named = [line for line in lines if FAILING.match(line)][:1]
    tail = lines[-3:]
    return running.returncode, time.monotonic() - started, "\n".join([*(n for n in named if n not in tail), *tail])


def _mutated(mutant: GeneratedMutant, scratch: Path, tests: list[str],
             timeout_s: float) -> tuple[int | None, float, str]:
    path = scratch / mutant.file
    original = path.read_text()
    path.write_text(mutant.apply(original))
    try:
        return _pytest(tests, scratch, timeout_s)
    finally:
        path.write_text(original)


def failing_test(detail: str) -> str | None:
    """The test a kill's output names as failing (or erring in a fixture): its id, spaces in parameters kept."""
    for line in detail.splitlines():
        if (failed := FAILING.match(line)) is not None:
            return failed.group(1)
    return None


def tests_through(tests: list[str], test: str) -> list[str]:
    """``tests`` up to the entry that ran ``test`` (its id, or its file): what
    ran before it too, in order, as pytest -x ran them."""
    for at, entry in enumerate(tests):
        if test == entry or test.startswith(f"{entry}::") or test.startswith(f"{entry}["):
            return tests[:at + 1]
    return tests


def confirm_kill(mutant: GeneratedMutant, test: str, tests: list[str], scratch: Path,
                 timeout_s: float) -> str | None:
    """None when the kill is repeated and is the mutant's: ``test`` fails
    again with the mutant, alone, or (a failure left by an earlier test, such
    as a fixture's error) after the tests that ran before it; and the same
    tests then pass without the mutant. Else why the kill is not confirmed:
    a test that fails for the machine's load (a system test's processes, a
    connection refused) fails either way, or not again."""
    runs = [[test]]
    if (before := tests_through(tests, test)) != [test]:
        runs.append(before)
    for chosen in runs:
        code, _, tail = _mutated(mutant, scratch, chosen, timeout_s)
        if code != 1:
            continue
        code, _, tail = _pytest(chosen, scratch, timeout_s)
        if code != 0:
            return f"{test}: fails without the mutant too ({'no end' if code is None else f'exit {code}'}): {tail}"
        return None
    return f"{test}: did not fail again with the mutant"


def run_one(mutant: GeneratedMutant, tests: list[str], scratch: Path, timeout_s: float, *,
            confirm: bool = True) -> tuple[str, float, str]:
    """(verdict, seconds, detail) of the mutant written in ``scratch`` against
    ``tests``. A kill is confirmed (``confirm_kill``) or the mutant runs once
    more; a kill still not confirmed is said as such, which is no kill."""
    spent = 0.0
    why = ""
    for _ in range(2):
        code, seconds, tail = _mutated(mutant, scratch, tests, timeout_s)
        spent += seconds
        if code is None:
            return "timed out", spent, tail
        if code == 0:
            return "survived", spent, tail
        if code != 1:
            return "error", spent, f"pytest exited {code}: {tail}"
        test = failing_test(tail)
        if not confirm or test is None:
            return "killed", spent, tail
        started = time.monotonic()
        why = confirm_kill(mutant, test, tests, scratch, timeout_s) or ""
        spent += time.monotonic() - started
        if not why:
            return "killed", spent, f"{tail}\n{CONFIRMED}"
    return "unconfirmed", spent, f"{tail}\n{why}"


def equivalents(path: Path = EQUIVALENT) -> dict[str, str]:
    """{mutant key: why it changes nothing a user can see}."""
    if not path.is_file():
        return {}
    listed = tomllib.loads(path.read_text()).get("mutant", [])
    return {entry["key"]: entry["why"] for entry in listed}


def run_sample(mutants: list[GeneratedMutant], cmap: coverage_map.CoverageMap | None, *, jobs: int,
               root: Path = REPO, results_cache: Path | None = CACHE / "results.json",
               recorded_tests: dict[str, list[str]] | None = None, timeout_s: float = TIMEOUT_S,
               log: bool = True, confirm: bool = True) -> list[Outcome]:
    """Each mutant against its covering tests (from the map, or as recorded),
    ``jobs`` at a time, each runner in a scratch copy of its own (and each of
    its tests on a database of its own); each kill confirmed unless
    ``confirm`` is false."""
    known = equivalents()
    cache: dict[str, dict[str, object]] = {}
    if results_cache is not None and results_cache.is_file():
        cache = json.loads(results_cache.read_text())
    planned: list[tuple[GeneratedMutant, list[str], str]] = []
    outcomes: dict[str, Outcome] = {}
    for mutant in mutants:
        if recorded_tests is not None:
            tests = recorded_tests.get(mutant.key, [])
        else:
            assert cmap is not None
            tests = covering_tests(mutant, cmap)
        if not tests:
            outcomes[mutant.key] = Outcome(mutant.key, mutant.file, mutant.where, mutant.operator,
                                           "not covered", 0.0, [], "no test executes it", mutant.diff)
            continue
        if mutant.key in known:
            # listed with why no test can tell it from the code: not run
            # again (a survivor costs every covering test's time); take its
            # entry out to have it judged anew
            outcomes[mutant.key] = Outcome(mutant.key, mutant.file, mutant.where, mutant.operator,
                                           "equivalent", 0.0, tests, known[mutant.key], mutant.diff)
            continue
        cache_key = f"{mutant.key}:{tests_hash(root, tests)}"
        hit = cache.get(cache_key)
        if hit is not None and not (confirm and hit["verdict"] == "killed" and not confirmed(str(hit["detail"]))):
            outcomes[mutant.key] = Outcome(**hit)  # type: ignore[arg-type]
            continue
        planned.append((mutant, tests, cache_key))

    def one(item: tuple[GeneratedMutant, list[str], str], scratch: Path) -> None:
        mutant, tests, cache_key = item
        verdict, seconds, detail = run_one(mutant, tests, scratch, timeout_s, confirm=confirm)
        outcome = Outcome(mutant.key, mutant.file, mutant.where, mutant.operator, verdict,
                          round(seconds, 1), tests, detail, mutant.diff)
        outcomes[mutant.key] = outcome
        if verdict in ("killed", "survived", "timed out"):
            cache[cache_key] = asdict(outcome)
            if results_cache is not None:
                results_cache.parent.mkdir(parents=True, exist_ok=True)
                results_cache.write_text(json.dumps(cache, indent=0, sort_keys=True))
        if log:
            _said(outcome)

    _each_in_scratch(planned, one, jobs=jobs, root=root)
    final = []
    for mutant in mutants:
        outcome = outcomes[mutant.key]
        if outcome.verdict in ("survived", "not covered") and mutant.key in known:
            outcome = Outcome(**{**asdict(outcome), "verdict": "equivalent", "detail": known[mutant.key]})
        final.append(outcome)
    return final


def _each_in_scratch(items: Sequence[T], work: Callable[[T, Path], None], *, jobs: int, root: Path) -> None:
    """``work(item, scratch)`` for each item, ``jobs`` at a time, each runner
    with a scratch copy of the repository to itself."""
    if not items:
        return
    runners = max(1, min(jobs, len(items)))
    with ExitStack() as stack:
        free: SimpleQueue[Path] = SimpleQueue()
        for _ in range(runners):
            free.put(stack.enter_context(scratch_copy(root)))

        def one(item: T) -> None:
            scratch = free.get()
            try:
                work(item, scratch)
            finally:
                free.put(scratch)

        with ThreadPoolExecutor(max_workers=runners) as pool:
            list(pool.map(one, items))


def _said(outcome: Outcome) -> None:
    sys.stdout.write(f"{outcome.verdict:<11}{outcome.seconds:6.1f} s  {outcome.key}  {outcome.file}  "
                     f"{outcome.where}  [{outcome.operator}]  {len(outcome.tests)} tests\n")
    sys.stdout.flush()


def confirmed(detail: str) -> bool:
    return detail.endswith(CONFIRMED)


# --- the report --------------------------------------------------------------

# unconfirmed: killed, but its failing test failed without the mutant too
# (or passed with it, alone), twice: no kill, and not a survivor either
VERDICTS = ("killed", "equivalent", "survived", "not covered", "timed out", "unconfirmed", "error")


def table(outcomes: list[Outcome], sizes: dict[str, int]) -> str:
    by_file: dict[str, Counter[str]] = defaultdict(Counter)
    for outcome in outcomes:
        by_file[outcome.file][outcome.verdict] += 1
    header = f"{'file':<36}{'population':>11}{'sampled':>8}" + "".join(f"{v:>12}" for v in VERDICTS) + f"{'killed %':>10}"
    lines = [header, "-" * len(header)]
    total: Counter[str] = Counter()
    for file in sorted(set(sizes) | set(by_file)):
        counts = by_file.get(file, Counter())
        total.update(counts)
        sampled = sum(counts.values())
        lines.append(f"{file:<36}{sizes.get(file, 0):>11}{sampled:>8}"
                     + "".join(f"{counts[v]:>12}" for v in VERDICTS) + f"{_score(counts):>10}")
    lines.append("-" * len(header))
    lines.append(f"{'all':<36}{sum(sizes.values()):>11}{sum(total.values()):>8}"
                 + "".join(f"{total[v]:>12}" for v in VERDICTS) + f"{_score(total):>10}")
    return "\n".join(lines) + "\n"


def _score(counts: Counter[str]) -> str:
    """Killed over the mutants that could be judged (equivalents left out)."""
    judged = sum(counts.values()) - counts["equivalent"] - counts["error"]
    return f"{100 * counts['killed'] / judged:.0f} %" if judged else "-"


def write_report(outcomes: list[Outcome], sizes: dict[str, int], *, seed: str, seconds: float,
                 map_seconds: float | None, map_test_files: list[str] | None, folder: Path = REPORT) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    summary = table(outcomes, sizes)
    (folder / "results.json").write_text(json.dumps(
        {"seed": seed, "seconds": round(seconds), "population": sizes,
         "map_seconds": map_seconds, "map_test_files": map_test_files,
         "mutants": [asdict(o) for o in sorted(outcomes, key=lambda o: (o.file, o.key))]},
        indent=1, sort_keys=True) + "\n")
    lines = [f"# Generated mutants: seed {seed}, {len(outcomes)} sampled, {seconds:.0f} s\n",
             "Made by `make mutants-all` (tests/mutants/generated.py); killed % is killed over the sampled",
             "mutants less the equivalent ones and the errors. Not covered: no test executes it.\n",
             "```", summary.rstrip(), "```\n"]
    for verdict in ("survived", "not covered", "timed out", "unconfirmed", "error", "equivalent"):
        chosen = [o for o in outcomes if o.verdict == verdict]
        if not chosen:
            continue
        lines.append(f"## {verdict} ({len(chosen)})\n")
        for o in sorted(chosen, key=lambda o: (o.file, o.where)):
            lines.append(f"### {o.key}: {o.file} {o.where} [{o.operator}]\n")
            if verdict == "equivalent":
                lines.append(f"Why: {o.detail}\n")
            elif o.tests:
                lines.append(f"{len(o.tests)} tests ran; {o.detail.splitlines()[-1] if o.detail else ''}\n")
            lines.append("```diff\n" + o.diff.rstrip() + "\n```\n")
    (folder / "README.md").write_text("\n".join(lines))
    return summary


# --- entry points ------------------------------------------------------------

def commit_seed(root: Path = REPO) -> str:
    found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False)
    return found.stdout.strip()[:12] or "no-commit"


def main_all(args: argparse.Namespace) -> int:
    started = time.monotonic()
    every = population(REPO)
    sizes = dict(Counter(m.file for m in every))
    if args.again and args.survivors:
        return main_survivors(args, every, sizes, started)
    if args.again and args.confirm:
        return main_confirm(args, every, sizes, started)
    eligible = [m for m in every if m.file in SQL_FILES or m.file in py_mutants.MODULES]
    if args.files:
        eligible = [m for m in eligible if m.file in args.files]
    kept: list[Outcome] = []
    if args.again:
        # the report's sample once more, after new tests: the same mutants,
        # whatever the population's other changes did to a fresh draw
        recorded = json.loads((REPORT / "results.json").read_text())
        # over some files, the report keeps its other files' verdicts, of
        # the mutants still made from the code
        made = {m.key for m in every}
        kept = [Outcome(**m) for m in recorded["mutants"]
                if args.files and m["file"] not in args.files and m["key"] in made]
        args.seed = recorded["seed"]
        keys = {m["key"] for m in recorded["mutants"] if not args.files or m["file"] in args.files}
        sample = [m for m in eligible if m.key in keys]
        gone = len(keys) - len(sample)
        if gone:
            sys.stdout.write(f"{gone} of the report's mutants are no longer made from the code\n")
    else:
        sample = stratified_sample(eligible, args.sample, args.seed)
    sys.stdout.write(f"population {len(every)} ({len(eligible)} in the sampled files); sample {len(sample)}, "
                     f"seed {args.seed}; {time.monotonic() - started:.0f} s to make\n")
    test_files = candidate_test_files(REPO, sample)
    if args.again:
        test_files = sorted(set(test_files) | recorded_test_files(REPO, recorded["mutants"], keys))
    sources = sorted({m.file for m in every} | {f"sql/{p.name}" for p in (REPO / "sql").glob("*.sql")})
    cmap, built = coverage_map.cached(REPO, CACHE, test_files, list(py_mutants.MODULES), sources, jobs=args.jobs)
    sys.stdout.write(f"coverage map over {len(test_files)} test files: "
                     f"{'built in' if built else 'cached, built in'} {cmap.seconds:.0f} s; "
                     f"{len(cmap.durations)} tests passed unmutated, {len(cmap.failed)} failed (left out)\n")
    outcomes = run_sample(sample, cmap, jobs=args.jobs)
    if kept:
        # a run over some files does not say how long the whole sample takes
        summary = write_report(outcomes + kept, sizes, seed=args.seed, seconds=recorded["seconds"],
                               map_seconds=recorded["map_seconds"], map_test_files=recorded["map_test_files"])
    else:
        summary = write_report(outcomes, sizes, seed=args.seed, seconds=time.monotonic() - started,
                               map_seconds=cmap.seconds, map_test_files=cmap.test_files)
    sys.stdout.write(summary)
    sys.stdout.write(f"report: {REPORT.relative_to(REPO)}/README.md; {time.monotonic() - started:.0f} s\n")
    bad = [o for o in outcomes if o.verdict not in ("killed", "equivalent")]
    return 1 if bad else 0


SURVIVING = ("survived", "timed out", "not covered", "unconfirmed")


def main_survivors(args: argparse.Namespace, every: list[GeneratedMutant], sizes: dict[str, int],
                   started: float) -> int:
    """The report's survivors (survived, timed out, not covered, unconfirmed) once more,
    after new tests: each against the test files written since the report's
    map that name its code, then the tests the report recorded for it, with
    every parameter of a parametrized one (a new case is a new test). The
    report's other verdicts stand: a new test cannot bring a killed mutant
    back, and the listed ones are read from the list again."""
    recorded = json.loads((REPORT / "results.json").read_text())
    made = {m.key: m for m in every}
    known = equivalents()
    mapped = set(recorded["map_test_files"] or [])
    kept: list[Outcome] = []
    again: list[GeneratedMutant] = []
    wanted: dict[str, list[str]] = {}
    for entry in recorded["mutants"]:
        mutant = made.get(entry["key"])
        if mutant is None:
            sys.stdout.write(f"{entry['key']} ({entry['file']} {entry['where']}) is no longer made from the code\n")
        elif entry["verdict"] in SURVIVING:
            again.append(mutant)
            new_files = [f for f in candidate_test_files(REPO, [mutant]) if f not in mapped]
            # a recorded test's every parameter, those added since included
            families = list(dict.fromkeys(test.split("[", 1)[0] for test in entry["tests"]))
            wanted[mutant.key] = new_files + families
        elif entry["key"] in known:
            kept.append(Outcome(**{**entry, "verdict": "equivalent", "detail": known[entry["key"]]}))
        else:
            kept.append(Outcome(**entry))
    collected = collected_tests(REPO, {t.split("::", 1)[0] for tests in wanted.values() for t in tests})
    outcomes = run_sample(again, None, jobs=args.jobs,
                          recorded_tests={key: tests_now(tests, collected) for key, tests in wanted.items()})
    summary = write_report(outcomes + kept, sizes, seed=recorded["seed"], seconds=recorded["seconds"],
                           map_seconds=recorded["map_seconds"], map_test_files=recorded["map_test_files"])
    sys.stdout.write(summary)
    sys.stdout.write(f"{len(again)} survivors run again in {time.monotonic() - started:.0f} s; "
                     f"report: {REPORT.relative_to(REPO)}/README.md\n")
    return 1 if any(o.verdict not in ("killed", "equivalent") for o in outcomes) else 0


def main_confirm(args: argparse.Namespace, every: list[GeneratedMutant], sizes: dict[str, int],
                 started: float) -> int:
    """The report's kills not yet confirmed, confirmed (``confirm_kill``).
    A kill that cannot be confirmed is reported unconfirmed, with why, for
    ``--again --survivors`` to judge (against the tests written for it since,
    or listed as equivalent): its recorded tests alone already let it
    through once. The report's other verdicts stand; it is written after
    each mutant, so that a run stopped part way resumes where it stopped."""
    recorded = json.loads((REPORT / "results.json").read_text())
    made = {m.key: m for m in every}
    to_confirm = [Outcome(**entry) for entry in recorded["mutants"] if entry["key"] in made
                  and entry["verdict"] == "killed" and not confirmed(entry["detail"])]
    # the kills most likely the machine's, first: by a system test, by a
    # fixture's error, by an integration test; a unit test's last
    to_confirm.sort(key=_doubt)
    kept = {entry["key"]: Outcome(**entry) for entry in recorded["mutants"] if entry["key"] in made}
    collected = collected_tests(REPO, {t.split("::", 1)[0] for o in to_confirm for t in o.tests})
    sys.stdout.write(f"{len(to_confirm)} of the report's kills to confirm\n")
    writing = threading.Lock()

    def one(outcome: Outcome, scratch: Path) -> None:
        mutant = made[outcome.key]
        killer = failing_test(outcome.detail)
        tests = tests_now(outcome.tests, collected)
        # the test as it is named today (renamed, or a file's whole when gone)
        killer_now = tests_now([killer], collected)[:1] if killer is not None else []
        began = time.monotonic()
        why = (confirm_kill(mutant, killer_now[0], tests, scratch, TIMEOUT_S) or "" if killer_now
               else "its failing test is no longer collected")
        spent = round(outcome.seconds + time.monotonic() - began, 1)
        if why:
            judged = Outcome(**{**asdict(outcome), "verdict": "unconfirmed", "tests": tests,
                                "detail": f"{outcome.detail}\n{why}", "seconds": spent})
        else:
            judged = Outcome(**{**asdict(outcome), "detail": f"{outcome.detail}\n{CONFIRMED}", "seconds": spent})
        with writing:
            kept[outcome.key] = judged
            write_report(list(kept.values()), sizes, seed=recorded["seed"], seconds=recorded["seconds"],
                         map_seconds=recorded["map_seconds"], map_test_files=recorded["map_test_files"])
            _said(judged)

    _each_in_scratch(to_confirm, one, jobs=args.jobs, root=REPO)
    outcomes = list(kept.values())
    sys.stdout.write(table(outcomes, sizes))
    sys.stdout.write(f"{len(to_confirm)} kills confirmed or not in {time.monotonic() - started:.0f} s; "
                     f"report: {REPORT.relative_to(REPO)}/README.md\n")
    return 1 if any(o.verdict not in ("killed", "equivalent") for o in outcomes) else 0


def _doubt(outcome: Outcome) -> int:
    """How likely a kill is the machine's rather than the mutant's: 0, most."""
    killer = failing_test(outcome.detail) or ""
    if outcome.verdict == "unconfirmed" or killer.startswith("tests/system/"):
        return 0
    if re.search(r"^ERROR ", outcome.detail, re.MULTILINE):
        return 1
    return 2 if killer.startswith("tests/integration/") else 3


def _killed_by_system_test(detail: str) -> bool:
    """Whether the test a kill's output names as failing is a system test."""
    failed = failing_test(detail)
    return failed is not None and failed.startswith("tests/system/")


def main_ci(args: argparse.Namespace) -> int:
    """A few verified mutants, chosen by the commit's seed, with their recorded tests."""
    started = time.monotonic()
    recorded = json.loads((REPORT / "results.json").read_text())
    # killed in the report, the kill confirmed (an equivalent one would only
    # spend CI's time surviving, a kill by the machine's load would survive
    # here), and quick enough that six fit CI's five minutes two at a time
    # and killed by a test of one process: a system test's failure can be
    # the machine's load as well as the mutant, on either side
    verified = [m for m in recorded["mutants"] if m["verdict"] == "killed" and confirmed(m["detail"])
                and m["seconds"] <= CI_MUTANT_S and not _killed_by_system_test(m["detail"])]
    # the code moves under the report: a mutant whose line changed since is no
    # longer made, and is said, not sampled (make mutants-all judges it anew)
    made = {m.key: m for m in population(REPO, {m["file"] for m in verified})}
    gone = sorted(m["key"] for m in verified if m["key"] not in made)
    if gone:
        sys.stdout.write(f"generated mutants: {len(gone)} of the report's {len(verified)} verified mutants are no "
                         f"longer made from the code (their lines changed): {', '.join(gone)}\n")
    verified = [m for m in verified if m["key"] in made]
    if not verified:
        sys.stderr.write("mutants: none of the report's verified mutants is made from the code: "
                         "run make mutants-all and commit its report\n")
        return 2
    rng = random.Random(args.seed)
    chosen = rng.sample(verified, min(args.sample, len(verified)))
    wanted = {m["key"] for m in chosen}
    collected = collected_tests(REPO, {t.split("::", 1)[0] for m in chosen for t in m["tests"]})
    tests = {m["key"]: tests_now(m["tests"], collected) for m in chosen}
    # CI asks whether the tests still kill them, which a kill answers
    # (confirming it would double the time of those that are)
    outcomes = run_sample([made[k] for k in sorted(wanted)], None, jobs=args.jobs, results_cache=None,
                          recorded_tests=tests, confirm=False)
    for outcome in outcomes:
        if outcome.verdict not in ("killed", "equivalent"):
            sys.stdout.write(f"\n{outcome.verdict}: {outcome.key} {outcome.file} {outcome.where}\n"
                             f"{outcome.detail}\n{outcome.diff}\n")
    counts = Counter(o.verdict for o in outcomes)
    sys.stdout.write(f"generated mutants (seed {args.seed}): {dict(counts)} in {time.monotonic() - started:.0f} s\n")
    return 0 if all(o.verdict in ("killed", "equivalent") for o in outcomes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants.generated", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", type=int, default=400, help="mutants sampled (default 400)")
    parser.add_argument("--seed", default=None, help="the sample's seed (default: 'mutants-all', or the commit with --ci)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once, each in a copy of its own")
    parser.add_argument("--files", nargs="*", help="with --again: only these files' mutants")
    parser.add_argument("--ci", action="store_true", help="a few verified mutants chosen by the commit")
    parser.add_argument("--again", action="store_true", help="the report's sample again (after new tests)")
    parser.add_argument("--survivors", action="store_true",
                        help="with --again: only the report's survivors, against the test files written since")
    parser.add_argument("--confirm", action="store_true",
                        help="with --again: confirm the report's kills that are not yet (each new kill is)")
    parser.add_argument("--population", action="store_true", help="print the population per file and operator")
    args = parser.parse_args(argv)
    if args.population:
        every = population(REPO)
        for (file, operator), count in sorted(Counter((m.file, m.operator) for m in every).items()):
            sys.stdout.write(f"{file:<36}{operator:<44}{count:>6}\n")
        sys.stdout.write(f"{'all':<80}{len(every):>6}\n")
        return 0
    if args.ci:
        args.seed = args.seed or commit_seed()
        return main_ci(args)
    if args.files and not args.again:
        # a fresh sample of a few files would replace the whole report
        parser.error("--files runs the report's sample again over those files: give --again too")
    args.seed = args.seed or "mutants-all"
    return main_all(args)


if __name__ == "__main__":
    sys.exit(main())
