"""The ``cuda_ipc`` backend: writes a plan into a same-host peer's GPU memory with one kernel.

``register`` takes this rank's GPU regions on one device (the lowest-numbered
among them: the kernel launches there; regions on other devices are left to
the lanes after this one). ``metadata`` is the IPC handles of the
allocations behind them (:mod:`.ipc`); ``add_peer`` maps a peer's and refuses
a peer whose GPU regions it cannot all reach (another host, memory without
legacy IPC, no CUDA here), so that core gives that peer's pairs to the next
lane. ``warm`` compiles the kernels of core's plans shaped like the peer's
requests before its handshake is answered, as ``register`` compiles those of
plans between its own regions, so that no request waits for a compile.
``write`` copies the whole plan unexpanded (:mod:`.kernel`), checking
core's fence between slices, and returns once every byte has landed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.core import Backend, BackendConfig, Region, TransferError, TransferPlan, checkpoint

from . import CAPABILITIES, ipc, kernel, split

__all__ = ["CudaIpcBackend"]

log = logging.getLogger(__name__)
#: Longest a registration or a handshake waits for its kernels to compile (a cold Triton cache on an H200 took
#: 5.3 s for the 23 kernels of a registration); copies needing one still compiling wait for it past that.
WARM_WAIT_S = 120.0


class CudaIpcBackend(Backend):
    """Same-host GPU -> GPU copies through CUDA IPC and a Triton kernel (see the module docstring)."""

    capabilities = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._regions: list[Region] = []
        self._device = -1
        self._peers: dict[str, ipc.GpuPeer] = {}
        self._metadata = b""
        self._warming: list[threading.Thread] = []
        self._closed = False

    def select(self, regions: Sequence[Region]) -> Sequence[Region]:
        if not regions or not ipc.available():
            return []
        device = min(r.device for r in regions)
        return [r for r in regions if r.device == device]

    def register(self, regions: Sequence[Region]) -> None:
        self._regions = list(regions)
        self._device = min((r.device for r in regions), default=-1)
        self._metadata = ipc.local_metadata(self._regions) if self._regions else b""
        if self._metadata:  # compile ahead, guessing that peers share as many allocations as this rank
            # and waiting: compiling beside the first copies slowed them 100-300 ms on an H200 (the compile
            # holds the interpreter), so registration (server start) pays it instead, once per Triton cache.
            self._warm("registration", warm_shapes(self._regions, self._regions),
                       split.search_steps(ipc.allocation_count(self._metadata))).join(WARM_WAIT_S)

    def metadata(self) -> bytes:
        return self._metadata

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        if self._closed:
            raise TransferError("cuda_ipc backend is closed")
        self._peers.pop(peer, None)
        if not self._regions:
            raise TransferError("this rank has no GPU regions the copy kernel can read")
        try:
            mapped = ipc.open_peer(metadata, self._device)
        except Exception as exc:
            raise TransferError(f"cannot map peer {peer!r}'s GPU memory: {exc}") from exc
        if mapped is None:
            raise TransferError(f"peer {peer!r} sent no CUDA IPC handles this process can open")
        if not mapped.covers(regions):
            raise TransferError(f"peer {peer!r}'s GPU regions are not all inside the allocations it shared")
        self._peers[peer] = mapped

    def warm(self, peer: str, batches: Sequence[TransferPlan]) -> None:
        """Compile the kernels that copies of ``batches`` to ``peer`` launch (core's plans shaped like the
        peer's requests, at the handshake), and return once they are loaded (at most :data:`WARM_WAIT_S`)."""
        mapped = self._peers.get(peer)
        if mapped is not None and batches:
            mapped.on_device(self._device)  # the peer's translation table copied to the GPU now, not in a copy
            shapes = list(split.plan_shapes(batches).values())
            self._warm(f"peer {peer!r}", shapes, split.search_steps(len(mapped.starts))).join(WARM_WAIT_S)

    def _warm(self, what: str, shapes: Sequence[tuple[split.Shape, int]], steps: int) -> threading.Thread:
        """Compile, beside the caller, the kernels of ``shapes`` (each with its sizes mode), so that requests do
        not pay for compiling (a fraction of a second each, and Triton's import before the first). A copy that
        needs one still being compiled waits for it; close() waits for these threads. Returns the thread."""
        def run() -> None:
            try:
                n = kernel.warm(self._device, shapes, steps)
                log.debug("cuda_ipc: compiled %d copy kernels ahead (%s)", n, what)
            except Exception as exc:  # a copy compiles what it needs anyway
                log.warning("cuda_ipc: could not compile the copy kernels ahead (%s): %r", what, exc)

        # Not a daemon: a compile cut off at interpreter exit aborts the process.
        thread = threading.Thread(target=run, name="kvbridge-cuda-ipc-warm")
        self._warming = [t for t in self._warming if t.is_alive()] + [thread]
        thread.start()
        return thread

    def remove_peer(self, peer: str) -> None:
        # Mappings stay open until the process ends: a write in flight may still use them, and CUDA
        # opens a handle once per device in a process anyway (ipc keeps them).
        self._peers.pop(peer, None)

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        mapped = self._peers.get(peer)
        if mapped is None:
            raise TransferError(f"cuda_ipc: write to unknown peer {peer!r}")
        try:  # the plan as the planner left it: rows x columns, unexpanded
            kernel.copy(self._device, batch.factors(in_units=True), mapped, lambda: checkpoint("between GPU copy slices"),
                        batch.hints(), batch.units())
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"cuda_ipc: GPU copy to peer {peer!r} failed: {exc}") from exc

    def close(self) -> None:
        self._closed = True
        self._peers.clear()
        for thread in self._warming:
            thread.join(60)

    def describe(self) -> dict[str, Any]:
        return {"cuda_ipc_device": self._device, "cuda_ipc_peers": sorted(self._peers)}


def warm_shapes(local: Sequence[Region], peer: Sequence[Region]) -> list[tuple[split.Shape, int]]:
    """The launch shapes (and sizes modes) of the plans most requests between these regions make: per item
    size (a region's stride), runs of pages of every length up to where the shape stops changing (two
    programs' bytes), of one length or of several. One per compiled kernel. Head-sliced pairs
    (heterogeneous TP) are not guessed."""
    remote = [r for r in peer if r.mem == "vram"]
    if not local or not remote:
        return []
    src_rows = np.array([r.addr for r in local], np.int64)
    dst_rows = np.resize(np.array([r.addr for r in remote], np.int64), len(src_rows))
    out: dict[tuple[Any, ...], tuple[split.Shape, int]] = {}
    zero = np.zeros(2, np.int64)
    for item in sorted({r.stride for r in local if r.stride > 0}):
        # runs of k pages: all of one length (one size), or of several (sizes per column, the longest
        # setting the piece); past two programs' bytes the shape no longer changes with k
        # (and the first k whose runs are whole programs: loads and stores then go unmasked)
        whole = max(1, split.TILE_BYTES // (item & -item))
        for k in sorted({*range(1, max(2, 2 * split.TILE_BYTES // item) + 1), whole, 2 * whole}):
            for part, hint, sizes in (((src_rows, dst_rows, zero[:1], zero[:1], np.array([k * item], np.int64)),
                                       (item & -item, k * item), 0),
                                      ((src_rows, dst_rows, zero, zero, np.array([item, k * item], np.int64)),
                                       (item & -item, 0), 2)):
                sh = split.shape(part, hint)
                out.setdefault((sh.rows, sh.chunk, sh.width, sh.align16, sh.even, sizes), (sh, sizes))
    return list(out.values())
