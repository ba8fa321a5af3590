"""What every command process shares: its logging and its exit statuses.

A run's children (``train``, ``explore``, ``feed``) report why they stopped through their
exit status, which ``streamrft run``'s supervisor reads to decide between a restart and a
failure.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

EXIT_CONFIG = 78
"""Exit status of a run's child process (train, explore, feed) stopped by a configuration
error (``ConfigError``, sysexits' EX_CONFIG): restarting it cannot help, and the supervisor
does not."""
EXIT_STALLED = 75
"""Exit status of a trainer that stopped because nothing can make progress (``Stalled``:
tasks left that no explorer works on; sysexits' EX_TEMPFAIL): ``streamrft run`` fails the
run with the reason rather than restarting it."""


def setup_logging(level: str = "INFO", fmt: str = "text", command: str = "") -> None:
    """Log lines to stderr (``monitor.log_format``): text with time, level and logger, or one
    JSON object a line (:class:`JsonLines`); chatty libraries at WARNING. Called again once
    the config is read, it replaces what the first call set."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLines(command))
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    logging.basicConfig(level=getattr(logging, level), handlers=[handler], force=True)
    logging.captureWarnings(fmt == "json")  # a library's warning is a JSON line too
    for noisy in ("aiokafka", "urllib3", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class JsonLines(logging.Formatter):
    """One JSON object a line: ``time`` (ISO 8601, UTC, milliseconds), ``level``,
    ``logger``, ``message``, ``command`` (``train``, ``explore``...), ``pid``, and
    ``exception`` (the traceback) when there is one; a multi-line message stays one line."""

    def __init__(self, command: str) -> None:
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        line = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "command": self.command,
            "pid": record.process,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)
