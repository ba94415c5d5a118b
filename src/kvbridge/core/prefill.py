"""The prefill manager: control endpoint, handshakes, decode peers and their requests."""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Iterable

import numpy.typing as npt
import zmq

from . import protocol as P
from .bootstrap import HELD, RENEW, register_rank
from .channel import Channel, quiet
from .checksum import vram_problem
from .layers import LayerIndex
from .layout import KVArgs, METADATA_SPACE
from .manager import SessionConfig, TransferManager
from .pairing import IncompatibleLayoutError, Route, pair_layouts
from .plan import Indices, PlanError
from .room import Poll, Room
from .row import inline_row
from .sender import DecodeRequest, Sender
from .transport import BackendChoice
from .worker import PeerWorker

__all__ = ["DecodePeer", "PrefillManager"]

log = logging.getLogger(__name__)

MAX_ABORTED = 65536  # rooms remembered as given up before their sender existed (bounded against floods)
LEASE_POLL = 0.005  # seconds between lease checks while a transfer worker waits for a renewal
COST_WINDOW = 16  # writes kept per size class to measure a peer's write cost (DecodePeer.note_write)
COST_SAMPLES = 3  # writes a size class needs before it counts (the first write to a peer is a cold one)
SMALL_WRITE = 64 << 10  # a write this small costs mostly what any write does: its fixed cost
GAP_WINDOW = 64  # layer-wise announcements whose fastest gap is the host's pace (PrefillManager.note_layer_gap)
FORGET_AFTER = 3  # a decode peer silent for this many heartbeat_timeouts is forgotten (its rooms failed before)


