"""Transfer workers: one thread per decode peer runs that peer's writes in order.

Writes to one peer never overlap, so a backend whose batches respect its
declared limits also respects its per-peer in-flight limit, and a slow or
frozen peer holds up only its own queue.

Jobs queued back to back that the submitter marked as one kind (a
:class:`Group` with the same ``run``) are run together, in queue order, by
one call: with many small requests in flight, their chunks then go out as one
backend write instead of one each.

A caller may :meth:`PeerWorker.claim` an idle worker and run a small write itself
(``Sender.send`` does, for backends that allow it: ``BackendCapabilities.inline_writes``):
no hand-off to the worker's thread, which on a busy 2-core host cost 75-100 us of a
1-page request (issue #27). Jobs submitted meanwhile wait for :meth:`PeerWorker.release`,
so a peer's writes still run one at a time, in order.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

__all__ = ["Group", "PeerWorker"]

log = logging.getLogger(__name__)

#: At most this many grouped jobs run in one call (bounds one write's size and latency).
MAX_GROUP = 64


@dataclass(frozen=True)
class Group:
    """A job that may run together with the grouped jobs queued right after it: ``run([item, ...])``."""

    run: Callable[[list[Any]], None]
    item: Any


Job = Union[Callable[[], None], Group]


class PeerWorker:
    """Runs submitted jobs one at a time (or one group at a time), in order, until stopped.

    Its thread starts with the first job and ends after ``idle`` seconds
    without one, so a decode rank that handshakes and sends nothing costs no
    thread: threads follow the peers with writes under way, not the peers.
    """

    def __init__(self, name: str, idle: float = 5.0) -> None:
        self.name = f"kvbridge-xfer-{name}"
        self.idle = idle
        self._jobs: collections.deque[Job | None] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._running = False  # the thread is running a job (set and cleared under _ready)
        self._claimed = False  # a caller runs a write itself (claim/release); queued jobs wait for it

    def claim(self) -> bool:
        """Reserve the peer's writes for the calling thread if nothing is queued or running; True if reserved.

        The caller then runs its write itself and must call :meth:`release` after it, whatever happens."""
        with self._ready:
            if self._jobs or self._running or self._claimed:
                return False
            self._claimed = True
            return True

    def release(self) -> None:
        """End a :meth:`claim`: the jobs submitted meanwhile run, in order, on the worker's thread."""
        with self._ready:
            self._claimed = False
            if self._jobs and self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._ready.notify_all()  # the worker's thread, and a join() waiting for the claim to end

    def submit(self, job: Job) -> None:
        with self._ready:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._ready.notify()

    def stop(self) -> None:
        """Run the jobs already queued, then end (does not wait; see :meth:`join`)."""
        with self._ready:
            if self._thread is not None:
                self._jobs.append(None)
                self._ready.notify()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end and a claimed write to be released."""
        end = time.monotonic() + timeout
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        with self._ready:
            self._ready.wait_for(lambda: not self._claimed, max(0.0, end - time.monotonic()))

    def _next(self) -> Callable[[], None] | list[Group] | None:
        """The next job, or the next run of grouped jobs sharing one ``run``; None: the thread ends."""
        with self._ready:
            self._running = False
            while True:
                if self._jobs and not self._claimed:
                    job = self._jobs.popleft()
                    if job is not None:
                        break
                    if not self._jobs:  # stopped; a job is queued under this lock: none slips past
                        self._thread = None
                        return None
                    continue
                # Idle (or waiting out a claim): a timeout with nothing queued ends the thread.
                if not self._ready.wait(self.idle) and not self._jobs:
                    self._thread = None
                    return None
            self._running = True
            if not isinstance(job, Group):
                return job
            group = [job]
            while self._jobs and len(group) < MAX_GROUP:
                nxt = self._jobs[0]
                if not isinstance(nxt, Group) or nxt.run != job.run:
                    break
                group.append(nxt)
                self._jobs.popleft()
            return group

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                if isinstance(job, list):
                    job[0].run([g.item for g in job])
                else:
                    job()
            except Exception:
                log.exception("kvbridge transfer job failed unexpectedly")
