"""SQL mutants made from the parse tree of every named statement.

Each named statement of the query files (sql/<caller>.sql) is parsed by
PostgreSQL's own parser (pglast), psycopg's ``%(name)s`` placeholders swapped
for ``$n`` before and back after. A mutation operator changes one node; the
tree is printed back, so every mutant is valid SQL by construction, and it is
written over its statement's block in a scratch copy. A mutant is shown as
the diff between the printed original and the printed mutant, so that the
printer's own layout never shows up as a change.

A block that includes another (``-- include:``) is mutated with its includes
expanded: the mutant inlines them, which changes that statement only. A block
that is only a part of others (it does not parse alone) is mutated through
the statements that include it.

The migrations are not mutated here: their PL/pgSQL bodies are strings to the
parser, which pglast cannot print back; the named catalog (catalog.py) keeps
their guards, and the DDL around them decides no single job's fate.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pglast import ast, enums, parse_sql, prettify
from pglast.parser import ParseError
from pglast.stream import RawStream

# the query files; a migration's name starts with its number
QUERY_FILE = re.compile(r"^[a-z]\w*\.sql$")
_NAME = re.compile(r"^-- name: (\w+)\s*$")
_INCLUDE = re.compile(r"^-- include: (\w+)\s*$", re.MULTILINE)
# psycopg's placeholders: %(name)s, or %(name)b for a binary parameter
_PLACEHOLDER = re.compile(r"%\(\w+\)[sbt]")
_PARAM = re.compile(r"\$(\d+)\b")


@dataclass(frozen=True)
class Block:
    """One named statement's place in its file: ``text[start:end]`` is its
    statement (description comments excluded), ``statement`` the same with its
    includes expanded."""

    file: str
    name: str
    start: int
    end: int
    raw: str
    statement: str


@dataclass(frozen=True)
class SqlMutant:
    """One node of one named statement changed."""

    file: str
    statement: str
    operator: str
    site: int
    # the block's new text, written over ``text[start:end]`` of ``file``
    start: int
    end: int
    original: str
    mutated: str

    @property
    def where(self) -> str:
        return self.statement

    @property
    def replacement(self) -> str:
        return self.mutated + ";\n\n"

    @property
    def diff(self) -> str:
        """The printed original against the printed mutant, one clause a line."""
        return _diff(_pretty(self.original), _pretty(self.mutated), f"{self.file}:{self.statement}")

    @property
    def key(self) -> str:
        """Stable over edits elsewhere: the file, the statement and the change."""
        digest = hashlib.sha256("\0".join((self.file, self.statement, self.operator, self.original,
                                           self.mutated)).encode())
        return digest.hexdigest()[:16]

    def apply(self, text: str) -> str:
        return text[: self.start] + self.replacement + text[self.end :]


def blocks(root: Path) -> list[Block]:
    """Every named statement of sql/<caller>.sql under ``root``, includes expanded."""
    found: list[tuple[str, str, int, int, str]] = []
    for path in sorted((root / "sql").iterdir()):
        if not QUERY_FILE.match(path.name):
            continue
        text = path.read_text()
        found.extend(_spans(f"sql/{path.name}", text))
    raw = {name: statement for _, name, _, _, statement in found}

    def expand(name: str, seen: tuple[str, ...]) -> str:
        if name in seen:
            raise ValueError(f"query {name!r} includes itself")
        return _INCLUDE.sub(lambda match: expand(match.group(1), (*seen, name)), raw[name])

    return [Block(file, name, start, end, statement, expand(name, ()))
            for file, name, start, end, statement in found]


def _spans(file: str, text: str) -> Iterator[tuple[str, str, int, int, str]]:
    """(file, name, start, end, statement) of each block, as shared/queries.py
    reads them: after the name, the comment lines at the top are its
    description; the rest, up to the next name, is the statement."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    heads = [i for i, line in enumerate(lines) if _NAME.match(line.rstrip("\n"))]
    for n, head in enumerate(heads):
        stop = heads[n + 1] if n + 1 < len(heads) else len(lines)
        first = head + 1
        while first < stop and lines[first].startswith("--"):
            first += 1
        name = _NAME.match(lines[head].rstrip("\n")).group(1)  # type: ignore[union-attr]
        body = "".join(lines[first:stop])
        statement = body.strip().rstrip(";").strip()
        yield file, name, offsets[first], offsets[stop], statement


