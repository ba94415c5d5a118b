"""GPU staging kernels: gather a window's pieces into a slice, or scatter a slice into pieces, in one launch.

The GPU half of staging on both sides (``kvbridge.core.transfer.relay``): where the
host path copies a window with numpy over a unit index
(``kvbridge.core.planning.stage_index``), GPU memory needs a kernel. :func:`unit_table`
turns a window (piece addresses, their offsets in the slice, their sizes) into
two index arrays, one entry per *unit* (the largest size, up to
:data:`MAX_UNIT`, dividing every size and offset): the unit's address in memory
and its offset in the slice. :func:`gather` and :func:`scatter` copy with one
Triton launch over those arrays, ``BLOCK`` elements a program, whatever the
number of pieces. The table is plain numpy (tested on the CPU:
``tests/test_gpu_staging.py`` applies it with numpy); torch and Triton are
imported on the first launch.

Core's write path uses them through its device seam
(``kvbridge.core.transfer.device``, adapted by :mod:`kvbridge.staging_torch`) for GPU
windows staged on both sides (``docs/architecture.md``, "Staging"); their own test
and benchmark are ``scripts/gpu_check.sh``'s step ``staging``, the wired path's
step ``gpustage``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_UNIT", "UnitTable", "apply_on_host", "gather", "scatter", "unit_table"]

#: Largest unit a table uses: a program copies whole units, ``BLOCK`` elements at a time.
MAX_UNIT = 64 << 10
BLOCK = 1024  # elements a program copies
_WIDTHS = (16, 8, 4, 2, 1)  # element widths tried, widest first

IntArray = npt.NDArray[np.int64]


class UnitTable(NamedTuple):
    """A window as units: unit ``k`` is ``unit`` bytes at ``far[k]`` (an address) and at ``near[k]``
    (an offset in the slice); every address and offset is a multiple of ``width``."""

    far: IntArray
    near: IntArray
    unit: int
    width: int


def unit_table(addr: IntArray, packed: IntArray, nbytes: IntArray) -> UnitTable:
    """The units of pieces at ``addr`` (absolute) packed at ``packed`` offsets of a slice, ``nbytes`` each."""
    if not (len(addr) == len(packed) == len(nbytes)) or len(addr) == 0 or (nbytes <= 0).any():
        raise ValueError(f"a window needs as many addresses ({len(addr)}), offsets ({len(packed)}) and sizes "
                         f"({len(nbytes)}) as pieces, at least one, each of a positive size")
    size = int(nbytes[0])
    same = bool((nbytes == size).all())  # pieces of one size (pages): no reduction over them
    if same and not (packed % size).any():
        unit = int(np.gcd(size, MAX_UNIT))
    else:
        unit = int(np.gcd.reduce(np.concatenate((nbytes, packed, [MAX_UNIT]))))
    if same and unit == size:  # one unit a piece: the pieces are the table
        far, near = addr.astype(np.int64, copy=True), packed.astype(np.int64, copy=True)
    else:
        count = nbytes // unit
        step = (np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)) * unit
        far = np.repeat(addr, count) + step
        near = np.repeat(packed, count) + step
    low = int(np.bitwise_or.reduce(addr)) | 16 | unit  # the lowest bit set in any address, 16 or the unit
    width = next(w for w in _WIDTHS if low % w == 0)
    return UnitTable(far, near, unit, width)


def apply_on_host(table: UnitTable, memory: npt.NDArray[np.uint8], slice_: npt.NDArray[np.uint8], base: int,
                  to_slice: bool) -> None:
    """What the kernels do, with numpy over host buffers (``memory`` starts at address ``base``): the
    CPU test of the table's address arithmetic."""
    for k in range(len(table.far)):  # a test oracle, never a hot path
        a, b = int(table.far[k]) - base, int(table.near[k])
        if to_slice:
            slice_[b:b + table.unit] = memory[a:a + table.unit]
        else:
            memory[a:a + table.unit] = slice_[b:b + table.unit]


_kernel: Any = None


def _compile() -> Any:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

    types = {16: tl.int64, 8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}

    @triton.jit
    def copy_units(far, near, slice_base, units, UNIT: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
                   TO_SLICE: tl.constexpr, DTYPE: tl.constexpr):
        # Program (u, c): elements [c * BLOCK, +BLOCK) of unit u; far/near: int64 arrays of ``units`` entries.
        u = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        i = c * BLOCK + tl.arange(0, BLOCK)
        live = i < UNIT // W
        a = tl.load(far + u) + i * W
        b = slice_base.to(tl.int64) + tl.load(near + u) + i * W
        if TO_SLICE:
            src, dst = a, b
        else:
            src, dst = b, a
        v = tl.load(src.to(tl.pointer_type(DTYPE)), mask=live)
        tl.store(dst.to(tl.pointer_type(DTYPE)), v, mask=live)

    return copy_units, types


def _launch(table: UnitTable, slice_ptr: int, to_slice: bool, stream: Any = None) -> None:
    import torch

    global _kernel
    if _kernel is None:
        _kernel = _compile()
    kern, types = _kernel
    width = min(table.width, 8)  # 16-byte elements as int64 pairs would need two loads; 8 is Triton's widest int
    far = torch.from_numpy(table.far).to("cuda", non_blocking=True)
    near = torch.from_numpy(table.near).to("cuda", non_blocking=True)
    elems = table.unit // width
    grid = (len(table.far), -(-elems // BLOCK))
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        kern[grid](far, near, slice_ptr, len(table.far), UNIT=table.unit, W=width, BLOCK=BLOCK, TO_SLICE=to_slice,
                   DTYPE=types[width])


def gather(table: UnitTable, slice_ptr: int, stream: Any = None) -> None:
    """Copy every unit from its address into the slice at ``slice_ptr`` (GPU memory), one launch."""
    _launch(table, slice_ptr, True, stream)


def scatter(table: UnitTable, slice_ptr: int, stream: Any = None) -> None:
    """Copy every unit from the slice at ``slice_ptr`` to its address (GPU memory), one launch."""
    _launch(table, slice_ptr, False, stream)
