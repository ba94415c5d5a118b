"""NIXL adapter: one agent with the UCX backend, agent metadata exchanged in core's handshake.

A peer's metadata is its NIXL agent metadata (``get_agent_metadata()``, a few
hundred bytes) and :meth:`NixlBackend.add_peer` loads it with
``add_remote_agent``. kvbridge carries it in its own handshake, so no
metadata server is needed. NIXL can also publish and fetch agent metadata
through a central store, etcd (``NIXL_ETCD_ENDPOINTS``, ``NIXL_ETCD_NAMESPACE``)
or a TCPStore (``NIXL_TCPSTORE_ENDPOINT``), with ``send_local_metadata`` /
``fetch_remote_metadata``; that option matters for large deployments where
every decode rank would otherwise handshake with every prefill rank, but it
is not used here because core already delivers metadata point to point.

Behaviour this adapter is built around (docs/engines.md, NIXL):

- **Exit crash.** A process that created a UCX-backed agent dies with SIGSEGV
  at interpreter exit (UCX's ``ib`` modules pull in a ``libnl-route`` whose
  destructor crashes in ``_dl_fini``). ``UCX_MODULES=^ib`` is therefore set,
  unless the user set it, before NIXL is first imported; on hosts with RDMA
  NICs, set ``UCX_MODULES`` yourself to keep the ``ib`` transports.
- **Logging.** NIXL's Python logger prints INFO lines (one per agent) to
  *stdout*, which belongs to the host (the e2e drivers print results there).
  Unless the user set ``NIXL_LOG_LEVEL``, it is defaulted to ``WARN`` and the
  ``nixl`` logger is lowered to WARNING, also when NIXL was imported earlier.
- **Idle CPU.** ``nixl_agent`` hard-codes ``pthrDelay=0``, so the progress
  thread polls with a zero timeout and spins a core. The agent is built with
  a delay of ``progress_delay_us`` (default 1000) instead: docs/engines.md
  measured 0.03 instead of 1.0 core idle and higher bandwidth on a 2-core box.
- **No transfer timeout.** NIXL waits forever on a stalled peer, so
  :meth:`NixlBackend.write` posts its batch as one request, polls
  ``check_xfer_state`` and, at the deadline, releases the request
  and raises :class:`TransferTimeout`. A dead peer raises ``nixlRemoteDisconnectError``, which becomes
  :class:`TransferError` naming the peer (measured here: on the first write
  after the kill, within 1 ms). Between processes on one host UCX puts by CMA,
  which writes into a *stopped* (SIGSTOP) process without its help, so such
  writes still complete; over TCP (``ucx_engine_config=TLS=tcp``) they stall
  and time out at the deadline, and the peer works again after SIGCONT.
  **Releasing does not cancel puts UCX has queued**: NIXL cancels the UCX
  requests, and UCP cancels only receives. Measured (128 MiB to a stopped
  peer over TCP, 1 s deadline): 127 of 128 MiB landed after the write had
  raised, and ``remove_remote_agent`` does not stop them either (NIXL closes
  the endpoint in flush mode). NIXL offers no forced close, so a timed-out
  write can leave up to its batch in flight; core keeps batches within
  16 MiB and 1024 descriptors for this reason, and over TCP resets the
  connections to the peer after a failed write, which drops what they queue
  (docs/failures.md); the next write reconnects (a failed endpoint, below).
- **The post does the copy.** With CMA, ``transfer()`` copies every byte
  before it returns (1 GiB: 0.2-0.3 s inside the call, state already DONE),
  so a deadline cannot interrupt it. The backend therefore declares
  ``max_bytes_per_batch`` of 64 MiB: core cuts longer descriptors, sends
  each batch as one request and checks the deadline before each, which
  bounds the overrun to one request's copy (about 15-30 ms here; core now keeps
  every batch within 16 MiB and 1024 descriptors for its fence anyway). 64 MiB
  requests measured within noise of one request per write for 1 GiB
  (contiguous 120 vs 112 ms, scattered 64 KiB pages 180 vs 199 ms). The call
  releases the GIL: a thread ticking every 1 ms saw gaps of at most 10-13 ms
  during a 1 GiB write.
- **Polling.** The first 200 us of a request are polled in a tight loop,
  then with sleeps growing to 1 ms. On 2 cores that was no slower than
  spinning (1 GiB contiguous: 213 ms against 297 ms spinning), since the
  spinning thread competes with the progress thread and the receiver.
- **Thread safety.** Core writes to different peers from different threads
  and adds or removes peers from its I/O thread, so the agent is created with
  ``NIXL_THREAD_SYNC_STRICT``.

Two ways to build a request (``xfer_mode`` option), both measured:

- ``descs`` (A, the default): build both descriptor lists from the plan's
  arrays and call ``initialize_xfer``; NIXL validates and prepares them on
  every write;
- ``prepped`` (B): the page tables of every local region (in :meth:`register`)
  and every peer region (in :meth:`add_peer`) are prepared once as strided
  descriptor lists (one ``(addr, stride, dev, stride, count)`` row per region,
  which NIXL keeps compressed: preparing 4 x 263168 pages took 50 us and no
  memory); a write maps its descriptors back to page indices with numpy
  (``searchsorted`` on the region bases, ``np.repeat`` to expand runs) and
  calls ``make_prepped_xfer``. Descriptors that are not whole pages of one
  size on both sides fall back to ``descs``.

Median ms per ``write`` between two processes (decode in a spawned process,
4 regions x 4096 pages, 9 interleaved repetitions after 2 warm-ups, 2-core
machine shared with other work, so +-10 % is noise); desc is the number of
descriptors, and MiB, A and B are given for each page size:

==========================  ======  =====  =====  =====  ======  =====  =====
page size                           1152-byte pages      65536-byte pages
--------------------------  ------  -------------------  --------------------
plan                        desc    MiB    A      B      MiB     A      B
==========================  ======  =====  =====  =====  ======  =====  =====
1 page, scattered           4       0.004  0.028  0.071  0.25    0.071  0.141
16 pages, scattered         64      0.07   0.264  0.376  4       0.41   0.51
256 pages, scattered        1024    1.1    2.18   2.28   64      10.8   10.5
1024 pages, scattered       4096    4.5    9.79   9.90   256     48.7   47.2
4096 pages, permuted        16380   18     41.5   41.5   1024    166    182
16 pages, contiguous        4       0.07   0.051  0.149  4       0.22   0.28
4096 pages, contiguous      4       18     1.89   2.20   1024    124    121
64 runs of 16 pages         256     4.5    0.92   1.01   256     25.7   25.5
==========================  ======  =====  =====  =====  ======  =====  =====

Moving the bytes dominates every plan of more than a few descriptors, and
there the two are within noise. What B saves inside NIXL (for 16384 page
descriptors ``make_prepped_xfer`` took 0.35-0.66 ms against 1.35 ms for
``initialize_xfer``) its numpy mapping spends again (0.1 ms for 1024
descriptors, 0.5-0.9 ms for 16384), and on small plans, the common case of
one chunk or one metadata row, the mapping's fixed cost (about 35 us of
numpy calls) makes B 40-100 us slower. Decision: A is the default and the
only path used unless ``xfer_mode=prepped`` is set; B stays selectable for
hosts whose wire is fast enough for NIXL's per-request work to matter
(RDMA), where it should be re-measured. Either way the page tables are
prepared in :meth:`add_peer`, which also checks early that a peer's
regions are covered by the memory its agent metadata declares.

**A failed endpoint.** NIXL keeps a UCX endpoint that failed (its TCP
connection reset, as core's fence does to a peer whose host stopped
answering: ``plugins/tcpfence.py``) failed, and every later write to that peer
raised ``nixlRemoteDisconnectError``. A write that fails so, or ends in
``ERR``, unloads the peer's agent and loads its metadata again
(:meth:`NixlBackend._reload`), so the next write connects anew.

Options (``config.options``, declared in :mod:`kvbridge.plugins.nixl`):
``progress_delay_us`` (default 1000; 0 restores NIXL's spinning progress
thread), ``ucx_error_handling_mode`` (``peer``, the default, reports a dead
peer as an error; ``none`` lets UCX use shared memory for its messages but
hides peer failures), ``num_workers`` (UCX workers, default 1),
``ucx_engine_config`` (extra UCX settings as ``KEY=VAL,KEY=VAL``, e.g.
``TLS=tcp``) and ``xfer_mode`` (``descs``, the default, or ``prepped``; see
above).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvbridge.core import Backend, BackendConfig, TransferCancelled, TransferError, TransferTimeout, may_post
from kvbridge.core.backend import wait_until
from kvbridge.core.auth import is_loopback
from kvbridge.core.layout import Region
from kvbridge.core.plan import RegionTable, TransferPlan, memory_of
from kvbridge.core.records import BackendCapabilities

from ..tcpfence import TcpFence
from . import CAPABILITIES

if TYPE_CHECKING:
    from nixl_cu12 import nixl_agent, nixl_prepped_dlist_handle, nixl_xfer_handle  # or nixl_cu13: same API

__all__ = ["NixlBackend", "PageTable"]

log = logging.getLogger(__name__)


_agent_lock = threading.Lock()


def _engine_env(host: str) -> bool:
    """Environment NIXL must see before it is first imported; values the user set win.

    Returns whether the user chose NIXL's log level.
    """
    # UCX listens on every interface unless told otherwise; a loopback host keeps it on `lo`.
    if "UCX_NET_DEVICES" not in os.environ:
        if is_loopback(host):
            os.environ["UCX_NET_DEVICES"] = "lo"
        else:
            log.warning("nixl: UCX_NET_DEVICES is not set, so UCX listens on every interface, not only %s's; "
                        "set it to that interface (docs/security.md)", host)
    # Without this every process that created an agent exits with SIGSEGV (see module docstring).
    os.environ.setdefault("UCX_MODULES", "^ib")
    # NIXL's Python logger writes INFO lines to stdout, which belongs to the host.
    user_level = "NIXL_LOG_LEVEL" in os.environ
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    return user_level


def _quiet_nixl_logger() -> None:
    """Lower NIXL's Python logger to WARNING even if something imported NIXL before us."""
    logging.getLogger("nixl").setLevel(logging.WARNING)


