"""Started against a transaction pooler without DATABASE_POOLER=transaction,
each process says so in one line naming the setting, and exits non-zero
instead of retrying the refused connection forever; the api's /readyz gives
the same reason."""

from __future__ import annotations

import pytest

from shared import db
from tests.support.api_client import api_client, assert_problem
from tests.support.pgbouncer import PgBouncer
from tests.system.procs import System, free_port

pytestmark = pytest.mark.system


@pytest.mark.parametrize("module", ["api", "worker", "sweeper"])
def test_a_process_behind_a_pooler_without_its_setting_says_so_once_and_exits(
    system: System, pgbouncer: PgBouncer, database_name: str, module: str
) -> None:
    """The process exits with status 2, and its output holds one line naming DATABASE_POOLER=transaction and
    the docs' section, and no warning about an unavailable database."""
    proc = system.start(module, module, DATABASE_URL=pgbouncer.url(database_name), DATABASE_POOLER="none",
                        API_PORT=free_port())
    assert proc.wait(timeout=30) == 2
    output = proc.output()
    hints = [line for line in output.splitlines() if "DATABASE_POOLER=transaction" in line]
    assert hints == [f"storyjobs {module}: {db.POOLER_REFUSED_OPTIONS}"], output
    assert "Behind a pooler" in hints[0]
    assert "database.unavailable" not in output


async def test_readyz_behind_a_pooler_without_its_setting_names_the_setting(
    pgbouncer: PgBouncer, database_name: str
) -> None:
    """An api whose pool goes through the pooler with startup options answers /readyz 503 with the hint."""
    pool = db.make_pool(pgbouncer.url(database_name), application_name="storyjobs-test", connect_timeout_s=5,
                        statement_timeout_s=10, min_size=0, max_size=2, wait_timeout_s=1)
    await pool.open(wait=False)
    try:
        async with api_client(pool) as client:
            answer = await client.get("/readyz")
    finally:
        await pool.close()
    assert assert_problem(answer, 503)["detail"] == db.POOLER_REFUSED_OPTIONS
