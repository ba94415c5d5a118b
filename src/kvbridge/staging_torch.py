"""Staging on GPU memory: core's device seam (:mod:`kvbridge.core.transfer.device`) over the ``cuda_ipc`` kernels.

Core imports this module by name the first time a rank would stage GPU memory, so core itself
stays free of torch and Triton. A window is turned into a unit table
(:func:`kvbridge.plugins.cuda_ipc.staging.unit_table`) and copied with one Triton launch on
the device's current stream, then that stream is synchronised: the engine reads a gathered
slice right after, and a room whose window was scattered may reach SUCCESS right after.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvbridge.plugins.cuda_ipc import staging as kernels

__all__ = ["alloc", "gather", "scatter"]

IntArray = npt.NDArray[np.int64]


def alloc(nbytes: int, device: int) -> tuple[int, Any]:
    """``nbytes`` of zeroed memory on GPU ``device``: its address and the tensor owning it."""
    t = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    torch.cuda.synchronize(device)  # zeroed before an engine registers it
    return t.data_ptr(), t


def _copy(addr: IntArray, nbytes: IntArray, slice_addr: int, device: int, to_slice: bool) -> None:
    table = kernels.unit_table(addr, np.cumsum(nbytes) - nbytes, nbytes)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream()
        (kernels.gather if to_slice else kernels.scatter)(table, slice_addr, stream)
        stream.synchronize()


def gather(src: IntArray, nbytes: IntArray, slice_addr: int, device: int) -> None:
    """Pieces at ``src`` back to back into the slice at ``slice_addr``: one launch, complete on return."""
    _copy(src, nbytes, slice_addr, device, True)


def scatter(slice_addr: int, dst: IntArray, nbytes: IntArray, device: int) -> None:
    """The slice at ``slice_addr`` out to the pieces at ``dst``: one launch, complete on return."""
    _copy(dst, nbytes, slice_addr, device, False)
