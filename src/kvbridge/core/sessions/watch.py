"""Decode's watch over prefill ranks' processes: connection events, a process gone or replaced.

:class:`RankWatch` holds what :class:`~.decode.DecodeManager` does when a prefill rank's process
goes: its control connection's zmq socket monitor (``_monitor``, ``_stop_monitor``), the
incarnations seen gone (a lookup still listing one waits), a server still handshaking looked up
again, a server's sockets closed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..control.channel import Channel
from ..control.ioloop import IOLoop
from .servers import PrefillRank, PrefillServer

if TYPE_CHECKING:
    from .receiver import Receiver

__all__ = ["RankWatch"]

log = logging.getLogger(__name__)

#: Incarnations of prefill processes seen gone or replaced that are remembered (a lookup listing one waits).
MAX_DEAD = 4096
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED

class RankWatch:
    """The prefill-rank watch of :class:`~.decode.DecodeManager` (a part of it: it keeps the state below
    and provides ``_fail_server`` and ``_lookup``), kept here because it is one job with its own rules."""

    loop: IOLoop
    lock: threading.RLock
    rooms: dict[int, Receiver]
    _servers: dict[str, PrefillServer]
    _unconfirmed: dict[int, Receiver]
    #: Incarnations (hex) seen gone or replaced -> the control address they had ("" once a successor there was noted).
    _dead: OrderedDict[str, str]
    _fail_server: Callable[[PrefillServer, str, str], None]
    _lookup: Callable[[PrefillServer], None]

    def _monitor(self, chan: Channel) -> zmq.Socket:
        """A PAIR socket receiving ``chan``'s connection events. Its address is unique: pyzmq's own
        (``get_monitor_socket``) is named after the socket's descriptor, which a later socket reuses while
        the closed one's endpoint may still be registered, and that monitor then fails to start."""
        address = f"inproc://kvbridge-monitor-{uuid.uuid4().hex}"
        chan.sock.monitor(address, _MONITORED)
        mon = self.loop.ctx.socket(zmq.PAIR)
        mon.connect(address)
        return mon

    @staticmethod
    def _monitor_handler(rank: PrefillRank) -> Callable[[zmq.Socket, list[bytes]], None]:
        return lambda _sock, frames: rank.on_event(parse_monitor_message(frames)["event"])

    def _stop_monitor(self, rank: PrefillRank) -> None:
        """Stop monitoring ``rank``'s connection, then close the socket its events came to (I/O thread).

        In this order. Measured: with the receiving socket closed first (and pyzmq's descriptor-named
        addresses), after a few dozen managers the process's other zmq sockets stopped answering (a
        bootstrap endpoint in the same process, handshakes); in this order and with unique addresses,
        they did not. Most likely a monitor event with nowhere to go blocked zmq's I/O thread.
        """
        if rank.monitor is not None:
            if rank.chan is not None:
                rank.chan.sock.disable_monitor()
            self.loop.remove_socket(rank.monitor)
            rank.monitor = None

    def _close_server(self, server: PrefillServer) -> None:
        for r in server.ranks.values():
            self._stop_monitor(r)
        for chan in [server.lookup, *(r.chan for r in server.ranks.values())]:
            if chan is not None:
                self.loop.remove_socket(chan.sock)
        server.lookup = None
        for r in server.ranks.values():
            r.chan = None

    def _gone(self, server: PrefillServer, rank: PrefillRank, why: str | None = None) -> None:
        """``rank``'s process is gone: it writes nothing more. Its rooms here stop waiting for its
        ``Fenced``, and a server still in use fails its rooms now, not at ``heartbeat_timeout``; one
        still handshaking looks the ranks up again instead (a replacement may be registering)."""
        rank.gone = True
        with self.lock:
            for inc in {rank.incarnation.hex(), rank.info.incarnation} - {""}:
                self._dead[inc] = rank.info.control_addr if why is None else ""  # a successor there is noted
            while len(self._dead) > MAX_DEAD:
                self._dead.popitem(last=False)
        why = why or "the process is gone (its control connection closed and reconnecting is refused)"
        if self._servers.get(server.address) is server and not server.ready:
            log.warning("decode: %s: %s; looking the prefill ranks up again", rank.label, why)
            self._relookup(server)
            return
        if self._servers.get(server.address) is server:
            self._fail_server(server, f"{rank.label}: {why}", "peer_dead")
        with self.lock:
            for recv in [*self.rooms.values(), *self._unconfirmed.values()]:
                if recv.server.address == server.address:
                    recv.on_fenced(rank.key)

    def _note_successor(self, rank: PrefillRank) -> None:
        """``rank`` answered the handshake from a new incarnation: if one seen gone by its closed connection had
        its address (a prefill restarted on its port), say so. The old one's rooms failed when it was seen gone ("the process is gone"):
        final then, their reason is not rewritten (the host may have read it and reused the pages)."""
        addr, new = rank.info.control_addr, rank.incarnation.hex()
        with self.lock:
            old = [inc for inc, at in self._dead.items() if at == addr and inc != new]
            for inc in old:
                self._dead[inc] = ""
        if old:
            log.warning("decode: %s restarted: a new process (incarnation %s) replaced incarnation %s, seen gone "
                        "before (its rooms failed then: the process is gone)", rank.label, new, ", ".join(old))

    def _relookup(self, server: PrefillServer) -> None:
        """Drop a handshaking server's ranks and ask its bootstrap endpoint again (I/O thread).

        Nothing was requested through it yet (requests wait for every rank's HelloAck), so its
        rooms keep waiting, bounded by ``bootstrap_timeout``. A rank that accepted the Hello keeps
        this decode as a peer until it is silent long enough; the next Hello replaces it."""
        self._close_server(server)
        with self.lock:
            server.ranks = {}
        self._lookup(server)
