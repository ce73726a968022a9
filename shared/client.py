"""``storyjobs generate``: the command-line client of the HTTP api."""

from __future__ import annotations

import argparse
from typing import Any


def add_generate_command(commands: Any) -> None:
    generate = commands.add_parser("generate", help="ask the api for a story")
    generate.add_argument("prompt")
    generate.set_defaults(run=_not_ready)


async def _not_ready(_: argparse.Namespace) -> int:
    raise NotImplementedError
