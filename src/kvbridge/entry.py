"""The ``kvbridge`` console script and ``python -m kvbridge``: a Ctrl-C from the first line on.

Importing the command (numpy, zmq, the engines' bindings) takes about half a
second; a Ctrl-C in that window used to end Python with a traceback. This
module imports nothing of kvbridge's until it is running (``import kvbridge``
itself is lazy), so the interruption is caught and reported like any other.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    try:
        from kvbridge.cli import main as command
    except KeyboardInterrupt:
        print("kvbridge: interrupted", file=sys.stderr)
        sys.stderr.flush()
        os._exit(130)  # as cli.main does: an import cut short may not survive the interpreter's exit
    return command()