class DecodePeer:
    """A decode rank that completed the handshake with this prefill rank, and its transfer worker.

    ``lease_until``: this rank may write to the peer until then (this rank's
    clock). The handshake grants ``lease`` seconds; a heartbeat renews it to
    ``lease`` after the clock it echoes (:class:`~kvbridge.core.protocol.Heartbeat`),
    so a ping that arrives late but echoes a recent clock still renews it, and
    pings queued while this rank was frozen or cut off do not.
    ``last_seen``: when anything last arrived from it (it is forgotten after
    long silence).
    """

    def __init__(self, peer_id: str, route: Route, lease: float, inline_row_bytes: int = 0) -> None:
        self.peer_id = peer_id
        self.ident = peer_id.encode()
        self.route = route
        #: The metadata row goes to this peer inside ``Done`` (small, host memory on both sides: kvbridge.core.row).
        self.inline_row = inline_row(route, inline_row_bytes)
        self.last_seen = time.monotonic()
        self.lease_until = self.last_seen + lease
        self.worker = PeerWorker(peer_id)
        #: What one write to it costs whatever its size (seconds), and what each byte adds (seconds);
        #: None until measured (see :meth:`note_write`). Layer-wise sending coalesces layers while
        #: their bytes cost less than a write.
        self.write_cost: float | None = None
        self.byte_time: float | None = None
        self._classes: dict[int, collections.deque[tuple[float, int]]] = {}  # see note_write

    def note_write(self, nbytes: int, seconds: float) -> None:
        """A write of ``nbytes`` took ``seconds``: update :attr:`write_cost` and :attr:`byte_time`.

        Writes are kept by size class (a power of two), the last ``COST_WINDOW``
        of each; a class's measure is its fastest write, since contention (a
        host computing on the same cores while a layer is written, a cold first
        write) only ever adds to a write's time, and a class counts once it
        holds ``COST_SAMPLES`` writes. The line through the smallest and the
        largest class's measures gives the fixed cost and each byte's time.
        With one class only: writes of at most ``SMALL_WRITE`` cost what the
        fastest took; larger ones cannot tell the cost from the bytes (None).
        """
        window = self._classes.setdefault(max(1, nbytes).bit_length(), collections.deque(maxlen=COST_WINDOW))
        window.append((seconds, nbytes))
        counted = [k for k, w in self._classes.items() if len(w) >= COST_SAMPLES]
        if not counted:
            return
        t_lo, n_lo = min(self._classes[min(counted)])
        t_hi, n_hi = min(self._classes[max(counted)])
        if n_hi > n_lo:
            self.byte_time = max(0.0, (t_hi - t_lo) / (n_hi - n_lo))
            self.write_cost = max(0.0, t_lo - n_lo * self.byte_time)
        elif n_lo <= SMALL_WRITE:
            self.write_cost, self.byte_time = t_lo, 0.0

    def renew(self, clock: float, lease: float) -> None:
        """Decode echoed ``clock`` (this rank's, from a heartbeat reply): it was alive after it."""
        self.lease_until = max(self.lease_until, min(clock, time.monotonic()) + lease)


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
        #: (room, decode peer) -> writes running now; a failed room is fenced towards a peer at zero.
        self._writing: dict[tuple[int, str], int] = {}
        #: Rooms a decode gave up on before their sender existed: reason, when (expire after bootstrap_timeout).
        self._aborted: dict[int, tuple[str, float]] = {}
        #: ``Fenced`` held back while an engine may still write a failed write's bytes: (due, room, peer id).
        self._deferred_fenced: list[tuple[float, int, str]] = []
        self._space_counts = {s.name: s.count for s in kvargs.index_spaces}
        self.layer_index = LayerIndex(kvargs)  # layer-wise sending: which layer each source address belongs to
        #: Layer-wise senders' pace: seconds between a chunk's announcements (see note_layer_gap; None until one).
        self.layer_gap: float | None = None
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAP_WINDOW)
        self._chan = Channel(self.loop.ctx, zmq.ROUTER, self.auth, endpoint="prefill",
                             max_bytes=self.config.max_message_bytes)
        # A decode that reconnects (after it gave up on this rank, say it was frozen) keeps its
        # identity: the new connection must take it over, or its Hello is dropped. (Every message
        # is still authenticated; holders of the secret are trusted alike: docs/security.md.)
        self._chan.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
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

    def requested(self, room: int) -> bool:
        """Whether a decode's request for ``room`` waits for the host to create its sender."""
        with self.lock:
            return room in self._pending

    def take_aborted(self, room: int) -> str | None:
        """Why decode gave up on ``room`` before its sender was created, or None (removed here)."""
        aborted = self._aborted.pop(room, None)
        return aborted[0] if aborted is not None else None

    # -- fencing: no byte of a failed room is written after decode is told it stopped ----------------
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
        thread must be free to take the renewal)."""
        if not self.live(sender, peer, wait=True):
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

    def _tell_failed(self, room: int, peer_id: str, reason: str) -> None:
        """Send ``Failed``, then ``Fenced`` unless a write to that peer is running (its end sends it)."""
        ident = peer_id.encode()
        self.send(lambda: self._chan, P.Failed(room=room, reason=reason), ident)
        if (room, peer_id) not in self._writing:
            self._fenced(room, peer_id)

    def _fenced(self, room: int, peer_id: str) -> None:
        """Tell ``peer_id`` nothing of ``room`` lands any more: now, or once the engine has certainly
        stopped writing what a failed write to it left behind (``Transport.fence_delay``; sent by the tick)."""
        delay = self.transport.fence_delay(peer_id)
        with self.lock:
            if delay > 0:
                self._deferred_fenced.append((time.monotonic() + delay, room, peer_id))
            else:
                self.send(lambda: self._chan, P.Fenced(room=room), peer_id.encode())

    def note_layer_gap(self, seconds: float) -> None:
        """A layer-wise sender announced layers ``seconds`` after its previous announcement (or its send()).

        The pace is the fastest of the last :data:`GAP_WINDOW` gaps, as a write's cost is its class's
        fastest: a stall (a garbage collection, a transfer thread holding the GIL) only ever lengthens a
        gap. A moving average, raised by a stall, could stop the workers lingering for the next layer;
        their writes layer by layer then slowed the host's announcements and kept it raised (one H200
        run, 16 layers without compute: 8 writes per request, layer-wise TTFT 2.8x per-chunk's)."""
        self._gaps.append(seconds)
        self.layer_gap = min(self._gaps)

    def peer(self, peer_id: str) -> DecodePeer | None:
        return self._peers.get(peer_id)

    def peers(self) -> list[DecodePeer]:
        """The decode ranks that completed the handshake (for benchmarks and ``describe``)."""
        with self.lock:
            return list(self._peers.values())

    def source_indices(self, space: str, values: npt.ArrayLike) -> Indices:
        """The host's source list for ``space``, checked against this rank's own index space."""
        return Indices.check(f"source {space} index", values, self._space_counts.get(space))

    def notify(self, peer: DecodePeer, *msgs: P.Message, wake: bool = False) -> None:
        """Send ``msgs`` to decode ``peer``, in order, with one hand-off to the I/O thread (any thread).

        ``wake``: then wake this rank's waiting hosts (:meth:`wake_hosts`), once the messages are on
        their way: a room that reached SUCCESS with ``wake=False`` wakes its host after its ``Done``
        left, so the host's thread does not compete with the I/O thread for the GIL before that.
        """
        payloads = [P.encode(m) for m in msgs]

        def send_all() -> None:
            for payload in payloads:
                self._chan.send(payload, peer.ident)
            if wake:
                self.wake_hosts()

        if wake and self.closed:  # the loop may have stopped: nobody would wake the hosts
            self.wake_hosts()
        self.loop.call(send_all)

    def fail_sender(self, sender: Sender, reason: str, kind: str) -> None:
        """Fail ``sender`` and tell every decode rank that asked for it (``kind``: the metrics reason)."""
        with self.lock:
            if not self.finish(sender, Poll.FAILED, reason, kind):
                return
            for peer_id in sender.peer_ids():
                self._tell_failed(sender.room, peer_id, reason)

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
            if peer is None and isinstance(msg, P.Abort):
                self._on_abort(None, peer_id, msg)
                return
            if peer is None:
                reason = f"{type(msg).__name__} from {peer_id!r} before a handshake; send Hello first"
                self._chan.reject(ident, reason, getattr(msg, "room", None))
                return
            peer.last_seen = time.monotonic()
            if isinstance(msg, P.Heartbeat):
                if msg.clock is not None:
                    peer.renew(msg.clock, self.config.heartbeat_timeout)
                self._reply(ident, P.Heartbeat(clock=time.monotonic()))
            elif isinstance(msg, P.TransferRequest):
                self._on_request(peer, msg)
            elif isinstance(msg, P.Abort):
                self._on_abort(peer, peer_id, msg)
            elif isinstance(msg, P.Unstaged):
                self.transport.unstaged(peer_id, msg.slot)
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
                                                  self.config.inline_row_bytes)
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
            if msg.checksum or self.config.checksum:
                problem = vram_problem(self.kvargs.regions, "prefill") or vram_problem(peer.route.dst.regions, "decode")
                if problem is not None:
                    raise P.ProtocolError(problem)
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
        req = DecodeRequest(peer.peer_id, dst.tp_rank, dst.tp_size, indices, msg.metadata_row, time.monotonic(), msg.strict,
                            msg.checksum or self.config.checksum)
        if sender is None:
            reqs = self._pending.setdefault(msg.room, {})
            problem = req.conflict(reqs)
            if problem is None:
                reqs[peer.peer_id] = req  # the host has not created the sender yet
        else:
            problem = sender.attach(req)
        if problem is not None:
            self._reply(peer.ident, P.Reject(reason=f"room {msg.room}: {problem}", room=msg.room))

    def _on_abort(self, peer: DecodePeer | None, peer_id: str, msg: P.Abort) -> None:
        """Stop what ``peer_id`` asked for in the room; answer ``Fenced`` once nothing of it is being written.

        A peer may abort only what it asked for, or a room nobody asked for
        yet (a decode whose ``init`` failed before its request went out). An
        unknown peer (dropped, or never handshaken) only gets the answer.
        """
        # One "aborted by decode" however the reason was written (a peer's default reason may already say it).
        reason = msg.reason if msg.reason.startswith("aborted by decode") else f"aborted by decode: {msg.reason}"
        if peer is not None:
            pending = self._pending.get(msg.room)
            sender = self.rooms.get(msg.room)
            if pending is not None:
                pending.pop(peer_id, None)
                if not pending:
                    del self._pending[msg.room]
            elif sender is None and not msg.requested and len(self._aborted) < MAX_ABORTED:
                self._aborted[msg.room] = (reason, time.monotonic())
            if sender is not None and (sender.asked_by(peer_id) or
                                       (sender.poll() == Poll.BOOTSTRAPPING and not sender.peer_ids())):
                self.fail_sender(sender, reason, "aborted")
        if (msg.room, peer_id) not in self._writing:
            self._fenced(msg.room, peer_id)

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
        self.transport.reset_overdue(now)
        with self.lock:
            due = [d for d in self._deferred_fenced if d[0] <= now]
            if due:
                self._deferred_fenced = [d for d in self._deferred_fenced if d[0] > now]
                for _, room, peer_id in due:
                    self._reply(peer_id.encode(), P.Fenced(room=room))
            for room, reqs in list(self._pending.items()):
                if now - min(r.received for r in reqs.values()) > cfg.sender_grace:
                    reason = f"no sender was created for room {room} within sender_grace={cfg.sender_grace}s of decode's request"
                    log.warning("prefill: %s", reason)
                    del self._pending[room]
                    for peer_id in reqs:
                        self._tell_failed(room, peer_id, reason)
            for room, (_, when) in list(self._aborted.items()):
                if now - when > cfg.bootstrap_timeout:
                    del self._aborted[room]
            for sender in list(self.rooms.values()):
                overdue = sender.overdue(now, cfg)
                if overdue is not None:
                    self.fail_sender(sender, *overdue)
            for peer in list(self._peers.values()):
                if now - peer.last_seen > FORGET_AFTER * cfg.heartbeat_timeout:
                    self._drop_peer(peer, f"decode peer {peer.peer_id!r} sent nothing for {now - peer.last_seen:.1f}s")
                elif now >= peer.lease_until:
                    for sender in list(self.rooms.values()):
                        why = self._lapsed(sender, peer, now) if sender.asked_by(peer.peer_id) else None
                        if why is not None:
                            self.fail_sender(sender, why, "peer_dead")

    def _drop_peer(self, peer: DecodePeer, reason: str) -> None:
        log.warning("prefill: %s; dropping it", reason)
        # Each Failed (and Fenced, once its write has returned) goes out: a decode
        # that was only frozen learns of it when it resumes.
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
