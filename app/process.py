"""What every command process shares: its logging and its exit statuses.

A run's children (``train``, ``explore``, ``feed``) report why they stopped through their
exit status, which ``streamrft run``'s supervisor reads to decide between a restart and a
failure.
"""

from __future__ import annotations

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


def setup_logging(level: str = "INFO") -> None:
    """Log lines to stderr with their time, level and logger; chatty libraries at WARNING."""
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("aiokafka", "urllib3", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
