"""The ``cuda_ipc`` backend: writes a plan into a same-host peer's GPU memory with one kernel.

``register`` takes this rank's GPU regions on one device (the lowest-numbered
among them: the kernel launches there; regions on other devices are left to
the lanes after this one). ``metadata`` is the IPC handles of the
allocations behind them (:mod:`.ipc`); ``add_peer`` maps a peer's and refuses
a peer whose GPU regions it cannot all reach (another host, memory without
legacy IPC, no CUDA here), so that core gives that peer's pairs to the next
lane. ``write`` copies the whole plan unexpanded (:mod:`.kernel`), checking
core's fence between slices, and returns once every byte has landed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvbridge.core import Backend, BackendConfig, Region, TransferError, TransferPlan, checkpoint

from . import CAPABILITIES, ipc, kernel

__all__ = ["CudaIpcBackend"]

log = logging.getLogger(__name__)


class CudaIpcBackend(Backend):
    """Same-host GPU -> GPU copies through CUDA IPC and a Triton kernel (see the module docstring)."""

    capabilities = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._regions: list[Region] = []
        self._device = -1
        self._peers: dict[str, ipc.GpuPeer] = {}
        self._closed = False

    def select(self, regions: Sequence[Region]) -> Sequence[Region]:
        if not regions or not ipc.available():
            return []
        device = min(r.device for r in regions)
        return [r for r in regions if r.device == device]

    def register(self, regions: Sequence[Region]) -> None:
        self._regions = list(regions)
        self._device = min((r.device for r in regions), default=-1)

    def metadata(self) -> bytes:
        return ipc.local_metadata(self._regions) if self._regions else b""

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

    def remove_peer(self, peer: str) -> None:
        # Mappings stay open until the process ends: a write in flight may still use them, and CUDA
        # opens a handle once per device in a process anyway (ipc keeps them).
        self._peers.pop(peer, None)

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        mapped = self._peers.get(peer)
        if mapped is None:
            raise TransferError(f"cuda_ipc: write to unknown peer {peer!r}")
        try:  # the plan as the planner left it: rows x columns, unexpanded
            kernel.copy(self._device, batch.factors(), mapped, lambda: checkpoint("between GPU copy slices"), batch.hints())
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"cuda_ipc: GPU copy to peer {peer!r} failed: {exc}") from exc

    def close(self) -> None:
        self._closed = True
        self._peers.clear()

    def describe(self) -> dict[str, Any]:
        return {"cuda_ipc_device": self._device, "cuda_ipc_peers": sorted(self._peers)}
