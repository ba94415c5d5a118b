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
    """Runs submitted jobs one at a time, in order, until stopped.

    Its thread starts with the first job and ends after ``idle`` seconds
    without one, so a decode rank that handshakes and sends nothing costs no
    thread: threads follow the peers with writes under way, not the peers.
    """

    def __init__(self, name: str, idle: float = 5.0) -> None:
        self.name = f"kvbridge-xfer-{name}"
        self.idle = idle
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, job: Job) -> None:
        with self._lock:
            self._jobs.put(job)
            self._start()

    def stop(self) -> None:
        """Run the jobs already queued, then end (does not wait; see :meth:`join`)."""
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _start(self) -> None:
        if self._thread is None:  # under the lock
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle)
            except queue.Empty:
                job = None
            if job is None:  # idle, or stopped
                with self._lock:  # a job is queued under this lock: none can slip past this check
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            try:
                job()
            except Exception:
                log.exception("kvbridge transfer job failed unexpectedly")
