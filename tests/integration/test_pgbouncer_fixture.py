"""The PgBouncer fixture pools as production poolers do: server connections are
shared per transaction, session state does not follow a client, and startup
options are refused. Tests of the processes behind a pooler rely on it to
reveal what would break there."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.support.pgbouncer import PgBouncer
from tests.support.waiting import wait_until_sync


def _connect(bouncer: PgBouncer, database_name: str, **kwargs: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(bouncer.url(database_name), autocommit=True, **kwargs)


def _one(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def test_consecutive_transactions_of_one_client_may_run_on_different_server_connections(
    pgbouncer: PgBouncer, database_name: str
) -> None:
    """A client's next transaction runs on another server connection when another client took its last one."""
    with _connect(pgbouncer, database_name) as client, _connect(pgbouncer, database_name) as other:
        first_backend = _one(client, "SELECT pg_backend_pid()")
        # the only idle server connection, the one `client` just released, goes to `other`
        with other.transaction():
            assert _one(other, "SELECT pg_backend_pid()") == first_backend
            second_backend = _one(client, "SELECT pg_backend_pid()")
        assert second_backend != first_backend
        pool = pgbouncer.pool(database_name)
        assert pool["pool_mode"] == "transaction"
        assert int(pool["sv_active"]) + int(pool["sv_idle"]) + int(pool["sv_used"]) == 2


def test_a_session_setting_does_not_follow_the_client_and_leaks_to_another(
    pgbouncer: PgBouncer, database_name: str
) -> None:
    """A SET outside a transaction stays on the server connection: the next client there sees it, its author not."""
    with _connect(pgbouncer, database_name) as client, _connect(pgbouncer, database_name) as other:
        client.execute("SET statement_timeout = '4321ms'")
        with other.transaction():
            assert _one(other, "SHOW statement_timeout") == "4321ms"
            assert _one(client, "SHOW statement_timeout") != "4321ms"


def test_a_client_sending_startup_options_is_refused(pgbouncer: PgBouncer, database_name: str) -> None:
    """Connecting with options=-c statement_timeout=1000 fails, as it does behind a production PgBouncer."""
    with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter: options"):
        _connect(pgbouncer, database_name, options="-c statement_timeout=1000")
    # the parameters libpq and psycopg send on their own are accepted
    with _connect(pgbouncer, database_name, application_name="storyjobs-test") as conn:
        assert _one(conn, "SELECT current_setting('application_name')") == "storyjobs-test"


def test_the_pool_holds_at_most_the_chosen_number_of_server_connections(
    pgbouncer_factory: Any, database_name: str
) -> None:
    """With default_pool_size 2, three clients in open transactions share two server connections: one waits."""
    bouncer: PgBouncer = pgbouncer_factory(default_pool_size=2)
    clients = [_connect(bouncer, database_name) for _ in range(3)]
    try:
        for conn in clients[:2]:
            conn.execute("BEGIN")
            conn.execute("SELECT 1")
        # the third client's query waits for a server connection; PgBouncer counts it
        clients[2].pgconn.send_query(b"SELECT 1")
        wait_until_sync(lambda: int(bouncer.pool(database_name)["cl_waiting"]) > 0, what="a client to wait")
        assert int(bouncer.pool(database_name)["sv_active"]) == 2
        clients[0].execute("COMMIT")
        result = clients[2].pgconn.get_result()
        assert result is not None
        assert result.status == psycopg.pq.ExecStatus.TUPLES_OK
    finally:
        for conn in clients:
            conn.close()
