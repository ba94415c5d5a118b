"""The ``kvbridge`` console script and ``python -m kvbridge``: a Ctrl-C from the first line on.

Importing the command (numpy, zmq, the engines' bindings) takes about half a
second; a Ctrl-C in that window used to end Python with a traceback. This
module imports nothing of kvbridge's until it is running (``import kvbridge``
itself is lazy), so the interruption is caught and reported like any other.
"""

from __future__ import annotations

import os
import sys


def _interrupted(*_: object) -> None:
    print("kvbridge: interrupted", file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)  # as cli.main does: an import cut short may not survive the interpreter's exit


def main() -> int:
    import _signal  # built in: nothing a Ctrl-C could cut short

    # While the command imports, a Ctrl-C ends the process from this handler instead of raising KeyboardInterrupt
    # wherever the import is: raised inside an extension module's initialisation, it could crash the interpreter
    # (SIGSEGV, nothing printed: 5 of 40 runs of `python -m kvbridge demo` interrupted 0.06 s after the start, on
    # this 2-core machine with two busy processes beside it).
    previous = _signal.signal(_signal.SIGINT, _interrupted)
    try:
        from kvbridge.cli import main as command
    except KeyboardInterrupt:  # a Ctrl-C that came before the handler was set
        _interrupted()
    finally:
        _signal.signal(_signal.SIGINT, previous)
    return command()
