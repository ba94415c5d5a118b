"""The checksum's ``wmix64`` on GPU memory: the same terms as core's numpy, in torch ops on the device.

Core (:mod:`kvbridge.core.sessions.wmix`) imports this module by name the first time a room's
ranges lie in a ``vram`` region, so core itself stays free of torch. A region's blocks are gathered
as rows of the region viewed in place (``__cuda_array_interface__``, no copy of the region),
mixed with int64 ops (multiplication wraps mod 2**64 as numpy's uint64; a logical right shift is an
arithmetic one masked) and summed on the device, on a stream of its own per device so the
host's compute stream is not serialised behind it. Only the sum comes back to the host.

Where Triton is installed, :mod:`kvbridge.checksum_triton`'s kernel does the same in one pass over
memory instead, once it has matched these ops on a probe on that device (:func:`path`).

:func:`block_sum` ``("cpu")`` runs the same torch ops over host memory, and ``("interpret")`` the
Triton kernel under ``TRITON_INTERPRET=1``: the tests compare both with numpy bit for bit on a
machine without a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvbridge.core.sessions.wmix import C1, C2, CHUNK_BYTES, K_POS, MASK, BlockSum, Part, PartsSum

__all__ = ["block_sum", "path", "problem", "sum_parts"]

log = logging.getLogger(__name__)


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no full uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_C1, _C2, _K_POS = _signed(C1), _signed(C2), _signed(K_POS)
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
    step = max(1, CHUNK_BYTES // block)  # the ops gather, then need two more chunks: bounded memory
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


def sum_parts(device: int, block: int, parts: Sequence[Part]) -> int:
    """GPU memory: core's ``PartsSum``: the blocks of every part (a region of CUDA device ``device`` and its rows).

    With the Triton kernel, every block of every part in one launch and one synchronisation; else
    the torch ops, region by region.
    """
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
    fused = path(device) == "triton"
    with torch.cuda.device(device), torch.cuda.stream(stream):
        if fused:
            from kvbridge.checksum_triton import fused_sum

            got = fused_sum(torch.device("cuda", device), block, *_addresses(block, parts))
            if got is not None:
                return got
        return sum(_rows(torch.as_tensor(_DeviceBytes(addr, nbytes), device=f"cuda:{device}"), block, rows, keys)
                   for addr, nbytes, rows, keys in parts) & MASK  # .item() synchronises the stream


def _addresses(block: int, parts: Sequence[Part]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]]:
    """Every part's blocks as (device address, first key) arrays."""
    addrs = np.concatenate([addr + rows * block for addr, _, rows, _ in parts])
    return addrs, np.concatenate([keys for *_, keys in parts])


def _sum_host(addr: int, nbytes: int, device: int, block: int, rows: npt.NDArray[np.int64],
              first_key: npt.NDArray[np.uint64]) -> int:
    region = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)
    return _rows(region, block, rows, first_key)


def _sum_interpreted(addr: int, nbytes: int, device: int, block: int, rows: npt.NDArray[np.int64],
                     first_key: npt.NDArray[np.uint64]) -> int:
    from kvbridge.checksum_triton import fused_sum

    got = fused_sum(torch.device("cpu"), block, *_addresses(block, [(addr, nbytes, rows, first_key)]))
    return _sum_host(addr, nbytes, device, block, rows, first_key) if got is None else got


def block_sum(on: str) -> BlockSum:
    """A torch ``BlockSum`` over host addresses, for tests: ``"cpu"`` (the torch ops) or ``"interpret"`` (the
    Triton kernel under ``TRITON_INTERPRET=1``)."""
    if on == "cpu":
        return _sum_host
    if on == "interpret":
        return _sum_interpreted
    raise ValueError(f"block_sum: on must be 'cpu' or 'interpret', got {on!r}")


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
