"""Native engines' log lines, routed through :mod:`logging` at kvbridge's level.

Engines written in C++ (Mooncake logs with glog) write straight to the
process's stderr file descriptor, past Python's logging, and some print
errors that are not (Mooncake's "Local segment descriptor not found" while
it starts). An adapter wraps such a call in :func:`routed_stderr`: what the
engine writes meanwhile is read back and logged through the adapter's
logger, each glog line at its own level, lines the adapter knows to be
harmless at DEBUG; anything else is written back to stderr unchanged.
:func:`engine_level` turns kvbridge's own level into a name for engines that
read their level from the environment.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["engine_level", "routed_stderr"]

# glog: "E1123 12:36:09.907191  3049 transfer_metadata.cpp:1098] Local segment descriptor not found"
_GLOG = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([^\]]+)\] ?(.*)")
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# glog's note that it was used before being initialised: says nothing about the engine.
_GLOG_PREAMBLE = "WARNING: Logging before InitGoogleLogging() is written to STDERR"
# One redirection of file descriptor 2 at a time.
_lock = threading.Lock()


def engine_level(logger: str = "kvbridge") -> str:
    """``INFO``, ``WARNING`` or ``ERROR``: the engine log level matching ``logger``'s effective level."""
    level = logging.getLogger(logger).getEffectiveLevel()
    if level <= logging.INFO:
        return "INFO"
    return "WARNING" if level <= logging.WARNING else "ERROR"


@contextmanager
def routed_stderr(logger: logging.Logger, harmless: Iterable[str] = ()) -> Iterator[list[str]]:
    """Route what is written to file descriptor 2 inside the block through ``logger``.

    glog lines are logged at their level (those containing one of the
    ``harmless`` texts at DEBUG); other text goes back to stderr as it was.
    Yields the list of the engine's messages, filled when the block ends
    (for an error message). Writes of other threads meanwhile are delayed,
    not lost; one redirection runs at a time.
    """
    quiet = tuple(harmless)
    lines: list[str] = []
    with _lock, tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            lines.extend(_route(text, logger, quiet))


def _route(text: str, logger: logging.Logger, quiet: tuple[str, ...]) -> list[str]:
    messages: list[str] = []
    passthrough: list[str] = []
    for line in text.splitlines():
        match = _GLOG.fullmatch(line)
        if match is None:
            if line == _GLOG_PREAMBLE:
                logger.debug("%s", line)
            else:
                passthrough.append(line)
            continue
        severity, where, message = match.groups()
        level = logging.DEBUG if any(q in message for q in quiet) else _GLOG_LEVELS[severity]
        logger.log(level, "%s (%s)", message, where)
        messages.append(message)
    if passthrough:
        sys.stderr.write("\n".join(passthrough) + "\n")
        sys.stderr.flush()
    return messages
