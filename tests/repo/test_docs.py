"""The README and the docs/ pages against the repository: every relative
link lands on a file and, with an #anchor, on a heading of it; every
command they show exists (make targets, `storyjobs` subcommands, `python -m`
modules); every upper-case name they show in code is a setting of
shared/config.py or a name the code defines or reads."""

from __future__ import annotations

import argparse
import importlib.util
import re
from functools import cache
from pathlib import Path

import msgspec
import pytest

from shared import config
from tests.support.host import REPO
from tools import cli

PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_NAME = re.compile(r"^([A-Z][A-Z0-9]*_[A-Z0-9_]+)(?:=.*)?$")
_SOURCES = ("api", "worker", "sweeper", "shared", "tools", "tests")


def _prose(text: str) -> str:
    return _FENCE.sub("", text)


def _code(text: str) -> list[str]:
    """The code a page shows: its fenced blocks' lines and its `spans`."""
    blocks = [line for block in _FENCE.findall(text) for line in block.splitlines()[1:-1]]
    return blocks + _SPAN.findall(_prose(text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> set[str]:
    return {slug(heading) for heading in _HEADING.findall(_prose(page.read_text()))}


def _id(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_relative_link_lands_on_a_file_and_heading(page: Path) -> None:
    """Each relative link of the page names a file that exists, and its #anchor a heading of that file."""
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not this repository's
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor}")
    assert broken == []


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.M))


@cache
def cli_commands() -> set[str]:
    parser = cli._parser()
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


@cache
def settings() -> set[str]:
    classes = (config.BaseSettings, config.ApiSettings, config.WorkerSettings, config.SweeperSettings)
    return {field.encode_name for cls in classes for field in msgspec.structs.fields(cls)}


@cache
def source() -> str:
    return "\n".join(path.read_text() for top in _SOURCES for path in (REPO / top).rglob("*.py"))


def _defined_or_read(name: str) -> bool:
    return re.search(rf"^\s*{name}\b.*=|[\"']{name}[\"']", source(), re.M) is not None


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_command_and_setting_shown_exists(page: Path) -> None:
    """The make targets, storyjobs subcommands, python -m modules and upper-case names the page shows in
    code are all in the Makefile, the CLI's parser, the importable modules and the code."""
    missing = []
    for code in _code(page.read_text()):
        missing += [f"make {target}" for target in re.findall(r"(?:^|[\s`;(])make ([a-z][\w-]*)", code)
                    if target not in make_targets()]
        missing += [f"storyjobs {command}" for command in re.findall(r"(?:^|[\s/`])storyjobs ([a-z][\w-]*)", code)
                    if command not in cli_commands()]
        missing += [f"python -m {module}" for module in re.findall(r"python3? -m ([\w.]+)", code)
                    if importlib.util.find_spec(module) is None]
        for word in code.split():
            match = _NAME.match(word.strip("`'\",;()"))
            # (OTEL_*: the OpenTelemetry specification's variables, which its SDK reads)
            if (match and match.group(1) not in settings() and not _defined_or_read(match.group(1))
                    and not match.group(1).startswith("OTEL_")):
                missing.append(match.group(1))
    assert missing == []
