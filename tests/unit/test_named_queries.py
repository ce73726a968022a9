"""The named blocks of the callers' sql/*.sql files (shared/queries.py):
parsed without their descriptions, whole, mistakes refused at import."""

from __future__ import annotations

import re

import pytest

from shared.queries import QUERIES, parse


def test_named_queries_are_parsed_without_their_descriptions() -> None:
    """Each block becomes one statement named by its header, the comment lines after the header dropped."""
    parsed = parse("-- name: one\n-- what it does\nSELECT 1;\n\n-- name: two\nSELECT\n  -- inline\n  2;\n")
    assert parsed == {"one": "SELECT 1", "two": "SELECT\n  -- inline\n  2"}
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
