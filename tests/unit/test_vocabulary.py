"""The pieces with no database: named queries, keys, fingerprints, prompts, prices, worker ids."""

from __future__ import annotations

from decimal import Decimal

import msgspec
import pytest

from shared import keys, prompt
from shared.pricing import Price
from shared.queries import QUERIES, parse
from shared.story_request import StoryRequest, fingerprint
from worker.coordinator import new_worker_id


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


def test_an_include_may_name_a_block_of_another_file() -> None:
    """A block is included by its name wherever it is defined, before or after the including file."""
    part = "-- name: part\nb AS (SELECT 2)\n"
    whole = "-- name: whole\nWITH a AS (SELECT 1),\n-- include: part\nSELECT * FROM a, b;\n"
    expected = "WITH a AS (SELECT 1),\nb AS (SELECT 2)\nSELECT * FROM a, b"
    assert parse(part, whole)["whole"] == parse(whole, part)["whole"] == expected


def test_every_caller_has_its_file_of_queries() -> None:
    """The queries come from each caller's file: the worker's round, the api's admission, the sweeper's rules,
    the console's lists and the common migrations' ledger are all loaded."""
    assert {"job_settle_and_claim", "job_insert_if_admitted", "job_fail_stale", "ops_job_list",
            "schema_migrations_create"} <= QUERIES.keys()


def test_an_included_block_stands_in_for_its_include_line() -> None:
    """A statement's `-- include: NAME` line becomes that block's statement, so shared parts exist once."""
    queries = parse(
        "-- name: part\n-- a shared part\nb AS (SELECT 2)\n"
        "-- name: whole\nWITH a AS (SELECT 1),\n-- include: part\nSELECT * FROM a, b;\n"
    )
    assert queries["whole"] == "WITH a AS (SELECT 1),\nb AS (SELECT 2)\nSELECT * FROM a, b"
    assert "include" not in QUERIES["job_settle_and_claim"] + QUERIES["job_settle_and_claim_limited"]


@pytest.mark.parametrize(("text", "error"), [
    ("-- name: a\nSELECT\n-- include: a\n", "includes itself"),
    ("-- name: a\nSELECT\n-- include: b\n", "not defined"),
])
def test_an_include_of_itself_or_of_nothing_is_refused(text: str, error: str) -> None:
    """A loop of includes, or an include of a block that does not exist, fails at import, naming it."""
    with pytest.raises(ValueError, match=error):
        parse(text)


def test_keys_are_hashed_and_recognised_by_shape() -> None:
    """A new key matches its own hash only, and its prefix is read back from the key."""
    new = keys.generate()
    assert keys.prefix_of(new.key) == new.prefix and keys.matches(new.key, new.hash)
    assert not keys.matches(keys.generate().key, new.hash)
    assert keys.prefix_of("sj_short_x") is None and keys.prefix_of(new.key + "x") is None
    assert new.key not in new.hash.hex()


def test_the_fingerprint_ignores_key_order_whitespace_and_spelt_out_defaults() -> None:
    """Equivalent bodies have one fingerprint; a different option another."""
    def of(body: bytes) -> bytes:
        return fingerprint(msgspec.json.decode(body, type=StoryRequest))

    base = of(b'{"prompt": "a fox", "age": 5}')
    assert of(b'{ "age":5,\n "prompt":"a fox" }') == base
    assert of(b'{"prompt": "a fox", "age": 5, "length": "medium", "language": "en"}') == base
    assert of(b'{"prompt": "a fox", "age": 6}') != base


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"prompt": "a\\u0000b"}', "prompt"),
        (b'{"prompt": "ok", "child_name": "\\u0007"}', "child_name"),
        (b'{"prompt": "   "}', "prompt"),
        (b'{"prompt": "ok", "lenght": "long"}', "lenght"),
        (b'{"prompt": "ok", "age": 13}', "age"),
        (b'{"prompt": "ok", "language": "english please"}', "language"),
    ],
)
def test_unstorable_or_unknown_input_is_refused_naming_the_field(body: bytes, field: str) -> None:
    """NUL, lone surrogates, control characters, blank text, unknown fields and out-of-range options fail."""
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.json.decode(body, type=StoryRequest)


def test_a_lone_surrogate_is_refused_by_the_decoder() -> None:
    """JSON text with an unpaired surrogate escape cannot become a storable string."""
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(b'{"prompt": "a\\ud800b"}', type=StoryRequest)
    with pytest.raises(msgspec.ValidationError, match="surrogate"):
        msgspec.convert({"prompt": "a\ud800b"}, StoryRequest)


def test_the_title_line_is_split_from_the_story() -> None:
    """'Title: X' on the first line becomes the title; without it a default title is used."""
    assert prompt.split_title("Title: The Owl\n\nOnce upon a time.") == ("The Owl", "Once upon a time.")
    assert prompt.split_title("# Title: **The Owl**\nText") == ("The Owl", "Text")
    assert prompt.split_title("Once upon a time.") == ("A bedtime story", "Once upon a time.")


def test_the_prompt_carries_every_option() -> None:
    """The child's name, age, length and language all reach the message, within the token budget."""
    request = StoryRequest(prompt="a fox", child_name="Mia", age=5, length="short", language="fr")
    message = prompt.user_message(request)
    assert all(part in message for part in ("a fox", "Mia", "5 years", "300 words", "'fr'"))
    assert prompt.max_tokens(request, 4000) == prompt.LENGTH_TOKENS["short"]
    assert prompt.max_tokens(StoryRequest(prompt="x", length="long"), 1000) == 1000


def test_cost_is_priced_per_million_tokens_to_the_micro_dollar() -> None:
    """1,000 input and 2,000 output tokens at $2/$10 per million cost $0.022."""
    assert Price(Decimal(2), Decimal(10)).cost(1000, 2000) == Decimal("0.022000")


def test_every_worker_start_has_a_new_id() -> None:
    """Two starts of a worker on the same host never share an id."""
    assert new_worker_id() != new_worker_id()
