"""The named blocks of the callers' sql/*.sql files (shared/queries.py):
parsed without their descriptions, whole, mistakes refused at import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared.queries import QUERIES, compact, parse


def test_named_queries_are_parsed_without_their_descriptions() -> None:
    """Each block becomes one statement named by its header, the comment lines after the header dropped, and
    the comments within it too."""
    parsed = parse("-- name: one\n-- what it does\nSELECT 1;\n\n-- name: two\nSELECT\n  -- inline\n  2;\n")
    assert parsed == {"one": "SELECT 1", "two": "SELECT\n2"}
    assert all(statement and not statement.startswith("--") for statement in QUERIES.values())


def test_a_query_defined_twice_is_refused() -> None:
    """Two blocks with one name are a mistake, not an override."""
    with pytest.raises(ValueError, match="twice"):
        parse("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


def test_a_query_defined_in_two_files_is_refused() -> None:
    """The callers' files share one set of names: a second file cannot redefine a query of the first."""
    with pytest.raises(ValueError, match="twice"):
        parse("-- name: a\nSELECT 1;\n", "-- name: a\nSELECT 2;\n")


def test_every_caller_has_its_file_of_queries() -> None:
    """The queries come from each caller's file: the worker's claim, the api's admission, the sweeper's rules,
    the console's lists and the common migrations' ledger are all loaded."""
    assert {"job_claim", "job_insert_if_admitted", "job_fail_stale", "ops_job_list",
            "schema_migrations_create"} <= QUERIES.keys()


def test_a_statement_that_includes_another_blocks_text_is_refused() -> None:
    """No text macro: a part several statements share is a SQL function or view in a migration, so a query
    lives in one place; a statement with an `-- include:` line fails at import, naming it."""
    with pytest.raises(ValueError, match="'whole' includes"):
        parse("-- name: part\nb AS (SELECT 2)\n-- name: whole\nWITH a AS (SELECT 1),\n-- include: part\nSELECT 1;\n")
    assert not any("-- include:" in statement for statement in QUERIES.values())


def test_no_statement_writes_a_charge_of_its_own() -> None:
    """A job's charge is derived from its ledger by jobs_end and the ledger's trigger (migration 019) alone: no
    named statement names charged_usd, so none can write one of its own."""
    writers = [name for name, text in QUERIES.items() if re.search(r"\bcharged_usd\b", text)]
    assert writers == []
    assert re.search(r"\bcharged_usd\b", parse("-- name: x\nUPDATE story_jobs SET charged_usd = 0;\n")["x"])


def test_a_compacted_statement_parses_to_what_the_file_says() -> None:
    """Dropping the comments and indentation changes no statement: each one's parse tree, by PostgreSQL's own
    parser (pglast), fingerprints the same before and after, and a literal or a dollar-quoted body keeps its
    dashes and spaces."""
    from pglast.parser import ParseError, fingerprint

    from tests.mutants.sql_mutants import blocks, to_numbered

    compared = 0
    for block in blocks(Path(__file__).resolve().parents[2]):
        assert QUERIES[block.name] == compact(block.statement)
        try:
            before = fingerprint(to_numbered(block.statement)[0])
        except ParseError:  # a part of a statement alone (a PL/pgSQL body): the database's tests run it
            continue
        assert fingerprint(to_numbered(QUERIES[block.name])[0]) == before, block.name
        compared += 1
    assert compared >= 0.9 * len(QUERIES)
    assert compact("SELECT 'a -- b',  \"c--d\" -- e\n  , /* f */ $x$ -- g  h $x$") == \
        "SELECT 'a -- b', \"c--d\"\n, $x$ -- g  h $x$"


def test_the_rounds_statements_fit_psycopgs_query_cache() -> None:
    """psycopg converts a statement's placeholders once and caches it, but only for statements of 4 kB or
    less; the worker runs its claim and settle once a round, so they must stay under that size."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    for name in ("job_claim", "job_settle", "job_heartbeat", "llm_call_start", "llm_call_finish"):
        assert len(QUERIES[name].encode()) <= MAX_CACHED_STATEMENT_LENGTH, name
