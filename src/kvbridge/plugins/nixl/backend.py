"""NIXL adapter: one agent with the UCX backend, agent metadata exchanged in core's handshake.

A peer's metadata is its NIXL agent metadata (``get_agent_metadata()``, a few
hundred bytes), carried in kvbridge's handshake and loaded with
``add_remote_agent``: no metadata server (NIXL's etcd or TCPStore publishing,
which matters when every decode rank would otherwise handshake with every
prefill rank) is needed, since core delivers metadata point to point.

Behaviour this adapter is built around (measured: docs/engines.md, NIXL):

- **The engine** (exit crash, logging, idle CPU, thread safety): :mod:`.engine`;
  **prepared page tables** (``xfer_mode=prepped``): :mod:`.pages`.
- **No transfer timeout.** NIXL waits forever on a stalled peer, so
  :meth:`NixlBackend.write` posts its batch as one request, polls it with
  core's ``wait_until`` and, at the deadline, releases it and raises
  :class:`TransferTimeout`; a dead peer's ``nixlRemoteDisconnectError`` becomes
  :class:`TransferError` naming the peer (within 1 ms of the first write after
  the kill). CMA writes into a *stopped* process complete; over TCP they time
  out and the peer works again after SIGCONT. **Releasing does not cancel puts
  UCX has queued** (127 of 128 MiB landed after a timed-out write to a stopped
  peer over TCP), so core keeps what is in flight to a peer within its fence's 64 MiB
  and 4096 descriptors (2 batches of 32 MiB and 2048) and, over TCP, resets the connections after a failed write
  (``abort_peer``, docs/failures.md); the next write reconnects (below).
- **The post does the copy.** With CMA, ``transfer()`` copies every byte before it returns (releasing
  the GIL), so a deadline cannot interrupt it: ``max_bytes_per_batch`` is 64 MiB.
- **One memory kind per request**, as a NIXL descriptor list holds: core posts each batch with one
  memory kind and device a side (``TransferPlan.memory``).
- **A failed endpoint.** NIXL keeps a UCX endpoint that failed (its TCP
  connection reset, by core's fence among others) failed, and every later
  write to that peer raised ``nixlRemoteDisconnectError``. A write that fails
  so, or ends in ``ERR``, unloads the peer's agent and loads its metadata again
  (:meth:`NixlBackend._reload`), so the next write connects anew.

Options (``config.options``): declared, with what each does, in :mod:`kvbridge.plugins.nixl`
(``kvbridge plugins`` lists them).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvbridge.core import Backend, BackendConfig, TransferCancelled, TransferError, TransferTimeout, may_post
from kvbridge.core.transfer.backend import wait_until
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.plan import RegionTable, TransferPlan, memory_of
from kvbridge.core.description.records import BackendCapabilities

from ..tcpfence import TcpFence
from . import CAPABILITIES
from .engine import engine_env, error_hint, make_agent, mem_type, nixl_errors, quiet_nixl_logger
from .pages import PageTable, prepped_indices
from .peers import NixlPeers, _Peer

if TYPE_CHECKING:
    from nixl_cu12 import nixl_agent, nixl_xfer_handle  # or nixl_cu13: same API

__all__ = ["NixlBackend"]

log = logging.getLogger(__name__)


_Side = tuple[bool, int]  # (GPU memory?, device) of every descriptor of a side

#: Batches of at most this many descriptors get their NIXL descriptor lists from Python tuples, not arrays
#: (measured: ~7 us against ~13 us for one descriptor; a fixed cost of a small request, issue #27).
SMALL_BATCH = 16
#: Bytes :meth:`NixlBackend.warm` reads from a peer, and how long it waits for them (seconds).
WARM_BYTES = 64
WARM_S = 5.0


class NixlBackend(NixlPeers, Backend):
    """Writes batches into peers through one NIXL agent (UCX backend); the module docstring explains the options."""

    capabilities: ClassVar[BackendCapabilities] = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._tcp = TcpFence(config.host, "nixl")  # before the agent listens
        options = config.options
        self.progress_delay_us: int = options["progress_delay_us"]
        self.error_mode: str = options["ucx_error_handling_mode"]
        self.xfer_mode: str = options["xfer_mode"]
        params = {"ucx_error_handling_mode": self.error_mode, "num_workers": str(options["num_workers"])}
        if options["ucx_engine_config"]:
            params["engine_config"] = options["ucx_engine_config"]
        user_log_level = engine_env(config.host)
        self._errors = nixl_errors()  # the first import of NIXL
        if not user_log_level:
            quiet_nixl_logger()
        # Agent names must be unique among the agents that meet; core's name is
        # per role, rank and process, and two managers of one role may share a process.
        self.agent_name = f"{config.name or 'kvbridge'}-{uuid.uuid4().hex[:8]}"
        try:
            self._agent: nixl_agent | None = make_agent(self.agent_name, self.progress_delay_us, params)
        except self._errors as exc:
            raise TransferError(f"nixl: could not create agent {self.agent_name!r} with UCX {params}: {exc!r}") from exc
        self._lock = threading.Lock()
        # Loading and unloading remote agents (add_peer on the I/O thread, _retire, _reload on a writing
        # thread): one at a time, or a reload could unload the agent a re-handshake just loaded.
        self._agents = threading.RLock()
        self._peers: dict[str, _Peer] = {}
        self._registered: list[Region] = []
        self._reg_descs: list[Any] = []
        self._local_regions = RegionTable(())
        self._local: PageTable | None = None
        self._stuck: list[nixl_xfer_handle] = []  # requests NIXL refused to release at a deadline
        self._scratch: np.ndarray | None = None  # registered host bytes warm() reads a peer's into
        log.debug("nixl agent %s up: progress delay %d us, UCX %s, xfer mode %s",
                  self.agent_name, self.progress_delay_us, params, self.xfer_mode)

    # -- setup -----------------------------------------------------------------------
    def _live_agent(self) -> nixl_agent:
        if self._agent is None:
            raise TransferError("nixl backend is closed")
        return self._agent

    def _prep(self, agent_name: str, regions: Sequence[Region]) -> PageTable | None:
        """The prepared page table of ``regions``, or None if they mix memory kinds (``descs`` mode then)."""
        if not regions or len({r.mem for r in regions}) > 1:
            return None
        agent = self._live_agent()
        rows, index = PageTable.rows(regions)
        handle = agent.prep_xfer_dlist(agent_name, rows, mem_type(regions[0].mem == "vram"))
        return PageTable(handle=handle, **index)

    def register(self, regions: Sequence[Region]) -> None:
        """Register every region with the agent (per memory kind) and prepare the local page table."""
        agent = self._live_agent()
        self._local_regions = RegionTable(regions)
        if not regions:
            return
        try:
            for vram in (False, True):
                mine = [r for r in regions if (r.mem == "vram") == vram]
                if mine:
                    rows = np.array([[r.addr, r.nbytes, r.device] for r in mine], np.uint64)
                    self._reg_descs.append(agent.register_memory(rows, mem_type(vram)))
            self._local = self._prep("NIXL_INIT_AGENT", regions)
            scratch = np.zeros(WARM_BYTES, np.uint8)
            self._reg_descs.append(agent.register_memory(np.array([[scratch.ctypes.data, WARM_BYTES, 0]], np.uint64),
                                                         "DRAM"))
            self._scratch = scratch
        except self._errors as exc:
            names = ", ".join(f"{r.name!r} ({r.nbytes} B at {r.addr:#x})" for r in regions)
            raise TransferError(f"nixl: registering regions {names} failed: {exc!r}") from exc
        self._registered = list(regions)

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info and registered memory keys), with where UCX listens."""
        return self._tcp.seal(bytes(self._live_agent().get_agent_metadata()))

    def _quietly(self, call: Any, what: str) -> None:
        try:
            call()
        except self._errors as exc:  # nothing better to do while tearing down
            log.warning("nixl: %s failed: %r", what, exc)

    def warm(self, peer: str, batches: Sequence[TransferPlan]) -> None:
        """Read :data:`WARM_BYTES` of ``peer``'s first region into a scratch buffer of this agent's, before its
        handshake is answered: UCX connects and unpacks the peer's keys there, not in the first write (4-18 ms
        of it on this host's loopback, where ``make_connection`` changed nothing). The peer's bytes are only
        read. A failure is logged: the first write then connects, as without it."""
        with self._lock:
            p = self._peers.get(peer)
        if p is None or not p.region_list or self._scratch is None:
            return
        r, agent, handle = p.region_list[0], self._live_agent(), None
        n = min(WARM_BYTES, r.nbytes)
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs([(self._scratch.ctypes.data, n, 0)], "DRAM"),
                                           agent.get_xfer_descs([(r.addr, n, r.device)], mem_type(r.mem == "vram")), p.agent)
            state = self._wait(agent, handle, agent.transfer(handle), time.monotonic() + WARM_S)
            if state != "DONE":
                log.info("nixl: reading from peer %r ahead of its writes ended %s", peer, state)
        except self._errors as exc:
            log.info("nixl: reading from peer %r ahead of its writes failed: %r", peer, exc)
        finally:
            if handle is not None:
                self._release(handle)

    # -- writes ----------------------------------------------------------------------
    # _begin/_end rather than a context manager: on a 1-descriptor write its generator cost more than NIXL's post.
    def _begin(self, peer: str) -> _Peer:
        """The peer, counted as written to until :meth:`_end` (so removing it meanwhile waits for the write)."""
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                known = ", ".join(sorted(self._peers)) or "none"
                raise TransferError(f"nixl: unknown peer {peer!r} (known peers: {known}); call add_peer first")
            p.writes += 1
        return p

    def _end(self, p: _Peer) -> None:
        with self._lock:
            p.writes -= 1
            release = p.retired and p.writes == 0
        if release:
            p.retired = False
            self._retire(p, forget_agent=p.forget_agent)

    def _request(self, p: _Peer, plan: TransferPlan, src: _Side, dst: _Side) -> nixl_xfer_handle:
        agent = self._live_agent()
        if self.xfer_mode == "prepped":
            indices = prepped_indices(self._local, p.table, plan)
            if indices is not None:
                assert self._local is not None and p.table is not None
                return agent.make_prepped_xfer("WRITE", self._local.handle, indices[0], p.table.handle, indices[1])
        n = len(plan)
        if 0 < n <= SMALL_BATCH:  # a chunk of a small request or a metadata row: tuples cost half of two arrays
            descs = plan.descriptors()
            return agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs([(a, k, src[1]) for a, _, k in descs], mem_type(src[0])),
                agent.get_xfer_descs([(b, k, dst[1]) for _, b, k in descs], mem_type(dst[0])), p.agent
            )
        local, remote = np.zeros((n, 3), np.uint64), np.zeros((n, 3), np.uint64)
        local[:, 0], remote[:, 0] = plan.src_addr, plan.dst_addr
        local[:, 1] = remote[:, 1] = plan.nbytes
        local[:, 2], remote[:, 2] = src[1], dst[1]
        return agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, mem_type(src[0])), agent.get_xfer_descs(remote, mem_type(dst[0])), p.agent
        )

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        """Post ``batch`` to ``peer`` as one WRITE request and poll it until DONE, ERR or ``deadline``
        (the post itself may overrun it by the time its CMA copy takes)."""
        self.post(peer, batch, deadline)(deadline)

    def post(self, peer: str, batch: TransferPlan, deadline: float) -> Callable[[float], None]:
        """Post ``batch`` to ``peer`` as one WRITE request; the returned wait polls it until DONE, ERR
        or its deadline, then releases it (core keeps several posted: ``batches_in_flight``)."""
        self._live_agent()
        p = self._begin(peer)
        try:
            # Core posts each batch with one memory kind and device a side (TransferPlan.memory): a NIXL
            # descriptor list holds one kind. A batch from elsewhere (a direct call) is placed here.
            m = batch.memory or memory_of(batch, self._local_regions, p.regions)
            handle, state, t0 = self._start(p, batch, (m.src_kind == "vram", m.src_device), (m.dst_kind == "vram", m.dst_device))
        except BaseException:
            self._end(p)
            raise

        def wait(deadline: float) -> None:
            try:
                self._finish(p, batch, handle, state, t0, deadline)
            finally:
                self._end(p)
        return wait

    def _start(self, p: _Peer, batch: TransferPlan, src: _Side, dst: _Side) -> tuple[nixl_xfer_handle, str, float]:
        """Create a WRITE request and post it (unless the room died meanwhile): (request, state, when)."""
        agent = self._live_agent()
        t0 = time.monotonic()
        handle = None
        if p.unloaded:
            self._reload(p)  # the last attempt to load its agent again failed
        try:
            handle = self._request(p, batch, src, dst)
            if not may_post():  # checked after preparing, right before the post that copies
                self._release(handle)
                raise TransferCancelled(f"nixl: write to peer {p.name!r} ({_what(batch)}) not posted: its room is no longer live")
            return handle, agent.transfer(handle), t0
        except self._errors as exc:
            raise self._failed(p, batch, handle, exc) from exc

    def _failed(self, p: _Peer, batch: TransferPlan, handle: nixl_xfer_handle | None, exc: BaseException) -> TransferError:
        if handle is not None:
            self._release(handle)
        if type(exc).__name__ == "nixlRemoteDisconnectError":
            self._reload(p)
        return TransferError(
            f"nixl: write to peer {p.name!r} (agent {p.agent}; {_what(batch)}) failed: {type(exc).__name__}: {exc}. "
            + error_hint(type(exc).__name__)
        )

    def _finish(self, p: _Peer, batch: TransferPlan, handle: nixl_xfer_handle, state: str, t0: float,
                deadline: float) -> None:
        """Poll a posted request until DONE, ERR or ``deadline``, then release it."""
        peer = p.name
        try:
            state = self._wait(self._live_agent(), handle, state, deadline)
        except self._errors as exc:
            raise self._failed(p, batch, handle, exc) from exc
        released = self._release(handle)
        if state == "PROC":
            raise TransferTimeout(
                f"nixl: write to peer {peer!r} (agent {p.agent}; {_what(batch)}) did not complete by its deadline "
                f"({time.monotonic() - t0:.3f} s after it was posted); the request was "
                + ("released" if released else "not releasable and is kept until close")
                + "; bytes may have partly landed, and puts UCX had queued may still land"
            )
        if state != "DONE":
            self._reload(p)  # an endpoint that failed stays failed
            raise TransferError(
                f"nixl: write to peer {peer!r} (agent {p.agent}; {_what(batch)}) ended in state {state!r}; "
                "bytes may have partly landed"
            )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("nixl: wrote %s to %r in %.6f s", _what(batch), peer, time.monotonic() - t0)

    @staticmethod
    def _wait(agent: nixl_agent, handle: nixl_xfer_handle, state: str, deadline: float) -> str:
        """Poll until the request leaves PROC or the deadline passes; return the last state."""
        last = [state]

        def done() -> bool:
            if last[0] == "PROC":
                last[0] = agent.check_xfer_state(handle)
            return last[0] != "PROC"

        wait_until(done, deadline)
        return last[0]

    def _release(self, handle: nixl_xfer_handle) -> bool:
        """Release a request (puts UCX already queued still go out); keep it for close if NIXL refuses."""
        try:
            handle.release()
            return True
        except self._errors as exc:
            log.warning("nixl: could not release a transfer request (%r); retrying at close", exc)
            self._stuck.append(handle)
            return False

    # -- teardown --------------------------------------------------------------------
    def close(self) -> None:
        """Release requests, page tables and peers, deregister memory, destroy the agent. Idempotent."""
        agent = self._agent
        if agent is None:
            return
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for handle in self._stuck:
            self._quietly(handle.release, "releasing a stuck transfer request")
        self._stuck.clear()
        for p in peers:
            p.writes = 0
            self._retire(p, forget_agent=True)
        if self._local is not None:
            self._quietly(self._local.handle.release, "releasing the local page table")
            self._local = None
        for descs in self._reg_descs:
            self._quietly(lambda d=descs, a=agent: a.deregister_memory(d), "deregistering memory")
        self._reg_descs = []
        self._registered.clear()
        self._agent = None
        del agent  # the agent's destructor stops its progress thread

    def describe(self) -> dict[str, Any]:
        return {"agent": self.agent_name, "progress_delay_us": self.progress_delay_us,
                "ucx_error_handling_mode": self.error_mode, "xfer_mode": self.xfer_mode,
                "peers": {k: v.agent for k, v in self._peers.items()}, "registered_regions": len(self._registered)}


def _what(batch: TransferPlan) -> str:
    return f"{len(batch)} descriptors, {batch.total_bytes} B"

