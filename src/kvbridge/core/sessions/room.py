"""A room's state machine, shared by :class:`Sender` and :class:`Receiver`.

States only move forward: BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING <
SUCCESS, and FAILED (with a reason) is sticky. SUCCESS and FAILED are final.
The numeric order lets a host min-reduce the states of one request across
ranks.
"""

from __future__ import annotations

import _thread
import enum
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

__all__ = ["Changes", "Poll", "Room"]

log = logging.getLogger(__name__)

#: Room ids travel as unsigned 64-bit integers.
MAX_ROOM = 2**64 - 1


class Poll(enum.IntEnum):
    """Request states. The numeric order lets a host min-reduce them across ranks.

    SUCCESS: everything landed, metadata row last. FAILED: nothing of the room
    lands after it (decode reports it once prefill confirmed it stopped, or
    ``fence_timeout`` passed), so the host may reuse the room's memory at once;
    ``Receiver.fenced`` says when even a frozen prefill's in-flight batch is
    excluded. See docs/failures.md.
    """

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class Changes:
    """A manager's rooms' changes: hosts wait in :meth:`wait_for`, a room's change wakes them all (:meth:`wake`).

    A condition variable cut to what rooms need (issue #27): a waiter sleeps on a lock of its own,
    and :meth:`wake` releases those, costing nothing when no host waits (a room changes state
    several times per request; most changes find no host waiting). A woken host returns after one
    look at its rooms, where ``threading.Condition`` took another lock and a dozen Python calls
    first, right when the host's wake-up is a request's critical path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[_thread.LockType] = []

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Block until ``predicate()`` is true or ``timeout`` seconds (None: no limit) pass; its last answer.

        It is asked under the lock before each sleep, and :meth:`wake` takes that lock: a change
        made after it was asked (states change first, then wake) wakes this waiter, so none is missed."""
        end = None if timeout is None else time.monotonic() + timeout
        waiter = _thread.allocate_lock()
        waiter.acquire()  # held: the next acquire sleeps until wake() releases it
        while True:
            with self._lock:
                if predicate():
                    return True
                self._waiters.append(waiter)
            if end is None:
                woken = waiter.acquire()
            else:
                left = end - time.monotonic()
                woken = left > 0 and waiter.acquire(True, left)
            if not woken:
                with self._lock:
                    if waiter in self._waiters:  # not woken meanwhile
                        self._waiters.remove(waiter)
                return predicate()
            if predicate():  # woken (wake() took it off the list), holding its lock again
                return True

    def wake(self) -> None:
        """Wake every waiting host: each waiter's lock released and the list emptied, under the lock."""
        with self._lock:
            waiters = self._waiters
            if waiters:
                self._waiters = []
                for waiter in waiters:
                    waiter.release()


class Room:
    """One request's state on one rank. Its manager's lock guards every change."""

    def __init__(self, room: int) -> None:
        if isinstance(room, bool) or not isinstance(room, (int, np.integer)) or not 0 <= room <= MAX_ROOM:
            raise ValueError(f"room must be an integer in 0 .. 2**64-1, got {room!r}")
        self.room = int(room)
        self.created = time.monotonic()
        #: ``time.monotonic()`` when the room reached SUCCESS or FAILED (a host's poll loop
        #: sees it later, by up to one iteration; latencies are measured from this).
        self.ended: float | None = None
        self._state = Poll.BOOTSTRAPPING
        #: SUCCESS or FAILED (an attribute, not a property: read a dozen times per request, #27).
        self.final = False
        self._reason: str | None = None
        #: Notified on every change of state: the manager's ``changed`` (set when the room is added to it).
        self.changed: Changes | None = None

    def poll(self) -> Poll:
        """The current state; never blocks."""
        return self._state

    def wait(self, state: Poll, timeout: float) -> Poll:
        """Block until the room reaches ``state`` (or a final state) or ``timeout`` seconds pass; the state then.

        Woken by the change itself, not by polling, so a host that waits here
        sees SUCCESS microseconds after it happens.
        """
        def reached() -> bool:
            return self._state >= state or self.final

        cond = self.changed
        if cond is None:
            raise RuntimeError("this room belongs to no manager; poll() it instead")
        if reached():  # states only move forward: nothing to wait for (a sender whose write ran inline)
            return self._state
        cond.wait_for(reached, timeout)
        return self._state

    def failure(self) -> str | None:
        """Why the room failed, or None."""
        return self._reason

    def advance(self, state: Poll, reason: str | None = None, wake: bool = True) -> bool:
        """Move forward (never back); False if nothing changed. The caller holds the manager's lock.

        ``wake=False``: the caller wakes the waiting hosts itself, later (``changed.wake()``).
        """
        if self.final:
            return False
        if state == Poll.FAILED:
            self._state, self._reason, self.ended = Poll.FAILED, reason or "failed", time.monotonic()
            self.final = True
            log.warning("room %d failed: %s", self.room, self._reason)
        elif state > self._state:
            self._state = state
            if state == Poll.SUCCESS:
                self.ended = time.monotonic()
                self.final = True
        else:
            return False
        if wake and self.changed is not None:
            self.changed.wake()
        return True
