"""Prefill's view of a decode rank: the peer (its route, lease, worker, measured write cost), its
request for a room, and what the sender and its writes ask of the prefill manager (``PrefillSide``).

Kept apart from ``prefill`` so that ``sender`` and ``writes`` name these without importing the
manager that imports them.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy.typing as npt

from ..control import protocol as P
from ..description.layout import METADATA_SPACE, KVArgs, Region
from ..planning.indices import Indices, check_index
from ..planning.layers import LayerIndex
from ..planning.pairing import Route
from .room import Poll, Room
from .checksum import device_problem
from .row import RowPlans, inline_row
from .worker import PeerWorker

if TYPE_CHECKING:
    from ..control.ioloop import IOLoop
    from ..transfer.transport import Transport
    from .manager import SessionConfig

__all__ = ["DecodePeer", "DecodeRequest", "PrefillSide"]

COST_WINDOW = 16  # writes kept per size class to measure a peer's write cost (DecodePeer.note_write)
COST_SAMPLES = 3  # writes a size class needs before it counts (the first write to a peer is a cold one)
SMALL_WRITE = 64 << 10  # a write this small costs mostly what any write does: its fixed cost


class _Measured:
    """A :class:`DecodePeer` cost, measured from the writes noted since it was last read (or set directly)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name

    def __get__(self, peer: DecodePeer | None, owner: type | None = None) -> Any:
        if peer is None:
            return self
        peer._measure()
        return getattr(peer, self.name)

    def __set__(self, peer: DecodePeer, value: float | None) -> None:
        peer._measure()
        setattr(peer, self.name, value)


class DecodePeer:
    """A decode rank that completed the handshake with this prefill rank, and its transfer worker.

    ``lease_until``: this rank may write to the peer until then (this rank's
    clock). The handshake grants ``lease`` seconds; a heartbeat renews it to
    ``lease`` after the clock it echoes (:class:`~kvbridge.core.control.protocol.Heartbeat`),
    so a ping that arrives late but echoes a recent clock still renews it, and
    pings queued while this rank was frozen or cut off do not.
    ``last_seen``: when anything last arrived from it (it is forgotten after
    long silence).
    """

    def __init__(self, peer_id: str, route: Route, lease: float, inline_row_bytes: int = 0, *,
                 ident: bytes | None = None, incarnation: bytes = b"", slot: tuple[str, str, int, int] | None = None
                 ) -> None:
        self.peer_id = peer_id
        #: (host, instance name, TP rank, PP rank) when decode named its instance: a new process with the
        #: same slot replaces this one (kvbridge.core.sessions.handshake); None: unnamed.
        self.slot = slot
        #: The connection its authenticated Hello came on: the only route to it (never its claimed id).
        self.ident = ident if ident is not None else peer_id.encode()
        #: Its decode manager's incarnation: only that process may handshake again under this peer id.
        self.incarnation = incarnation
        self.route = route
        #: Metadata row plans to it, by (source row, destination row), with their bytes per state type:
        #: the same for every request using those rows, planned once (a small request's fixed cost, #27).
        self.row_plans = RowPlans()
        #: The metadata row goes to this peer inside ``Done`` (small, host memory on both sides: kvbridge.core.sessions.row).
        self.inline_row = inline_row(route, inline_row_bytes)
        self.last_seen = time.monotonic()
        self.lease_until = self.last_seen + lease
        self.worker = PeerWorker(peer_id)
        self._classes: dict[int, collections.deque[tuple[float, int]]] = {}  # see note_write
        self._write_cost: float | None = None
        self._byte_time: float | None = None
        self._dirty = False  # writes were noted since the two were measured

    def note_write(self, nbytes: int, seconds: float) -> None:
        """A write of ``nbytes`` took ``seconds``: :attr:`write_cost` and :attr:`byte_time` count it.

        Writes are kept by size class (a power of two), the last ``COST_WINDOW``
        of each; a class's measure is its fastest write, since contention (a
        host computing on the same cores while a layer is written, a cold first
        write) only ever adds to a write's time, and a class counts once it
        holds ``COST_SAMPLES`` writes. The line through the smallest and the
        largest class's measures gives the fixed cost and each byte's time.
        With one class only: writes of at most ``SMALL_WRITE`` cost what the
        fastest took; larger ones cannot tell the cost from the bytes (None).
        Measured when read (layer-wise sending), not per write (every request: #27).
        """
        key = max(1, nbytes).bit_length()
        window = self._classes.get(key)
        if window is None:
            window = self._classes[key] = collections.deque(maxlen=COST_WINDOW)
        window.append((seconds, nbytes))
        self._dirty = True

    #: What one write to it costs whatever its size (seconds), and what each byte adds (seconds); None until
    #: measured (:meth:`note_write`). Layer-wise sending coalesces layers while their bytes cost less than a write.
    write_cost = _Measured()
    byte_time = _Measured()

    def _measure(self) -> None:
        """Measure the writes noted since the last time (a class too small to count keeps what was measured)."""
        if not self._dirty:
            return
        self._dirty = False
        # Copies: a worker may append meanwhile (a deque refuses to be iterated while it changes).
        classes = {k: tuple(w) for k, w in list(self._classes.items())}
        counted = [k for k, w in classes.items() if len(w) >= COST_SAMPLES]
        if not counted:
            return
        t_lo, n_lo = min(classes[min(counted)])
        t_hi, n_hi = min(classes[max(counted)])
        if n_hi > n_lo:
            self._byte_time = max(0.0, (t_hi - t_lo) / (n_hi - n_lo))
            self._write_cost = max(0.0, t_lo - n_lo * self._byte_time)
        elif n_lo <= SMALL_WRITE:
            self._write_cost, self._byte_time = t_lo, 0.0

    def renew(self, clock: float, lease: float) -> None:
        """Decode echoed ``clock`` (this rank's, from a heartbeat reply): it was alive after it."""
        self.lease_until = max(self.lease_until, min(clock, time.monotonic()) + lease)


