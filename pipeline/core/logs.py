"""The server's own operational logs through structlog (serve, cluster, bench, and each
child process: the engine, a frontend, a tensor-parallel worker).

`configure(level, fmt)` is called once per process by its entry point (web/cli.py,
web/child.py, pipeline/layouts/tp_worker.py). It lives below web so that a child that runs
no HTTP (a worker rank) sets its logs up without importing web. It puts one handler on the root
logger whose formatter is structlog's ProcessorFormatter, so every stdlib
``logging.getLogger("tailrace...")`` call (and Hypercorn's, and the libraries') comes out
the same way:

- ``text`` (the default): one line per record, ``TIME [level] message [logger] key=value``,
  a traceback below it when there is one;
- ``json``: one JSON object per line: ``timestamp``, ``level``, ``logger``, ``event`` (the
  message), the record's structured fields, and ``exception`` (the whole traceback as one
  string) when there is one.

Structured fields are a call's ``extra={...}`` (e.g. gpu_step's ``step``, web/app.py's
``request_id``); a structlog logger (``structlog.get_logger("tailrace...")``) passes them as
keywords. The event log (pipeline/core/events.py) is separate: orjson lines from its own thread.
"""
from __future__ import annotations

import logging
import sys

import structlog

LOG_FORMATS = ("text", "json")


def formatter(fmt: str = "text") -> structlog.stdlib.ProcessorFormatter:
    """The formatter for a stdlib handler: records rendered as text or JSON lines."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; choose from {', '.join(LOG_FORMATS)}")
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    pre_chain = [structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name,
                 structlog.stdlib.ExtraAdder(), timestamper]
    if fmt == "json":
        last = [structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer()]
    else:
        last = [structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback)]
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *last])


def configure(level: str | int = "info", fmt: str = "text", stream=None) -> None:
    """Once per process: the root logger's one handler (to `stream`, stderr by default)
    renders through structlog; structlog's own loggers go through the same handler."""
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_log_level,
                    structlog.stdlib.add_logger_name,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True)
    level = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    handler = _Handler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(formatter(fmt))
    handler.setLevel(level)
    root = logging.getLogger()
    for old in list(root.handlers):   # a second call replaces ours; others (pytest's) stay
        if isinstance(old, _Handler):
            root.removeHandler(old)
    root.addHandler(handler)
    # the handler filters by --log-level; the root only lets records through to it
    root.setLevel(min(root.getEffectiveLevel(), level))


class _Handler(logging.StreamHandler):
    """The root handler `configure` installs (a later call replaces it)."""


class _StderrHandler(_Handler):
    """Writes to whatever sys.stderr is at the time (a test may have swapped it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass
