"""What the state machines on Postgres share: each example runs on a
database of its own, made from the migrated template, through a connection
of its own, from an event loop of its own, and leaves nothing behind."""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

import psycopg
from hypothesis.stateful import RuleBasedStateMachine

from tests.support import postgres_server

_counter = itertools.count()


class PostgresMachine(RuleBasedStateMachine):
    """A subclass names itself (``label``), its fixture sets ``server_url``
    and ``template``, and its own teardown ends with ``super().teardown()``,
    which closes the connection and the loop and drops the database."""

    label = "model"
    server_url = ""
    template = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self._database = f"storyjobs_{self.label}_model_{os.getpid()}_{next(_counter)}"
        self.database_url = postgres_server.create_database_from_template(
            self.server_url, self._database, self.template)
        self.conn: psycopg.AsyncConnection[Any] = self.run(
            psycopg.AsyncConnection.connect(self.database_url, autocommit=True))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.run(self.conn.close())
            self.loop.close()
        finally:
            postgres_server.drop_database(self.server_url, self._database)