def to_numbered(statement: str) -> tuple[str, list[str]]:
    """The statement with ``$n`` for each distinct ``%(name)s``, and the placeholders in order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(0) not in names:
            names.append(match.group(0))
        return f"${names.index(match.group(0)) + 1}"

    return _PLACEHOLDER.sub(number, statement), names


def to_named(statement: str, names: list[str]) -> str:
    return _PARAM.sub(lambda match: names[int(match.group(1)) - 1], statement)


def deparse(tree: tuple[ast.Node, ...]) -> str:
    return str(RawStream()(tree))


def parse(statement: str) -> tuple[tuple[ast.RawStmt, ...], list[str]]:
    """The parse tree of a named statement and its placeholders' names."""
    numbered, names = to_numbered(statement)
    return parse_sql(numbered), names


def round_trips(statement: str) -> bool:
    """True when the printed tree parses back to the same tree, placeholders included."""
    tree, names = parse(statement)
    printed = to_named(deparse(tree), names)
    again, names_again = parse(printed)
    return bool(again == tree and names_again == names)


def complete(block: Block) -> bool:
    """A block that parses alone; the others are parts of statements."""
    try:
        parse(block.statement)
    except ParseError:
        return False
    return True


# --- the operators -----------------------------------------------------------

Site = tuple[str, str, Callable[[], None]]  # (operator, what it does, apply)

_FLIP = {"=": "<>", "<>": "=", "<": "<=", "<=": "<", ">": ">=", ">=": ">"}
_ARITH = {"+": "-", "-": "+"}


def _slots(node: ast.Node) -> tuple[str, ...]:
    return tuple(getattr(type(node), "__slots__", ()))


def _children(node: ast.Node) -> Iterator[tuple[str, object]]:
    for slot in _slots(node):
        yield slot, getattr(node, slot, None)


def _walk(value: object) -> Iterator[ast.Node]:
    if isinstance(value, ast.Node):
        yield value
        for _, child in _children(value):
            yield from _walk(child)
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _walk(item)


def _op(node: ast.A_Expr) -> str | None:
    if node.name and len(node.name) == 1 and isinstance(node.name[0], ast.String):
        return str(node.name[0].sval)
    return None


def _set(node: ast.Node, slot: str, value: object) -> Callable[[], None]:
    def apply() -> None:
        setattr(node, slot, value)
    return apply


def _items(value: tuple[ast.Node, ...] | None) -> tuple[ast.Node, ...]:
    return tuple(value or ())


