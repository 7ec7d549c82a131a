"""Logging of every spopp process: one setup, text for a terminal or JSON lines for a collector.

`setup_logging(service, fmt, run=..., worker=...)` replaces the root logger's handlers with one
handler on stderr. Everything goes through it: our loggers, uvicorn's error and access logs (the
servers in `server.py` leave uvicorn's own logging config out, so its loggers propagate here) and
`warnings` (captured), so that with `json` every line a process writes is one JSON object:

    {"time": "2026-11-25T09:13:20.123Z", "level": "INFO", "logger": "spopp.rollout",
     "service": "rollout", "run": "math-spopp", "worker": "rollout-0", "message": "...", ...}

plus the event's own fields (`log.info("...", extra={"version": 3})`) and `exc_info` with the
traceback. `bind(worker=...)` adds context learnt later (a replica's claimed worker id).

Warnings and errors that repeat are rate-limited (`RepeatLimit`): a process that fails the same
way thousands of times a second (asyncio's accept loop out of file descriptors once wrote 202 MB in
a minute) logs the first few of each kind per minute, then one line with the count it left out.

Request lines (uvicorn's access log) are off unless a server asks for them
(`http_access_log_per_minute`); then `AccessLog` writes at most that many a minute, each path cut
to ACCESS_PATH_CHARS with its control characters escaped. Logged at INFO for every request, they
once let one client write 49 MB in 20 s (16 KB paths, refused or not).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from pythonjsonlogger.json import JsonFormatter

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# Loggers that say too much at INFO for a long-running service: a line per HTTP call.
QUIET = ("httpx", "httpcore")


class _Context(logging.Filter):
    """Puts the process's context (service, run, worker) on every record the handler sees."""

    def __init__(self, **fields: Any) -> None:
        super().__init__()
        self.fields = {k: v for k, v in fields.items() if v is not None}

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if not hasattr(record, key):  # an event's own field wins
                setattr(record, key, value)
        return True


