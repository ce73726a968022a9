"""The generated mutants' sample and map (tests/mutants/generated.py,
coverage_map.py): seeded, spread over files and operators, and each mutant
given only the tests that executed its code and passed unmutated."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.mutants import generated
from tests.mutants.coverage_map import CoverageMap
from tests.mutants.sql_mutants import SqlMutant


def _mutants() -> list[SqlMutant]:
    made = []
    for file, operators, per in (("sql/a.sql", ("comparison", "conjunct"), 50), ("sql/b.sql", ("case",), 5),
                                 ("sql/c.sql", ("limit", "lock", "in-list"), 2)):
        for operator in operators:
            for n in range(per):
                made.append(SqlMutant(file=file, statement=f"s{n}", operator=operator, site=n, start=0, end=0,
                                      original="SELECT 1", mutated=f"SELECT {n + 2}"))
    return made


def test_the_sample_is_fixed_by_its_seed() -> None:
    """One seed, one sample; another seed, another sample."""
    mutants = _mutants()
    first = [m.key for m in generated.stratified_sample(mutants, 12, "a")]
    assert first == [m.key for m in generated.stratified_sample(list(reversed(mutants)), 12, "a")]
    assert first != [m.key for m in generated.stratified_sample(mutants, 12, "b")]
    assert len(set(first)) == 12


def test_a_small_sample_reaches_every_file_and_operator() -> None:
    """A file with few mutants is sampled as surely as one with many: strata are taken in turn."""
    sample = generated.stratified_sample(_mutants(), 9, "seed")
    assert {m.file for m in sample} == {"sql/a.sql", "sql/b.sql", "sql/c.sql"}
    by_file = Counter(m.file for m in sample)
    assert by_file == {"sql/a.sql": 3, "sql/b.sql": 3, "sql/c.sql": 3}
    assert {m.operator for m in sample if m.file == "sql/c.sql"} == {"limit", "lock", "in-list"}


def test_a_sample_larger_than_the_population_is_all_of_it() -> None:
    mutants = _mutants()
    assert sorted(m.key for m in generated.stratified_sample(mutants, 10_000, "s")) == sorted(m.key for m in mutants)


def test_a_mutant_runs_only_the_tests_that_executed_its_code_and_passed() -> None:
    """Tests that failed unmutated or never read the statement are not its tests; the fastest run first."""
    cmap = CoverageMap(statements={"s1": ["t::slow", "t::fast", "t::broken"]},
                       lines={"worker/ends.py": {10: ["t::fast"]}},
                       durations={"t::slow": 9.0, "t::fast": 0.5}, failed=["t::broken"])
    mutant = SqlMutant(file="sql/a.sql", statement="s1", operator="comparison", site=0, start=0, end=0,
                       original="SELECT 1", mutated="SELECT 2")
    assert generated.covering_tests(mutant, cmap) == ["t::fast", "t::slow"]
    other = SqlMutant(file="sql/a.sql", statement="s2", operator="comparison", site=0, start=0, end=0,
                      original="SELECT 1", mutated="SELECT 2")
    assert generated.covering_tests(other, cmap) == []


def test_a_mutant_no_test_executes_is_not_covered_and_fails_the_run() -> None:
    """Not covered counts as a survivor: the report shows it and nothing is run for it."""
    mutant = SqlMutant(file="sql/a.sql", statement="nobody", operator="comparison", site=0, start=0, end=0,
                       original="SELECT 1 WHERE 1 = 1", mutated="SELECT 1 WHERE 1 <> 1")
    [outcome] = generated.run_sample([mutant], CoverageMap(), jobs=1, results_cache=None, log=False)
    assert outcome.verdict == "not covered"
    assert "not covered" in generated.table([outcome], {"sql/a.sql": 1})
    assert generated._score(Counter({"killed": 9, "not covered": 1, "equivalent": 5})) == "90 %"


def test_a_line_run_only_at_import_is_covered_by_every_test_that_ran_its_module() -> None:
    """A constant or a signature runs before any test: the tests of the module are its tests; a line never run has none."""
    cmap = CoverageMap(lines={"worker/ends.py": {3: [], 10: ["t::a"], 11: ["t::b"]}},
                       durations={"t::a": 1.0, "t::b": 2.0})
    assert cmap.tests_of_line("worker/ends.py", 3) == ["t::a", "t::b"]
    assert cmap.tests_of_line("worker/ends.py", 10) == ["t::a"]
    assert cmap.tests_of_line("worker/ends.py", 99) == []
    assert cmap.tests_of_line("worker/held.py", 3) == []


def test_a_line_run_at_import_is_covered_by_every_test_of_its_module_whichever_test_imported_it() -> None:
    """The test an import is counted to is an accident (the first to import the module in its process, or one that
    starts a process): a mutant of a constant, a class body or a signature runs every test of its module, one in a
    function's body only the tests that ran that line."""
    source = ("LIMIT = 5 * 60.0\n"
              "\n"
              "class Row:\n"
              "    frozen = True\n"
              "\n"
              "def wait(after: float = LIMIT) -> float:\n"
              "    return after * 2\n")
    assert [generated.runs_at_import(source, line) for line in (1, 4, 6, 7)] == [True, True, True, False]
    cmap = CoverageMap(lines={"worker/ends.py": {1: ["t::imported_first"], 7: ["t::waits"]}},
                       durations={"t::imported_first": 1.0, "t::waits": 2.0})
    assert cmap.tests_of_line("worker/ends.py", 1, at_import=True) == ["t::imported_first", "t::waits"]
    assert cmap.tests_of_line("worker/ends.py", 7) == ["t::waits"]


