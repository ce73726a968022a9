"""structlog set-up shared by the three processes.

JSON lines off a terminal, readable console lines on one. Events have dotted
names (``job.claimed``) and key-value fields; ``job_id`` and ``worker_id`` are
bound in contextvars so every line about a job carries them, and a line
written while a span is current carries its ``trace_id`` and ``span_id``.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

from shared import telemetry

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(
    level: str = "info",
    log_format: Literal["console", "json"] | None = None,
    *,
    process: str,
) -> None:
    """Configures structlog (and the stdlib loggers of our libraries) for one process."""
    if log_format is None:
        log_format = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.typing.Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer()
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        telemetry.add_trace_ids,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if log_format == "json":
        processors.append(structlog.processors.dict_tracebacks)
    processors.append(renderer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(process=process)
    # Libraries (psycopg's pool, uvicorn) log through the stdlib: render their
    # warnings the same way, in the same stream.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                telemetry.add_trace_ids,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(_LEVELS[level], logging.WARNING))
