"""The prefill side's write fence: no byte of a failed room is written after decode is told it stopped.

A write is counted while it runs (:meth:`WriteFence.begin_write`/:meth:`WriteFence.end_write`);
before every batch the room must be live (:meth:`WriteFence.live`: not failed, the decode
peer's lease not lapsed); ``Fenced`` goes to decode once the room failed and no write of it
to that peer runs any more (or, after a failed write, once the engine has certainly stopped:
``Transport.fence_delay``). docs/failures.md describes the guarantees.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..control import protocol as P
from .peers import DecodePeer
from .room import Poll

if TYPE_CHECKING:
    from ..control.channel import Channel
    from ..transfer.transport import Transport
    from .manager import SessionConfig
    from .sender import Sender

__all__ = ["WriteFence"]

LEASE_POLL = 0.005  # seconds between lease checks while a transfer worker waits for a renewal


class WriteFence:
    """The fence of :class:`~.prefill.PrefillManager` (a part of it: it keeps the state below and
    provides ``send`` and ``fail_sender``), kept here because it is one job with its own rules."""

    lock: threading.RLock
    config: SessionConfig
    transport: Transport
    _chan: Channel
    _peers: dict[str, DecodePeer]
    #: (room, peer id) -> writes of that room to that peer running now.
    _writing: dict[tuple[int, str], int]
    #: ``Fenced`` messages waiting out an engine's drain: (when, room, peer id); sent by the tick.
    _deferred_fenced: list[tuple[float, int, str]]
    #: decode peer id -> the connection of its latest accepted Hello (kept after a drop, for late Fenced).
    _routes: OrderedDict[str, bytes]
    send: Callable[..., Any]
    fail_sender: Callable[[Sender, str, str], None]

    def _lapsed(self, sender: Sender, peer: DecodePeer, now: float) -> str | None:
        """Why ``sender``'s room has waited too long for ``peer``'s lease to be renewed, or None.

        A lapsed lease fails a room only ``heartbeat_timeout`` after the lapse
        (or after the room's request arrived, if later: a decode that resumed
        after a freeze renews within a heartbeat round trip). Meanwhile no
        batch starts: the lapse, not the failure, is what fences.
        """
        req = sender.request(peer.peer_id)
        since = max(peer.lease_until, req.received if req is not None else 0.0)
        if now - since <= self.config.heartbeat_timeout:
            return None
        proof = peer.lease_until - self.config.heartbeat_timeout
        return (f"decode peer {peer.peer_id!r} gave no sign of life for {now - proof:.1f}s "
                f"(its lease lapsed {now - peer.lease_until:.1f}s ago; heartbeat_timeout={self.config.heartbeat_timeout}s)")

    def live(self, sender: Sender, peer: DecodePeer, wait: bool = False) -> bool:
        """Whether ``sender`` may start another batch to ``peer`` now (checked before every batch).

        Not once the room has failed, nor while ``peer``'s lease has lapsed
        (no proof within ``heartbeat_timeout`` that decode is alive and has not
        given up: see :class:`DecodePeer`). A lapse that outlasts
        :meth:`_lapsed`'s margin fails the room; with ``wait`` (a transfer
        worker, not holding the lock) a shorter one is waited out, else it
        fails the room at once.
        """
        while True:
            if sender.poll() == Poll.FAILED:
                return False
            if self._peers.get(peer.peer_id) is not peer:
                self.fail_sender(sender, f"decode peer {peer.peer_id!r} was dropped", "peer_dead")
                return False
            now = time.monotonic()
            if now < peer.lease_until:
                return True
            why = self._lapsed(sender, peer, now)
            if why is not None or not wait:
                self.fail_sender(sender, why or f"decode peer {peer.peer_id!r}'s lease lapsed "
                                 f"{now - peer.lease_until:.1f}s ago", "peer_dead")
                return False
            time.sleep(LEASE_POLL)  # bounded: _lapsed fails the room heartbeat_timeout after the lapse

    def begin_write(self, sender: Sender, peer: DecodePeer) -> bool:
        """Count a write of ``sender`` to ``peer`` as running; False (nothing counted) if the room is not live.

        Waits out a short lapse of the lease first (without the lock: the I/O
        thread must be free to take the renewal); a valid lease has none to wait
        out, and everything else is checked under the lock."""
        if time.monotonic() >= peer.lease_until and not self.live(sender, peer, wait=True):
            return False
        with self.lock:
            if not self.live(sender, peer):
                return False
            key = (sender.room, peer.peer_id)
            self._writing[key] = self._writing.get(key, 0) + 1
            return True

    def end_write(self, sender: Sender, peer: DecodePeer) -> None:
        """The write has returned: if the room failed meanwhile, it is now fenced towards ``peer``."""
        with self.lock:
            key = (sender.room, peer.peer_id)
            left = self._writing.pop(key, 1) - 1
            if left > 0:
                self._writing[key] = left
            elif sender.poll() == Poll.FAILED:
                self._fenced(sender.room, peer.peer_id)

    def _route(self, peer_id: str) -> bytes | None:
        """The connection to decode peer ``peer_id``: that of its latest accepted Hello (None: never had one)."""
        return self._routes.get(peer_id)

    def _tell_failed(self, room: int, peer_id: str, reason: str) -> None:
        """Send ``Failed``, then ``Fenced`` unless a write to that peer is running (its end sends it)."""
        ident = self._route(peer_id)
        if ident is not None:
            self.send(lambda: self._chan, P.Failed(room=room, reason=reason), ident)
        if (room, peer_id) not in self._writing:
            self._fenced(room, peer_id)

    def _fenced(self, room: int, peer_id: str, ident: bytes | None = None) -> None:
        """Tell ``peer_id`` nothing of ``room`` lands any more: now, or once the engine has certainly
        stopped writing what a failed write to it left behind (``Transport.fence_delay``; sent by the tick).
        ``ident``: answer on that connection (an unknown one) instead of the peer's route."""
        delay = self.transport.fence_delay(peer_id)
        with self.lock:
            if delay > 0:
                self._deferred_fenced.append((time.monotonic() + delay, room, peer_id))
            else:
                ident = ident if ident is not None else self._route(peer_id)
                if ident is not None:
                    self.send(lambda: self._chan, P.Fenced(room=room), ident)
