"""Transfer workers: one thread per decode peer runs that peer's writes in order.

Writes to one peer never overlap, so a backend whose batches respect its
declared limits also respects its per-peer in-flight limit, and a slow or
frozen peer holds up only its own queue.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["PeerWorker"]

log = logging.getLogger(__name__)

Job = Callable[[], None]


class PeerWorker:
    """A thread that runs submitted jobs one at a time, in order, until stopped."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"kvbridge-xfer-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """Run the jobs already queued, then end (does not wait; see :meth:`join`)."""
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("kvbridge transfer job failed unexpectedly")
