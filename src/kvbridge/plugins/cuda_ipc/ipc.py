"""CUDA IPC between processes of one host: the handles a rank sends and the mappings its peer opens.

The decode side sends IPC handles of the allocations behind its GPU regions
(its backend metadata); the prefill side maps them once
(``cuIpcOpenMemHandle``) for the GPU that launches its copies. The driver
is reached through ctypes (its C ABI is stable); nothing is loaded until a
GPU region is seen, so this imports cleanly on machines without CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge.core import Region, host_id

from .split import search_steps

__all__ = ["GpuPeer", "available", "check_rc", "driver", "local_metadata", "on_device", "open_peer"]

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]


# -- CUDA driver calls (ctypes: the C ABI is stable) ------------------------------------------------
class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_lib: Any = None
_lock = threading.Lock()
_opened: dict[tuple[bytes, int], int] = {}  # (handle, device opened for) -> mapped base (once per device and process)


def available() -> bool:
    """Whether this process can use the fast path (a CUDA driver and torch with a GPU)."""
    try:
        driver()
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def driver() -> Any:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        check_rc(lib.cuInit(0), "cuInit")
        _lib = lib
    return _lib


def check_rc(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {rc}")


def on_device(device: int) -> None:
    import torch

    torch.cuda.set_device(device)  # makes the device's primary context current in this thread


class _Alloc(msgspec.Struct, array_like=True):
    device: int
    base: int
    size: int
    handle: bytes


class _Meta(msgspec.Struct, array_like=True, tag="kvbridge-cuda-ipc/1"):
    boot_id: str
    pid: int
    allocs: list[_Alloc]


def local_metadata(regions: Sequence[Region]) -> bytes:
    """IPC handles of the allocations behind this rank's GPU regions (b"" when there are none or no CUDA)."""
    vram = [r for r in regions if r.mem == "vram"]
    if not vram or not available():
        return b""
    lib = driver()
    allocs: dict[int, _Alloc] = {}
    for r in vram:
        on_device(r.device)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        check_rc(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), r.addr), f"cuMemGetAddressRange of {r.name!r}")
        if base.value in allocs:
            continue
        handle = _IpcHandle()
        try:
            check_rc(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), f"cuIpcGetMemHandle of {r.name!r}")
        except RuntimeError as exc:  # e.g. memory from cuMemCreate (expandable segments): no legacy IPC
            log.info("GPU fast path off: %s", exc)
            return b""
        # string_at, not handle.reserved: a c_char field stops at the first NUL byte.
        allocs[base.value] = _Alloc(r.device, base.value, size.value, ctypes.string_at(ctypes.addressof(handle), 64))
    return msgspec.msgpack.encode(_Meta(host_id(), os.getpid(), list(allocs.values())))


def allocation_count(metadata: bytes) -> int:
    """How many allocations ``metadata`` (of :func:`local_metadata`) shares."""
    return len(msgspec.msgpack.decode(metadata, type=_Meta).allocs) if metadata else 0


class GpuPeer:
    """A peer's GPU allocations mapped into this process (sorted by the peer's address)."""

    def __init__(self, starts: IntArray, ends: IntArray, delta: IntArray) -> None:
        self.starts, self.ends, self.delta = starts, ends, delta
        self._tables: dict[int, tuple[Any, Any, tuple[int, int, int, int]]] = {}

    def inside(self, dst: IntArray, nbytes: IntArray) -> npt.NDArray[np.bool_]:
        """Which descriptors land wholly inside one mapped allocation."""
        pos = np.searchsorted(self.starts, dst, side="right") - 1
        return (pos >= 0) & (dst + nbytes <= self.ends[np.maximum(pos, 0)])

    def covers(self, regions: Sequence[Region]) -> bool:
        """Whether every one of ``regions`` (the peer's) lies inside a mapped allocation."""
        if not regions:
            return True
        addr = np.array([r.addr for r in regions], np.int64)
        return bool(self.inside(addr, np.array([r.nbytes for r in regions], np.int64)).all())

    def on_device(self, device: int) -> tuple[int, int, int, int]:
        """The kernel's translation table on ``device``: the addresses of its starts and its deltas, the
        steps of its search and the number of allocations."""
        got = self._tables.get(device)
        if got is None:
            import torch

            starts = torch.from_numpy(self.starts).to(f"cuda:{device}")
            deltas = torch.from_numpy(self.delta).to(f"cuda:{device}")
            got = self._tables[device] = (starts, deltas, (starts.data_ptr(), deltas.data_ptr(),
                                                           search_steps(len(self.starts)), len(self.starts)))
        return got[2]  # type: ignore[no-any-return]


def open_peer(metadata: bytes, device: int) -> GpuPeer | None:
    """Map a peer's GPU allocations for copies launched on this process's ``device``, or None (another
    host, no CUDA here, or nothing to map).

    Each handle is opened in ``device``'s context, which CUDA then lets reach the allocation's GPU
    (``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``): the peer's own device numbers are its process's, not
    this one's. CUDA opens a handle once per device in a process: ranks of one process on two GPUs
    (say prefill TP 2 -> 1) each get their own mapping of decode's memory, reached from their GPU."""
    if not metadata or not available():
        return None
    meta = msgspec.msgpack.decode(metadata, type=_Meta)
    if meta.boot_id != host_id():
        return None
    lib = driver()
    starts, ends, delta = [], [], []
    for a in meta.allocs:
        if meta.pid == os.getpid():
            local = a.base  # our own memory: IPC refuses to open it, and needs not
        else:
            with _lock:
                local = _opened.get((a.handle, device), 0)
                if not local:
                    on_device(device)
                    ptr = ctypes.c_uint64()
                    handle = _IpcHandle.from_buffer_copy(a.handle)
                    # 1 = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: also maps another GPU's memory of this host.
                    check_rc(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, 1), "cuIpcOpenMemHandle")
                    local = _opened[a.handle, device] = ptr.value
        starts.append(a.base)
        ends.append(a.base + a.size)
        delta.append(local - a.base)
    order = np.argsort(np.array(starts, np.int64))
    return GpuPeer(*(np.array(x, np.int64)[order] for x in (starts, ends, delta)))

