"""``memory``: a backend with no engine, for tests and for host servers' own CI.

It moves bytes with ``process_vm_writev`` (cross-memory attach), so prefill and
decode may share one process (the pytest process: no extra process for the
bytes) or be two processes of one host owned by the same user. A peer's
metadata is its host's boot id, its pid and that process's start time, and
the memory it registered; a write to a peer on another host, or to a pid
that now belongs to another process, is refused. It declares
``cross_host=False`` so it is never the default backend.

Behaviour, as the conformance suite sees it: writes land before ``write``
returns (the system call copies them); a killed peer fails the next write
(``ESRCH``); a stopped (SIGSTOP) peer still receives bytes, as over NIXL's
CMA path. Linux only; a hardened kernel (``kernel.yama.ptrace_scope`` >= 2)
refuses it, and the error says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import msgspec
import numpy as np

from kvbridge.core.transfer.backend import Backend, BackendConfig, TransferError
from kvbridge.core.transfer.backend import host_id
from kvbridge.core.description.hookspecs import hookimpl
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.description.records import BackendCapabilities, BackendSpec

__all__ = ["CAPABILITIES", "MemoryBackend", "defer_posts", "kvbridge_register_backends"]

CAPABILITIES = BackendCapabilities(memory_kinds=("dram",), cross_host=False, inline_writes=True)
IOV_MAX = 1024  # iovecs per system call (Linux UIO_MAXIOV)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="memory", factory="kvbridge.testing.memory:MemoryBackend", capabilities=CAPABILITIES,
                        description="no engine: process_vm_writev between processes of one host (tests, host CI)")]


class _Meta(msgspec.Struct, frozen=True, array_like=True, tag="kvbridge-memory/1"):
    boot_id: str
    pid: int
    start_time: int  # /proc/PID/stat field 22: tells a reused pid apart
    regions: list[tuple[int, int]]  # (address, bytes) registered


class _Peer(msgspec.Struct):
    pid: int
    start_time: int


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Meta).decode
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_writev = _libc.process_vm_writev
_writev.restype = ctypes.c_ssize_t
_writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


def state(pid: int) -> str | None:
    """Process ``pid``'s state letter (``R``, ``S``, ``T`` stopped, ...), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


class MemoryBackend(Backend):
    """Writes plans into a peer on this host with ``process_vm_writev``."""

    capabilities: ClassVar[BackendCapabilities] = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._regions: list[tuple[int, int]] = []
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    def register(self, regions: Sequence[Region]) -> None:
        self._regions.extend((r.addr, r.nbytes) for r in regions)

    def metadata(self) -> bytes:
        pid = os.getpid()
        return _encode(_Meta(host_id(), pid, start_time(pid) or 0, self._regions))

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        try:
            meta = _decode(metadata)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransferError(f"memory: peer {peer!r} sent metadata ({len(metadata)} B) that is not a memory backend's: {exc}") from None
        if meta.boot_id != host_id():
            raise TransferError(f"memory: peer {peer!r} runs on another host; this backend moves bytes within one host only")
        if start_time(meta.pid) != meta.start_time:
            raise TransferError(f"memory: peer {peer!r} (pid {meta.pid}) is no longer running")
        for r in regions:
            if not any(a <= r.addr and r.end <= a + n for a, n in meta.regions):
                raise TransferError(f"memory: peer {peer!r} describes region {r.name!r} ({r.nbytes} B at {r.addr:#x}) "
                                    "but registered no memory covering it")
        self._peers[peer] = _Peer(meta.pid, meta.start_time)

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def _target(self, peer: str) -> _Peer:
        if self._closed:
            raise TransferError("memory backend is closed")
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"memory: unknown peer {peer!r} (known peers: {', '.join(sorted(self._peers)) or 'none'})")
        if start_time(p.pid) != p.start_time:
            raise TransferError(f"memory: peer {peer!r} (pid {p.pid}) is gone")
        return p

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        self.copy(self._target(peer), peer, batch.src_addr, batch.dst_addr, batch.nbytes)

    @staticmethod
    def copy(p: _Peer, peer: str, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """``process_vm_writev`` of every descriptor, IOV_MAX at a time (whole arrays, no per-descriptor Python)."""
        local = np.stack([src, nbytes], axis=1).astype(np.uint64)
        remote = np.stack([dst, nbytes], axis=1).astype(np.uint64)
        for lo in range(0, len(local), IOV_MAX):
            lv, rv = local[lo:lo + IOV_MAX], remote[lo:lo + IOV_MAX]
            want = int(lv[:, 1].sum())
            got = _writev(p.pid, lv.ctypes.data, len(lv), rv.ctypes.data, len(rv), 0)
            if got != want:
                err = ctypes.get_errno() if got < 0 else 0
                why = {errno.ESRCH: "the process is gone", errno.EPERM: "not permitted (another user, or ptrace_scope)",
                       errno.EFAULT: "an address is not mapped"}.get(err, os.strerror(err) if err else f"{got} of {want} B written")
                raise TransferError(f"memory: write to peer {peer!r} (pid {p.pid}) failed: {why}; "
                                    f"descriptors before {lo} landed")

    def close(self) -> None:
        self._closed = True
        self._peers.clear()

    def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "peers": {k: v.pid for k, v in self._peers.items()}}


def defer_posts(monkeypatch: Any, capabilities: BackendCapabilities) -> list[int]:
    """Make :class:`MemoryBackend` declare ``capabilities`` (``batches_in_flight`` > 1) and post batches
    (``Backend.post``) that copy only when core waits for them, until ``monkeypatch`` undoes it: a staged
    window announced before its bytes landed, or a slice reused while the engine still reads it, shows in
    the bytes. Returns a list whose one item is the most batches posted at once so far."""
    peak: list[int] = [0]
    pending: list[TransferPlan] = []

    def post(self: MemoryBackend, peer: str, batch: TransferPlan, deadline: float) -> Callable[[float], None]:
        target = self._target(peer)
        src, dst, nbytes = batch.src_addr.copy(), batch.dst_addr.copy(), batch.nbytes.copy()
        pending.append(batch)
        peak[0] = max(peak[0], len(pending))

        def wait(deadline: float) -> None:
            pending.remove(batch)
            self.copy(target, peer, src, dst, nbytes)
        return wait

    monkeypatch.setattr(MemoryBackend, "capabilities", capabilities)
    monkeypatch.setattr(MemoryBackend, "post", post)
    return peak