def sites(tree: tuple[ast.Node, ...]) -> list[Site]:
    """Every mutation of the tree, in a fixed order (the same tree, the same list)."""
    found: list[Site] = []
    for node in _walk(tree):
        if isinstance(node, ast.A_Expr) and node.kind == enums.A_Expr_Kind.AEXPR_OP:
            op = _op(node)
            if op in _FLIP:
                found.append(("comparison", f"{op} -> {_FLIP[op]}",
                              _set(node, "name", (ast.String(sval=_FLIP[op]),))))
            if op in _ARITH and node.lexpr is not None:
                found.append(("arithmetic", f"{op} -> {_ARITH[op]}",
                              _set(node, "name", (ast.String(sval=_ARITH[op]),))))
        if isinstance(node, ast.A_Expr) and node.kind == enums.A_Expr_Kind.AEXPR_IN \
                and isinstance(node.rexpr, tuple) and len(node.rexpr) > 1:
            listed = node.rexpr
            for i in range(len(listed)):
                shorter = listed[:i] + listed[i + 1 :]
                found.append(("in-list", f"IN list without item {i + 1}", _set(node, "rexpr", shorter)))
        for slot in ("whereClause", "quals"):
            clause = getattr(node, slot, None) if slot in _slots(node) else None
            if isinstance(clause, ast.BoolExpr) and clause.boolop == enums.BoolExprType.AND_EXPR:
                conjuncts = _items(clause.args)
                for i in range(len(conjuncts)):
                    rest = conjuncts[:i] + conjuncts[i + 1 :]
                    kept = rest[0] if len(rest) == 1 else ast.BoolExpr(boolop=enums.BoolExprType.AND_EXPR,
                                                                       args=rest)
                    found.append(("conjunct", f"{slot} without conjunct {i + 1}", _set(node, slot, kept)))
        if isinstance(node, ast.CaseExpr) and node.defresult is not None:
            for i, when in enumerate(_items(node.args)):
                if not isinstance(when, ast.CaseWhen):
                    continue

                def swap(case: ast.CaseExpr = node, branch: ast.CaseWhen = when) -> None:
                    case.defresult, branch.result = branch.result, case.defresult
                found.append(("case", f"CASE branch {i + 1} swapped with ELSE", swap))
        if isinstance(node, ast.CoalesceExpr | ast.MinMaxExpr) and len(_items(node.args)) > 1:
            arguments = _items(node.args)
            fn = "coalesce" if isinstance(node, ast.CoalesceExpr) else \
                ("greatest" if node.op == enums.MinMaxOp.IS_GREATEST else "least")
            for i in range(len(arguments)):
                found.append(("argument", f"{fn} without argument {i + 1}",
                              _set(node, "args", arguments[:i] + arguments[i + 1 :])))
        if isinstance(node, ast.SelectStmt) and node.limitCount is not None:
            for op in ("+", "-"):
                bumped = ast.A_Expr(kind=enums.A_Expr_Kind.AEXPR_OP, name=(ast.String(sval=op),),
                                    lexpr=node.limitCount, rexpr=ast.A_Const(val=ast.Integer(ival=1)))
                found.append(("limit", f"LIMIT {op} 1", _set(node, "limitCount", bumped)))
        if isinstance(node, ast.SelectStmt) and node.lockingClause:
            for i, lock in enumerate(node.lockingClause):
                rest = node.lockingClause[:i] + node.lockingClause[i + 1 :]
                found.append(("lock", f"locking clause {i + 1} dropped",
                              _set(node, "lockingClause", rest or None)))
                if lock.waitPolicy == enums.LockWaitPolicy.LockWaitSkip:
                    found.append(("skip-locked", "SKIP LOCKED dropped",
                                  _set(lock, "waitPolicy", enums.LockWaitPolicy.LockWaitBlock)))
    return found


def _diff(before: str, after: str, label: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        f"a/{label}", f"b/{label}", n=1))


def _pretty(statement: str) -> str:
    """One clause a line, for a diff a reader can follow."""
    numbered, names = to_numbered(statement)
    return to_named(str(prettify(numbered, preserve_comments=False)), names)


def mutants_of(block: Block) -> list[SqlMutant]:
    """Every mutant of one complete block."""
    tree, names = parse(block.statement)
    original = to_named(deparse(tree), names)
    made: list[SqlMutant] = []
    for index, (operator, _, _) in enumerate(sites(tree)):
        fresh, _ = parse(block.statement)
        sites(fresh)[index][2]()
        mutated = to_named(deparse(fresh), names)
        if mutated == original:
            continue
        made.append(SqlMutant(file=block.file, statement=block.name, operator=operator, site=index,
                              start=block.start, end=block.end, original=original, mutated=mutated))
    return made


def population(root: Path) -> list[SqlMutant]:
    """Every SQL mutant of the query files under ``root``."""
    made: list[SqlMutant] = []
    for block in blocks(root):
        if complete(block):
            made.extend(mutants_of(block))
    return made
