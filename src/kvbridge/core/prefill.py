"""The prefill manager: control endpoint, handshakes, decode peers and their requests."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable

import numpy.typing as npt
import zmq

from . import protocol as P
from .bootstrap import HELD, RENEW, register_rank
from .channel import Channel, quiet
from .layers import LayerIndex
from .layout import KVArgs, METADATA_SPACE
from .manager import SessionConfig, TransferManager
from .pairing import IncompatibleLayoutError, Route, pair_layouts
from .plan import Indices, PlanError
from .room import Poll, Room
from .sender import DecodeRequest, Sender
from .transport import BackendChoice
from .worker import PeerWorker

__all__ = ["DecodePeer", "PrefillManager"]

log = logging.getLogger(__name__)


class DecodePeer:
    """A decode rank that completed the handshake with this prefill rank, and its transfer worker."""

    def __init__(self, peer_id: str, route: Route) -> None:
        self.peer_id = peer_id
        self.ident = peer_id.encode()
        self.route = route
        self.last_seen = time.monotonic()
        self.worker = PeerWorker(peer_id)


class PrefillManager(TransferManager[Sender]):
    """One per prefill rank: control endpoint, decode peers, transfer workers.

    Every decode rank of a room sends this rank its destination lists; the
    room is ready (WAITING_FOR_INPUT) once all of them (the decode TP size)
    have arrived, even if this rank has nothing to send to some of them
    (MLA pages go from one prefill rank only): it still reports ``Done``.
    """

    role = "prefill"

    def __init__(
        self, kvargs: KVArgs, backend: BackendChoice = None, *, bootstrap: str, config: SessionConfig | None = None
    ) -> None:
        super().__init__(kvargs, backend, config)
        self._pending: dict[int, dict[str, DecodeRequest]] = {}  # requests that arrived before their sender
        self._peers: dict[str, DecodePeer] = {}
        self._space_counts = {s.name: s.count for s in kvargs.index_spaces}
        self.layer_index = LayerIndex(kvargs)  # layer-wise sending: which layer each source address belongs to
        self._chan = Channel(self.loop.ctx, zmq.ROUTER, self.auth, endpoint="prefill",
                             max_bytes=self.config.max_message_bytes)
        self.control_address = self._chan.bind(self.config.host)
        self.loop.add_socket(self._chan.sock, self._on_message)
        # Handshakes are a token bucket: `handshake_rate` per second, bursts of twice as many.
        self._hello_tokens = 2 * self.config.handshake_rate
        self._hello_refill = time.monotonic()
        self.bootstrap = bootstrap
        self._rank = P.RankInfo(kvargs.tp_rank, kvargs.tp_size, kvargs.pp_rank, kvargs.pp_size, self.control_address,
                                self.backend_name)
        self._lease: Channel | None = None
        self._renewed = math.inf  # no renewals before the first registration
        self.loop.start()
        try:
            register_rank(bootstrap, self._rank, self.config.bootstrap_timeout, self.auth)
        except Exception:
            self.close()
            raise
        self._renewed = time.monotonic()

    def active_rooms(self) -> int:
        """Senders plus rooms whose requests wait for their sender (for leak checks)."""
        with self.lock:
            return len(self.rooms) + len(self._pending)

    # -- for senders -------------------------------------------------------------------------
    def take_pending(self, room: int) -> Iterable[DecodeRequest]:
        """The requests that arrived for ``room`` before its sender was created (removed here)."""
        return self._pending.pop(room, {}).values()

    def peer(self, peer_id: str) -> DecodePeer | None:
        return self._peers.get(peer_id)

    def peers(self) -> list[DecodePeer]:
        """The decode ranks that completed the handshake (for benchmarks and ``describe``)."""
        with self.lock:
            return list(self._peers.values())

    def source_indices(self, space: str, values: npt.ArrayLike) -> Indices:
        """The host's source list for ``space``, checked against this rank's own index space."""
        return Indices.check(f"source {space} index", values, self._space_counts.get(space))

    def notify(self, peer: DecodePeer, *msgs: P.Message) -> None:
        """Send ``msgs`` to decode ``peer``, in order, with one hand-off to the I/O thread (any thread)."""
        payloads = [P.encode(m) for m in msgs]

        def send_all() -> None:
            for payload in payloads:
                self._chan.send(payload, peer.ident)

        self.loop.call(send_all)

    def fail_sender(self, sender: Sender, reason: str, kind: str) -> None:
        """Fail ``sender`` and tell every decode rank that asked for it (``kind``: the metrics reason)."""
        with self.lock:
            if not self.finish(sender, Poll.FAILED, reason, kind):
                return
            for peer_id in sender.peer_ids():
                peer = self._peers.get(peer_id)
                if peer is not None:
                    self.notify(peer, P.Failed(room=sender.room, reason=reason))

    def abort_room(self, room: Room, reason: str) -> None:
        assert isinstance(room, Sender)
        self.fail_sender(room, reason, "aborted")

    # -- control messages (I/O thread) --------------------------------------------------
    def _reply(self, ident: bytes, msg: P.Message) -> None:
        self._chan.send_msg(msg, ident)

    def _on_message(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        got = self._chan.receive(frames)
        if got is None:
            return
        ident, msg = got
        assert ident is not None
        if self.closed:
            return  # closing: each room's Failed is on its way; a "who are you" now would overtake it
        peer_id = ident.decode(errors="replace")
        if isinstance(msg, P.Hello):
            self._on_hello(ident, msg)
            return
        with self.lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                reason = f"{type(msg).__name__} from {peer_id!r} before a handshake; send Hello first"
                self._chan.reject(ident, reason, getattr(msg, "room", None))
                return
            peer.last_seen = time.monotonic()
            if isinstance(msg, P.Heartbeat):
                self._reply(ident, P.Heartbeat())
            elif isinstance(msg, P.TransferRequest):
                self._on_request(peer, msg)
            elif isinstance(msg, P.Abort):
                self._on_abort(peer, msg)
            else:
                reason = f"prefill does not accept {type(msg).__name__} messages"
                self._chan.reject(ident, reason, getattr(msg, "room", None))

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
        if not self._hello_allowed():
            problem = (f"too many handshakes: this prefill rank accepts {cfg.handshake_rate:g} per second "
                       "(SessionConfig.handshake_rate); retry")
        elif msg.peer_id not in self._peers and len(self._peers) >= cfg.max_peers:
            problem = (f"this prefill rank already serves {len(self._peers)} decode ranks, its limit "
                       "(SessionConfig.max_peers)")
        elif msg.peer_id.encode() != ident:
            problem = f"Hello peer_id {msg.peer_id!r} does not match the connection identity"
        elif msg.backend != self.backend_name:
            problem = f"decode uses backend {msg.backend!r} but this prefill rank uses {self.backend_name!r}"
        if problem is None:
            try:
                route = pair_layouts(self.kvargs, msg.kvargs)
                self.transport.add_peer(msg.peer_id, msg.backend_meta, msg.kvargs.regions, msg.local_meta)
            except IncompatibleLayoutError as exc:
                problem = str(exc)
            except Exception as exc:
                problem = f"backend {self.backend_name!r} could not add the peer: {exc}"
        if problem is not None:
            quiet.warning("prefill:hello", "prefill: rejected handshake from %r: %s", msg.peer_id[:64], problem)
            self._chan.reject(ident, problem)
            return
        with self.lock:
            old = self._peers.pop(msg.peer_id, None)
            if old is not None:
                old.worker.stop()
            self._peers[msg.peer_id] = DecodePeer(msg.peer_id, route)
        self._reply(ident, P.HelloAck(kvargs=self.kvargs))

    def _on_request(self, peer: DecodePeer, msg: P.TransferRequest) -> None:
        """Check a decode rank's destination lists once, on arrival; the planner trusts them after."""
        sender = self.rooms.get(msg.room)
        try:
            indices: dict[str, Indices] = {}
            for space, packed in msg.indices.items():
                # Checked before decoding: a list longer than allowed costs nothing to refuse.
                if len(packed) > 4 * self.config.max_index_list:
                    raise P.ProtocolError(f"index list {space[:64]!r} has {len(packed) // 4} entries, more than "
                                          f"max_index_list={self.config.max_index_list}")
                # Spaces this rank holds no regions of (another pipeline stage's state) are ignored.
                sr = peer.route.spaces.get(space)
                if sr is not None and len(packed) > 4 * sr.dst_count:
                    raise P.ProtocolError(f"index list {space[:64]!r} has {len(packed) // 4} entries but decode "
                                          f"declared only {sr.dst_count} {space!r} indices")
                idx = P.unpack_indices(space, packed)
                if sr is not None:
                    indices[space] = Indices.check(f"destination {space} index", idx, sr.dst_count, unique=True)
            if METADATA_SPACE in peer.route.spaces:
                Indices.check("destination metadata row", [msg.metadata_row], peer.route.spaces[METADATA_SPACE].dst_count)
        except (P.ProtocolError, PlanError) as exc:
            reason = f"bad transfer request from decode {peer.peer_id!r}: {exc}"
            # Fail the room only if nobody else has a valid request in it: one
            # decode must not be able to fail another decode's room.
            if sender is not None and not sender.peer_ids():
                self.finish(sender, Poll.FAILED, reason, "bad_request")
            # Reply last: whoever reads the reply must find the room already failed.
            self._reply(peer.ident, P.Failed(room=msg.room, reason=reason))
            return
        dst = peer.route.dst
        req = DecodeRequest(peer.peer_id, dst.tp_rank, dst.tp_size, indices, msg.metadata_row, time.monotonic())
        if sender is None:
            reqs = self._pending.setdefault(msg.room, {})
            problem = req.conflict(reqs)
            if problem is None:
                reqs[peer.peer_id] = req  # the host has not created the sender yet
        else:
            problem = sender.attach(req)
        if problem is not None:
            self._reply(peer.ident, P.Reject(reason=f"room {msg.room}: {problem}", room=msg.room))

    def _on_abort(self, peer: DecodePeer, msg: P.Abort) -> None:
        # A peer may abort only what it asked for.
        pending = self._pending.get(msg.room, {})
        pending.pop(peer.peer_id, None)
        if not pending:
            self._pending.pop(msg.room, None)
        sender = self.rooms.get(msg.room)
        if sender is not None and sender.asked_by(peer.peer_id):
            self.fail_sender(sender, f"aborted by decode: {msg.reason}", "aborted")

    # -- the bootstrap lease (I/O thread) ----------------------------------------------
    def _renew(self, now: float) -> None:
        """Renew this rank's registration with the bootstrap endpoint (see :mod:`kvbridge.core.bootstrap`)."""
        if now - self._renewed < RENEW:
            return
        self._renewed = now
        if self._lease is None:
            self._lease = Channel(self.loop.ctx, zmq.DEALER, self.auth, endpoint="prefill",
                                  max_bytes=self.config.max_message_bytes, to=self.bootstrap.encode())
            self._lease.connect(self.bootstrap)
            self.loop.add_socket(self._lease.sock, self._on_lease)
        self._lease.send_msg(P.Register(rank=self._rank))

    def _on_lease(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        assert self._lease is not None
        got = self._lease.receive(frames)
        if got is not None and isinstance(got[1], P.Reject):
            level = logging.WARNING if HELD in got[1].reason else logging.ERROR
            log.log(level, "prefill: the bootstrap endpoint %s refused to renew this rank: %s", self.bootstrap, got[1].reason)

    # -- timeouts and dead peers (I/O thread) ------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        self._renew(now)
        with self.lock:
            for room, reqs in list(self._pending.items()):
                if now - min(r.received for r in reqs.values()) > cfg.bootstrap_timeout:
                    log.warning("prefill: dropping requests for room %d: no sender created within %.1fs", room, cfg.bootstrap_timeout)
                    del self._pending[room]
            for sender in list(self.rooms.values()):
                overdue = sender.overdue(now, cfg)
                if overdue is not None:
                    self.fail_sender(sender, *overdue)
            for peer in list(self._peers.values()):
                if now - peer.last_seen > cfg.heartbeat_timeout:
                    self._drop_peer(peer, f"decode peer {peer.peer_id!r} sent no heartbeat for {now - peer.last_seen:.1f}s")

    def _drop_peer(self, peer: DecodePeer, reason: str) -> None:
        log.warning("prefill: %s; dropping it", reason)
        # Fail its rooms while it is still a known peer, so each Failed goes out: a
        # decode that was only frozen learns of it when it resumes.
        for sender in list(self.rooms.values()):
            if sender.asked_by(peer.peer_id):
                self.fail_sender(sender, reason, "peer_dead")
        self._peers.pop(peer.peer_id, None)
        peer.worker.stop()
        for room, reqs in list(self._pending.items()):
            reqs.pop(peer.peer_id, None)
            if not reqs:
                del self._pending[room]
        try:
            self.transport.remove_peer(peer.peer_id)
        except Exception:
            log.exception("backend failed to remove peer %s", peer.peer_id)

    def _shutdown(self) -> None:
        with self.lock:
            peers = list(self._peers.values())
            for peer in peers:
                peer.worker.stop()
            self._peers.clear()
            self._pending.clear()
        # The engine closes next: let running writes end first (they honour their
        # deadline, so this is bounded).
        deadline = time.monotonic() + self.config.transfer_timeout
        for peer in peers:
            peer.worker.join(max(0.0, deadline - time.monotonic()))
