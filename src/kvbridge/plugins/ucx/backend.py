"""UCX adapter on UCXX: prefill pushes pages with one-sided UCP puts into decode memory.

Why one-sided RMA through ctypes (UCXX's Python API has only two-sided messages), and what it
measured against the alternatives: :mod:`._ucp`. The ``error_handling`` and ``UCX_*`` options:
:mod:`kvbridge.plugins.ucx`.

**Timeouts.** UCX never notices a frozen (SIGSTOPped) peer. Over CMA the puts
still land in the stopped process, so the write succeeds (the bytes are
there). Over TCP, flush waits for the peer; :meth:`UcxBackend.write` stops at
``deadline`` and raises :class:`TransferTimeout`. A write that fails or times
out with puts still queued force-closes the peer's endpoint, which drops them,
and connects a new one for the next write, so nothing of the batch is left in
UCX when ``write`` returns; what the kernel already took into the TCP socket's
buffers core drops next, by resetting the connections to the peer
(``plugins/tcpfence.py``); a stopped peer may still read what its own receive
buffers hold when it resumes.

**Progress.** UCXX's progress thread runs in blocking (epoll) mode (an idle backend costs no CPU) but
picks up puts posted from another thread late (a 256 MiB write took 20 s), so the writing thread
progresses the worker itself while it waits for the flush after a batch's puts (core's
``wait_until``). Puts queue until then: ``max_descriptors_per_batch`` of 4096 bounds that queue.
The worker is thread-safe; ctypes drops the GIL for every UCP call.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from ctypes import byref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import numpy as np

from kvbridge.core import Backend, BackendConfig, TransferCancelled, TransferError, TransferTimeout, may_post
from kvbridge.core.control.auth import is_loopback
from kvbridge.core.transfer.backend import wait_until
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.description.records import BackendCapabilities

from ..tcpfence import TcpFence
from . import CAPABILITIES

__all__ = ["UcxBackend"]

log = logging.getLogger(__name__)



class _Meta(msgspec.Struct, frozen=True, array_like=True, tag="kvbridge-ucx-rma/1"):
    """What a peer needs to write into this backend's memory."""

    worker_address: bytes
    regions: list[tuple[int, int, bytes]]  # (address, bytes, packed rkey)


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Meta).decode


@dataclass(eq=False)
class _Peer:
    name: str
    meta: _Meta | None = None  # what the peer sent, kept to reconnect after a failed write
    endpoint: Any = None  # ucxx UCXEndpoint
    starts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    rkeys: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by the one write in progress
    removed: bool = False
    dirty: bool = False  # a write ended with puts possibly still queued


