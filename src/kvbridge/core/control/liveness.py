"""Is anybody listening at a control address? A TCP probe that tells a dead process from a live one.

A process that is gone leaves its port closed: the host's kernel refuses a
connection at once. A live process accepts it, and so does the kernel of a
*frozen* one (SIGSTOP: the listen backlog still answers); a cut link or a
host that is down answers nothing within the timeout. Only the first case is
"gone": :func:`refused` is True only when the connection was actively
refused, so a frozen, slow or unreachable holder is never taken for dead.

:class:`Probes` runs such probes off the caller's thread (the bootstrap
endpoint's I/O thread must not wait on a remote host), one at a time per
address, and calls back with the verdict.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

__all__ = ["PROBE_TIMEOUT", "Probes", "refused"]

log = logging.getLogger(__name__)

#: Seconds a probe waits for an answer; silence counts as "not refused".
PROBE_TIMEOUT = 0.5


def refused(address: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether a TCP connection to ``address`` (``HOST:PORT``) is refused: nobody listens there any more."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):  # timed out, unreachable, unresolvable: not known gone
        return False


class Probes:
    """Probes run on short-lived threads, at most one in flight per address."""

    def __init__(self, timeout: float = PROBE_TIMEOUT) -> None:
        self.timeout = timeout
        self._running: set[str] = set()
        self._lock = threading.Lock()

    def start(self, address: str, done: Callable[[bool], None]) -> bool:
        """Probe ``address``; ``done(refused)`` runs on the probe's thread. False if one is already running."""
        with self._lock:
            if address in self._running:
                return False
            self._running.add(address)

        def run() -> None:
            try:
                verdict = refused(address, self.timeout)
                done(verdict)
            except Exception:
                log.exception("probe of %s failed", address)
            finally:
                with self._lock:
                    self._running.discard(address)

        threading.Thread(target=run, name="kvbridge-probe", daemon=True).start()
        return True