def test_recorded_tests_renamed_or_merged_since_the_report_run_as_they_are_named_today() -> None:
    collected = {
        "tests/integration/test_a.py::test_kept",
        "tests/integration/test_a.py::test_merged[by-another]",
        "tests/integration/test_a.py::test_merged[taken-again]",
        "tests/integration/test_a.py::test_now_plain",
        "tests/integration/test_b.py::test_other",
        "tests/integration/test_c.py::test_one",
        "tests/integration/test_c.py::test_two",
    }
    recorded = [
        "tests/integration/test_a.py::test_kept",
        "tests/integration/test_a.py::test_merged",
        "tests/integration/test_a.py::test_now_plain[x]",
        "tests/integration/test_c.py::test_renamed",
        "tests/integration/test_c.py::test_one",
        "tests/integration/test_gone.py::test_any",
    ]
    assert generated.tests_now(recorded, collected) == [
        "tests/integration/test_a.py::test_kept",
        "tests/integration/test_a.py::test_merged[by-another]",
        "tests/integration/test_a.py::test_merged[taken-again]",
        "tests/integration/test_a.py::test_now_plain",
        "tests/integration/test_c.py",
    ]
    # in the recorded order: the first to fail ends the run
    assert generated.tests_now(list(reversed(recorded)), collected) == [
        "tests/integration/test_c.py",
        "tests/integration/test_a.py::test_now_plain",
        "tests/integration/test_a.py::test_merged[by-another]",
        "tests/integration/test_a.py::test_merged[taken-again]",
        "tests/integration/test_a.py::test_kept",
    ]


def test_a_mutant_run_past_its_timeout_ends_with_every_process_its_tests_started(tmp_path: Path) -> None:
    """A mutant's tests that start a process and hang are timed out, and the process they started goes with
    them: left running, it would hold the database's connections through the next mutants' runs."""
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "a.sql").write_text("SELECT 1 WHERE 1 = 1")
    child_pid = tmp_path / "child.pid"
    (tmp_path / "test_hang.py").write_text(
        "import subprocess, sys, time\n"
        "def test_hang():\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(120)\n")
    mutant = SqlMutant(file="sql/a.sql", statement="s", operator="comparison", site=0, start=0, end=0,
                       original="SELECT 1 WHERE 1 = 1", mutated="SELECT 1 WHERE 1 <> 1")
    # long enough for pytest to start and reach the test on a busy machine (5 s was not, once, beside the
    # suite's other worker), far below the test's hang
    verdict, seconds, _ = generated.run_one(mutant, ["test_hang.py"], tmp_path, timeout_s=20.0)
    assert verdict == "timed out" and seconds < 60
    pid = int(child_pid.read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)


def _scratch_with_test(root: Path, body: str) -> SqlMutant:
    """A scratch tree with sql/a.sql and a test_it.py whose test runs ``body``
    (it can read the query file); the mutant that turns its ``=`` into ``<>``."""
    (root / "sql").mkdir()
    (root / "sql" / "a.sql").write_text("SELECT 1 WHERE 1 = 1")
    (root / "test_it.py").write_text(
        "from pathlib import Path\n"
        "HERE = Path(__file__).parent\n"
        "def test_it():\n"
        + "".join(f"    {line}\n" for line in body.splitlines()))
    return SqlMutant(file="sql/a.sql", statement="s", operator="comparison", site=0, start=0, end=0,
                     original="SELECT 1 WHERE 1 = 1", mutated="SELECT 1 WHERE 1 <> 1")


@pytest.mark.parametrize("ci", [None, "true"])
def test_a_kill_is_confirmed_when_its_test_fails_with_the_mutant_and_passes_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ci: str | None) -> None:
    """Also where CI is set, under which pytest writes an assertion's whole message below the failing test's
    name, so that the name is no longer among the output's last lines."""
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    mutant = _scratch_with_test(tmp_path, "assert '<>' not in (HERE / 'sql' / 'a.sql').read_text()")
    verdict, _, detail = generated.run_one(mutant, ["test_it.py"], tmp_path, timeout_s=60.0)
    assert verdict == "killed" and generated.confirmed(detail)
    assert (tmp_path / "sql" / "a.sql").read_text() == "SELECT 1 WHERE 1 = 1"


