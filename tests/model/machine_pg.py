"""What the state machines on Postgres share: each example runs on a
database of its own, made from the migrated template, through a connection
of its own, from an event loop of its own, and leaves nothing behind, even
when a part of it cannot be made or its end-of-example drain fails."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from tests.support import postgres_server

_counter = itertools.count()

T = TypeVar("T")
# more than any machine's choices: an index drawn below it picks evenly enough
_CHOICE_BOUND = 64


def one_of(data: st.DataObject, choices: Sequence[T]) -> T:
    """One of ``choices`` (not empty), drawn within the same bounds however
    many there are. Where a machine's steps race (two lanes ticking at once),
    one sequence of steps may leave another state each time it runs; a draw
    among what that state holds then has other bounds when Hypothesis runs
    the sequence again, which it reports as FlakyStrategyDefinition. An index
    taken modulo the count is drawn alike every time (and shrinks towards
    the first choice)."""
    return choices[data.draw(st.integers(0, _CHOICE_BOUND - 1)) % len(choices)]


class PostgresMachine(RuleBasedStateMachine):
    """A subclass names itself (``label``), its fixture sets ``server_url``
    and ``template``; it makes its own parts inside ``with self.made():``
    and registers how each is closed on ``self.cleanup``; its end-of-example
    checks go in ``drain``, which teardown runs only when the example has
    not already failed (a drain after a failure would report its own error
    in place of the first)."""

    label = "model"
    server_url = ""
    template = ""

    def __init__(self) -> None:
        super().__init__()
        # closed in reverse order of making, each whatever the others do
        self.cleanup = contextlib.ExitStack()
        with self.made():
            self.loop = asyncio.new_event_loop()
            self.cleanup.callback(self.loop.close)
            database = f"storyjobs_{self.label}_model_{os.getpid()}_{next(_counter)}"
            self.database_url = postgres_server.create_database_from_template(
                self.server_url, database, self.template)
            self.cleanup.callback(postgres_server.drop_database, self.server_url, database)
            self.conn: psycopg.AsyncConnection[Any] = self.run(
                psycopg.AsyncConnection.connect(self.database_url, autocommit=True))
            self.cleanup.callback(lambda: self.run(self.conn.close()))

    @contextlib.contextmanager
    def made(self) -> Iterator[None]:
        """Makes parts of the example: when one cannot be made, those made
        are closed before the error goes on."""
        try:
            yield
        except BaseException:
            self.cleanup.close()
            raise

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def drain(self) -> None:
        """The end-of-example checks, run by teardown; none here."""

    def teardown(self) -> None:
        with self.cleanup:
            if sys.exc_info()[0] is None:
                self.drain()