class UcxBackend(Backend):
    """Writes batches into peers with UCP puts through one UCXX worker (options: see the module docstring)."""

    capabilities: ClassVar[BackendCapabilities] = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._tcp = TcpFence(config.host, "ucx")  # before the worker listens
        self.error_handling = config.options["error_handling"] == "on"
        ucx_config = {key[4:]: value for key, value in config.options.items() if key.startswith("UCX_")}
        if "CMA_MEMORY_INVALIDATE" not in ucx_config and "UCX_CMA_MEMORY_INVALIDATE" not in os.environ:
            ucx_config["CMA_MEMORY_INVALIDATE"] = "y"  # lets peer-failure mode put over CMA
        if "NET_DEVICES" not in ucx_config and "UCX_NET_DEVICES" not in os.environ and is_loopback(config.host):
            ucx_config["NET_DEVICES"] = "lo"
        if not self.error_handling:
            log.warning("ucx: endpoint error handling is off; a put to a dead peer aborts this process")

        # Imported only now: selecting another backend never loads UCX. UCXX's own settings go to this
        # context, not the environment (_ucp._import_ucxx), where a variable you set still wins.
        from . import _ucp

        ucx = _ucp.ucxx
        ucx_config = {**{k: v for k, v in _ucp.UCXX_SETTINGS.items() if f"UCX_{k}" not in os.environ}, **ucx_config}
        # Where something imported UCXX before kvbridge, its UCX_MEMTYPE_CACHE is in the environment and UCX
        # prints an "unused environment variable" warning to stdout, corrupting a host's stdout protocol.
        if "UCX_WARN_UNUSED_ENV_VARS" not in os.environ:
            ucx_config.setdefault("WARN_UNUSED_ENV_VARS", "n")
        self._ucx, self._ucp = ucx, _ucp
        self._lock = threading.Lock()  # guards _peers and _closed
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._memh: list[tuple[Region, int, bytes]] = []
        self._context = ucx.UCXContext(config_dict=ucx_config, feature_flags=(ucx.Feature.RMA, ucx.Feature.WAKEUP))
        self._worker = ucx.UCXWorker(self._context)
        mode = _ucp.worker_thread_mode(self._worker.handle)
        if mode != _ucp.UCS_THREAD_MODE_MULTI:
            raise TransferError(
                f"ucx: UCXX created its worker in UCS thread mode {mode}; this backend calls UCP from "
                f"several threads and needs UCS_THREAD_MODE_MULTI ({_ucp.UCS_THREAD_MODE_MULTI})"
            )
        self._worker.start_progress_thread(polling_mode=False)
        _LIVE.add(self)
        self._address = self._worker.address.tobytes()
        self._flush_param = _ucp.RequestParam()  # no fields: UCP returns a request to poll
        self._put_param = _ucp.RequestParam()
        log.debug("ucx backend up: error handling %s, context config %s", self.error_handling, ucx_config)

    # -- memory ---------------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> None:
        """``ucp_mem_map`` each region and pack its remote key; raise naming the first that fails."""
        self._check_open()
        for r in regions:
            try:
                memh = self._ucp.mem_map(self._context.handle, r.addr, r.nbytes)
            except self._ucp.UcpError as exc:
                raise TransferError(f"ucx: cannot register region {r.name!r} ({r.nbytes} B at {r.addr:#x}): {exc}") from exc
            try:
                rkey = self._ucp.rkey_pack(self._context.handle, memh)
            except self._ucp.UcpError as exc:
                self._ucp.lib.ucp_mem_unmap(self._context.handle, memh)
                raise TransferError(f"ucx: cannot pack the remote key of region {r.name!r}: {exc}") from exc
            self._memh.append((r, memh, rkey))

    def metadata(self) -> bytes:
        """Worker address plus every registered region's address, size and packed remote key."""
        return self._tcp.seal(_encode(_Meta(self._address, [(r.addr, r.nbytes, rkey) for r, _, rkey in self._memh])))

    # -- peers ----------------------------------------------------------------------------
    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """Connect an endpoint to ``peer`` and unpack its remote keys.

        Metadata that is not a UCX backend's raises :class:`TransferError`; core
        then rejects that peer's handshake with the reason (other peers are
        unaffected).
        """
        self._check_open()
        metadata = self._tcp.open(peer, metadata)
        try:
            meta = _decode(metadata)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransferError(f"ucx: peer {peer!r} sent metadata ({len(metadata)} B) that is not a ucx backend's: {exc}") from None
        covered = [(a, a + n) for a, n, _ in meta.regions]
        for r in regions:
            if not any(lo <= r.addr and r.end <= hi for lo, hi in covered):
                raise TransferError(
                    f"ucx: peer {peer!r} describes region {r.name!r} ({r.nbytes} B at {r.addr:#x}) "
                    "but registered no UCX memory covering it"
                )
        p = _Peer(peer, meta)
        self._connect(p)
        self._install(p)

    def _connect(self, p: _Peer) -> None:
        """Give ``p`` a new endpoint to its worker address and unpack its remote keys on it."""
        assert p.meta is not None
        meta, ucx = p.meta, self._ucx
        try:
            address = ucx.UCXAddress.create_from_buffer(meta.worker_address)
            p.endpoint = ucx.UCXEndpoint.create_from_worker_address(self._worker, address, self.error_handling)
        except Exception as exc:
            raise TransferError(f"ucx: cannot create an endpoint to peer {p.name!r}: {exc}") from exc
        p.dirty = False
        order = sorted(range(len(meta.regions)), key=lambda i: meta.regions[i][0])
        rkeys = []
        try:
            for i in order:
                rkeys.append(self._ucp.rkey_unpack(p.endpoint.handle, meta.regions[i][2]))
        except self._ucp.UcpError as exc:
            p.rkeys = np.array(rkeys, np.uint64)
            self._teardown(p)
            raise TransferError(f"ucx: cannot unpack remote key {len(rkeys)} of peer {p.name!r}: {exc}") from exc
        p.starts = np.array([meta.regions[i][0] for i in order], np.int64)
        p.rkeys = np.array(rkeys, np.uint64)

    def _install(self, p: _Peer) -> None:
        with self._lock:
            old = self._peers.get(p.name)
            self._peers[p.name] = p
        if old is not None:
            self._retire(old)

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` and close its endpoint (after the write in progress, if any)."""
        self._tcp.forget(peer)
        with self._lock:
            p = self._peers.pop(peer, None)
        if p is not None:
            self._retire(p)

    def abort_peer(self, peer: str, stuck: bool = False) -> int:
        return self._tcp.abort_peer(peer, stuck)

    def _retire(self, p: _Peer) -> None:
        # Core calls remove_peer from its I/O thread while the peer's worker may be
        # inside write(): never wait for it; the write tears the peer down on exit.
        if p.lock.acquire(blocking=False):
            try:
                self._teardown(p)
            finally:
                p.lock.release()
        else:
            p.removed = True

    def _teardown(self, p: _Peer) -> None:
        ep, p.endpoint = p.endpoint, None
        rkeys, p.rkeys = p.rkeys.tolist(), np.empty(0, np.uint64)
        destroy = self._ucp.lib.ucp_rkey_destroy
        if ep is None:
            return
        if not p.dirty:  # UCP's order: keys first, once nothing uses them, then the endpoint
            for k in rkeys:
                destroy(k)
        try:
            # Error handling on: force close, which also drops queued puts. Off: UCXX
            # flushes first; bound that wait (10 ms) since the peer may be gone.
            ep.close_blocking(10_000_000, 1)
        except Exception as exc:  # nothing else to do at teardown
            log.warning("ucx: closing the endpoint to %r failed: %s", p.name, exc)
        if p.dirty:
            # Puts may have been queued with these keys; the forced close dropped
            # them. ucp_rkey_destroy only releases the key's own memory (UCX 1.21).
            for k in rkeys:
                destroy(k)

    # -- writes ---------------------------------------------------------------------------
    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        """Put every descriptor of ``batch`` into ``peer``, then flush; raise by ``deadline``."""
        self._check_open()
        with self._lock:
            p = self._peers.get(peer)
            known = ", ".join(sorted(self._peers)) or "none"
        if p is None:
            raise TransferError(f"ucx: unknown peer {peer!r} (known peers: {known}); call add_peer first")
        with p.lock:
            try:
                if p.removed or p.endpoint is None:
                    raise TransferError(f"ucx: peer {peer!r} was removed")
                self._write(p, batch, deadline)
            except TransferError:
                if p.dirty and not (p.removed or self._closed):
                    self._drop_queued(p)
                raise
            finally:
                if p.removed or self._closed:
                    self._teardown(p)

    def _drop_queued(self, p: _Peer) -> None:
        """A write failed or timed out with puts possibly still queued: force-close the endpoint, which
        drops them (core's contract: nothing of the batch left in the engine once ``write`` returns),
        and connect a new one for the peer's next write. Bytes the kernel already took into a TCP
        socket's buffers are past UCX's reach: core resets the connections next (docs/failures.md)."""
        self._teardown(p)
        try:
            self._connect(p)
        except TransferError as exc:
            log.warning("ucx: reconnecting to peer %r after a failed write: %s; later writes to it fail", p.name, exc)
            p.removed = True

    def _write(self, p: _Peer, batch: TransferPlan, deadline: float) -> None:
        n = len(batch)
        self._check_alive(p, "before the write")
        # The remote key of each descriptor's destination region (core checked that one contains it).
        rkeys = p.rkeys[np.searchsorted(p.starts, batch.dst_addr, side="right") - 1]
        ucp = self._ucp
        put, free, err_min = ucp.lib.ucp_put_nbx, ucp.lib.ucp_request_free, ucp.ERR_PTR_MIN
        handle, param = p.endpoint.handle, byref(self._put_param)
        t0 = time.monotonic()
        if not may_post():
            raise TransferCancelled(f"ucx: write to peer {p.name!r} not posted: its room is no longer live")
        p.dirty = True
        for i, s, d, k, r in zip(range(n), batch.src_addr.tolist(), batch.dst_addr.tolist(), batch.nbytes.tolist(),
                                 rkeys.tolist()):
            req = put(handle, s, k, d, r, param)
            if req:
                if req >= err_min:
                    raise TransferError(
                        f"ucx: put to peer {p.name!r} failed: {ucp.status_string(req - (1 << 64))}; "
                        f"{i} of {n} descriptors were posted before it and may have landed"
                    )
                free(req)  # UCP completes it on its own; the flush below reports failures
        self._flush(p, deadline, n, batch.total_bytes)
        p.dirty = False
        log.debug("ucx: wrote %d descriptors, %d B to %r in %.3f s", n, batch.total_bytes, p.name, time.monotonic() - t0)

    def _flush(self, p: _Peer, deadline: float, n: int, nbytes: int) -> None:
        ucp = self._ucp
        req = ucp.lib.ucp_ep_flush_nbx(p.endpoint.handle, byref(self._flush_param))
        status = ucp.ptr_status(req)
        if status == ucp.UCS_INPROGRESS:
            check, advance, worker = ucp.lib.ucp_request_check_status, ucp.lib.ucp_worker_progress, self._worker.handle

            def done() -> bool:
                nonlocal status
                status = check(req)
                return status != ucp.UCS_INPROGRESS

            def progress() -> bool:
                if self._closed:
                    raise TransferError(f"ucx: backend closed during a write to peer {p.name!r}")
                return bool(advance(worker))

            try:
                if not wait_until(done, deadline, progress):
                    raise TransferTimeout(
                        f"ucx: write to peer {p.name!r} ({n} descriptors, {nbytes} B) did not complete by "
                        "its deadline; UCX reports no error (a stopped or overloaded peer), and the "
                        "queued puts may still land"
                    )
            finally:
                ucp.lib.ucp_request_free(req)
        if status != ucp.UCS_OK:
            raise TransferError(
                f"ucx: write to peer {p.name!r} failed: {ucp.status_string(status)} ({n} descriptors, "
                f"{nbytes} B; some may have landed){self._endpoint_state(p)}"
            )

    def _check_alive(self, p: _Peer, when: str) -> None:
        if not p.endpoint.alive:
            raise TransferError(f"ucx: peer {p.name!r} is unreachable {when}{self._endpoint_state(p)}")

    @staticmethod
    def _endpoint_state(p: _Peer) -> str:
        try:
            p.endpoint.raise_on_error()
        except Exception as exc:  # the endpoint's own status, e.g. connection reset
            return f"; endpoint error: {exc}"
        return ""

    # -- lifecycle ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("ucx backend is closed")

    def close(self) -> None:
        """Close endpoints, unmap memory, stop the progress thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        stuck = []
        for p in peers:
            # A write in progress notices _closed while it waits for its flush.
            if p.lock.acquire(timeout=5.0):
                try:
                    self._teardown(p)
                finally:
                    p.lock.release()
            else:
                stuck.append(p.name)
        _LIVE.discard(self)
        if stuck:
            # Destroying the worker under a running write would be a use-after-free.
            log.warning("ucx: writes to %s did not stop within 5 s of close; leaking the UCX worker", stuck)
            return
        for r, memh, _ in self._memh:
            status = self._ucp.lib.ucp_mem_unmap(self._context.handle, memh)
            if status != self._ucp.UCS_OK:
                log.warning("ucx: ucp_mem_unmap of region %r: %s", r.name, self._ucp.status_string(status))
        self._memh.clear()
        self._worker.stop_progress_thread()
        self._worker = None
        self._context = None

    def describe(self) -> dict[str, Any]:
        return {
            "error_handling": "on" if self.error_handling else "off",
            "worker_address_bytes": len(self._address),
            "registered_regions": len(self._memh),
            "peers": sorted(self._peers),
        }


#: Backends not closed yet. UCXX warns and UCX complains about in-use memory when
#: a worker is destroyed with its progress thread running at interpreter exit.
_LIVE: weakref.WeakSet[UcxBackend] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for backend in list(_LIVE):
        backend.close()

