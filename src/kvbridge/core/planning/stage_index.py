"""Index arrays of a staged window: which units of memory a gather reads or a scatter writes.

A staged window is a list of pieces (address, bytes) packed back to back in a
staging slice. Both the gather on prefill (pieces -> slice) and the scatter on
decode (slice -> pieces) move whole *units*: per region, the greatest size
dividing every piece's size, its offset from the region's lowest piece and its
offset in the slice, so that a copy is one ``numpy.take`` and one fancy
assignment per region (host memory) or one kernel launch over the index arrays
(GPU memory: ``kvbridge.plugins.cuda_ipc.staging``), never a loop per piece.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_UNITS_PER_PIECE", "UnitCopy", "gather_into", "pack", "scatter_from", "unit_copy"]

#: A window whose pieces hold more units than this on average is not staged: its index arrays would
#: outgrow the descriptors they replace (odd sizes or offsets, so the unit is a few bytes).
MAX_UNITS_PER_PIECE = 4

IntArray = npt.NDArray[np.int64]


class UnitCopy(NamedTuple):
    """One region's pieces as units: unit ``k`` of the copy is ``base + far[k] * unit`` in memory and
    ``packed[k] * unit`` in the slice."""

    base: int
    unit: int
    far: IntArray
    packed: IntArray
    #: Units from ``base`` to the end of the highest piece (the span a raw view must cover).
    span: int
    #: Units from the slice's start to the end of the last piece packed (the view of the slice).
    end: int


def unit_copy(addr: IntArray, packed: IntArray, nbytes: IntArray,
              max_units_per_piece: int = MAX_UNITS_PER_PIECE) -> UnitCopy | None:
    """The unit indices of pieces at ``addr`` packed at offsets ``packed`` of a slice, ``nbytes`` each;
    None when there are none or their unit is too small (module docstring)."""
    n = len(addr)
    if n == 0:
        return None
    base = int(addr.min())
    rel = addr - base
    unit = int(np.gcd.reduce(np.concatenate((nbytes, rel, packed))))
    if unit <= 0:
        return None
    count = nbytes // unit
    units = int(count.sum())
    if units > max_units_per_piece * n:
        return None
    if units == n:
        far, near = rel // unit, packed // unit
    else:  # pieces of several units: every unit of every piece, in order
        step = np.arange(units, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        far, near = np.repeat(rel // unit, count) + step, np.repeat(packed // unit, count) + step
    return UnitCopy(base, unit, far, near, (int((addr + nbytes).max()) - base) // unit,
                    int((packed + nbytes).max()) // unit)


class _Raw:
    """A numpy view of ``count`` items of ``itemsize`` bytes at a raw address (no copy, no ctypes type)."""

    def __init__(self, addr: int, count: int, itemsize: int) -> None:
        self.__array_interface__ = {
            "shape": (count,), "typestr": f"|V{itemsize}", "data": (addr, False), "version": 3,
        }


def _copies(addr: IntArray, nbytes: IntArray, groups: IntArray, max_units_per_piece: int) -> list[UnitCopy] | None:
    """One :class:`UnitCopy` per group (region) of pieces, packed back to back in their order."""
    packed = np.cumsum(nbytes) - nbytes
    out = []
    for g in np.unique(groups).tolist():  # per region (a few per rank), never per piece
        pick = groups == g
        copy = unit_copy(addr[pick], packed[pick], nbytes[pick], max_units_per_piece)
        if copy is None:
            return None
        out.append(copy)
    return out


def pack(addr: IntArray, nbytes: IntArray, groups: IntArray,
         max_units_per_piece: int = MAX_UNITS_PER_PIECE) -> tuple[IntArray, list[UnitCopy]]:
    """Which pieces a gather packs, in the order it packs them, and its copies: the pieces grouped by region
    (each region's in their order; the region with the largest unit first, so that a region of odd sizes
    does not shift the others' offsets off their unit), a region whose pieces are too odd to copy by units
    left out. What is left out is written as planned: one odd region (a state of odd sizes written with
    the pages) must not keep the rest of its window from being staged."""
    found = np.unique(groups)
    picks = [np.flatnonzero(groups == g) for g in found.tolist()] if len(found) > 1 else [np.arange(len(addr))]
    own = [int(np.gcd.reduce(np.concatenate((nbytes[i], addr[i] - addr[i].min())))) for i in picks]
    kept: list[IntArray] = []
    copies: list[UnitCopy] = []
    offset = 0
    for k in sorted(range(len(picks)), key=lambda k: -own[k]):  # stable: regions of one unit keep their order
        i = picks[k]
        copy = unit_copy(addr[i], offset + np.cumsum(nbytes[i]) - nbytes[i], nbytes[i], max_units_per_piece)
        if copy is not None:
            kept.append(i)
            copies.append(copy)
            offset += int(nbytes[i].sum())
    return (np.concatenate(kept) if kept else np.zeros(0, np.int64)), copies


def _packed(slice_: npt.NDArray[np.uint8], c: UnitCopy) -> npt.NDArray[Any] | None:
    """The units ``c`` packs, as a view of ``slice_``, when they lie back to back there (pieces of one unit
    each, the usual window: ``packed`` ascends, so its ends say it); else None."""
    first, n = int(c.packed[0]), len(c.packed)
    if int(c.packed[-1]) - first != n - 1:
        return None
    return slice_[first * c.unit:(first + n) * c.unit].view(f"V{c.unit}")


def gather_into(out: npt.NDArray[np.uint8], copies: list[UnitCopy]) -> None:
    """Copy the pieces of ``copies`` (:func:`pack`) into ``out`` (host memory), back to back as packed."""
    for c in copies:
        far = np.asarray(_Raw(c.base, c.span, c.unit))
        near = _packed(out, c)
        if near is not None:  # straight into the slice: one copy, no temporary of the window's size
            np.take(far, c.far, out=near, mode="clip")  # indices known in range: "raise" would buffer
        else:
            out[:c.end * c.unit].view(f"V{c.unit}")[c.packed] = far[c.far]


def scatter_from(src: npt.NDArray[np.uint8], addr: IntArray, nbytes: IntArray, groups: IntArray) -> None:
    """Copy ``src``, the pieces back to back, to ``addr`` (host memory); ``groups``: each piece's region."""
    copies = _copies(addr, nbytes, groups, 1 << 30)
    assert copies is not None  # no limit on units: every non-empty piece has a unit
    for c in copies:
        near = _packed(src, c)
        if near is None:
            near = src[:c.end * c.unit].view(f"V{c.unit}")[c.packed]
        np.asarray(_Raw(c.base, c.span, c.unit))[c.far] = near  # from the slice as it lies: one copy
