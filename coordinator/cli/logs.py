"""structlog for the coordinator: JSON lines to stdout, a console renderer only on a tty."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", level: str = "info") -> None:
    console = fmt == "console" or (fmt == "auto" and sys.stdout.isatty())
    renderer: structlog.typing.Processor = (
        # Colours only for a terminal: a log file or CI output must not hold ANSI codes.
        structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
        if console
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