def test_a_test_that_fails_without_the_mutant_too_kills_nothing(tmp_path: Path) -> None:
    """A test failing for the machine (a refused connection, a slow process) fails either way: the kill is said
    unconfirmed, which the score counts against, not for."""
    mutant = _scratch_with_test(tmp_path, "raise ConnectionRefusedError('the server is full')")
    verdict, _, detail = generated.run_one(mutant, ["test_it.py"], tmp_path, timeout_s=60.0)
    assert verdict == "unconfirmed" and "without the mutant" in detail
    assert generated._score(Counter({"killed": 9, "unconfirmed": 1})) == "90 %"


def test_a_kill_the_mutant_does_not_repeat_is_judged_again(tmp_path: Path) -> None:
    """A test that failed once for a passing reason, and passes with the mutant alone, is no kill: the mutant
    runs again, and here survives."""
    mutant = _scratch_with_test(tmp_path, "flag = HERE / 'failed-once'\n"
                                          "if not flag.exists():\n"
                                          "    flag.write_text('')\n"
                                          "    raise TimeoutError('a slow machine')")
    verdict, _, detail = generated.run_one(mutant, ["test_it.py"], tmp_path, timeout_s=60.0)
    assert verdict == "survived" and not generated.confirmed(detail)


@pytest.mark.parametrize("detail, test", [
    ("FAILED tests/unit/test_a.py::test_b - AssertionError: x - y\n1 failed", "tests/unit/test_a.py::test_b"),
    ("ERROR tests/integration/test_m.py::test_n[invalid utf-8]\n!!! stopping\n211 passed, 1 error",
     "tests/integration/test_m.py::test_n[invalid utf-8]"),
    ("ERROR tests/unit/test_a.py - ImportError\n1 error", None),
    ("1 failed in 3.0s", None),
])
def test_the_failing_test_is_read_from_the_kills_output(detail: str, test: str | None) -> None:
    assert generated.failing_test(detail) == test


def test_a_failure_an_earlier_test_left_is_confirmed_with_the_tests_before_it(tmp_path: Path) -> None:
    """The mutant makes the first test leave something behind that the second trips on (a fixture's error
    in the next test, say): alone the second passes, after the first it fails, and without the mutant both
    pass. The kill is the mutant's, and confirmed."""
    mutant = _scratch_with_test(tmp_path, "pass")
    (tmp_path / "test_it.py").write_text(
        "from pathlib import Path\n"
        "HERE = Path(__file__).parent\n"
        "def test_leaves():\n"
        "    if '<>' in (HERE / 'sql' / 'a.sql').read_text():\n"
        "        (HERE / 'left-behind').write_text('')\n"
        "def test_trips():\n"
        "    left = HERE / 'left-behind'\n"
        "    found = left.exists()\n"
        "    left.unlink(missing_ok=True)\n"
        "    assert not found\n")
    tests = ["test_it.py::test_leaves", "test_it.py::test_trips"]
    verdict, _, detail = generated.run_one(mutant, tests, tmp_path, timeout_s=60.0)
    assert verdict == "killed" and generated.confirmed(detail)
    assert "test_it.py::test_trips" in detail


def test_the_tests_through_the_failing_one_are_those_pytest_ran_up_to_it() -> None:
    tests = ["tests/unit/test_a.py::test_x", "tests/integration/test_b.py", "tests/unit/test_c.py::test_p"]
    assert generated.tests_through(tests, "tests/integration/test_b.py::test_y[one]") == tests[:2]
    assert generated.tests_through(tests, "tests/unit/test_c.py::test_p[2]") == tests
    assert generated.tests_through(tests, "tests/unit/test_a.py::test_x") == tests[:1]
    assert generated.tests_through(tests, "tests/unit/test_a.py::test_xy") == tests


def test_a_run_of_the_reports_sample_maps_the_test_files_the_report_ran_for_it(tmp_path: Path) -> None:
    """Over some files, the report's sample is mapped against the test files the report ran for those mutants
    too (a statement's tests found by its name alone leave out those that reach it through a module), of those
    mutants only, and only the files still there."""
    (tmp_path / "tests" / "integration").mkdir(parents=True)
    for name in ("test_by_module.py", "test_named.py", "test_other.py"):
        (tmp_path / "tests" / "integration" / name).write_text("")
    recorded = [
        {"key": "a", "tests": ["tests/integration/test_by_module.py::test_x",
                               "tests/integration/test_named.py::test_y[1]",
                               "tests/integration/test_deleted.py::test_z"]},
        {"key": "b", "tests": ["tests/integration/test_other.py::test_w"]},
    ]
    assert generated.recorded_test_files(tmp_path, recorded, {"a"}) == {
        "tests/integration/test_by_module.py", "tests/integration/test_named.py"}
    assert generated.recorded_test_files(tmp_path, recorded, set()) == set()
