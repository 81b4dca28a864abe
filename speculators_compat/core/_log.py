"""The ``speculators_compat`` logger, set up on first use (``logging`` is not imported by
``import speculators_compat`` unless ``SPECULATORS_COMPAT_VERBOSE`` is set).

Where the application configured logging (a handler on the root logger), the library's records
reach it by propagation and nothing else is printed. Where it did not, the library's warnings
and errors would be lost (a library's ``NullHandler`` silences Python's last-resort output), so
one stderr handler prints them -- and the runner's INFO lines, and everything with
``SPECULATORS_COMPAT_VERBOSE=1`` -- itself. In a vLLM worker its lines start as vLLM's do, with
the process's name (``(Worker_TP1 pid=123) ``): vLLM 0.11 - 0.16 prefixed the worker's stderr
itself, later releases put the name on each log record (``vllm_process_name``) for their own
formatter only, and the ranks' lines would otherwise be told apart by nothing."""

from __future__ import annotations

import sys

from . import _env

NAME = "speculators_compat"
FORMAT = "%(asctime)s speculators-compat %(levelname)s: %(message)s"

_configured = False
_classes: list = []  # the handler class, made once (``logging`` is imported on first use)


def _handler_class():
    import logging

    if _classes:
        return _classes[0]

    class Named(logging.Formatter):
        """:data:`FORMAT`, after the vLLM process's name where vLLM put one on the record."""

        def format(self, record) -> str:
            line = super().format(record)
            name = getattr(record, "vllm_process_name", None)
            if not name or name == "MainProcess":  # not a vLLM worker (the driver)
                return line
            if hasattr(sys.stderr, "start_new_line"):  # vLLM prefixes this stderr itself (vllm.utils' _add_prefix)
                return line
            return f"({name} pid={record.process}) {line}"

    class Fallback(logging.StreamHandler):
        """Prints a record of the library to stderr when no handler of the application's would:
        the root logger has none (and none but this one sits on the library's loggers). The
        lowest level printed is set per logger name (:func:`show`)."""

        def __init__(self) -> None:
            super().__init__(sys.stderr)
            self.levels: dict[str, int] = {NAME: logging.WARNING}
            self.setFormatter(Named(FORMAT))

        def filter(self, record) -> bool:
            if logging.getLogger().handlers:
                return False  # the application's handlers have it
            name = record.name
            while name and name not in self.levels:
                name = name.rpartition(".")[0]
            return bool(name) and record.levelno >= self.levels[name]

        def emit(self, record) -> None:
            self.stream = sys.stderr  # the current one (a test's capture, a redirected stderr)
            super().emit(record)

    _classes.append(Fallback)
    return Fallback


def _fallback():
    import logging

    log = logging.getLogger(NAME)
    cls = _handler_class()
    for handler in log.handlers:
        if isinstance(handler, cls):
            return handler
    handler = cls()
    log.addHandler(handler)
    return handler


def show(name: str, level: int) -> None:
    """Print the records of logger ``name`` (and below it) from ``level`` up when the application
    configured no logging; the logger lets them through from that level."""
    import logging

    _fallback().levels[name] = level
    log = logging.getLogger(name)
    if log.getEffectiveLevel() > level:
        log.setLevel(level)


def logger():
    """The ``speculators_compat`` logger, with the stderr fallback for an application that
    configured no logging (everything from DEBUG up when ``SPECULATORS_COMPAT_VERBOSE=1``)."""
    global _configured
    import logging

    log = logging.getLogger(NAME)
    if not _configured:
        _configured = True
        _fallback()
        if _env.verbose():
            show(NAME, logging.DEBUG)
    return log