class RepeatLimit(logging.Filter):
    """At most `burst` records of one kind (logger, level, the message's first line up to 60
    characters) per `window` seconds, for WARNING and above; the first record of a kind after a
    window in which some were dropped says how many. INFO and below pass: nothing logs at INFO
    per request but the access log, which is off or bounded by its own `AccessLog`."""

    MAX_KINDS = 1024  # kinds remembered; the oldest window is forgotten first

    def __init__(self, burst: int = 10, window: float = 60.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self.kinds: dict[tuple, list] = {}  # kind -> [window start, passed, dropped]
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        first_line = str(record.msg).split("\n", 1)[0][:60]
        kind = (record.name, record.levelno, first_line)
        now = self.clock()
        with self.lock:
            state = self.kinds.get(kind)
            if state is None or now - state[0] >= self.window:
                dropped = state[2] if state is not None else 0
                self.kinds.pop(kind, None)
                if len(self.kinds) >= self.MAX_KINDS:
                    self.kinds.pop(next(iter(self.kinds)))
                self.kinds[kind] = [now, 1, 0]
                if dropped:
                    record.msg = (
                        f"{record.msg} [{dropped} more like this in the last {self.window:.0f} s, not logged]"
                    )
                    record.suppressed = dropped
                return True
            if state[1] < self.burst:
                state[1] += 1
                return True
            state[2] += 1
            return False


# An access line's path (with its query) is cut to this many characters: the request line may be
# as long as the server's header bound (16 KiB), the log line need not.
ACCESS_PATH_CHARS = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _printable_path(path: str) -> str:
    """The path cut to ACCESS_PATH_CHARS (saying how long it was), its control characters written as
    escapes: it is the client's text, and a newline in it would forge a line (uvicorn quotes the
    path again, not the query)."""
    if len(path) > ACCESS_PATH_CHARS:
        path = f"{path[:ACCESS_PATH_CHARS]}...({len(path)} chars)"
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", path)


class AccessLog:
    """One server's request lines: uvicorn's access log, at most `per_minute` lines in a window of
    `window` seconds; the first line after a window that dropped some says how many. Stands in for
    uvicorn's access logger on the server's connections (`connections.BoundedHttpProtocol`), which
    call `info` with uvicorn's arguments (client, method, path, HTTP version, status).

    Written at INFO to `uvicorn.access` whatever that logger's level: the server's setting is what
    turns the lines on or off, not the service's log level."""

    def __init__(self, per_minute: int, window: float = 60.0, clock=time.monotonic) -> None:
        self.per_minute, self.window, self.clock = per_minute, window, clock
        self.logger = logging.getLogger("uvicorn.access")
        self.lock = threading.Lock()
        self.start, self.passed, self.dropped = -float("inf"), 0, 0

    def info(self, msg: str, *args: Any) -> None:
        now = self.clock()
        with self.lock:
            dropped = 0
            if now - self.start >= self.window:
                self.start, self.passed, dropped, self.dropped = now, 0, self.dropped, 0
            if self.passed >= self.per_minute:
                self.dropped += 1
                return
            self.passed += 1
        if len(args) == 5:
            client, method, path, version, status = args
            args = (client, method, _printable_path(str(path)), version, status)
        if dropped:
            msg = f"{msg} [{dropped} more requests in the last {self.window:.0f} s, not logged]"
        record = self.logger.makeRecord(self.logger.name, logging.INFO, "(access)", 0, msg, args, None)
        if dropped:
            record.suppressed = dropped
        self.logger.handle(record)  # past the logger's level (uvicorn's log level); filters apply


class _AccessFields(logging.Filter):
    """uvicorn's access log passes (client, method, path, http version, status) as arguments:
    keep them as fields, so a collector need not parse the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, _, status = record.args
            record.client, record.method, record.path, record.status = client, method, path, status
        return True


class JsonLines(JsonFormatter):
    """One JSON object a line: time (RFC 3339, UTC), level, logger, the context, message, then
    the event's extra fields."""

    FIRST = ("service", "run", "worker")

    def add_fields(self, log_data: dict, record: logging.LogRecord, message_dict: dict) -> None:
        stamp = datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")
        log_data["time"] = stamp.replace("+00:00", "Z")
        log_data["level"] = record.levelname
        log_data["logger"] = record.name
        for key in self.FIRST:
            if getattr(record, key, None) is not None:
                log_data[key] = getattr(record, key)
        log_data["message"] = record.message
        super().add_fields(log_data, record, message_dict)  # extras and exc_info; no format fields


def _handler(fmt: LogFormat) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        # The context fields are placed first by JsonLines; keep them out of the extras.
        handler.setFormatter(JsonLines(reserved_attrs=(*_RESERVED, *JsonLines.FIRST)))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    return handler


def setup_logging(
    service: str, fmt: LogFormat = "text", *, level: int = logging.INFO, **context: Any
) -> None:
    """Configure the process's logging (again: a second call replaces the first). `context`:
    fields of every line, `run` and `worker` where known, others (a learner's `rank`) too; None
    values are left out."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: choose from {', '.join(LOG_FORMATS)}")
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler = _handler(fmt)
    handler.addFilter(RepeatLimit())
    handler.addFilter(_Context(service=service, **context))
    root.addHandler(handler)
    root.setLevel(level)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _AccessFields) for f in access.filters):
        access.addFilter(_AccessFields())
    # Off, then on: captureWarnings(True) does nothing when logging thinks it captures already,
    # even after someone else (a test harness's catch_warnings) put warnings.showwarning back.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    if fmt == "json":
        _log_uncaught()


def _log_uncaught() -> None:
    """An exception that escapes a thread or the main program is logged (one JSON line with its
    traceback) instead of printed by Python as plain text."""
    log = logging.getLogger("spopp.uncaught")

    def main_hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, value, tb)
            return
        log.critical("%s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        log.critical(
            "%s in thread %s: %s", args.exc_type.__name__, getattr(args.thread, "name", "?"), args.exc_value,
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        )  # fmt: skip

    sys.excepthook = main_hook
    threading.excepthook = thread_hook


def bind(**fields: Any) -> None:
    """Add context to every later line (e.g. the worker id a replica claimed at start-up)."""
    for handler in logging.getLogger().handlers:
        for f in handler.filters:
            if isinstance(f, _Context):
                f.fields.update({k: v for k, v in fields.items() if v is not None})


# The LogRecord's own attributes: never copied into a JSON line as extras (python-json-logger's
# defaults, plus `message`, which JsonLines writes itself, taskName of Python 3.12, and uvicorn's
# `color_message`, its message again with terminal colour codes).
_RESERVED = (
    "args", "asctime", "created", "exc_info", "exc_text", "filename", "funcName", "levelname",
    "levelno", "lineno", "module", "msecs", "message", "msg", "name", "pathname", "process",
    "processName", "relativeCreated", "stack_info", "thread", "threadName", "taskName", "color_message",
)  # fmt: skip


def command_echo(settings: Any, service: str, **context: Any) -> Callable[[str], None]:
    """Set up a command's logging (`settings.log_format`); answer how it prints its progress: plain
    lines on stdout, or with json logs, log lines (so that everything it writes parses)."""
    import click

    setup_logging(service, settings.log_format, **context)
    if settings.log_format == "json":
        return logging.getLogger(f"spopp.{service}").info
    return click.echo
