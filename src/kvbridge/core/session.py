"""Sessions: one manager per rank and role, one sender or receiver per request.

Prefill side::

    mgr = PrefillManager(kvargs, backend="mooncake", bootstrap="127.0.0.1:8998")
    sender = Sender(mgr, room, metadata_row=row)
    # poll() until WAITING_FOR_INPUT (decode's destination lists have arrived)
    sender.send(chunk_pages)                    # once per prefill chunk
    sender.send(last_pages, state_indices={"slot": [s]}, last=True)
    # poll() until SUCCESS or FAILED

Decode side::

    mgr = DecodeManager(kvargs, backend="mooncake")
    recv = Receiver(mgr, room, bootstrap="127.0.0.1:8998")
    recv.init(page_indices, state_indices={"slot": [s]}, metadata_row=row)
    # poll() until SUCCESS (the metadata row has landed) or FAILED

``poll()`` never blocks and is monotone: BOOTSTRAPPING < WAITING_FOR_INPUT <
TRANSFERRING < SUCCESS, with FAILED sticky; ``failure()`` gives the reason.
Everything a manager holds for a room is released when the room reaches
SUCCESS or FAILED (including by ``abort()`` or a timeout).

Commit point: prefill writes the KV pages and state of every chunk, then the
metadata row, and only then sends ``Done``; decode reaches SUCCESS on ``Done``,
so SUCCESS means the metadata row (written last) has landed.

Timeouts (:class:`SessionConfig`, seconds):

- ``bootstrap_timeout`` (30): decode must find and handshake with the prefill
  ranks, and a prefill sender must receive decode's request, within it;
- ``waiting_timeout`` (300): after ``init``, decode must see the room complete;
- ``transfer_timeout`` (60): one chunk's write must complete within it;
- ``heartbeat_interval`` (1) / ``heartbeat_timeout`` (5): decode pings each
  prefill rank it uses; either side declares the other dead after
  ``heartbeat_timeout`` of silence and fails every room shared with it.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from . import protocol as P
from .backend import Backend, BackendConfig, TransferTimeout
from .bootstrap import register_rank
from .channel import IOLoop
from .layout import KV_PAGE_SPACE, METADATA_SPACE, KVArgs
from .metrics import METRICS
from .pairing import IncompatibleLayoutError, Route, pair_layouts
from .plan import PlanError, TransferPlan, check_indices
from .plugins import get_registry

__all__ = [
    "KV_PAGE_SPACE",
    "METADATA_SPACE",
    "Poll",
    "SessionConfig",
    "TransferManager",
    "PrefillManager",
    "DecodeManager",
    "Sender",
    "Receiver",
]

log = logging.getLogger(__name__)


class Poll(enum.IntEnum):
    """Request states. The numeric order lets a host min-reduce them across ranks."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass(frozen=True)
class SessionConfig:
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 300.0
    transfer_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    host: str = "127.0.0.1"
    backend_options: Mapping[str, str] = field(default_factory=dict)
    #: Treat every index-length mismatch as an error (default: page-indexed
    #: state lists are trimmed to the shorter side with a warning).
    strict_index_lengths: bool = False

    def __post_init__(self) -> None:
        for name in ("bootstrap_timeout", "waiting_timeout", "transfer_timeout", "heartbeat_interval", "heartbeat_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed heartbeat_interval ({self.heartbeat_interval})"
            )


class _Room:
    """State shared by Sender and Receiver: monotone, FAILED sticky."""

    def __init__(self, manager: TransferManager, room: int) -> None:
        if not isinstance(room, (int, np.integer)) or room < 0:
            raise ValueError(f"room must be a non-negative integer, got {room!r}")
        self.room = int(room)
        self._manager = manager
        self._state = Poll.BOOTSTRAPPING
        self._reason: str | None = None
        self._created = time.monotonic()

    def poll(self) -> Poll:
        return self._state

    def failure(self) -> str | None:
        """Why the room failed, or None."""
        return self._reason

    def _advance(self, state: Poll, reason: str | None = None) -> bool:
        """Move forward (never back); FAILED and SUCCESS are final. Caller holds the lock."""
        if self._state in (Poll.FAILED, Poll.SUCCESS):
            return False
        if state == Poll.FAILED:
            self._state, self._reason = Poll.FAILED, reason or "failed"
            log.warning("room %d failed: %s", self.room, self._reason)
            return True
        if state > self._state:
            self._state = state
            return True
        return False


