"""The mutants' list stays in step with the code it mutates."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.mutants.catalog import MUTANTS, Mutant
from tests.mutants.generated import EQUIVALENT
from tests.mutants.runner import REPO, TargetMissing, check_targets


def test_every_mutant_target_is_found_exactly_once() -> None:
    """A restructuring that moves a mutant's target fails here until the list follows it."""
    check_targets(MUTANTS, REPO)


def test_mutant_names_are_unique_and_each_names_its_tests() -> None:
    """Each mutant is asked for by a name of its own and runs some tests that exist."""
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    for mutant in MUTANTS:
        assert mutant.tests, mutant.name
        for test in mutant.tests:
            assert (REPO / test.split("::", 1)[0]).exists(), (mutant.name, test)


def test_a_target_found_twice_or_not_at_all_is_refused(tmp_path: Path) -> None:
    """check_targets names a mutant whose target is ambiguous or gone."""
    (tmp_path / "a.sql").write_text("x = 1\nx = 1\ny = 2\n")
    twice = Mutant(name="twice", invariant="-", tier="unit", file="a.sql", edits=(("x = 1", "x = 2"),), tests=("t",))
    gone = Mutant(name="gone", invariant="-", tier="unit", file="a.sql", edits=(("z = 3", "z = 4"),), tests=("t",))
    once = Mutant(name="once", invariant="-", tier="unit", file="a.sql", edits=(("y = 2", "y = 3"),), tests=("t",))
    check_targets([once], tmp_path)
    with pytest.raises(TargetMissing, match="twice: a target is found 2 times"):
        check_targets([twice], tmp_path)
    with pytest.raises(TargetMissing, match="gone: a target is found 0 times"):
        check_targets([gone], tmp_path)


def test_every_listed_equivalent_says_where_and_why_once() -> None:
    """tests/mutants/equivalent.toml: each entry a key of its own, where it is and why no user can tell it."""
    listed = tomllib.loads(EQUIVALENT.read_text()).get("mutant", [])
    keys = [entry["key"] for entry in listed]
    assert len(keys) == len(set(keys))
    for entry in listed:
        assert set(entry) == {"key", "where", "why"} and entry["why"].strip(), entry