def engine_module() -> str:
    """``nixl_cu12`` or ``nixl_cu13``: the wheel matching torch's CUDA major, else whichever is installed."""
    names = [n for n in ("nixl_cu12", "nixl_cu13") if importlib.util.find_spec(n) is not None]
    try:
        import torch

        cuda = torch.version.cuda or ""
    except ImportError:
        cuda = ""
    wanted = f"nixl_cu{cuda.split('.')[0]}" if cuda else ""
    return wanted if wanted in names else (names[0] if names else "nixl_cu12")


def _nixl_errors() -> tuple[type[BaseException], ...]:
    """NIXL's exception classes (they share no base class beyond ``Exception``)."""
    bindings = importlib.import_module(f"{engine_module()}._bindings")
    return tuple(
        v for k, v in vars(bindings).items()
        if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type) and issubclass(v, BaseException)
    )


def _make_agent(name: str, progress_delay_us: int, backend_params: dict[str, str]) -> nixl_agent:
    """An agent with one UCX backend whose progress thread waits ``progress_delay_us`` per poll.

    ``nixl_agent.__init__`` sets ``pthrDelay = 0`` on the binding config and
    offers no argument for it, so for the duration of this one constructor
    call the binding's ``nixlAgent`` is wrapped to override the delay, then
    restored. The lock keeps concurrent constructions in kvbridge apart.
    """
    engine = importlib.import_module(engine_module())
    nixl_agent, nixl_agent_config, nixl_thread_sync_t = engine.nixl_agent, engine.nixl_agent_config, engine.nixl_thread_sync_t

    bindings = sys.modules[nixl_agent.__module__].nixlBind
    config = nixl_agent_config(backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _agent_lock:
        original = bindings.nixlAgent

        def with_delay(agent_name: str, cfg: Any) -> Any:
            cfg.pthrDelay = progress_delay_us
            return original(agent_name, cfg)

        bindings.nixlAgent = with_delay
        try:
            agent = nixl_agent(name, config)
        finally:
            bindings.nixlAgent = original
    agent.create_backend("UCX", backend_params)
    return agent


@dataclass(frozen=True)
class PageTable:
    """The regions of one side as a prepared list of pages, and how to index it.

    Page ``p`` of the region at ``base[r]`` (sorted by address) is entry
    ``offset[r] + p`` of the prepared list ``handle``.
    """

    handle: nixl_prepped_dlist_handle
    base: npt.NDArray[np.int64]
    stride: npt.NDArray[np.int64]
    count: npt.NDArray[np.int64]
    offset: npt.NDArray[np.int64]

    @classmethod
    def rows(cls, regions: Sequence[Region]) -> tuple[npt.NDArray[np.uint64], dict[str, npt.NDArray[np.int64]]]:
        """Strided prep rows ``(addr, stride, dev, stride, count)`` and the index arrays, sorted by address."""
        ordered = sorted(regions, key=lambda r: r.addr)
        base = np.array([r.addr for r in ordered], np.int64)
        stride = np.array([r.stride for r in ordered], np.int64)
        count = np.array([r.nbytes // r.stride for r in ordered], np.int64)
        offset = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
        device = np.array([r.device for r in ordered], np.int64)  # as registered: GPU memory on cuda:1 is device 1
        rows = np.stack([base, stride, device, stride, count], axis=1).astype(np.uint64)
        return rows, {"base": base, "stride": stride, "count": count, "offset": offset}

    def locate(self, addr: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
    ] | None:
        """Each descriptor's first list entry, page count and page size; None unless all are whole pages."""
        pos = np.searchsorted(self.base, addr, side="right") - 1
        if pos.size and pos.min() < 0:
            return None
        if self.stride.size == 1 or (self.stride == self.stride[0]).all():
            stride: Any = int(self.stride[0])  # scalar arithmetic is much cheaper than per-element
        else:
            stride = self.stride[pos]
        page, rem = np.divmod(addr - self.base[pos], stride)
        pages, rem_n = np.divmod(nbytes, stride)
        if rem.any() or rem_n.any() or (page + pages > self.count[pos]).any():
            return None
        return self.offset[pos] + page, pages, np.broadcast_to(stride, pos.shape)


def _expand(first: npt.NDArray[np.int64], pages: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
    """Entry indices ``first[i] .. first[i] + pages[i] - 1`` for every descriptor, concatenated."""
    if (pages == 1).all():
        return first.astype(np.int32)
    ends = np.cumsum(pages)
    return (np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(first - (ends - pages), pages)).astype(np.int32)


def _mem(vram: bool) -> str:
    return "VRAM" if vram else "DRAM"


_Side = tuple[bool, int]  # (GPU memory?, device) of every descriptor of a side


@dataclass
class _Peer:
    name: str  # kvbridge's peer id
    agent: str  # the NIXL agent name add_remote_agent returned
    table: PageTable | None  # None when the peer registered no regions, or they mix memory kinds
    regions: RegionTable  # its regions, to place a batch core did not post (memory_of)
    metadata: bytes  # its agent metadata, to load again after its endpoint failed (_reload)
    region_list: list[Region]  # its regions as add_peer got them, for the page table _reload prepares again
    writes: int = 0  # writes in progress (guarded by the backend's lock)
    retired: bool = False  # removed while a write was in progress; released by the last write
    forget_agent: bool = True  # whether retiring also unloads the remote agent


class NixlBackend(Backend):
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
        user_log_level = _engine_env(config.host)
        self._errors = _nixl_errors()  # the first import of NIXL
        if not user_log_level:
            _quiet_nixl_logger()
        # Agent names must be unique among the agents that meet; core's name is
        # per role, rank and process, and two managers of one role may share a process.
        self.agent_name = f"{config.name or 'kvbridge'}-{uuid.uuid4().hex[:8]}"
        try:
            self._agent: nixl_agent | None = _make_agent(self.agent_name, self.progress_delay_us, params)
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
        handle = agent.prep_xfer_dlist(agent_name, rows, _mem(regions[0].mem == "vram"))
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
                    self._reg_descs.append(agent.register_memory(rows, _mem(vram)))
            self._local = self._prep("NIXL_INIT_AGENT", regions)
        except self._errors as exc:
            names = ", ".join(f"{r.name!r} ({r.nbytes} B at {r.addr:#x})" for r in regions)
            raise TransferError(f"nixl: registering regions {names} failed: {exc!r}") from exc
        self._registered = list(regions)

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info and registered memory keys), with where UCX listens."""
        return self._tcp.seal(bytes(self._live_agent().get_agent_metadata()))

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """Load ``peer``'s agent metadata and prepare the page table of its regions."""
        metadata = self._tcp.open(peer, metadata)
        with self._agents:
            self._add_peer(peer, metadata, regions)

    def _add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        agent = self._live_agent()
        try:
            loaded = agent.add_remote_agent(bytes(metadata))
        except self._errors as exc:
            raise TransferError(
                f"nixl: peer {peer!r} sent {len(metadata)} bytes of metadata that NIXL could not load "
                f"({exc!r}); expected get_agent_metadata() of another nixl backend"
            ) from exc
        # NIXL returns the name as bytes (b"decode-..."); it accepts str everywhere.
        agent_name = loaded.decode(errors="replace") if isinstance(loaded, bytes) else str(loaded)
        try:
            table = self._prep(agent_name, regions)
        except self._errors as exc:
            with self._lock:
                in_use = any(p.agent == agent_name for p in self._peers.values())
            if not in_use:
                self._quietly(lambda: agent.remove_remote_agent(agent_name), f"unloading the agent of peer {peer!r}")
            raise TransferError(
                f"nixl: peer {peer!r} (agent {agent_name!r}) described {len(regions)} regions that its "
                f"agent metadata does not cover ({exc!r}); it must register them before sending metadata"
            ) from exc
        with self._lock:
            old = self._peers.pop(peer, None)
            table_of_regions = RegionTable(regions)
            self._peers[peer] = _Peer(peer, agent_name, table, table_of_regions, bytes(metadata), list(regions))
        if old is not None:
            self._retire(old, forget_agent=old.agent != agent_name)

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` and disconnect from its agent. Unknown peers are ignored."""
        self._tcp.forget(peer)
        with self._lock:
            old = self._peers.pop(peer, None)
        if old is not None:
            self._retire(old, forget_agent=True)

    def abort_peer(self, peer: str, stuck: bool = False) -> int:
        return self._tcp.abort_peer(peer, stuck)

    def _retire(self, peer: _Peer, forget_agent: bool) -> None:
        """Release what ``peer`` holds now, or after the writes to it in progress."""
        with self._agents:
            with self._lock:
                peer.forget_agent = forget_agent
                if peer.writes:
                    peer.retired = True  # the last write in progress releases it
                    return
                # Another peer id may use the same agent (a re-handshake under a new id).
                forget_agent = forget_agent and not any(p.agent == peer.agent for p in self._peers.values())
            if peer.table is not None:
                self._quietly(peer.table.handle.release, f"releasing the page table of peer {peer.name!r}")
            if forget_agent and self._agent is not None:
                self._quietly(lambda: self._agent.remove_remote_agent(peer.agent),
                              f"removing the agent of peer {peer.name!r}")

    def _reload(self, p: _Peer) -> None:
        """Unload ``p``'s agent and load its metadata again, so that the next write connects anew: NIXL
        keeps a UCX endpoint that failed failed (the peer's connection was reset, by core's TCP fence
        among others) and every later write to it would fail too. Runs on the writing thread.

        Not for a peer that was retired or replaced meanwhile (a re-handshake loaded its agent afresh),
        nor while another peer id uses the same agent (its page table was prepared against that load)."""
        with self._agents:
            with self._lock:
                current = self._peers.get(p.name) is p and not p.retired
                shared = any(o is not p and o.agent == p.agent for o in self._peers.values())
            if not current or shared:
                log.info("nixl: not reloading the agent of peer %r: %s", p.name,
                         "another peer id uses it" if current else "the peer was replaced or removed")
                return
            agent = self._live_agent()
            if p.table is not None:
                self._quietly(p.table.handle.release, f"releasing the page table of peer {p.name!r}")
                p.table = None
            self._quietly(lambda: agent.remove_remote_agent(p.agent), f"unloading the agent of peer {p.name!r}")
            try:
                agent.add_remote_agent(p.metadata)
                p.table = self._prep(p.agent, p.region_list)
            except self._errors as exc:
                log.warning("nixl: loading the agent of peer %r again failed: %r; its writes will fail", p.name, exc)
                return
        log.info("nixl: loaded the agent of peer %r again after its endpoint failed; the next write reconnects", p.name)

    def _quietly(self, call: Any, what: str) -> None:
        try:
            call()
        except self._errors as exc:  # nothing better to do while tearing down
            log.warning("nixl: %s failed: %r", what, exc)

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

    def _page_indices(self, p: _Peer, plan: TransferPlan) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None:
        """Local and remote page-table indices of the plan, or None if a descriptor is not whole pages."""
        if self._local is None or p.table is None:
            return None
        src = self._local.locate(plan.src_addr, plan.nbytes)
        dst = p.table.locate(plan.dst_addr, plan.nbytes)
        if src is None or dst is None or not np.array_equal(src[2], dst[2]):
            return None
        if int(src[1].sum()) >= 2**31:  # make_prepped_xfer takes int32 indices
            return None
        return _expand(src[0], src[1]), _expand(dst[0], dst[1])

    def _request(self, p: _Peer, plan: TransferPlan, src: _Side, dst: _Side) -> nixl_xfer_handle:
        agent = self._live_agent()
        if self.xfer_mode == "prepped":
            indices = self._page_indices(p, plan)
            if indices is not None:
                assert self._local is not None and p.table is not None
                return agent.make_prepped_xfer("WRITE", self._local.handle, indices[0], p.table.handle, indices[1])
        n = len(plan)
        local, remote = np.zeros((n, 3), np.uint64), np.zeros((n, 3), np.uint64)
        local[:, 0], remote[:, 0] = plan.src_addr, plan.dst_addr
        local[:, 1] = remote[:, 1] = plan.nbytes
        local[:, 2], remote[:, 2] = src[1], dst[1]
        return agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, _mem(src[0])), agent.get_xfer_descs(remote, _mem(dst[0])), p.agent
        )

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        """Post ``batch`` to ``peer`` as one WRITE request and poll it until DONE, ERR or ``deadline``.

        The post itself may overrun the deadline by the time its CMA copy takes.
        """
        self._live_agent()
        p = self._begin(peer)
        try:
            # Core posts each batch with one memory kind and device a side (TransferPlan.memory): a NIXL
            # descriptor list holds one kind. A batch from elsewhere (a direct call) is placed here.
            m = batch.memory or memory_of(batch, self._local_regions, p.regions)
            self._post(p, batch, (m.src_kind == "vram", m.src_device), (m.dst_kind == "vram", m.dst_device), deadline)
        finally:
            self._end(p)

    def _post(self, p: _Peer, batch: TransferPlan, src: _Side, dst: _Side, deadline: float) -> None:
        """One WRITE request: create, post, poll until DONE, ERR or ``deadline``, release."""
        agent = self._live_agent()
        peer = p.name
        t0 = time.monotonic()
        handle = None
        try:
            handle = self._request(p, batch, src, dst)
            if not may_post():  # checked after preparing, right before the post that copies
                self._release(handle)
                raise TransferCancelled(f"nixl: write to peer {peer!r} ({_what(batch)}) not posted: its room is no longer live")
            state = self._wait(agent, handle, agent.transfer(handle), deadline)
        except self._errors as exc:
            if handle is not None:
                self._release(handle)
            if type(exc).__name__ == "nixlRemoteDisconnectError":
                self._reload(p)
            raise TransferError(
                f"nixl: write to peer {peer!r} (agent {p.agent}; {_what(batch)}) failed: {type(exc).__name__}: {exc}. "
                + _hint(type(exc).__name__)
            ) from exc
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
        return {
            "agent": self.agent_name,
            "progress_delay_us": self.progress_delay_us,
            "ucx_error_handling_mode": self.error_mode,
            "xfer_mode": self.xfer_mode,
            "peers": {k: v.agent for k, v in self._peers.items()},
            "registered_regions": len(self._registered),
        }


def _what(batch: TransferPlan) -> str:
    return f"{len(batch)} descriptors, {batch.total_bytes} B"


def _hint(error: str) -> str:
    if error == "nixlRemoteDisconnectError":
        return "The peer's process died or closed its agent."
    if error == "nixlNotFoundError":
        return "A descriptor lies outside the memory either side registered."
    return "Bytes may have partly landed."
