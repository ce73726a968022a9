"""DATABASE_POOLER and DATABASE_LISTEN_URL: validated at start, and what they
change in how connections are made."""

from __future__ import annotations

from typing import Any

import pytest

from shared import db
from shared.config import (
    ApiSettings,
    BaseSettings,
    ConfigError,
    SweeperSettings,
    WorkerSettings,
)
from shared.config_load import load

POOLER = "postgresql://storyjobs@pgbouncer:6432/storyjobs"
DIRECT = "postgresql://storyjobs@postgres:5432/storyjobs"


def test_without_a_pooler_nothing_changes_by_default() -> None:
    """Unset, DATABASE_POOLER is none and the session URL is DATABASE_URL."""
    settings = load(WorkerSettings, {"DATABASE_URL": DIRECT})
    assert settings.database_pooler == "none" and settings.database_listen_url is None
    assert db.session_url(settings) == DIRECT


def test_behind_a_pooler_the_session_url_is_the_listen_url() -> None:
    """With DATABASE_POOLER=transaction, LISTEN and migrations go to DATABASE_LISTEN_URL."""
    settings = load(WorkerSettings, {"DATABASE_URL": POOLER, "DATABASE_POOLER": "transaction",
                                     "DATABASE_LISTEN_URL": DIRECT})
    assert db.database_url(settings) == POOLER and db.session_url(settings) == DIRECT


@pytest.mark.parametrize(
    ("settings_type", "environ", "message"),
    [
        (BaseSettings, {"DATABASE_URL": POOLER, "DATABASE_POOLER": "session"}, "DATABASE_POOLER"),
        (ApiSettings, {"DATABASE_POOLER": "transaction"}, "DATABASE_POOLER=transaction needs DATABASE_URL"),
        (SweeperSettings, {"DATABASE_URL": POOLER, "DATABASE_POOLER": "transaction", "DATABASE_LISTEN_URL": POOLER},
         "DATABASE_LISTEN_URL must reach the database directly"),
        (WorkerSettings, {"DATABASE_URL": POOLER, "DATABASE_POOLER": "transaction"},
         "DATABASE_LISTEN_URL is needed"),
    ],
)
def test_a_pooler_setting_that_cannot_work_names_its_variable(
    settings_type: type, environ: dict[str, str], message: str
) -> None:
    """An unknown pooler, a pooler without DATABASE_URL, a listen URL through the pooler, and a listening worker
    behind a pooler without a listen URL are refused at start."""
    with pytest.raises(ConfigError, match=message):
        load(settings_type, environ)


def test_a_polling_worker_and_the_api_need_no_listen_url_behind_a_pooler() -> None:
    """Behind a pooler, a worker with WORKER_LISTEN=false, the api and the sweeper start without DATABASE_LISTEN_URL;
    asking them for a session URL then says which variable is missing."""
    environ = {"DATABASE_URL": POOLER, "DATABASE_POOLER": "transaction"}
    worker = load(WorkerSettings, {**environ, "WORKER_LISTEN": "false"})
    load(ApiSettings, environ)
    load(SweeperSettings, environ)
    with pytest.raises(ConfigError, match="DATABASE_LISTEN_URL"):
        db.session_url(worker)


def test_a_pooled_connection_sends_no_options_and_prepares_no_statements() -> None:
    """Behind a transaction pooler, a connection sends no startup options and never prepares a statement;
    without one, it keeps today's session settings and psycopg's prepared statements."""
    pooled = db.connect_kwargs(application_name="storyjobs-worker", connect_timeout_s=5, statement_timeout_s=30,
                               generic_plans=True, pooler="transaction")
    assert "options" not in pooled and pooled["prepare_threshold"] is None
    assert pooled["application_name"] == "storyjobs-worker" and pooled["autocommit"] is True
    direct = db.connect_kwargs(application_name="storyjobs-worker", connect_timeout_s=5, statement_timeout_s=30,
                               generic_plans=True)
    assert "prepare_threshold" not in direct
    assert direct["options"] == ("-c jit=off -c statement_timeout=30000 -c plan_cache_mode=force_generic_plan "
                                 "-c enable_seqscan=off")


def test_only_a_pool_behind_a_pooler_keeps_its_statement_timeout_on_the_client() -> None:
    """The pool of DATABASE_POOLER=transaction makes DeadlineConnections bounded by its statement timeout; the
    direct pool makes plain connections, whose timeout the server keeps."""
    common: dict[str, Any] = {"application_name": "storyjobs-api", "connect_timeout_s": 5, "statement_timeout_s": 5,
              "min_size": 1, "max_size": 2, "wait_timeout_s": 1}
    pooled = db.make_pool(POOLER, pooler="transaction", **common)
    assert issubclass(pooled.connection_class, db.DeadlineConnection)
    assert pooled.connection_class.statement_timeout_s == 5
    direct = db.make_pool(DIRECT, **common)
    assert not issubclass(direct.connection_class, db.DeadlineConnection)
