"""Mooncake TransferEngine adapter: register, exchange session strings, write.

The engine runs with the ``P2PHANDSHAKE`` metadata mode, so no metadata
server is needed: a peer's metadata is just its session string
``b"<host>:<rpc_port>"`` and writes target raw destination addresses.

Behaviour this adapter is built around (docs/engines.md, Mooncake):

- **In-flight limit.** Each peer has a queue of
  ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` descriptors (default 1024). Going
  over it fails the batch and can wedge the peer for the rest of the process,
  so :data:`~kvbridge.plugins.mooncake.CAPABILITIES` declares 1024 descriptors
  per batch and in flight, and :meth:`MooncakeBackend.write` sends its batch
  as one ``batch_transfer_sync_write`` call. Core runs at most one write per
  peer at a time, so that bounds what is in flight to a peer. The limit
  assumes the default queue: lowering the variable below 1024 is not supported.
- **Timeouts.** Mooncake waits 30 s (spinning a core) on a frozen peer. Before
  the first engine is created the internal timeouts are shortened to
  ``config.transfer_timeout`` plus one second unless the user set them. They
  are process-wide environment variables, so the first backend in a process
  decides them. A batch still running a quarter second past the write's
  deadline has its TCP connections reset by core (``plugins/tcpfence.py``), which
  ends it with rc -1 at once; the engine's own timeout, later, is a backstop.
- **Partial writes.** A failed batch may still have landed some bytes.

GIL: ``batch_transfer_sync_write`` releases the GIL while it runs. Measured
here (2 cores, 256 MiB as 256 x 1 MiB descriptors to another process on
127.0.0.1): a Python thread counting in a loop kept 57-70 % of its idle rate
during the write (three runs; the rest went to the engine's threads and the
receiving process). Core can therefore call :meth:`MooncakeBackend.write`
from worker threads without stalling the host's scheduler thread.

Closing costs about 1 s: the engine's destructor waits that long for its
threads to stop.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvbridge.core import Backend, BackendConfig, TransferCancelled, TransferError, TransferTimeout, may_post
from kvbridge.core.transfer.backend import expired
from .enginelog import engine_level, routed_stderr
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.description.records import BackendCapabilities

from ..tcpfence import TcpFence
from . import CAPABILITIES

if TYPE_CHECKING:
    from mooncake.engine import TransferEngine

__all__ = ["MooncakeBackend"]

log = logging.getLogger(__name__)

MIN_TRANSFER_TIMEOUT = 5  # MC_TRANSFER_TIMEOUT is clamped to this by the engine


#: What Mooncake logs while it starts that says nothing wrong: with the
#: P2PHANDSHAKE metadata mode it looks up its own segment before publishing it
#: ("E ... Local segment descriptor not found"), and it notes its allocator.
#: Routed to DEBUG; with protocol=tcp so is "No RDMA devices found".
STARTUP_NOISE = ("Local segment descriptor not found", "Using default malloc/free", "Memory allocator already initialized")


def _engine_env(transfer_timeout: float) -> None:
    """Default Mooncake's logging and timeouts; values the user set win.

    Must run before ``mooncake.engine`` is first imported (the log level is
    read then): it follows the ``kvbridge`` logger's level (WARNING unless
    the host sets one), so there is no INFO line per call. The timeouts are
    read when an engine is created.
    """
    # A second beyond the write's deadline: a write still running at its deadline has its TCP
    # connections reset by core first (core/transfer/writing.py, RESET_GRACE), which drops what they hold;
    # the engine timing out first would close them itself, and the kernel would still deliver
    # their queued bytes later (docs/failures.md).
    secs = max(1, math.ceil(transfer_timeout)) + 1
    os.environ.setdefault("MC_LOG_LEVEL", engine_level())
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(secs))
    os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", str(secs))
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(MIN_TRANSFER_TIMEOUT, secs)))


class MooncakeBackend(Backend):
    """Writes batches into peers through one Mooncake TransferEngine (options: ``protocol``, ``device_name``)."""

    capabilities: ClassVar[BackendCapabilities] = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._tcp = TcpFence(config.host, "mooncake")  # before the engine listens
        self.protocol: str = config.options["protocol"]
        self.device_name: str = config.options["device_name"]
        _engine_env(config.transfer_timeout)
        # A failed batch_transfer_sync_write (rc -1: its status timed out, say after this process was
        # stopped) does not stop the slices still queued in the engine's lanes: measured, a prefill
        # frozen mid-write and resumed landed 564 pages after its write returned. They complete or the
        # engine drops them within its progress timeout.
        self.drain_after_failure = float(os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC") or 0) or 30.0
        # Imported only now: Mooncake reads MC_LOG_LEVEL when its module loads.
        from mooncake.engine import TransferEngine

        noise = STARTUP_NOISE + (("No RDMA devices found",) if self.protocol == "tcp" else ())
        # Mooncake logs to file descriptor 2 while it starts: through this module's logger instead.
        with routed_stderr(log, noise) as said:
            self._engine: TransferEngine | None = TransferEngine()
            rc = self._engine.initialize(config.host, "P2PHANDSHAKE", self.protocol, self.device_name)
        if rc != 0:
            raise TransferError(
                f"mooncake: TransferEngine.initialize({config.host!r}, 'P2PHANDSHAKE', "
                f"{self.protocol!r}, {self.device_name!r}) returned {rc}; check the protocol "
                "option and, for rdma, the device_name option" + (f" (the engine said: {'; '.join(said)})" if said else "")
            )
        self._session = f"{config.host}:{self._engine.get_rpc_port()}"
        _warn_wildcard(self._session)
        self._registered: list[Region] = []
        self._peers: dict[str, str] = {}
        log.debug("mooncake engine up: session %s, protocol %s", self._session, self.protocol)

    def _live_engine(self) -> TransferEngine:
        if self._engine is None:
            raise TransferError("mooncake backend is closed")
        return self._engine

    def register(self, regions: Sequence[Region]) -> None:
        """Register each region with the engine; raise naming the first that fails."""
        engine = self._live_engine()
        for r in regions:
            rc = engine.register_memory(r.addr, r.nbytes)
            if rc != 0:
                raise TransferError(
                    f"mooncake: register_memory failed for region {r.name!r} "
                    f"({r.nbytes} B at {r.addr:#x}) with rc {rc}"
                )
            self._registered.append(r)

    def metadata(self) -> bytes:
        """The session string peers target, ``b"<host>:<rpc_port>"``, with where the engine listens."""
        return self._tcp.seal(self._session.encode())

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """Record ``peer``'s session string; the engine connects on the first write."""
        session = self._tcp.open(peer, metadata).decode("ascii", errors="replace")
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(
                f"mooncake: peer {peer!r} sent metadata {session!r}; expected '<host>:<rpc_port>' "
                "from another mooncake backend"
            )
        self._peers[peer] = session

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``. The engine keeps its connection; there is no API to drop it."""
        self._peers.pop(peer, None)
        self._tcp.forget(peer)

    def abort_peer(self, peer: str, stuck: bool = False) -> int:
        return self._tcp.abort_peer(peer, stuck)

    def _prepare(self, peer: str, batch: TransferPlan) -> tuple[Any, str, tuple[list[int], list[int], list[int]]]:
        """The engine, ``peer``'s session and ``batch`` as the engine's int lists, checked right before a post."""
        engine = self._live_engine()
        session = self._peers.get(peer)
        if session is None:
            known = ", ".join(sorted(self._peers)) or "none"
            raise TransferError(f"mooncake: unknown peer {peer!r} (known peers: {known}); call add_peer first")
        # tolist() converts whole arrays in C; the engine wants Python int lists.
        lists = (batch.src_addr.tolist(), batch.dst_addr.tolist(), batch.nbytes.tolist())
        if not may_post():
            raise TransferCancelled(f"mooncake: write to peer {peer!r} not posted: its room is no longer live")
        return engine, session, lists

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        """Write ``batch`` into ``peer`` with one ``batch_transfer_sync_write`` call."""
        engine, session, lists = self._prepare(peer, batch)
        rc = engine.batch_transfer_sync_write(session, *lists)
        if rc != 0:
            error = TransferTimeout if expired(deadline) else TransferError
            raise error(
                f"mooncake: write to peer {peer!r} ({session}) of {len(batch)} descriptors, {batch.total_bytes} B "
                f"returned rc {rc}; it may have partly landed. The engine's log above says why "
                "(peer gone, address not registered, timeout)"
            )

    def post(self, peer: str, batch: TransferPlan, deadline: float) -> Callable[[float], None]:
        """Post ``batch`` with one ``batch_transfer_async_write``; the returned wait blocks in
        ``get_batch_transfer_status`` (GIL released) until it landed, failed or timed out."""
        engine, session, lists = self._prepare(peer, batch)
        batch_id = engine.batch_transfer_async_write(session, *lists)
        if not batch_id:
            raise TransferError(f"mooncake: posting a write to peer {peer!r} ({session}) of {len(batch)} descriptors, "
                                f"{batch.total_bytes} B failed (batch id 0); the engine's log above says why")

        def wait(deadline: float) -> None:
            rc = engine.get_batch_transfer_status([batch_id])
            if rc != 0:
                error = TransferTimeout if expired(deadline) else TransferError
                raise error(
                    f"mooncake: write to peer {peer!r} ({session}) of {len(batch)} descriptors, {batch.total_bytes} B "
                    f"(posted asynchronously) ended with rc {rc}; it may have partly landed. The engine's log above says why"
                )
        return wait

    def close(self) -> None:
        """Deregister memory and drop the engine. Idempotent."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        with routed_stderr(log):  # the engine logs as it shuts down
            for r in self._registered:
                rc = engine.unregister_memory(r.addr)
                if rc != 0:  # nothing else to do at close; keep releasing the rest
                    log.warning("mooncake: unregister_memory for region %r returned %d", r.name, rc)
            self._registered.clear()
            self._peers.clear()
            del engine  # the engine's destructor stops its threads and listeners

    def describe(self) -> dict[str, Any]:
        return {
            "session": self._session,
            "protocol": self.protocol,
            "peers": dict(self._peers),
            "registered_regions": len(self._registered),
        }


_warned_wildcard = False


def _warn_wildcard(session: str) -> None:
    """Say once per process that the engine listens beyond the host it was given (docs/security.md)."""
    global _warned_wildcard
    if not _warned_wildcard:
        _warned_wildcard = True
        log.warning(
            "mooncake: the engine listens on every interface (0.0.0.0 and ::), not only on %s: its Python API "
            "cannot bind an address and MC_TCP_BIND_ADDRESS does not change it. Whoever reaches those ports can "
            "read and write registered memory; firewall them or use a private network (docs/security.md)", session,
        )
