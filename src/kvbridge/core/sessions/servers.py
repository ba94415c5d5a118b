"""Decode's view of a prefill server (found through its bootstrap endpoint) and of its ranks, and what
a :class:`~.receiver.Receiver` uses of the :class:`~.decode.DecodeManager` (``DecodeSide``).

Kept apart from ``decode`` so that ``receiver`` names these without importing the manager that
imports it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Protocol

import zmq

from ..control import protocol as P
from ..control.channel import Channel
from ..description.layout import KVArgs
from .room import Poll, Room

if TYPE_CHECKING:
    from .manager import SessionConfig

__all__ = ["DecodeSide", "PrefillRank", "PrefillServer"]

#: Seconds a prefill rank's control connection must have been closed, with reconnecting refused, before
#: its process counts as gone: what its engine had already sent (a dead process's kernel still delivers
#: its sockets' queued bytes) lands within it on a working link.
GONE_GRACE = 0.5


class PrefillRank:
    """One prefill rank of a server: its control socket and liveness."""

    def __init__(self, info: P.RankInfo) -> None:
        self.info = info
        self.chan: Channel | None = None
        self.acked = False
        self.last_seen = time.monotonic()
        self.last_ping = 0.0
        #: The latest clock this rank put in a heartbeat reply: echoed in the next ping (its lease).
        self.clock: float | None = None
        #: zmq's events of ``chan``'s connection (a PAIR socket), to tell a dead process from a silent one.
        self.monitor: zmq.Socket | None = None
        # Not connected yet counts as closed since now: an address nobody listens at (a process that died
        # after it registered) is seen gone as a closed connection is, instead of waited on.
        self.dropped_at: float | None = time.monotonic()  # when the connection closed (None: connected)
        self.retries = 0  # reconnects zmq scheduled since then (the first when it closed)
        self.gone = False  # its process is gone: it writes nothing more
        #: The incarnation its HelloAck came from: a message from another one means the process was replaced.
        self.incarnation = b""

    def on_event(self, event: int) -> None:
        """A zmq monitor event of the control connection."""
        if event == zmq.EVENT_DISCONNECTED:
            # Always from now: the connection's CONNECTED may have come before the monitor started, so
            # "not connected since creation" must not shorten GONE_GRACE for a connection that was up.
            self.dropped_at, self.retries = time.monotonic(), 0
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.retries += self.dropped_at is not None
        elif event == zmq.EVENT_CONNECTED:
            # A listener took the connection back (the process had dropped it: prefill's ROUTER hands an
            # identity to its newest connection), or a new process on the port: not known gone.
            self.dropped_at, self.retries = None, 0

    def is_gone(self, now: float) -> bool:
        """Whether the process is gone: its connection closed, reconnecting failed since (zmq schedules
        one retry as it closes, then one per failed attempt: two or more) and no reconnect succeeded
        within :data:`GONE_GRACE`. A frozen process keeps its connections (its kernel even accepts new
        ones); a cut link closes none."""
        return self.dropped_at is not None and self.retries >= 2 and now - self.dropped_at >= GONE_GRACE

    def socket(self) -> Channel | None:
        """The control channel, looked up when a message goes out (with the I/O loop's lock held)."""
        return self.chan

    @property
    def key(self) -> tuple[int, int]:
        return (self.info.tp_rank, self.info.pp_rank)

    @property
    def label(self) -> str:
        return f"prefill tp{self.info.tp_rank}/pp{self.info.pp_rank} at {self.info.control_addr}"


class PrefillServer:
    """Decode's view of one prefill server (found through its bootstrap endpoint)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.created = time.monotonic()
        self.lookup: Channel | None = None
        self.next_lookup = 0.0
        self.ranks: dict[tuple[int, int], PrefillRank] = {}
        self.ready = False
        self.failed: str | None = None
        self.queued: list[P.Message] = []  # for every rank once the handshake completes
        #: Once given up on: its sockets stay open at least until then, so the Aborts sent last get out.
        self.linger_until = 0.0


class DecodeSide(Protocol):
    """What a :class:`~.receiver.Receiver` uses of its :class:`~.decode.DecodeManager`."""

    lock: threading.RLock
    kvargs: KVArgs
    space_counts: dict[str, int]
    config: SessionConfig
    backend_name: str

    def server(self, address: str) -> PrefillServer: ...
    def add_room(self, room: Room) -> None: ...
    def tell(self, server: PrefillServer, msg: P.Message) -> None: ...
    def send_to_ranks(self, server: PrefillServer, msg: P.Message) -> None: ...
    def confirmed(self, recv: Room) -> None: ...
    def unconfirmed(self, recv: Room) -> None: ...
    def finish(self, room: Room, state: Poll, reason: str | None = None, kind: str = "transfer_error",
               wake: bool = True) -> bool: ...