# ======================================================================================
class TransferManager:
    """Shared by both roles: the backend, the I/O thread, the lock, shutdown."""

    role: str

    def __init__(self, kvargs: KVArgs, backend: str, config: SessionConfig | None) -> None:
        self.kvargs = kvargs
        self.config = config or SessionConfig()
        self.backend_name = backend
        registry = get_registry()
        # The one place core creates backends: every backend gets the same
        # option policy (declared keys only, valid values), before any engine exists.
        options = registry.backend_spec(backend).check_options(self.config.backend_options)
        factory = registry.load_backend(backend)
        self.backend: Backend = factory(
            BackendConfig(
                host=self.config.host,
                name=f"{self.role}-tp{kvargs.tp_rank}-pp{kvargs.pp_rank}-{os.getpid()}",
                transfer_timeout=self.config.transfer_timeout,
                options=options,
            )
        )
        self.backend.register(kvargs.regions)
        self._lock = threading.RLock()
        self._closed = False
        self._loop = IOLoop(
            f"kvbridge-{self.role}", tick=self._tick, tick_interval=min(0.05, self.config.heartbeat_interval / 2)
        )

    def _tick(self) -> None:  # pragma: no cover - overridden
        pass

    def _send(self, sock: Callable[[], zmq.Socket | None], msg: P.Message, ident: bytes | None = None) -> None:
        payload = P.encode(msg)
        self._loop.send(sock, [ident, payload] if ident is not None else [payload])

    def close(self) -> None:
        """Fail every open room, stop threads, release the engine. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for room in list(self._rooms().values()):
                room.abort(f"{self.role} manager closed")  # counted as "aborted"
        self._shutdown()
        self._loop.stop()
        self.backend.close()

    def __enter__(self) -> TransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rooms(self) -> dict[int, Any]:  # pragma: no cover - overridden
        return {}

    def _shutdown(self) -> None:
        pass

    def _finish(self, room: _Room, state: Poll, reason: str | None = None, kind: str = "transfer_error") -> bool:
        """Move ``room`` to a final state and drop everything held for it.

        ``kind`` is the failure's metrics label (one of ``metrics.FAILURE_REASONS``).
        """
        with self._lock:
            changed = room._advance(state, reason)
            if changed and state == Poll.FAILED:
                METRICS.failed(self.backend_name, self.role, kind)
            elif changed and state == Poll.SUCCESS:
                METRICS.succeeded(self.backend_name, self.role)
            if room._state in (Poll.SUCCESS, Poll.FAILED):
                rooms = self._rooms()
                if rooms.get(room.room) is room:
                    del rooms[room.room]
            return changed

    def active_rooms(self) -> int:
        """How many rooms this manager still holds state for (for leak checks)."""
        with self._lock:
            return len(self._rooms())


# ======================================================================================
# Prefill
# ======================================================================================
@dataclass
class _Request:
    """One decode rank's destination lists for a room."""

    peer: str
    decode_rank: int
    decode_tp: int
    indices: dict[str, npt.NDArray[np.int64]]
    metadata_row: int
    received: float


class _DecodePeer:
    """A decode rank that completed the handshake with this prefill rank."""

    def __init__(self, peer_id: str, route: Route) -> None:
        self.peer_id = peer_id
        self.ident = peer_id.encode()
        self.route = route
        self.last_seen = time.monotonic()
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # One worker per peer: writes to one peer never overlap, so a backend that
        # keeps each call within its limits keeps the per-peer in-flight limit too.
        self.worker = threading.Thread(target=self._work, name=f"kvbridge-xfer-{peer_id}", daemon=True)
        self.worker.start()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("kvbridge transfer job failed unexpectedly")


