"""The prefill side's handshakes: a decode rank's ``Hello`` checked, rate-limited, paired and routed.

:class:`Handshakes` holds what :class:`~.prefill.PrefillManager` does with a ``Hello``: the token
bucket (``SessionConfig.handshake_rate``), the peer limit, a peer id claimed by another process
refused, the two layouts paired and the peer added to the transport, and the connection it came
on remembered as that peer's route (no route without proof: docs/security.md). A decode that named
its instance (``SessionConfig.instance_name``) holds a *slot* (host, name, TP rank, PP rank): a new
process's accepted handshake in a slot retires the process that held it at once (its rooms fail naming
the restart), instead of leaving them to its lapsed lease (docs/failures.md, "Restarts").
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..control import protocol as P
from ..control.channel import Channel, quiet
from ..control.ioloop import IOLoop
from ..description.layout import METADATA_SPACE, KVArgs
from ..planning.layers import LayerIndex
from ..planning.pairing import IncompatibleLayoutError, Route, pair_layouts
from ..planning.transferplan import TransferPlan
from .peers import DecodePeer

if TYPE_CHECKING:
    from ..transfer.transport import Transport
    from .manager import SessionConfig

__all__ = ["Handshakes"]

MAX_ROUTES = 4096  # decode peer ids whose last connection is remembered after the peer was dropped (late Fenced)
log = logging.getLogger(__name__)


def warm_plans(route: Route, layers: LayerIndex) -> list[TransferPlan]:
    """What a peer's lanes prepare for (``Backend.warm``): the route's sample plans
    (:meth:`~kvbridge.core.planning.pairing.Route.samples`) of every index space but the metadata row's
    (planned apart, once per peer: ``DecodePeer.row_plans``), each whole (a chunk sent at once) and layer
    by layer (layer-wise sending posts a layer's rows). A layer's part differs from another's only in where
    its rows are, so one layer of each alignment of its rows (to :data:`ROW_ALIGN` bytes) stands for all:
    61 layers planned and handed over one by one cost a handshake 0.4 s of CPU on this VM."""
    out: list[TransferPlan] = []
    for plan in route.samples([space for space in route.spaces if space != METADATA_SPACE]):
        out.append(plan)
        seen: set[tuple[int, ...]] = set()
        for part in layers.split(plan).parts:
            key = _row_alignment(part)
            if len(part) and key not in seen:
                seen.add(key)
                out.append(part)
    return out


#: Alignments of a layer's rows up to this many bytes tell layers apart in :func:`warm_plans`.
ROW_ALIGN = 16


def _row_alignment(plan: TransferPlan) -> tuple[int, ...]:
    """Per part of ``plan``, the largest power of two up to :data:`ROW_ALIGN` dividing every row's address."""
    out = []
    for src_rows, dst_rows, *_ in plan.factors(in_units=True):
        bits = int(np.bitwise_or.reduce(src_rows)) | int(np.bitwise_or.reduce(dst_rows)) if len(src_rows) else 0
        out.append(min(ROW_ALIGN, bits & -bits) if bits else ROW_ALIGN)
    return tuple(out)


class Handshakes:
    """The handshakes of :class:`~.prefill.PrefillManager` (a part of it: it keeps the state below and
    provides ``_reply`` and ``_drop_peer``), kept here because it is one job with its own rules."""

    lock: threading.RLock
    config: SessionConfig
    transport: Transport
    kvargs: KVArgs
    backend_name: str
    _chan: Channel
    _peers: dict[str, DecodePeer]
    _routes: OrderedDict[str, bytes]
    _route_peer: OrderedDict[bytes, str]
    _slots: dict[tuple[str, str, int, int], str]  # a named decode rank's slot -> the peer id holding it
    _hello_tokens: float
    _hello_refill: float
    _reply: Callable[[bytes, P.Message], None]
    _drop_peer: Callable[[DecodePeer, str], None]
    loop: IOLoop
    layer_index: LayerIndex

    def _hello_allowed(self) -> bool:
        """Take a handshake token (I/O thread)."""
        now = time.monotonic()
        rate = self.config.handshake_rate
        self._hello_tokens = min(2 * rate, self._hello_tokens + (now - self._hello_refill) * rate)
        self._hello_refill = now
        if self._hello_tokens < 1:
            return False
        self._hello_tokens -= 1
        return True

    def _on_hello(self, ident: bytes, msg: P.Hello) -> None:
        problem = None
        cfg = self.config
        incarnation = self._chan.sender_incarnation
        held = self._peers.get(msg.peer_id)
        slot = (msg.host, msg.instance, msg.kvargs.tp_rank, msg.kvargs.pp_rank) if msg.instance else None
        replaced = self._slot_holder(slot, msg.peer_id, incarnation)
        if not self._hello_allowed():
            problem = (f"too many handshakes: this prefill rank accepts {cfg.handshake_rate:g} per second "
                       "(SessionConfig.handshake_rate); retry")
        elif msg.peer_id not in self._peers and replaced is None and len(self._peers) >= cfg.max_peers:
            problem = (f"this prefill rank already serves {len(self._peers)} decode ranks, its limit "
                       "(SessionConfig.max_peers)")
        elif held is not None and held.incarnation != incarnation:
            # Another process claims a live peer's id: it must not take its route nor fail its rooms.
            problem = (f"decode peer id {msg.peer_id[:64]!r} belongs to another process (incarnation "
                       f"{held.incarnation.hex() or 'none'}, this Hello came from {incarnation.hex() or 'none'}); "
                       "a restarted decode handshakes under a new id")
        elif not set(msg.lanes) & set(self.backend_name.split(",")):
            problem = f"decode uses backend {','.join(msg.lanes)!r} but this prefill rank uses {self.backend_name!r}"
        if problem is None:
            try:
                route = pair_layouts(self.kvargs, msg.kvargs)
                with self.lock:
                    old = self._peers.get(msg.peer_id)
                    if old is not None:
                        # A decode handshakes again only after it gave up on this rank: what
                        # it asked for before is dead on its side.
                        self._drop_peer(old, f"decode peer {msg.peer_id!r} handshook again")
                self.transport.add_peer(msg.peer_id, msg.lanes, msg.kvargs.regions, msg.host, msg.staging)
                if replaced is not None:
                    with self.lock:
                        # Accepted: the process it replaces is dead (a name is never shared by two live
                        # instances), and so are the destinations of its rooms.
                        self._drop_peer(replaced, self._restart_reason(replaced, msg, incarnation))
            except IncompatibleLayoutError as exc:
                problem = str(exc)
            except Exception as exc:
                problem = f"backend {self.backend_name!r} could not add the peer: {exc}"
        if problem is not None:
            quiet.warning("prefill:hello", "prefill: rejected handshake from %r: %s", msg.peer_id[:64], problem)
            self._chan.reject(ident, problem)
            return
        with self.lock:
            self._peers[msg.peer_id] = DecodePeer(msg.peer_id, route, self.config.heartbeat_timeout,
                                                  self.config.inline_row_bytes, ident=ident, incarnation=incarnation,
                                                  slot=slot)
            if slot is not None:
                self._slots[slot] = msg.peer_id
            self._route_peer[ident] = msg.peer_id
            self._route_peer.move_to_end(ident)
            self._routes[msg.peer_id] = ident
            self._routes.move_to_end(msg.peer_id)
            for table in (self._routes, self._route_peer):
                while len(table) > MAX_ROUTES:
                    table.popitem(last=False)
        self._acknowledge(ident, msg.peer_id, route)

    def _acknowledge(self, ident: bytes, peer_id: str, route: Route) -> None:
        """Answer an accepted ``Hello`` (I/O thread): at once, unless a lane prepares for the peer's writes
        (``Backend.warm``, on a thread of its own, with plans shaped like the peer's requests): then once
        it is done or ``SessionConfig.warm_timeout`` has passed, whichever comes first. The peer sends no
        request before the answer, so its first ones find the lanes ready. A peer dropped or replaced
        meanwhile gets no answer here (its next ``Hello`` gets its own)."""
        ack = P.HelloAck(kvargs=self.kvargs)
        if not self.transport.warms(peer_id):
            self._reply(ident, ack)
            return
        peer, pending = self._peers[peer_id], [True]

        def answer(why: str) -> None:  # on the I/O thread only: the flag needs no lock
            if not pending:
                return
            pending.clear()
            timer.cancel()
            if self._peers.get(peer_id) is peer:
                if why:
                    log.warning("prefill: answering decode peer %r's handshake %s", peer_id[:64], why)
                self._reply(ident, ack)

        def prepare() -> None:
            try:
                self.transport.warm(peer_id, warm_plans(route, self.layer_index))
            except Exception as exc:  # only the first writes are slower for it
                log.warning("prefill: preparing the lanes for decode peer %r failed: %r", peer_id[:64], exc)
            self.loop.call(lambda: answer(""))

        timeout = self.config.warm_timeout
        timer = threading.Timer(timeout, lambda: self.loop.call(
            lambda: answer(f"while its lanes still prepare for it ({timeout:g} s: SessionConfig.warm_timeout)")))
        timer.daemon = True
        threading.Thread(target=prepare, name="kvbridge-warm", daemon=True).start()
        if timeout:
            timer.start()
        else:
            answer("")  # at once; the lanes still prepare beside the first writes

    def _release_slot(self, peer: DecodePeer) -> None:
        """``peer`` is gone: its slot, if it holds one, is free."""
        if peer.slot is not None and self._slots.get(peer.slot) == peer.peer_id:
            del self._slots[peer.slot]

    def _slot_holder(self, slot: tuple[str, str, int, int] | None, peer_id: str, incarnation: bytes) -> DecodePeer | None:
        """The live peer of another process holding ``slot``, which a handshake from ``peer_id`` of
        ``incarnation`` replaces once accepted; or None."""
        if slot is None:
            return None
        with self.lock:
            holder = self._peers.get(self._slots.get(slot, ""))
        if holder is None or holder.slot != slot or holder.peer_id == peer_id or holder.incarnation == incarnation:
            return None
        return holder

    @staticmethod
    def _restart_reason(old: DecodePeer, msg: P.Hello, incarnation: bytes) -> str:
        """Why ``old``'s rooms fail: a new process of its decode rank handshook (naming both incarnations)."""
        return (f"decode {msg.instance[:64]!r} TP rank {msg.kvargs.tp_rank} (PP rank {msg.kvargs.pp_rank}) restarted: "
                f"a new process (peer {msg.peer_id[:64]!r}, incarnation {incarnation.hex() or 'none'}) replaced "
                f"peer {old.peer_id!r} (incarnation {old.incarnation.hex() or 'none'}), whose rooms are lost")
