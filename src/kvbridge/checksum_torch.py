"""The checksum's ``wmix64`` on GPU memory: the same terms as core's numpy, in torch ops on the device.

Core (:mod:`kvbridge.core.sessions.wmix`) imports this module by name the first time a room's
ranges lie in a ``vram`` region, so core itself stays free of torch. A region's blocks are gathered
as rows of the region viewed in place (``__cuda_array_interface__``, no copy of the region),
mixed with int64 ops (multiplication wraps mod 2**64 as numpy's uint64; a logical right shift is an
arithmetic one masked) and summed on the device, on a stream of its own per device so the
host's compute stream is not serialised behind it. Only the sum comes back to the host.

Where Triton is installed, :mod:`kvbridge.checksum_triton`'s kernel does the same in one pass over
memory instead, once it has matched these ops on a probe on that device (:func:`path`).

:func:`block_sum` and :func:`device_sum_on_host` run the same torch ops, or the Triton kernel under
``TRITON_INTERPRET=1``, over host memory: the tests compare them with numpy bit for bit on a
machine without a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvbridge.core.sessions.wmix import C1, C2, K_POS, MASK, BlockSum, DeviceBlocks, DeviceSum

__all__ = ["block_sum", "device_sum_on_host", "path", "problem", "sum_device"]

log = logging.getLogger(__name__)


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no full uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_C1, _C2, _K_POS = _signed(C1), _signed(C2), _signed(K_POS)
#: Bytes the torch ops gather at a time (they need about two more such chunks meanwhile): bounded memory.
GATHER_BYTES = 64 << 20
_streams: dict[int, Any] = {}
_paths: dict[int, str] = {}  # device -> "triton" or "torch", decided once by a probe (path())
_decided: dict[int, threading.Event] = {}  # device -> set when its probe ended
_lock = threading.Lock()


class _DeviceBytes:
    """``nbytes`` of device memory at ``addr`` as a CUDA array (torch wraps it without copying)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "stream": None}


def _mix_sum(words: torch.Tensor, first_key: torch.Tensor) -> int:
    """The sum (mod 2**64) of the terms of ``words`` (k x W int64, overwritten), as core's ``mix_sum``."""
    steps = torch.arange(words.shape[1], dtype=torch.int64, device=words.device) * _K_POS
    tmp = first_key[:, None] + steps[None, :]  # the keys, then reused for each shift: two chunks of memory in all
    words ^= tmp
    words *= _C1
    torch.bitwise_right_shift(words, 31, out=tmp)
    words ^= tmp.bitwise_and_((1 << 33) - 1)  # a logical shift: the sign bits masked off
    words *= _C2
    torch.bitwise_right_shift(words, 29, out=tmp)
    words ^= tmp.bitwise_and_((1 << 35) - 1)
    return int(words.sum(dtype=torch.int64).item()) & MASK


def _rows(region: torch.Tensor, block: int, rows: npt.NDArray[np.int64], first_key: npt.NDArray[np.uint64]) -> int:
    nrows = region.numel() // block
    grid = region[: nrows * block].view(nrows, block)
    step = max(1, GATHER_BYTES // block)
    total = 0
    for i in range(0, len(rows), step):
        idx = torch.from_numpy(rows[i:i + step]).to(region.device, non_blocking=False)
        keys = torch.from_numpy(first_key[i:i + step].view(np.int64)).to(region.device)
        total += _mix_sum(grid.index_select(0, idx).view(torch.int64), keys)
    return total & MASK


def path(device: int, wait: float = 0.0) -> str:
    """How blocks on CUDA ``device`` are hashed now: ``"triton"`` (one fused pass, once it matched the
    torch ops on a probe there) or ``"torch"`` (the torch ops: Triton missing, its probe differed, or
    not decided yet).

    The first call starts the probe (compiling the kernel: seconds) on a thread of its own, so no
    caller, decode's I/O thread included, waits for a compiler; until it ends the torch ops hash.
    ``wait``: seconds to wait for the decision (benchmarks, tests).
    """
    with _lock:
        done = _decided.get(device)
        if done is None:
            done = _decided[device] = threading.Event()
            threading.Thread(target=_probe, args=(device, done), name=f"kvbridge-wmix-probe-{device}",
                             daemon=True).start()
    done.wait(wait)
    return _paths.get(device, "torch")


def _probe(device: int, done: threading.Event) -> None:
    how = "torch"
    try:
        from kvbridge import checksum_triton
    except ImportError as exc:
        log.info("wmix64 on GPU %d: torch ops (no Triton: %s)", device, exc)
    else:
        try:
            with torch.cuda.device(device):
                if checksum_triton.probe(torch.device("cuda", device)):
                    how = "triton"
                else:
                    log.warning("wmix64 on GPU %d: the Triton kernel's digest differed from the torch ops' on a "
                                "probe; hashing with the torch ops (slower, same digests)", device)
        except Exception as exc:  # a compiler or driver failure: the torch ops still give the right digest
            log.warning("wmix64 on GPU %d: the Triton kernel failed (%s: %s); hashing with the torch ops",
                        device, type(exc).__name__, exc)
    _paths[device] = how
    done.set()


def sum_device(device: int, block: int, blocks: DeviceBlocks) -> int:
    """GPU memory: core's ``DeviceSum``: every block of ``blocks`` on CUDA device ``device``.

    With the Triton kernel: one launch over the blocks' addresses and one synchronisation; else
    the torch ops, region by region.
    """
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        return _sum_blocks(block, blocks, lambda addr, n: torch.as_tensor(_DeviceBytes(addr, n), device=f"cuda:{device}"),
                           torch.device("cuda", device) if path(device) == "triton" else None)


def _sum_blocks(block: int, blocks: DeviceBlocks, region_at: Callable[[int, int], torch.Tensor],
                fused_on: torch.device | None) -> int:
    if fused_on is not None:
        from kvbridge.checksum_triton import fused_sum

        got = fused_sum(fused_on, block, blocks.starts[blocks.region] + blocks.rows * block, blocks.keys)
        if got is not None:
            return got
    order = np.argsort(blocks.region, kind="stable")
    total = 0
    for part in np.split(order, np.flatnonzero(np.diff(blocks.region[order])) + 1):
        g = int(blocks.region[part[0]])
        region = region_at(int(blocks.starts[g]), int(blocks.sizes[g]))
        total += _rows(region, block, blocks.rows[part], blocks.keys[part])  # .item() synchronises the stream
    return total & MASK


def _host_bytes(addr: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def device_sum_on_host(kernel: bool) -> DeviceSum:
    """For tests: :func:`sum_device`'s work over host addresses, by the Triton kernel (``kernel``: run under
    ``TRITON_INTERPRET=1``) or by the torch ops."""
    return lambda device, block, blocks: _sum_blocks(block, blocks, _host_bytes, torch.device("cpu") if kernel else None)


def block_sum() -> BlockSum:
    """For tests: the torch ops as a ``BlockSum`` over host addresses."""
    return lambda addr, nbytes, device, block, rows, first_key: _rows(_host_bytes(addr, nbytes), block, rows, first_key)


def problem(devices: Sequence[int] = ()) -> str | None:
    """Why GPU memory cannot be hashed in this process (no CUDA device visible to torch), or None.

    When it can, each of ``devices`` starts deciding its :func:`path` now (in the background), so
    the first room's hash is not the one that compiles the kernel.
    """
    if not torch.cuda.is_available():
        return (f"hashing GPU memory needs a CUDA device visible to torch in this process (torch {torch.__version__} "
                "sees none); turn checksum off or run where the GPU is")
    for d in devices:
        path(d)
    return None