class PrefillManager(TransferManager):
    """One per prefill rank: control endpoint, decode peers, transfer workers.

    Every decode rank of a room sends this rank its destination lists; the
    room is ready (WAITING_FOR_INPUT) once all of them (the decode TP size)
    have arrived, even if this rank has nothing to send to some of them
    (MLA pages go from one prefill rank only): it still reports ``Done``.
    """

    role = "prefill"

    def __init__(self, kvargs: KVArgs, backend: str = "mooncake", *, bootstrap: str, config: SessionConfig | None = None) -> None:
        super().__init__(kvargs, backend, config)
        self._senders: dict[int, Sender] = {}
        self._pending: dict[int, dict[str, _Request]] = {}  # requests that arrived before their sender
        self._peers: dict[str, _DecodePeer] = {}
        router = self._loop.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port(f"tcp://{self.config.host}")
        self._router = router
        self.control_address = f"{self.config.host}:{port}"
        self._loop.add_socket(router, self._on_message)
        self._loop.start()
        self.bootstrap = bootstrap
        try:
            register_rank(
                bootstrap,
                P.RankInfo(kvargs.tp_rank, kvargs.tp_size, kvargs.pp_rank, kvargs.pp_size, self.control_address, backend),
                self.config.bootstrap_timeout,
            )
        except Exception:
            self.close()
            raise

    def _rooms(self) -> dict[int, Any]:
        return self._senders

    def active_rooms(self) -> int:
        """Senders plus rooms whose requests wait for their sender (for leak checks)."""
        with self._lock:
            return len(self._senders) + len(self._pending)

    # -- control messages (I/O thread) --------------------------------------------------
    def _reply(self, ident: bytes, msg: P.Message) -> None:
        self._router.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)

    def _on_message(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("prefill: dropped a control message with %d frames", len(frames))
            return
        ident, data = frames
        try:
            msg = P.decode(data)
        except P.ProtocolError as exc:
            log.warning("prefill: rejected a control message from %r: %s", ident[:64], exc)
            self._reply(ident, P.Reject(reason=str(exc)))
            return
        peer_id = ident.decode(errors="replace")
        if isinstance(msg, P.Hello):
            self._on_hello(ident, msg)
            return
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                reason = f"{type(msg).__name__} from {peer_id!r} before a handshake; send Hello first"
                log.warning("prefill: %s", reason)
                self._reply(ident, P.Reject(reason=reason, room=getattr(msg, "room", None)))
                return
            peer.last_seen = time.monotonic()
            if isinstance(msg, P.Heartbeat):
                self._reply(ident, P.Heartbeat())
            elif isinstance(msg, P.TransferRequest):
                self._on_request(peer, msg)
            elif isinstance(msg, P.Abort):
                # A peer may abort only what it asked for.
                pending = self._pending.get(msg.room, {})
                pending.pop(peer_id, None)
                if not pending:
                    self._pending.pop(msg.room, None)
                sender = self._senders.get(msg.room)
                if sender is not None and peer_id in sender._requests:
                    self._fail_sender(sender, f"aborted by decode: {msg.reason}", "aborted")
            else:
                reason = f"prefill does not accept {type(msg).__name__} messages"
                self._reply(ident, P.Reject(reason=reason, room=getattr(msg, "room", None)))

    def _on_hello(self, ident: bytes, msg: P.Hello) -> None:
        problem = None
        if msg.peer_id.encode() != ident:
            problem = f"Hello peer_id {msg.peer_id!r} does not match the connection identity"
        elif msg.backend != self.backend_name:
            problem = f"decode uses backend {msg.backend!r} but this prefill rank uses {self.backend_name!r}"
        if problem is None:
            try:
                route = pair_layouts(self.kvargs, msg.kvargs)
                self.backend.add_peer(msg.peer_id, msg.backend_meta, msg.kvargs.regions)
            except IncompatibleLayoutError as exc:
                problem = str(exc)
            except Exception as exc:
                problem = f"backend {self.backend_name!r} could not add the peer: {exc}"
        if problem is not None:
            log.warning("prefill: rejected handshake from %r: %s", msg.peer_id, problem)
            self._reply(ident, P.Reject(reason=problem))
            return
        with self._lock:
            old = self._peers.pop(msg.peer_id, None)
            if old is not None:
                old.jobs.put(None)
            self._peers[msg.peer_id] = _DecodePeer(msg.peer_id, route)
        self._reply(ident, P.HelloAck(kvargs=self.kvargs))

    def _on_request(self, peer: _DecodePeer, msg: P.TransferRequest) -> None:
        sender = self._senders.get(msg.room)
        try:
            indices = {k: P.unpack_indices(k, v) for k, v in msg.indices.items()}
            for space, idx in indices.items():
                # Spaces this rank holds no regions of (another pipeline stage's state) are ignored.
                sr = peer.route.spaces.get(space)
                if sr is not None:
                    check_indices(f"destination {space} index", idx, sr.dst_count, unique=True)
            if METADATA_SPACE in peer.route.spaces:
                check_indices("destination metadata row", [msg.metadata_row], peer.route.spaces[METADATA_SPACE].dst_count)
        except (P.ProtocolError, PlanError) as exc:
            reason = f"bad transfer request from decode {peer.peer_id!r}: {exc}"
            # Fail the room only if nobody else has a valid request in it: one
            # decode must not be able to fail another decode's room.
            if sender is not None and not sender._requests:
                self._finish(sender, Poll.FAILED, reason, "bad_request")
            # Reply last: whoever reads the reply must find the room already failed.
            self._reply(peer.ident, P.Failed(room=msg.room, reason=reason))
            return
        dst = peer.route.dst
        req = _Request(peer.peer_id, dst.tp_rank, dst.tp_size, indices, msg.metadata_row, time.monotonic())
        if sender is None:
            reqs = self._pending.setdefault(msg.room, {})
            problem = _conflict(reqs, req)
            if problem is None:
                reqs[peer.peer_id] = req  # the host has not created the sender yet
        else:
            problem = sender._attach(req)
        if problem is not None:
            self._reply(peer.ident, P.Reject(reason=f"room {msg.room}: {problem}", room=msg.room))

    # -- timeouts and dead peers (I/O thread) ------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        with self._lock:
            for room, reqs in list(self._pending.items()):
                if now - min(r.received for r in reqs.values()) > cfg.bootstrap_timeout:
                    log.warning("prefill: dropping requests for room %d: no sender created within %.1fs", room, cfg.bootstrap_timeout)
                    del self._pending[room]
            for sender in list(self._senders.values()):
                if sender._state == Poll.BOOTSTRAPPING and now - sender._created > cfg.bootstrap_timeout:
                    got = sorted(r.decode_rank for r in sender._requests.values())
                    self._fail_sender(
                        sender,
                        f"requests from decode ranks {got} of {sender._expected or '?'} arrived within "
                        f"bootstrap_timeout={cfg.bootstrap_timeout}s",
                        "timeout",
                    )
                elif sender._busy and now - min(sender._busy.values()) > cfg.transfer_timeout:
                    self._fail_sender(sender, f"transfer did not complete within transfer_timeout={cfg.transfer_timeout}s", "timeout")
            for peer in list(self._peers.values()):
                if now - peer.last_seen > cfg.heartbeat_timeout:
                    self._drop_peer(peer, f"decode peer {peer.peer_id!r} sent no heartbeat for {now - peer.last_seen:.1f}s")

    def _drop_peer(self, peer: _DecodePeer, reason: str) -> None:
        log.warning("prefill: %s; dropping it", reason)
        # Fail its rooms while it is still a known peer, so each Failed goes out: a
        # decode that was only frozen learns of it when it resumes.
        for sender in list(self._senders.values()):
            if peer.peer_id in sender._requests:
                self._fail_sender(sender, reason, "peer_dead")
        self._peers.pop(peer.peer_id, None)
        peer.jobs.put(None)
        for room, reqs in list(self._pending.items()):
            reqs.pop(peer.peer_id, None)
            if not reqs:
                del self._pending[room]
        try:
            self.backend.remove_peer(peer.peer_id)
        except Exception:
            log.exception("backend failed to remove peer %s", peer.peer_id)

    def _fail_sender(self, sender: Sender, reason: str, kind: str) -> None:
        """Fail ``sender`` and tell every decode rank that asked for it (``kind``: the metrics reason)."""
        with self._lock:
            if not self._finish(sender, Poll.FAILED, reason, kind):
                return
            for peer_id in sender._requests:
                peer = self._peers.get(peer_id)
                if peer is not None:
                    self._send(lambda: self._router, P.Failed(room=sender.room, reason=reason), peer.ident)

    def _shutdown(self) -> None:
        with self._lock:
            peers = list(self._peers.values())
            for peer in peers:
                peer.jobs.put(None)
            self._peers.clear()
            self._pending.clear()
        # The engine closes next: let running writes end first (they honour their
        # deadline, so this is bounded).
        deadline = time.monotonic() + self.config.transfer_timeout
        for peer in peers:
            peer.worker.join(max(0.0, deadline - time.monotonic()))


def _conflict(reqs: Mapping[str, _Request], req: _Request) -> str | None:
    """Why ``req`` cannot join a room's other requests, or None."""
    if req.peer in reqs:
        return f"decode {req.peer!r} already sent a request for it"
    for other in reqs.values():
        if other.decode_tp != req.decode_tp:
            return f"decode ranks disagree on the decode TP size ({other.decode_tp} vs {req.decode_tp})"
        if other.decode_rank == req.decode_rank:
            return f"decode TP rank {req.decode_rank} already sent a request for it (from {other.peer!r})"
    return None


class Sender(_Room):
    """Prefill side of one request, towards every decode rank of the room."""

    def __init__(self, manager: PrefillManager, room: int, metadata_row: int = 0) -> None:
        super().__init__(manager, room)
        self._pm = manager
        self.metadata_row = int(metadata_row)
        self._requests: dict[str, _Request] = {}
        self._expected: int | None = None
        self._chunks = 0
        self._sent_pages = 0
        self._last_sent = False
        self._unfinished = 0  # peers whose last chunk has not landed yet
        self._busy: dict[str, float] = {}  # peer -> start of its running write
        with manager._lock:
            if manager._closed:
                raise RuntimeError("the prefill manager is closed")
            if room in manager._senders:
                raise ValueError(f"room {room} already has a sender on this prefill rank")
            manager._senders[self.room] = self
            for req in manager._pending.pop(self.room, {}).values():
                self._attach(req)

    def _attach(self, req: _Request) -> str | None:
        """Add one decode rank's request; WAITING_FOR_INPUT once every decode rank's is in."""
        problem = _conflict(self._requests, req)
        if problem is not None:
            return problem
        if self._state != Poll.BOOTSTRAPPING:
            return "the room is already being served"
        self._requests[req.peer] = req
        self._expected = req.decode_tp
        if len(self._requests) == self._expected and self._advance(Poll.WAITING_FOR_INPUT):
            METRICS.bootstrap(self._pm.backend_name, "prefill", time.monotonic() - self._created)
        return None

    def send(
        self,
        page_indices: npt.ArrayLike,
        state_indices: Mapping[str, npt.ArrayLike] | None = None,
        last: bool = False,
    ) -> None:
        """Queue one prefill chunk (its KV pages, plus state with the last chunk).

        Returns at once; progress shows in :meth:`poll`. Bad indices (out of
        range, more pages than decode allocated, a slot-list mismatch) fail
        the room with the reason, on both sides.
        """
        m = self._pm
        with m._lock:
            if self._state == Poll.FAILED:
                return
            if self._state == Poll.BOOTSTRAPPING:
                raise RuntimeError(f"room {self.room}: send() before every decode rank's request arrived; wait for WAITING_FOR_INPUT")
            if self._last_sent:
                raise RuntimeError(f"room {self.room}: send() after the last chunk")
            jobs = []
            try:
                pages = check_indices("source kv_page index", page_indices)
                for peer_id, req in sorted(self._requests.items()):
                    peer = m._peers.get(peer_id)
                    if peer is None:
                        raise PlanError(f"decode peer {peer_id!r} is gone")
                    totals: dict[str, tuple[int, int]] = {}
                    plan, meta_plan = self._plan_chunk(peer.route, req, pages, state_indices, last, totals)
                    jobs.append((peer, plan, meta_plan, totals))
            except PlanError as exc:
                m._fail_sender(self, f"room {self.room} chunk {self._chunks}: {exc}", "bad_request")
                return
            chunk = self._chunks
            self._chunks += 1
            self._sent_pages += pages.size
            self._last_sent = last
            if last:
                self._unfinished = len(jobs)
            self._advance(Poll.TRANSFERRING)
        for peer, plan, meta_plan, totals in jobs:
            peer.jobs.put(functools.partial(self._run, peer, plan, meta_plan, totals, chunk, last))

    def _plan_chunk(
        self,
        route: Route,
        req: _Request,
        pages: npt.NDArray[np.int64],
        state_indices: Mapping[str, npt.ArrayLike] | None,
        last: bool,
        totals: dict[str, tuple[int, int]],
    ) -> tuple[TransferPlan, TransferPlan | None]:
        """This chunk's plan and (last chunk) metadata plan; adds their bytes per state type to ``totals``."""
        dst_pages = req.indices.get(KV_PAGE_SPACE, np.empty(0, np.int64))
        lo, hi = self._sent_pages, self._sent_pages + pages.size
        if hi > dst_pages.size:
            raise PlanError(f"prefill sent {hi} pages in total but decode rank {req.decode_rank} allocated {dst_pages.size}")
        if last and hi != dst_pages.size:
            raise PlanError(f"the last chunk ends at page {hi} but decode rank {req.decode_rank} allocated {dst_pages.size} pages")
        src: dict[str, npt.ArrayLike] = {}
        dst: dict[str, npt.ArrayLike] = {}
        if pages.size and route.spaces.get(KV_PAGE_SPACE) is not None:
            src[KV_PAGE_SPACE], dst[KV_PAGE_SPACE] = pages, dst_pages[lo:hi]
        if state_indices:
            if not last:
                raise PlanError("state indices are sent with the last chunk")
            for space, idx in state_indices.items():
                if space not in req.indices:
                    raise PlanError(f"decode rank {req.decode_rank} sent no destination indices for {space!r}")
                s, d = self._align(route, space, check_indices(f"source {space} index", idx), req.indices[space])
                src[space], dst[space] = s, d
        plan = route.plan(src, dst, totals) if src else TransferPlan.empty()
        meta_plan = None
        kv = self._pm.kvargs
        meta = route.spaces.get(METADATA_SPACE)
        # The metadata row comes from the last pipeline stage, sent by one TP rank.
        if last and meta is not None and meta.sends and kv.pp_rank == kv.pp_size - 1:
            meta_plan = route.plan({METADATA_SPACE: [self.metadata_row]}, {METADATA_SPACE: [req.metadata_row]}, totals)
        return plan, meta_plan

    def _align(
        self, route: Route, space: str, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The one index-length mismatch policy, for every backend and state type."""
        if src.size == dst.size:
            return src, dst
        sr = route.spaces.get(space)
        kind = sr.kind if sr is not None else "slot"
        if kind != "page" or self._pm.config.strict_index_lengths:
            why = "strict_index_lengths is set" if kind == "page" else f"{space!r} is {kind}-indexed"
            raise PlanError(f"{space}: prefill has {src.size} indices, decode {dst.size} ({why}; they must match)")
        n = min(src.size, dst.size)
        log.warning(
            "room %d: %s index lists differ (prefill %d, decode %d); sending the first %d",
            self.room, space, src.size, dst.size, n,
        )
        return src[:n], dst[:n]  # slices: the request's own lists stay as they are

    def _run(
        self,
        peer: _DecodePeer,
        plan: TransferPlan,
        meta_plan: TransferPlan | None,
        totals: Mapping[str, tuple[int, int]],
        chunk: int,
        last: bool,
    ) -> None:
        """On the peer's worker thread: write the chunk, then (last) the metadata row."""
        m = self._pm
        if self._state == Poll.FAILED:
            return
        start = time.monotonic()
        deadline = start + m.config.transfer_timeout
        self._busy[peer.peer_id] = start
        try:
            for p in (plan, meta_plan):
                if p is not None and len(p):
                    m.backend.write(peer.peer_id, p, deadline)
                if self._state == Poll.FAILED:  # aborted or timed out meanwhile
                    return
        except Exception as exc:
            kind = "timeout" if isinstance(exc, TransferTimeout) else "transfer_error"
            m._fail_sender(self, f"transfer of chunk {chunk} to {peer.peer_id!r} failed: {exc}", kind)
            return
        finally:
            self._busy.pop(peer.peer_id, None)
        if totals:  # something was written
            METRICS.transfer(m.backend_name, totals, time.monotonic() - start)
        m._send(lambda: m._router, P.ChunkDone(room=self.room, chunk=chunk, last=last), peer.ident)
        if last:
            m._send(lambda: m._router, P.Done(room=self.room), peer.ident)
            with m._lock:
                self._unfinished -= 1
                if self._unfinished == 0:
                    m._finish(self, Poll.SUCCESS)

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Give up on this room; decode is told. Bytes already in flight may still land."""
        self._pm._fail_sender(self, reason, "aborted")


# ======================================================================================
# Decode
# ======================================================================================
class _PrefillRank:
    def __init__(self, info: P.RankInfo) -> None:
        self.info = info
        self.sock: zmq.Socket | None = None
        self.acked = False
        self.last_seen = time.monotonic()
        self.last_ping = 0.0

    def socket(self) -> zmq.Socket | None:
        return self.sock

    @property
    def label(self) -> str:
        return f"prefill tp{self.info.tp_rank}/pp{self.info.pp_rank} at {self.info.control_addr}"


class _PrefillServer:
    """Decode's view of one prefill server (found through its bootstrap endpoint)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.created = time.monotonic()
        self.lookup_sock: zmq.Socket | None = None
        self.next_lookup = 0.0
        self.ranks: dict[tuple[int, int], _PrefillRank] = {}
        self.ready = False
        self.failed: str | None = None


class DecodeManager(TransferManager):
    """One per decode rank: finds prefill ranks, handshakes, tracks receivers."""

    role = "decode"

    def __init__(self, kvargs: KVArgs, backend: str = "mooncake", *, config: SessionConfig | None = None) -> None:
        super().__init__(kvargs, backend, config)
        self.peer_id = f"decode-tp{kvargs.tp_rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._meta = self.backend.metadata()
        self._servers: dict[str, _PrefillServer] = {}
        self._receivers: dict[int, Receiver] = {}
        self._loop.start()

    def _rooms(self) -> dict[int, Any]:
        return self._receivers

    def _server(self, address: str) -> _PrefillServer:
        """Caller holds the lock. Starts connecting on first use."""
        server = self._servers.get(address)
        if server is None:
            server = self._servers[address] = _PrefillServer(address)
            self._loop.call(lambda: self._lookup(server))
        return server

    # -- bootstrap and handshake (I/O thread) ------------------------------------------
    def _lookup(self, server: _PrefillServer) -> None:
        if server.lookup_sock is None:
            sock = self._loop.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{server.address}")
            server.lookup_sock = sock
            self._loop.add_socket(sock, lambda s, f: self._on_lookup(server, f))
        server.next_lookup = time.monotonic() + 0.2
        server.lookup_sock.send(P.encode(P.Lookup()), zmq.NOBLOCK)

    def _on_lookup(self, server: _PrefillServer, frames: list[bytes]) -> None:
        try:
            msg = P.decode(frames[-1])
        except P.ProtocolError as exc:
            self._fail_server(server, f"bootstrap endpoint {server.address} sent a bad reply: {exc}", "bootstrap")
            return
        if not isinstance(msg, P.LookupReply):
            self._fail_server(server, f"bootstrap endpoint {server.address} answered {msg}", "bootstrap")
            return
        if server.ranks or not msg.ranks:
            return  # already handshaking, or nobody registered yet (retry on tick)
        # Every prefill rank (all TP ranks of all stages): each one tells this
        # rank Done for every room, even the ones it has nothing to send to.
        tp_size, pp_size = msg.ranks[0].tp_size, msg.ranks[0].pp_size
        wanted = {(r.tp_rank, r.pp_rank): r for r in msg.ranks}
        if len(wanted) < tp_size * pp_size:
            return  # not every rank registered yet
        bad = [r for r in wanted.values() if r.backend != self.backend_name]
        if bad:
            self._fail_server(
                server,
                f"prefill at {server.address} uses backend {bad[0].backend!r}, this decode rank {self.backend_name!r}",
                "layout",
            )
            return
        self._loop.remove_socket(server.lookup_sock)  # type: ignore[arg-type]
        server.lookup_sock = None
        hello = P.encode(P.Hello(peer_id=self.peer_id, backend=self.backend_name, backend_meta=self._meta, kvargs=self.kvargs))
        for key, info in sorted(wanted.items()):
            rank = server.ranks[key] = _PrefillRank(info)
            sock = self._loop.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.peer_id.encode())
            sock.connect(f"tcp://{info.control_addr}")
            rank.sock = sock
            self._loop.add_socket(sock, self._rank_handler(server, rank))
            sock.send(hello, zmq.NOBLOCK)

    def _rank_handler(self, server: _PrefillServer, rank: _PrefillRank) -> Callable[[zmq.Socket, list[bytes]], None]:
        return lambda _sock, frames: self._on_prefill(server, rank, frames)

    def _on_prefill(self, server: _PrefillServer, rank: _PrefillRank, frames: list[bytes]) -> None:
        try:
            msg = P.decode(frames[-1])
        except P.ProtocolError as exc:
            log.warning("decode: bad message from %s: %s", rank.label, exc)
            return
        rank.last_seen = time.monotonic()
        with self._lock:
            if isinstance(msg, P.HelloAck):
                try:
                    pair_layouts(msg.kvargs, self.kvargs)
                except IncompatibleLayoutError as exc:
                    self._fail_server(server, f"{rank.label}: {exc}", "layout")
                    return
                rank.acked = True
                if all(r.acked for r in server.ranks.values()):
                    server.ready = True
                    for recv in list(self._receivers.values()):
                        if recv._server is server:
                            recv._on_ready()
            elif isinstance(msg, P.Reject):
                rejected = self._receivers.get(msg.room) if msg.room is not None else None
                if rejected is not None:
                    self._finish(rejected, Poll.FAILED, f"{rank.label} rejected the request: {msg.reason}", "rejected")
                elif not rank.acked:
                    self._fail_server(server, f"{rank.label} rejected the handshake: {msg.reason}", "layout")
                else:
                    # An acked rank refusing a room-less message (a heartbeat) has dropped
                    # this decode rank: fail its rooms now; the next receiver reconnects.
                    self._fail_server(server, f"{rank.label} no longer knows this decode rank: {msg.reason}", "peer_dead")
            elif isinstance(msg, (P.ChunkDone, P.Done, P.Failed, P.Abort)):
                target = self._receivers.get(msg.room)
                if target is None or target._server is not server:
                    return  # finished or aborted here already
                if isinstance(msg, P.ChunkDone):
                    target._advance(Poll.TRANSFERRING)
                elif isinstance(msg, P.Done):
                    target._done.add((rank.info.tp_rank, rank.info.pp_rank))
                    if len(target._done) == len(server.ranks):
                        self._finish(target, Poll.SUCCESS)
                else:
                    kind = "aborted" if isinstance(msg, P.Abort) else "remote"
                    self._finish(target, Poll.FAILED, f"{rank.label}: {msg.reason}", kind)
            # Heartbeat replies only refresh last_seen.

    def _fail_server(self, server: _PrefillServer, reason: str, kind: str) -> None:
        """Fail every receiver of ``server`` and forget it, so a later receiver reconnects.

        ``kind`` is the failure's metrics label."""
        log.warning("decode: %s", reason)
        with self._lock:
            server.failed = reason
            if self._servers.get(server.address) is server:
                del self._servers[server.address]
            for recv in list(self._receivers.values()):
                if recv._server is server:
                    self._finish(recv, Poll.FAILED, reason, kind)
        for sock in [server.lookup_sock, *(r.sock for r in server.ranks.values())]:
            if sock is not None:
                self._loop.remove_socket(sock)

    def _send_to_ranks(self, server: _PrefillServer, msg: P.Message) -> None:
        payload = P.encode(msg)
        for rank in server.ranks.values():
            self._loop.send(rank.socket, [payload])

    # -- timeouts, heartbeats (I/O thread) ---------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        with self._lock:
            servers = list(self._servers.values())
        for server in servers:
            if not server.ready:
                if now - server.created > cfg.bootstrap_timeout:
                    self._fail_server(server, f"could not reach every prefill rank through {server.address} within bootstrap_timeout={cfg.bootstrap_timeout}s", "timeout")
                elif server.lookup_sock is not None and now >= server.next_lookup:
                    self._lookup(server)
                continue
            for rank in server.ranks.values():
                if now - rank.last_seen > cfg.heartbeat_timeout:
                    self._fail_server(server, f"{rank.label} sent nothing for {now - rank.last_seen:.1f}s (heartbeat_timeout={cfg.heartbeat_timeout}s)", "peer_dead")
                    break
                if now - rank.last_ping >= cfg.heartbeat_interval and rank.sock is not None:
                    rank.last_ping = now
                    rank.sock.send(P.encode(P.Heartbeat()), zmq.NOBLOCK)
        with self._lock:
            for recv in list(self._receivers.values()):
                if recv._state == Poll.BOOTSTRAPPING and now - recv._created > cfg.bootstrap_timeout:
                    self._finish(recv, Poll.FAILED, f"bootstrap did not complete within bootstrap_timeout={cfg.bootstrap_timeout}s", "timeout")
                elif recv._init_at is not None and now - recv._init_at > cfg.waiting_timeout:
                    recv._abort_remote("decode waiting_timeout expired")
                    self._finish(recv, Poll.FAILED, f"transfer did not complete within waiting_timeout={cfg.waiting_timeout}s", "timeout")

    def _shutdown(self) -> None:
        self._servers.clear()


class Receiver(_Room):
    """Decode side of one request."""

    def __init__(self, manager: DecodeManager, room: int, bootstrap: str) -> None:
        super().__init__(manager, room)
        self._dm = manager
        self._request: P.TransferRequest | None = None
        self._init_at: float | None = None
        self._sent = False
        self._done: set[tuple[int, int]] = set()
        with manager._lock:
            if manager._closed:
                raise RuntimeError("the decode manager is closed")
            if room in manager._receivers:
                raise ValueError(f"room {room} already has a receiver on this decode rank")
            manager._receivers[self.room] = self
            self._server = manager._server(bootstrap)
            if self._server.ready:
                self._on_ready()

    def init(
        self,
        page_indices: npt.ArrayLike,
        state_indices: Mapping[str, npt.ArrayLike] | None = None,
        metadata_row: int = 0,
    ) -> None:
        """Tell prefill where this room's pages, state and metadata row go."""
        m = self._dm
        with m._lock:
            if self._state == Poll.FAILED:
                return
            if self._request is not None:
                raise RuntimeError(f"room {self.room}: init() called twice")
            try:
                indices = {KV_PAGE_SPACE: page_indices, **(state_indices or {})}
                packed = {}
                for space, idx in indices.items():
                    count = m.kvargs.index_space(space).count
                    packed[space] = P.pack_indices(check_indices(f"destination {space} index", idx, count, unique=True))
                if any(s.name == METADATA_SPACE for s in m.kvargs.index_spaces):
                    check_indices("metadata_row", [metadata_row], m.kvargs.index_space(METADATA_SPACE).count)
            except (KeyError, PlanError, P.ProtocolError) as exc:
                m._finish(self, Poll.FAILED, f"room {self.room}: {exc.args[0] if exc.args else exc}", "bad_request")
                return
            self._request = P.TransferRequest(room=self.room, indices=packed, metadata_row=int(metadata_row))
            self._init_at = time.monotonic()
            if self._server.ready:
                self._send_request()

    def _on_ready(self) -> None:
        if self._advance(Poll.WAITING_FOR_INPUT):
            METRICS.bootstrap(self._dm.backend_name, "decode", time.monotonic() - self._created)
        if self._request is not None:
            self._send_request()

    def _send_request(self) -> None:
        if not self._sent and self._request is not None:
            self._sent = True
            self._dm._send_to_ranks(self._server, self._request)

    def _abort_remote(self, reason: str) -> None:
        if self._sent:
            self._dm._send_to_ranks(self._server, P.Abort(room=self.room, reason=reason))

    def abort(self, reason: str = "aborted by decode") -> None:
        """Give up on this room; prefill is told. Bytes already in flight may still land."""
        with self._dm._lock:
            if self._dm._finish(self, Poll.FAILED, reason, "aborted"):
                self._abort_remote(reason)
