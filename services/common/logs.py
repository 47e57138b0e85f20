"""structlog set-up: JSON lines in services, key=value in development.

One event name per thing that happens; bind ``transfer_id`` on everything about one transfer.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def configure(json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog once per process.

    ``json`` defaults to ``KVPUSH_LOG_JSON`` (``1`` in services); ``level`` to ``KVPUSH_LOG_LEVEL``.
    """
    global _configured
    if json is None:
        json = os.environ.get("KVPUSH_LOG_JSON", "0") == "1"
    level_name = (level or os.environ.get("KVPUSH_LOG_LEVEL", "INFO")).upper()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.processors.KeyValueRenderer(key_order=["event", "transfer_id"], drop_missing=True)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level_name]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(component: str, **bound: Any) -> structlog.typing.FilteringBoundLogger:
    if not _configured:
        configure()
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger().bind(component=component, **bound)
    return logger
