"""A room's state machine, shared by :class:`Sender` and :class:`Receiver`.

States only move forward: BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING <
SUCCESS, and FAILED (with a reason) is sticky. SUCCESS and FAILED are final.
The numeric order lets a host min-reduce the states of one request across
ranks.
"""

from __future__ import annotations

import enum
import logging
import threading
import time

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


class Changes(threading.Condition):
    """A manager's rooms' changes: a condition on a plain lock whose :meth:`wake` costs nothing
    when no host waits (a room changes state several times per request; most changes find no host
    waiting, and ``notify_all`` is a dozen Python calls: issue #27)."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())

    def wake(self) -> None:
        """``notify_all()`` under the lock: each waiter's lock released and taken off the list, without
        ``notify``'s checks and per-waiter ``remove`` (run on the I/O thread just before the woken host
        needs the GIL it holds: #27). A waiter joins the list under the lock, after it found the state
        unchanged: checked under the lock, none is missed. One that timed out meanwhile finds itself off
        the list (``Condition.wait`` allows for that)."""
        with self._lock:  # type: ignore[attr-defined]
            waiters = self._waiters  # type: ignore[attr-defined]
            while waiters:
                waiters.popleft().release()


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
        with cond:
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
