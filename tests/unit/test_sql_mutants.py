"""The SQL mutants (tests/mutants/sql_mutants.py): every named statement goes
through PostgreSQL's parser and back unchanged, and each operator changes one
node of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.queries import QUERIES, parse
from tests.mutants import sql_mutants
from tests.mutants.sql_mutants import Block

REPO = Path(__file__).resolve().parents[2]


def test_every_complete_named_statement_round_trips_through_the_parser() -> None:
    """Printed back from its parse tree, each statement parses to the same tree with the same placeholders."""
    found = sql_mutants.blocks(REPO)
    assert {block.name for block in found} == QUERIES.keys()
    complete = [block for block in found if sql_mutants.complete(block)]
    assert len(complete) >= 90
    assert [block.name for block in complete if not sql_mutants.round_trips(block.statement)] == []


def test_only_parts_of_other_statements_are_left_unparsed() -> None:
    """A block that does not parse alone is one that another block includes."""
    found = sql_mutants.blocks(REPO)
    included = {block.name for block in found if f"-- include: {block.name}\n" in
                "\n".join(other.raw + "\n" for other in found)}
    assert {block.name for block in found if not sql_mutants.complete(block)} <= included


def test_a_mutant_written_over_its_block_is_what_the_query_layer_reads() -> None:
    """The mutated file parses (shared/queries.py) to the mutant for that name and to the same text for the rest."""
    block = next(b for b in sql_mutants.blocks(REPO) if b.name == "job_claim")
    mutant = sql_mutants.mutants_of(block)[0]
    text = (REPO / block.file).read_text()
    others = [(REPO / "sql" / name).read_text() for name in ("api.sql", "batch.sql", "common.sql", "console.sql",
                                                              "sweeper.sql", "worker.sql") if f"sql/{name}" != block.file]
    mutated = parse(mutant.apply(text), *others)
    assert mutated["job_claim"] == mutant.mutated
    assert {name: q for name, q in mutated.items() if name != "job_claim"} == \
        {name: q for name, q in QUERIES.items() if name != "job_claim"}


@pytest.mark.parametrize(("statement", "operator", "expected"), [
    ("SELECT 1 FROM t WHERE a = %(x)s", "comparison", "SELECT 1 FROM t WHERE a <> %(x)s"),
    ("SELECT 1 FROM t WHERE a < 2", "comparison", "SELECT 1 FROM t WHERE a <= 2"),
    ("SELECT 1 FROM t WHERE a AND b", "conjunct", "SELECT 1 FROM t WHERE b"),
    ("SELECT 1 FROM t JOIN u ON t.a = u.a AND u.b", "conjunct", "SELECT 1 FROM t INNER JOIN u ON u.b"),
    ("SELECT 1 FROM t WHERE s IN ('a', 'b')", "in-list", "SELECT 1 FROM t WHERE s IN ('b')"),
    ("SELECT CASE WHEN a THEN 1 ELSE 2 END", "case", "SELECT CASE WHEN a THEN 2 ELSE 1 END"),
    ("SELECT a + b", "arithmetic", "SELECT a - b"),
    ("SELECT coalesce(a, 0)", "argument", "SELECT COALESCE(0)"),
    ("SELECT greatest(a, 0)", "argument", "SELECT GREATEST(0)"),
    ("SELECT 1 FROM t LIMIT 5", "limit", "SELECT 1 FROM t LIMIT (5 + 1)"),
    ("SELECT 1 FROM t FOR UPDATE SKIP LOCKED", "lock", "SELECT 1 FROM t"),
    ("SELECT 1 FROM t FOR UPDATE SKIP LOCKED", "skip-locked", "SELECT 1 FROM t FOR UPDATE"),
])
def test_each_operator_changes_one_node(statement: str, operator: str, expected: str) -> None:
    """The first mutant of each operator is the one-node change it names, placeholders kept by name."""
    block = Block(file="sql/x.sql", name="x", start=0, end=0, raw=statement, statement=statement)
    made = [m.mutated for m in sql_mutants.mutants_of(block) if m.operator == operator]
    assert made and made[0] == expected
