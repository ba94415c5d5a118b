"""What both managers share: settings, the transport, the I/O thread, the lock, final states."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

from ..control import protocol as P
from ..control.auth import auth_for, check_host, new_incarnation
from ..control.ioloop import IOLoop, SocketGetter
from .checksum import device_problem
from ..description.layout import KVArgs
from ..control.metrics import metrics
from .room import Changes, Poll, Room
from ..transfer.staging import DEVICE_SLICE_BYTES
from ..transfer.transport import BackendChoice, open_transport

__all__ = ["SessionConfig", "TransferManager"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Room)


@dataclass(frozen=True)
class SessionConfig:
    """Timeouts (seconds) and settings of a manager; see :mod:`kvbridge.core.sessions.session`."""

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
    #: Put the same-host lanes (``cuda_ipc``: GPU -> GPU within one host with CUDA IPC and one
    #: kernel per write) before the backend where they are installed, when the backend is the
    #: default or one name; a comma-separated list of backends is taken as it is.
    gpu_fast_path: bool = True
    #: A file holding the shared secret that authenticates control messages (else
    #: ``$KVBRIDGE_SECRET_FILE``, else ``$KVBRIDGE_SECRET``; see docs/security.md).
    #: Without a secret, ``host`` must be a loopback address.
    secret_file: str | None = None
    #: Largest control message accepted (bytes); zmq drops a longer frame before allocating it.
    #: The default holds a request with several index lists of ``max_index_list`` entries.
    max_message_bytes: int = 32 << 20
    #: Most entries of one index list in a request (pages, slots), checked on both sides.
    max_index_list: int = 1 << 20
    #: Most decode ranks one prefill rank keeps a handshake with; more are refused.
    max_peers: int = 1024
    #: Handshakes a prefill rank accepts per second (bursts of twice as many); more are refused.
    handshake_rate: float = 200.0
    #: How long decode waits, after it gives up on a room, for every prefill rank to
    #: confirm it stopped writing (``Fenced``) before it reports FAILED anyway.
    #: None: ``transfer_timeout + heartbeat_timeout`` (a write in flight ends by its
    #: deadline; a live prefill stops starting writes within ``heartbeat_timeout`` of
    #: losing decode). See docs/failures.md.
    fence_timeout: float | None = None
    #: How long prefill keeps a request whose room has no ``Sender`` yet (the host
    #: creates it slightly later) before it tells decode the room failed.
    sender_grace: float = 5.0
    #: How long a prefill rank holds back its answer to a decode rank's handshake while its lanes
    #: prepare for that peer's writes (``Backend.warm``: ``cuda_ipc`` compiles the copy kernels of the
    #: peer's plans, so the first requests do not pay for it); the peer's requests wait for the answer.
    #: Past it the handshake is answered and the preparing goes on beside the first writes; 0: answer
    #: at once. Keep it well under decode's ``bootstrap_timeout``.
    warm_timeout: float = 20.0
    #: Verify every room end to end: prefill hashes the bytes it wrote, decode
    #: the bytes it holds, a difference fails the room (kvbridge.core.sessions.checksum).
    #: Either side may ask. GPU memory is hashed in place (``wmix64`` with torch); a rank
    #: whose torch sees no CUDA device refuses it for its GPU regions.
    checksum: bool = False
    #: Staging of fragmented host-memory windows (docs/performance.md, "Staging"): ``gather`` (the default)
    #: gathers a window of small pieces on prefill where that merges them in the destination; ``auto`` also
    #: stages on both sides (decode lends slots) when its pieces are small
    #: (``kvbridge.core.transfer.relay.choose``); ``on`` every window it can; ``off`` none (every descriptor
    #: written as planned). Both-sides staging is opt-in: see docs/performance.md. GPU pages through an
    #: engine lane are staged on both sides with ``auto``/``on`` only (``kvbridge.core.transfer.device``).
    staging: str = "gather"
    #: GPU staging (``staging`` auto or on, GPU pages through an engine lane): the most one staged window holds,
    #: the size of prefill's GPU staging slices and of decode's GPU landing slots (a multiple of 4 KiB). Either
    #: side's buffer stays bounded: prefill keeps ``kvbridge.core.transfer.staging.device_slices`` slices (4 of
    #: the default 32 MiB; 2 from 64 MiB up), decode ``kvbridge.core.transfer.landing.device_slots`` slots
    #: (8 of the default, lent 2 per prefill rank; fewer from 64 MiB up, 2 from 128 MiB up: one prefill rank
    #: staged, the others write as planned). ``kvbridge bench transfer --device cuda --slice-mib`` measures sizes.
    gpu_staging_slice_bytes: int = DEVICE_SLICE_BYTES
    #: Prefill: a metadata row of at most this many bytes (all metadata regions together)
    #: in host memory on both sides travels inside ``Done`` instead of as an engine write
    #: (kvbridge.core.sessions.row); 0: always an engine write.
    inline_row_bytes: int = 4096
    #: Decode: this decode instance's name, the same across its restarts and never shared by two
    #: live instances (a server's address, its DP rank). A prefill rank that accepts a handshake from a
    #: new process of the same name, host and TP/PP rank fails the old process's rooms at once, naming
    #: the restart; without a name (the default) they fail when its lease lapses (docs/failures.md).
    instance_name: str = ""
    #: Prefill: the TCP port of the control endpoint on ``host`` (0: an ephemeral port). A fixed port
    #: lets a restarted prefill come back on the same address; decode tells it apart by its incarnation.
    control_port: int = 0

    @property
    def fence_wait(self) -> float:
        """``fence_timeout``, or its default ``transfer_timeout + heartbeat_timeout``."""
        return self.fence_timeout if self.fence_timeout is not None else self.transfer_timeout + self.heartbeat_timeout

    @classmethod
    def from_fields(cls, source: object) -> SessionConfig:
        """The settings among ``source``'s attributes (those named like this class's fields; the rest default).

        Host-side settings objects (``TransferConfig``, test scenarios) pass
        themselves whole instead of copying fields one by one.
        """
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)})

    def __post_init__(self) -> None:
        for name in ("bootstrap_timeout", "waiting_timeout", "transfer_timeout", "heartbeat_interval", "heartbeat_timeout",
                     "sender_grace"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_message_bytes", "max_index_list", "max_peers", "handshake_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if self.max_message_bytes < 4 * self.max_index_list + 4096:
            raise ValueError(
                f"max_message_bytes ({self.max_message_bytes}) must hold one index list of max_index_list "
                f"({self.max_index_list}) int32 entries: at least {4 * self.max_index_list + 4096}"
            )
        if not self.warm_timeout >= 0:
            raise ValueError(f"warm_timeout must be >= 0 (0: answer handshakes at once), got {self.warm_timeout}")
        if isinstance(self.inline_row_bytes, bool) or not isinstance(self.inline_row_bytes, int) or self.inline_row_bytes < 0:
            raise ValueError(f"inline_row_bytes must be an int >= 0 (0: never inline), got {self.inline_row_bytes!r}")
        if self.inline_row_bytes > self.max_message_bytes // 2:
            raise ValueError(f"inline_row_bytes ({self.inline_row_bytes}) must be at most half of max_message_bytes "
                             f"({self.max_message_bytes}): the row travels in a control message")
        if not isinstance(self.instance_name, str) or len(self.instance_name) > 256:
            raise ValueError(f"instance_name must be a str of at most 256 characters, got {self.instance_name!r:.300}")
        if isinstance(self.control_port, bool) or not isinstance(self.control_port, int) \
                or not 0 <= self.control_port <= 65535:
            raise ValueError(f"control_port must be an int in 0..65535 (0: ephemeral), got {self.control_port!r}")
        if (isinstance(self.gpu_staging_slice_bytes, bool) or not isinstance(self.gpu_staging_slice_bytes, int)
                or self.gpu_staging_slice_bytes <= 0 or self.gpu_staging_slice_bytes % 4096):
            raise ValueError(f"gpu_staging_slice_bytes must be a positive multiple of 4096 (whole 4 KiB pages), "
                             f"got {self.gpu_staging_slice_bytes!r}")
        if self.staging not in ("gather", "auto", "on", "off"):
            raise ValueError(f"staging must be one of gather, auto, on, off, got {self.staging!r}")
        if self.fence_timeout is not None and self.fence_timeout <= 0:
            raise ValueError(f"fence_timeout must be > 0 (or None for the default), got {self.fence_timeout}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed heartbeat_interval ({self.heartbeat_interval})"
            )


class TransferManager(Generic[R]):
    """Shared by both roles: the transport, the I/O thread, the rooms, shutdown.

    ``backend`` is a registered backend name, a ``BackendSpec``, a ready
    ``Backend`` instance, or None for the default backend (the first
    available of ``BACKEND_PREFERENCE``).
    """

    role: str

    def __init__(self, kvargs: KVArgs, backend: BackendChoice, config: SessionConfig | None) -> None:
        self.kvargs = kvargs
        #: Each index space's size, by name (looked up per request).
        self.space_counts = {s.name: s.count for s in kvargs.index_spaces}
        self.config = config or SessionConfig()
        #: Seals and opens every control message (docs/security.md).
        self.auth = auth_for(self.config.secret_file)
        #: This manager's incarnation, in the header of every message it sends: a restarted
        #: process is a new peer to the others (kvbridge.core.control.auth, docs/failures.md).
        self.incarnation = new_incarnation()
        if self.config.checksum:
            problem = device_problem(kvargs.regions, f"this {self.role} rank's")
            if problem is not None:
                raise ValueError(f"checksum=True: {problem}")
        check_host(self.config.host, self.auth, f"kvbridge {self.role} manager")
        self.transport = open_transport(
            backend,
            host=self.config.host,
            name=f"{self.role}-tp{kvargs.tp_rank}-pp{kvargs.pp_rank}-{os.getpid()}",
            transfer_timeout=self.config.transfer_timeout,
            options=self.config.backend_options,
            fast_path=self.config.gpu_fast_path,
        )
        self.backend_name = self.transport.name
        try:
            self.transport.staging_mode = self.config.staging
            self.transport.device_slice_bytes = self.config.gpu_staging_slice_bytes
            self.transport.on_window = lambda how: metrics().window(self.backend_name, how)
            self.transport.register(kvargs.regions, sends=self.role == "prefill")
        except BaseException:
            self.transport.close()
            raise
        #: Guards every room and peer table; rooms and workers take it too.
        self.lock = threading.RLock()
        #: Notified whenever one of this manager's rooms changes state (``Room.wait``, ``wait_any``).
        #: Its own lock, not ``lock``: a woken host then runs at once instead of waiting for the
        #: notifying thread to leave ``lock`` (states only move forward and are read without it).
        self.changed = Changes()
        self.rooms: dict[int, R] = {}
        self.closed = False
        self.loop = IOLoop(
            f"kvbridge-{self.role}", tick=self._tick, tick_interval=min(0.05, self.config.heartbeat_interval / 2)
        )

    @property
    def backend(self) -> object:
        """The backend object (for ``describe()`` and tests)."""
        return self.transport.backend

    def _tick(self) -> None:  # pragma: no cover - overridden
        pass

    def send(self, channel: SocketGetter, msg: P.Message, ident: bytes | None = None) -> None:
        """Send ``msg`` on the channel ``channel()`` returns, from the I/O thread (any thread may call)."""
        self.loop.send(channel, P.encode(msg), ident=ident)

    def wake_hosts(self) -> None:
        """Wake every host waiting in ``Room.wait`` or :meth:`wait_any` (after a change made with ``wake=False``)."""
        self.changed.wake()

    def wait_any(self, rooms: Iterable[Room], timeout: float, seen: Mapping[Room, Poll] | None = None) -> None:
        """Block until one of ``rooms`` is final or in another state than ``seen`` says, or ``timeout`` seconds pass.

        For a host serving many rooms from one thread: wake on the change, then poll them. ``seen``
        holds the states the host last acted on (a room missing from it: its state now). Pass it when
        a room may change between the host's poll and this call (a sender becoming ready to send):
        without it that change is the baseline, and the wait lasts until the room's next change.
        """
        rooms = list(rooms)
        last = {id(r): seen[r] if seen is not None and r in seen else r.poll() for r in rooms}

        def moved() -> bool:
            return any(r.final or r.poll() != last[id(r)] for r in rooms)

        if moved():
            return
        self.changed.wait_for(moved, timeout)

    def add_room(self, room: R) -> None:
        """Register a new room (a Sender or Receiver being created)."""
        room.changed = self.changed
        with self.lock:
            if self.closed:
                raise RuntimeError(f"the {self.role} manager is closed")
            if room.room in self.rooms:
                kind = "sender" if self.role == "prefill" else "receiver"
                raise ValueError(f"room {room.room} already has a {kind} on this {self.role} rank")
            self.rooms[room.room] = room

    def finish(self, room: Room, state: Poll, reason: str | None = None, kind: str = "transfer_error",
               wake: bool = True) -> bool:
        """Move ``room`` to a final state and drop everything held for it; False if it was final already.

        ``kind`` is the failure's metrics label (one of ``metrics.FAILURE_REASONS``); ``wake``: as
        :meth:`Room.advance`.
        """
        with self.lock:
            # Counted before the state changes: a host that sees the room final finds it counted.
            will = not room.final and (state == Poll.FAILED or state > room.poll())
            if will and state == Poll.FAILED:
                metrics().failed(self.backend_name, self.role, kind)
            elif will and state == Poll.SUCCESS:
                metrics().succeeded(self.backend_name, self.role)
            changed = room.advance(state, reason, wake)
            if room.final and self.rooms.get(room.room) is room:
                del self.rooms[room.room]
            return changed

    def active_rooms(self) -> int:
        """How many rooms this manager still holds state for (for leak checks)."""
        with self.lock:
            return len(self.rooms)

    def abort_room(self, room: Room, reason: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        """Fail every open room, stop threads, release the engine. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for room in list(self.rooms.values()):
                self.abort_room(room, f"{self.role} manager closed")  # counted as "aborted"
        self._shutdown()
        self.loop.stop()
        self.transport.close()

    def _shutdown(self) -> None:
        pass

    def __enter__(self) -> TransferManager[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
