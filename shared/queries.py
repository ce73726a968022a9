"""The named queries of sql/*.sql, parsed once at import.

Each caller has its own file of queries (common.sql, api.sql, worker.sql,
sweeper.sql, console.sql; the numbered files are migrations), and the names
are one set across them: a name defined twice, in one file or in two, is an
error.

A block starts with ``-- name: <name>``; the comment lines after it describe
the query and are dropped; the rest, up to the next block, is one statement,
whole: a part several statements need is a SQL function or view in a
migration (a view of a read, PL/pgSQL for a part that writes), never text
pasted into them, so a query lives in one place.

A statement is kept without its comments and indentation (``compact``): what
the file says about it is for its reader, not for each execution, and a short
statement is one psycopg converts once and then finds in its cache (it skips
the cache for statements over 4 kB: the worker's claim was one).
"""

from __future__ import annotations

import os
import re
from importlib.resources import files

_NAME = re.compile(r"^-- name: (\w+)\s*$")
# the text macro the statements once shared parts by
_INCLUDE = re.compile(r"^-- include: (\w+)\s*$", re.MULTILINE)
# the files of queries; a migration's name starts with its number
_QUERY_FILE = re.compile(r"^[a-z]\w*\.sql$")
# what compact() reads: the literals and quoted names it keeps whole, the
# comments it drops, the runs of white space it shortens
_TOKEN = re.compile(
    r"""(?P<keep>'(?:[^']|'')*'|"(?:[^"]|"")*"|(?P<dollar>\$(?:[A-Za-z_]\w*)?\$).*?(?P=dollar))"""
    r"|(?P<line_comment>--[^\n]*)"
    r"|(?P<block_comment>/\*.*?\*/)"
    r"|(?P<space>\s+)",
    re.DOTALL,
)


def compact(statement: str) -> str:
    """The statement without its comments, each run of white space and
    comments one space, or one line break where the run had one; string
    literals, quoted names and dollar-quoted bodies kept as written."""
    parts: list[str] = []
    gap = ""  # the separator owed before the next text: "", " " or "\n"
    done = 0
    for match in _TOKEN.finditer(statement):
        text = statement[done:match.start()]
        done = match.end()
        if match.group("keep") is not None:
            parts += [gap, text, match.group(0)]
            gap = ""
            continue
        if text:
            parts += [gap, text]
            gap = ""
        gap = "\n" if match.group("space") is not None and "\n" in match.group(0) else gap or " "
    parts += [gap, statement[done:]]
    return "".join(parts).strip()


def _blocks(text: str, queries: dict[str, str]) -> None:
    """Adds the blocks of text to queries."""
    name: str | None = None
    lines: list[str] = []

    def flush() -> None:
        if name is None:
            return
        statement = "\n".join(lines).strip().rstrip(";").strip()
        if not statement:
            raise ValueError(f"query {name!r} has no statement")
        if _INCLUDE.search(statement):
            raise ValueError(f"query {name!r} includes another block's text: "
                             "make the shared part a SQL function or view in a migration")
        queries[name] = compact(statement)

    for line in text.splitlines():
        match = _NAME.match(line)
        if match:
            flush()
            name = match.group(1)
            if name in queries:
                raise ValueError(f"query {name!r} is defined twice")
            lines = []
        elif name is not None and not (not lines and line.startswith("--")):
            lines.append(line)
    flush()


def parse(*texts: str) -> dict[str, str]:
    """The queries of every text, as one set of names."""
    queries: dict[str, str] = {}
    for text in texts:
        _blocks(text, queries)
    return queries


def _query_texts() -> list[str]:
    found = sorted((entry for entry in files("sql").iterdir() if _QUERY_FILE.match(entry.name)),
                   key=lambda entry: entry.name)
    return [entry.read_text("utf-8") for entry in found]


class _TracedQueries(dict[str, str]):
    """The queries, each name read appended to a file with the test that
    read it: how the mutation runs learn which tests execute which statement
    (tests/mutants/coverage_map.py). A name is read just before its statement
    runs, by the processes a test starts as well."""

    def __init__(self, queries: dict[str, str], path: str) -> None:
        super().__init__(queries)
        self._path = path

    def __getitem__(self, name: str) -> str:
        statement = super().__getitem__(name)
        # one short line in append mode: whole, even with other processes writing
        with open(self._path, "a", encoding="utf-8") as trace:
            trace.write(f"{os.environ.get('STORYJOBS_TEST_ID', '')}\t{name}\n")
        return statement


def _queries() -> dict[str, str]:
    queries = parse(*_query_texts())
    trace = os.environ.get("STORYJOBS_QUERY_TRACE")
    return _TracedQueries(queries, trace) if trace else queries


QUERIES: dict[str, str] = _queries()