@dataclass
class DecodeRequest:
    """One decode rank's destination lists for a room, checked on arrival."""

    peer: str
    decode_rank: int
    decode_tp: int
    indices: dict[str, Indices]
    metadata_row: int
    received: float
    strict: bool = False  # decode asked for strict_index_lengths
    checksum: bool = False  # either side asked for the end-to-end checksum

    @classmethod
    def check(cls, peer: DecodePeer, msg: P.TransferRequest, regions: Sequence[Region],
              config: SessionConfig) -> DecodeRequest:
        """Check a decode rank's destination lists once, on arrival (the planner trusts them after);
        ``ProtocolError`` or ``PlanError`` naming what is wrong. ``regions``: this rank's own."""
        indices: dict[str, Indices] = {}
        for space, packed in msg.indices.items():
            # Checked before decoding: a list longer than allowed costs nothing to refuse.
            if len(packed) > 4 * config.max_index_list:
                raise P.ProtocolError(f"index list {space[:64]!r} has {len(packed) // 4} entries, more than "
                                      f"max_index_list={config.max_index_list}")
            # Spaces this rank holds no regions of (another pipeline stage's state) are ignored.
            sr = peer.route.spaces.get(space)
            if sr is not None and len(packed) > 4 * sr.dst_count:
                raise P.ProtocolError(f"index list {space[:64]!r} has {len(packed) // 4} entries but decode "
                                      f"declared only {sr.dst_count} {space!r} indices")
            idx = P.unpack_indices(space, packed)
            if sr is not None:
                indices[space] = Indices.check(f"destination {space} index", idx, sr.dst_count, unique=True, own=True)
                # Counted now, while prefill computes, not when it sends (the planner asks: #27).
                indices[space].count_continuing()
        if METADATA_SPACE in peer.route.spaces:
            check_index("destination metadata row", msg.metadata_row, peer.route.spaces[METADATA_SPACE].dst_count)
        if msg.checksum or config.checksum:
            # Each side hashes its own bytes: decode its GPU memory (failing the room, saying why, if it
            # cannot), prefill its own, checked here so the request is refused at once.
            problem = device_problem(regions, "prefill")
            if problem is not None:
                raise P.ProtocolError(problem)
        dst = peer.route.dst
        return cls(peer.peer_id, dst.tp_rank, dst.tp_size, indices, msg.metadata_row, time.monotonic(), msg.strict,
                   msg.checksum or config.checksum)

    def conflict(self, others: Mapping[str, DecodeRequest]) -> str | None:
        """Why this request cannot join a room's ``others``, or None."""
        if self.peer in others:
            return f"decode {self.peer!r} already sent a request for it"
        for other in others.values():
            if other.decode_tp != self.decode_tp:
                return f"decode ranks disagree on the decode TP size ({other.decode_tp} vs {self.decode_tp})"
            if other.decode_rank == self.decode_rank:
                return f"decode TP rank {self.decode_rank} already sent a request for it (from {other.peer!r})"
        return None


class PrefillSide(Protocol):
    """What a :class:`~.sender.Sender` and its writes (:mod:`.writes`) use of the
    :class:`~.prefill.PrefillManager` that owns them: its lock, config and transport, the write
    fence (``begin_write``/``live``/``end_write``) and the calls that end or report a room."""

    lock: threading.RLock
    config: SessionConfig
    kvargs: KVArgs
    transport: Transport
    backend_name: str
    layer_index: LayerIndex
    layer_gap: float | None
    ready: set[int]
    loop: IOLoop

    def add_room(self, room: Room) -> None: ...
    def take_pending(self, room: int) -> Iterable[DecodeRequest]: ...
    def take_aborted(self, room: int) -> str | None: ...
    def peer(self, peer_id: str) -> DecodePeer | None: ...
    def source_indices(self, space: str, values: npt.ArrayLike) -> Indices: ...
    def note_layer_gap(self, seconds: float) -> None: ...
    def begin_write(self, sender: Room, peer: DecodePeer) -> bool: ...
    def live(self, sender: Room, peer: DecodePeer, wait: bool = False) -> bool: ...
    def end_write(self, sender: Room, peer: DecodePeer) -> None: ...
    def fail_sender(self, sender: Room, reason: str, kind: str) -> None: ...
    def finish(self, room: Room, state: Poll, reason: str | None = None, kind: str = "transfer_error",
               wake: bool = True) -> bool: ...
    def notify(self, peer: DecodePeer, *msgs: P.Message, wake: bool = False) -> None: ...
