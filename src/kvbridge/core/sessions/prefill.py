"""The prefill manager: control endpoint, handshakes, decode peers and their requests."""

from __future__ import annotations

import collections
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable

import numpy.typing as npt
import zmq

from ..control import protocol as P
from ..control.bootstrap import HELD, RENEW, register_rank
from ..control.channel import Channel
from ..description.layout import KVArgs
from ..planning.indices import Indices, PlanError
from ..planning.layers import LayerIndex
from ..transfer.transport import BackendChoice
from .fence import WriteFence
from .handshake import Handshakes
from .manager import SessionConfig, TransferManager
from .peers import DecodePeer, DecodeRequest
from .room import Poll, Room
from .sender import Sender

__all__ = ["PrefillManager"]

log = logging.getLogger(__name__)

MAX_ABORTED = 65536  # rooms remembered as given up before their sender existed (bounded against floods)
GAP_WINDOW = 64  # layer-wise announcements whose fastest gap is the host's pace (PrefillManager.note_layer_gap)
FORGET_AFTER = 3  # a decode peer silent for this many heartbeat_timeouts is forgotten (its rooms failed before)


class PrefillManager(TransferManager[Sender], WriteFence, Handshakes):
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
        self._ticked = time.monotonic()  # the last tick: a long gap since is this process's stall
        self.layer_index = LayerIndex(kvargs)  # layer-wise sending: which layer each source address belongs to
        #: Layer-wise senders' pace: seconds between a chunk's announcements (see note_layer_gap; None until one).
        self.layer_gap: float | None = None
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAP_WINDOW)
        #: Rooms ready to send, not sent yet: a small chunk then goes to the worker (sessions.inline).
        self.ready: set[int] = set()
        self._chan = Channel(self.loop.ctx, zmq.ROUTER, self.auth, endpoint="prefill",
                             max_bytes=self.config.max_message_bytes, incarnation=self.incarnation)
        # No ROUTER_HANDOVER: a connection never takes another's routing id. A decode peer's route is
        # the connection its authenticated Hello came on (no route without proof: docs/security.md).
        #: decode peer id -> the connection of its latest accepted Hello (kept after a drop, for late Fenced).
        self._routes: OrderedDict[str, bytes] = OrderedDict()
        #: connection -> the decode peer whose accepted Hello it carried, kept after the peer handshook
        #: again or was dropped: an Abort on an old connection must be fenced as that peer's (its running
        #: writes, its engine's drain), not as a stranger's.
        self._route_peer: OrderedDict[bytes, str] = OrderedDict()
        self._slots = {}  # a named decode rank's slot -> its live peer id (Handshakes)
        port = self.config.control_port
        self.control_address = self._chan.bind_port(self.config.host, port) if port else self._chan.bind(self.config.host)
        self.loop.add_socket(self._chan.sock, self._on_message)
        # Handshakes are a token bucket: `handshake_rate` per second, bursts of twice as many.
        self._hello_tokens = 2 * self.config.handshake_rate
        self._hello_refill = time.monotonic()
        self.bootstrap = bootstrap
        self._rank = P.RankInfo(kvargs.tp_rank, kvargs.tp_size, kvargs.pp_rank, kvargs.pp_size, self.control_address,
                                self.backend_name, self.incarnation.hex())
        self._lease: Channel | None = None
        self._bootstrap_incarnation = b""  # the bootstrap server's, as its last answer to a renewal said
        self._renewed = math.inf  # no renewals before the first registration
        self.loop.start()
        try:
            register_rank(bootstrap, self._rank, self.config.bootstrap_timeout, self.auth, self.incarnation)
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

    def pending_rooms(self) -> list[int]:
        """Rooms a decode asked for whose sender the host has not created yet (oldest first)."""
        with self.lock:
            return list(self._pending)

    def requested(self, room: int) -> bool:
        """Whether a decode's request for ``room`` waits for the host to create its sender."""
        with self.lock:
            return room in self._pending

    def take_aborted(self, room: int) -> str | None:
        """Why decode gave up on ``room`` before its sender was created, or None (removed here)."""
        aborted = self._aborted.pop(room, None)
        return aborted[0] if aborted is not None else None

    def note_layer_gap(self, seconds: float) -> None:
        """A layer-wise sender announced layers ``seconds`` after its previous announcement (or its send()).

        The pace is the fastest of the last :data:`GAP_WINDOW` gaps: a stall (GC, the GIL) only lengthens a
        gap, and a moving average raised by one stopped the workers lingering for the next layer, which kept it
        raised (one H200 run, 16 layers without compute: layer-wise TTFT 2.8x per-chunk's)."""
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
        return Indices.check(f"source {space} index", values, self.space_counts.get(space))

    def notify(self, peer: DecodePeer, *msgs: P.Message, wake: bool = False) -> None:
        """Send ``msgs`` to decode ``peer``, in order, at once or with one hand-off to the I/O thread (any thread).

        ``wake``: then wake this rank's waiting hosts (:meth:`wake_hosts`), once the messages are on
        their way: a room that reached SUCCESS with ``wake=False`` wakes its host after its ``Done``
        left, so the host's thread does not compete for the GIL with the thread sending it before that.
        """
        if wake and self.closed:  # the loop may have stopped: nobody would wake the hosts
            self.wake_hosts()
        self.loop.send(lambda: self._chan, *(P.encode(m) for m in msgs), ident=peer.ident,
                       then=self.wake_hosts if wake else None)

    def finish(self, room: Room, state: Poll, reason: str | None = None, kind: str = "transfer_error",
               wake: bool = True) -> bool:
        with self.lock:
            if state == Poll.FAILED or state == Poll.SUCCESS:
                self.ready.discard(room.room)
            return super().finish(room, state, reason, kind, wake)

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
        if isinstance(msg, P.Hello):
            self._on_hello(ident, msg)
            return
        with self.lock:
            # Who sent it is the connection's, never what the message or the socket claims.
            peer_id = self._route_peer.get(ident)
            peer = self._peers.get(peer_id) if peer_id is not None else None
            if peer is not None and peer.ident != ident:
                peer = None  # an older connection of a peer that handshook again since
            if peer is None and isinstance(msg, P.Abort):
                # Fenced as that peer's when the connection was one (a write of the room may still run),
                # and it may give up what that peer could (a peer dropped for silence that resumed
                # aborts the room it asked for while it was away, which prefill's host is waiting on).
                self._on_abort(None, peer_id or ident.hex(), msg, ident, known=peer_id is not None)
                return
            if peer is None:
                # A connection is a peer only once a Hello of its own was accepted.
                who = f"connection {ident.hex()}" if ident[:1] == b"\x00" else repr(ident.decode(errors="replace"))
                reason = f"{type(msg).__name__} from {who} before a handshake; send Hello first"
                # Room-less: the refusal is of the connection, not of one room. A decode this rank
                # dropped (it was silent) learns so from any message, fails its rooms here and
                # handshakes again for the next one, instead of losing one room per request.
                self._chan.reject(ident, reason)
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

    def _on_request(self, peer: DecodePeer, msg: P.TransferRequest) -> None:
        """Check a decode rank's destination lists once, on arrival; the planner trusts them after."""
        sender = self.rooms.get(msg.room)
        try:
            req = DecodeRequest.check(peer, msg, self.kvargs.regions, self.config)
        except (P.ProtocolError, PlanError) as exc:
            reason = f"bad transfer request from decode {peer.peer_id!r}: {exc}"
            # Fail the room only if nobody else has a valid request in it: one
            # decode must not be able to fail another decode's room.
            if sender is not None and not sender.peer_ids():
                self.finish(sender, Poll.FAILED, reason, "bad_request")
            # Reply last: whoever reads the reply must find the room already failed.
            self._reply(peer.ident, P.Failed(room=msg.room, reason=reason))
            return
        if sender is None:
            reqs = self._pending.setdefault(msg.room, {})
            problem = req.conflict(reqs)
            if problem is None:
                reqs[peer.peer_id] = req  # the host has not created the sender yet
        else:
            problem = sender.attach(req)
        if problem is not None:
            self._reply(peer.ident, P.Reject(reason=f"room {msg.room}: {problem}", room=msg.room))

    def _on_abort(self, peer: DecodePeer | None, peer_id: str, msg: P.Abort, ident: bytes | None = None,
                  known: bool = False) -> None:
        """Stop what ``peer_id`` asked for in the room; answer ``Fenced`` once nothing of it is being written.

        A peer may abort only what it asked for, or a room nobody asked for yet (a decode whose ``init``
        failed before its request went out), also through a connection of its own that is no longer its
        route (``known``: it was dropped, or handshook again since). A stranger's connection only gets the
        answer, on ``ident``. A room given up on before its sender exists is remembered
        (``bootstrap_timeout``): the sender fails as the host creates it.
        """
        # One "aborted by decode" however the reason was written (a peer's default reason may already say it).
        reason = msg.reason if msg.reason.startswith("aborted by decode") else f"aborted by decode: {msg.reason}"
        if peer is not None or known:
            pending = self._pending.get(msg.room)
            sender = self.rooms.get(msg.room)
            if pending is not None:
                if pending.pop(peer_id, None) is not None:
                    self._remember_aborted(msg.room, reason)
                if not pending:
                    del self._pending[msg.room]
            elif sender is None and not msg.requested:
                self._remember_aborted(msg.room, reason)
            if sender is not None and (sender.asked_by(peer_id) or
                                       (sender.poll() == Poll.BOOTSTRAPPING and not sender.peer_ids())):
                self.fail_sender(sender, reason, "aborted")
        if (msg.room, peer_id) not in self._writing:
            self._fenced(msg.room, peer_id, ident if peer is None else None)

    def _remember_aborted(self, room: int, reason: str) -> None:
        """``room`` was given up on before its sender exists: fail the sender as the host creates it."""
        if len(self._aborted) < MAX_ABORTED:
            self._aborted[room] = (reason, time.monotonic())

    # -- the bootstrap lease (I/O thread) ----------------------------------------------
    def _renew(self, now: float) -> None:
        """Renew this rank's registration with the bootstrap endpoint (see :mod:`kvbridge.core.control.bootstrap`)."""
        if now - self._renewed < RENEW:
            return
        self._renewed = now
        if self._lease is None:
            self._lease = Channel(self.loop.ctx, zmq.DEALER, self.auth, endpoint="prefill",
                                  max_bytes=self.config.max_message_bytes, to=self.bootstrap.encode(),
                                  incarnation=self.incarnation)
            self._lease.connect(self.bootstrap)
            self.loop.add_socket(self._lease.sock, self._on_lease)
        self._lease.send_msg(P.Register(rank=self._rank))

    def _on_lease(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        assert self._lease is not None
        got = self._lease.receive(frames)
        incarnation = self._lease.sender_incarnation
        if got is not None and incarnation and incarnation != self._bootstrap_incarnation:
            if self._bootstrap_incarnation:
                # A restarted bootstrap server refuses renewals addressed to the one it replaced: register now.
                log.warning("prefill: the bootstrap endpoint %s restarted (incarnation %s, was %s); registering again",
                            self.bootstrap, incarnation.hex(), self._bootstrap_incarnation.hex())
                self._bootstrap_incarnation = incarnation
                if isinstance(got[1], P.Reject):
                    self._lease.send_msg(P.Register(rank=self._rank))
                    return
            self._bootstrap_incarnation = incarnation
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
                    ident = self._route(peer_id)
                    if ident is not None:
                        self._reply(ident, P.Fenced(room=room))
            for room, reqs in list(self._pending.items()):
                if now - min(r.received for r in reqs.values()) > cfg.sender_grace:
                    reason = f"no sender was created for room {room} within sender_grace={cfg.sender_grace}s of decode's request"
                    log.warning("prefill: %s", reason)
                    del self._pending[room]
                    self._remember_aborted(room, reason)  # a sender created after all fails at once
                    for peer_id in reqs:
                        self._tell_failed(room, peer_id, reason)
            for room, (_, when) in list(self._aborted.items()):
                if now - when > cfg.bootstrap_timeout:
                    del self._aborted[room]
            for sender in list(self.rooms.values()):
                overdue = sender.overdue(now, cfg)
                if overdue is not None:
                    self.fail_sender(sender, *overdue)
            # A decode's silence while this process itself did not run (frozen, swapped out, its I/O
            # thread held up) is not evidence against the decode: only time this side listened counts.
            # (Leases are not shifted: a decode may have given up on its rooms meanwhile.)
            stalled = now - self._ticked - cfg.heartbeat_interval
            self._ticked = now
            for peer in list(self._peers.values()):
                if stalled > 0:
                    peer.last_seen += stalled
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
        self._release_slot(peer)
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
            self._slots.clear()
            self._pending.clear()
        # The engine closes next: let running writes end first (they honour their
        # deadline, so this is bounded).
        deadline = time.monotonic() + self.config.transfer_timeout
        for peer in peers:
            peer.worker.join(max(0.0, deadline - time.monotonic()))
