"""A stand-in for the GPU staging seam (:mod:`kvbridge.core.transfer.device`) over host memory.

The CPU tests set ``kvbridge.core.transfer.device.DEVICE_MODULE`` to this module and mark host
regions ``vram``: core then takes the GPU staging path (its decision, windows, ``Staged``
announcements, the scatter under decode's lock) with numpy doing what the kernels do. Unit runs
are copied as :mod:`kvbridge.staging_torch` copies them (rows of one unit of a view of the
region, indexed by the run's unit offsets); a gather by piece address through the kernels' own index
arithmetic (:func:`kvbridge.plugins.cuda_ipc.staging.unit_table`), applied with whole-array numpy
over raw views. ``calls`` counts the copies, so a test can tell which ran.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.core.planning.stage_index import UnitRun
from kvbridge.plugins.cuda_ipc.staging import unit_table

__all__ = ["alloc", "calls", "gather", "gather_units", "scatter_units"]

IntArray = npt.NDArray[np.int64]

#: Copies made, by name ("alloc", "gather", "gather_units", "scatter_units").
calls: Counter[str] = Counter()


class _Raw:
    """``count`` bytes (rows of ``row`` bytes) at a raw address as a numpy array (no copy)."""

    def __init__(self, addr: int, count: int, row: int = 1) -> None:
        self.__array_interface__ = {"shape": (count // row, row), "typestr": "|u1", "data": (addr, False), "version": 3}


def alloc(nbytes: int, device: int) -> tuple[int, Any]:
    calls["alloc"] += 1
    buf = np.zeros(nbytes, np.uint8)
    return buf.ctypes.data, buf


def gather(src: IntArray, nbytes: IntArray, slice_addr: int, device: int) -> None:
    calls["gather"] += 1
    table = unit_table(src, np.cumsum(nbytes) - nbytes, nbytes)
    lo = int(min(int(table.far.min()), slice_addr))
    hi = int(max(int(table.far.max()), slice_addr + int(table.near.max()))) + table.unit
    # One view over the span holding every piece and the slice; each unit's bytes as one row.
    mem = np.asarray(_Raw(lo, hi - lo)).ravel()
    cols = np.arange(table.unit, dtype=np.int64)
    mem[(slice_addr - lo + table.near)[:, None] + cols] = mem[(table.far - lo)[:, None] + cols]


def _units(runs: Sequence[UnitRun], slice_addr: int, to_slice: bool) -> None:
    for r in runs:
        memory = np.asarray(_Raw(r.base, r.span * r.unit, r.unit))
        packed = np.asarray(_Raw(slice_addr + r.start, len(r.offsets) * r.unit, r.unit))
        if to_slice:
            packed[:] = memory[r.offsets]
        else:
            memory[r.offsets] = packed


def gather_units(runs: Sequence[UnitRun], slice_addr: int, device: int) -> None:
    calls["gather_units"] += 1
    _units(runs, slice_addr, True)


def scatter_units(slice_addr: int, runs: Sequence[UnitRun], device: int) -> None:
    calls["scatter_units"] += 1
    _units(runs, slice_addr, False)
