"""structlog set-up: every line carries role, rank and (where known) layer."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


def configure_logging(level: str = "WARNING", *, json: bool = False) -> None:
    """Configure structlog once per process; lines go to stderr."""
    global _configured
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S.%f", utc=False),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def make_logger(role: str, rank: int, **context: Any) -> Any:
    """A logger bound to ``role`` and ``rank``; services bind ``layer`` per line."""
    if not _configured:
        configure_logging()
    return structlog.get_logger("rd2h").bind(role=role, rank=rank, layer=None, **context)
