"""Staging on GPU memory: core's device seam (:mod:`kvbridge.core.transfer.device`) over the ``cuda_ipc`` kernels.

Core imports this module by name the first time a rank would stage GPU memory, so core itself
stays free of torch and Triton. Every copy runs on the device's current stream, then that
stream is synchronised: the engine reads a gathered slice right after, and a room whose
window was scattered may reach SUCCESS right after.

A window given as unit runs (:func:`gather_units`, :func:`scatter_units`: a decode scatter,
a prefill gather of pages of a pool) is copied with torch's own ``index_select`` /
``index_copy_`` over a view of each run's region as rows of one unit, indexed straight
by the run's unit offsets (no table). A window given as piece addresses (:func:`gather`, :func:`scatter`)
is turned into a unit table (:func:`kvbridge.plugins.cuda_ipc.staging.unit_table`) and
copied the same way when every unit lies a whole number of units from the lowest one, else
with the Triton kernel over the table's addresses: on an H200 the Triton launch alone cost
its caller 60-90 us, torch's ``index_select`` with its synchronisation 31-39 us for a whole
32 MiB window, as long as the contiguous copy of the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvbridge.core.planning.stage_index import UnitRun
from kvbridge.plugins.cuda_ipc import staging as kernels

__all__ = ["alloc", "gather", "gather_units", "scatter", "scatter_units"]

IntArray = npt.NDArray[np.int64]


def alloc(nbytes: int, device: int) -> tuple[int, Any]:
    """``nbytes`` of zeroed memory on GPU ``device``: its address and the tensor owning it."""
    t = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    torch.cuda.synchronize(device)  # zeroed before an engine registers it
    return t.data_ptr(), t


_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class _Memory:
    """``nbytes`` of GPU memory at ``addr`` as a CUDA array, for a tensor viewing (not owning) them."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def _rows(addr: int, rows: int, unit: int, width: int, device: str) -> torch.Tensor:
    """``rows`` rows of ``unit`` bytes from ``addr`` on ``device``, as elements of ``width`` bytes (a view, no copy)."""
    return torch.as_tensor(_Memory(addr, rows * unit), device=device).view(_DTYPES[width]).view(rows, unit // width)


def _copy(addr: IntArray, nbytes: IntArray, slice_addr: int, device: int, to_slice: bool) -> None:
    table = kernels.unit_table(addr, np.cumsum(nbytes) - nbytes, nbytes)
    base = int(table.far.min())
    offset = table.far - base
    if (offset % table.unit).any():  # units at odd distances from each other: the kernel reads addresses
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream()
            (kernels.gather if to_slice else kernels.scatter)(table, slice_addr, stream)
            stream.synchronize()
    else:  # rows of one view from the lowest unit, packed in the order of the pieces: one unit run
        row = offset // table.unit
        _units([UnitRun(base, table.unit, row, 0, int(row.max()) + 1)], slice_addr, device, to_slice)


def _one_view(runs: Sequence[UnitRun]) -> list[UnitRun]:
    """``runs`` as one run over a view from the lowest region when they share a unit and every region starts a
    whole number of units from it (a window across a model's layers: one launch, not one per region), else
    as they are."""
    if len(runs) < 2:
        return list(runs)
    unit, lo = runs[0].unit, min(r.base for r in runs)
    if any(r.unit != unit or (r.base - lo) % unit for r in runs):
        return list(runs)
    offsets = np.concatenate([r.offsets.astype(np.int64) + (r.base - lo) // unit for r in runs])
    span = max((r.base - lo) // unit + r.span for r in runs)
    return [UnitRun(lo, unit, offsets, runs[0].start, span)]


def _units(runs: Sequence[UnitRun], slice_addr: int, device: int, to_slice: bool) -> None:
    where = f"cuda:{device}"
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream()
        for r in _one_view(runs):  # runs are packed back to back in the slice, in order
            at = slice_addr + r.start
            low = r.base | r.unit | at | 8
            width = low & -low  # the widest element (up to 8 bytes) every row's start is aligned to
            memory = _rows(r.base, r.span, r.unit, width, where)
            packed = _rows(at, len(r.offsets), r.unit, width, where)
            index = torch.from_numpy(r.offsets.astype(np.int64, copy=False)).to(where, non_blocking=True)
            if to_slice:
                torch.index_select(memory, 0, index, out=packed)
            else:
                memory.index_copy_(0, index, packed)
        stream.synchronize()


def gather_units(runs: Sequence[UnitRun], slice_addr: int, device: int) -> None:
    """Each run's units into the slice at ``slice_addr``: one indexed copy a run, complete on return."""
    _units(runs, slice_addr, device, True)


def scatter_units(slice_addr: int, runs: Sequence[UnitRun], device: int) -> None:
    """The slice at ``slice_addr`` out to each run's units: one indexed copy a run, complete on return."""
    _units(runs, slice_addr, device, False)


def gather(src: IntArray, nbytes: IntArray, slice_addr: int, device: int) -> None:
    """Pieces at ``src`` back to back into the slice at ``slice_addr``: one launch, complete on return."""
    _copy(src, nbytes, slice_addr, device, True)


def scatter(slice_addr: int, dst: IntArray, nbytes: IntArray, device: int) -> None:
    """The slice at ``slice_addr`` out to the pieces at ``dst``: one launch, complete on return."""
    _copy(dst, nbytes, slice_addr, device, False)
