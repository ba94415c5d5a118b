"""Index arrays of a staged window: which units of memory a gather reads or a scatter writes.

A staged window is a list of pieces (address, bytes) packed back to back in a
staging slice. Both the gather on prefill (pieces -> slice) and the scatter on
decode (slice -> pieces) move whole *units*: per region, the greatest size
dividing every piece's size and offset, so that a copy is one ``numpy.take`` or
one ``numpy.put`` per region (host memory) or one indexed copy (GPU memory:
the device seam, ``kvbridge.core.transfer.device``), never a loop per piece.
Pieces continuing each other in memory are one piece to both (:func:`merged`),
and pieces of one size at multiples of it have that size as their unit without a
gcd over every value (:func:`_unit`): head slices of heterogeneous TP are tens of
thousands of pieces of a few hundred bytes a window, and these passes, not the
copy, were their cost.

Where a window's pieces go travels in these terms (``Staged``): :func:`region_pieces`
says a window's pieces as runs of pieces in one region each, a unit and every
piece's unit offset from the region's start (4 bytes a piece); decode checks them
by bounds and copies them as :class:`UnitRun` (:func:`put_units`). A prefill
gather of host memory packs by :func:`pack` (:class:`UnitCopy`), one of GPU pages
by unit runs too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..description.layout import Region
from .regions import RegionTable

__all__ = ["MAX_OFFSET", "MAX_RUNS", "MAX_UNITS_PER_PIECE", "RegionPieces", "UnitCopy", "UnitRun", "expand", "gather_into",
           "merged", "pack", "put_units", "region_pieces", "unit_copy", "unit_runs"]

#: A window whose pieces hold more units than this on average is not staged: its index arrays would
#: outgrow the descriptors they replace (odd sizes or offsets, so the unit is a few bytes).
MAX_UNITS_PER_PIECE = 4

IntArray = npt.NDArray[np.int64]
#: Most runs of pieces (consecutive pieces in one region) a window described by :func:`region_pieces` may hold: a
#: plan lists its descriptors region pair by region pair, so a window holds about one run per region it touches.
MAX_RUNS = 4096
#: Unit offsets and counts travel as uint32 (``Staged``): a piece whose end lies further from its region's
#: start, in units, is not described (its window is written as planned).
MAX_OFFSET = (1 << 32) - 1


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


def _rem(values: IntArray, unit: int) -> IntArray:
    """``values % unit``; a mask where ``unit`` is a power of two."""
    return values & (unit - 1) if unit & (unit - 1) == 0 else values % unit


def _div(values: IntArray, unit: int) -> IntArray:
    """``values // unit`` (``values`` >= 0); a shift where ``unit`` is a power of two."""
    return values >> (unit.bit_length() - 1) if unit & (unit - 1) == 0 else values // unit


def _unit(sizes: IntArray, *offsets: IntArray, same: bool | None = None) -> int:
    """The greatest number dividing every size and offset (``same``: whether every size is the first one, where
    the caller knows). Pieces of one size at multiples of it (pages of a pool, head slices) have that size:
    one check an array, without a gcd over every value (the gcd of a window of 32,768 head slices, its sizes,
    sources and slice offsets, cost more than gathering their bytes)."""
    size = int(sizes[0])
    if size > 0 and (bool((sizes == size).all()) if same is None else same):
        if not any(_rem(o, size).any() for o in offsets):
            return size
    return int(np.gcd.reduce(np.concatenate((sizes, *offsets))))


def unit_copy(addr: IntArray, packed: IntArray, nbytes: IntArray, max_units_per_piece: int = MAX_UNITS_PER_PIECE,
              pieces: int | None = None) -> UnitCopy | None:
    """The unit indices of pieces at ``addr`` packed at offsets ``packed`` of a slice, ``nbytes`` each;
    None when there are none or their unit is too small (module docstring): more than ``max_units_per_piece``
    units for each of the ``pieces`` descriptors they stand for (default: one each)."""
    n = len(addr)
    if n == 0:
        return None
    base = int(addr.min())
    rel = addr - base
    size = int(nbytes[0])
    same = bool((nbytes == size).all())
    unit = _unit(nbytes, rel, packed, same=same)
    if unit <= 0:
        return None
    if same and unit == size:  # a unit a piece (pages, head slices): no counts, no expansion
        far, near = _div(rel, unit), _div(packed, unit)
        return UnitCopy(base, unit, far, near, int(far.max()) + 1, int(near.max()) + 1)
    count = nbytes // unit
    units = int(count.sum())
    if units > max_units_per_piece * (n if pieces is None else pieces):
        return None
    # Pieces of several units (one unit each, of one size, returned above): every unit of every piece, in order.
    far, near = expand(rel // unit, count), expand(packed // unit, count)
    return UnitCopy(base, unit, far, near, (int((addr + nbytes).max()) - base) // unit,
                    int((packed + nbytes).max()) // unit)


class _Raw:
    """A numpy view of ``count`` items of ``itemsize`` bytes at a raw address (no copy, no ctypes type)."""

    def __init__(self, addr: int, count: int, itemsize: int) -> None:
        self.__array_interface__ = {
            "shape": (count,), "typestr": f"|V{itemsize}", "data": (addr, False), "version": 3,
        }


def merged(addr: IntArray, nbytes: IntArray) -> tuple[IntArray, IntArray]:
    """Pieces that continue each other in memory merged into one, in order (the arrays as given when none do).
    Pieces packed back to back in a slice continue each other there too, so a gather or scatter may copy the
    runs instead: a page's head slices where the slice holds its heads whole (TP 2 -> 1 on prefill, 1 -> 2 on
    decode) are one unit of a page's share, not a unit of a few hundred bytes each (16x fewer indices and
    ``Staged`` offsets at 16 rows a page)."""
    if len(addr) < 2:
        return addr, nbytes
    cont = addr[:-1] + nbytes[:-1] == addr[1:]
    if not cont.any():
        return addr, nbytes
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return addr[starts], np.add.reduceat(nbytes, starts)


def _copy(addr: IntArray, nbytes: IntArray, offset: int, max_units_per_piece: int) -> UnitCopy | None:
    """:func:`unit_copy` of pieces packed back to back from ``offset``, the runs of them continuing each other in
    memory copied as one piece each (:func:`merged`)."""
    runs, sizes = merged(addr, nbytes)
    packed = np.cumsum(sizes)
    packed -= sizes
    if offset:
        packed += offset
    return unit_copy(runs, packed, sizes, max_units_per_piece, len(addr))


def pack(addr: IntArray, nbytes: IntArray, groups: IntArray | None,
         max_units_per_piece: int = MAX_UNITS_PER_PIECE) -> tuple[IntArray, list[UnitCopy]]:
    """Which pieces a gather packs, in the order it packs them, and its copies: the pieces grouped by region
    (``groups``: each piece's; None: one region holds them all), each region's in their order, the region
    with the largest unit first (so that a region of odd sizes does not shift the others' offsets off their
    unit), a region whose pieces are too odd to copy by units left out. What is left out is written as
    planned: one odd region (a state of odd sizes written with the pages) must not keep the rest of its
    window from being staged."""
    found = np.unique(groups) if groups is not None else None
    if found is None or len(found) <= 1:  # one region: its pieces in their order, no index of them
        copy = _copy(addr, nbytes, 0, max_units_per_piece)
        return (np.arange(len(addr)), [copy]) if copy is not None else (np.zeros(0, np.int64), [])
    picks = [np.flatnonzero(groups == g) for g in found.tolist()]
    own = [_unit(nbytes[i], addr[i] - addr[i].min()) for i in picks]
    kept: list[IntArray] = []
    copies: list[UnitCopy] = []
    offset = 0
    for k in sorted(range(len(picks)), key=lambda k: -own[k]):  # stable: regions of one unit keep their order
        i = picks[k]
        copy = _copy(addr[i], nbytes[i], offset, max_units_per_piece)
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


class RegionPieces(NamedTuple):
    """A run of a window's pieces lying in one region, as unit offsets: piece ``k`` is ``counts[k]`` units
    (one each where ``counts`` is None) of ``unit`` bytes from unit ``offsets[k]`` of region ``region``
    (its position in the regions the :class:`RegionTable` was built from). What ``Staged`` carries."""

    region: int
    unit: int
    offsets: npt.NDArray[np.uint32]
    counts: npt.NDArray[np.uint32] | None


def region_pieces(addr: IntArray, nbytes: IntArray, table: RegionTable,
                  max_runs: int = MAX_RUNS) -> list[RegionPieces] | None:
    """Pieces at ``addr`` (``nbytes`` each), in order, as runs of consecutive pieces in one region of ``table``,
    each in units of the gcd of its pieces' sizes and offsets from the region's start; None when a piece lies
    outside every region, the runs would be more than ``max_runs``, or an offset passes :data:`MAX_OFFSET` units.
    A few passes over the arrays: pieces of one size at multiples of it (pages of a pool, head slices) need no
    gcd (:func:`_unit`), and of a power-of-two size no division either."""
    n = len(addr)
    if n == 0 or not len(table):
        return None
    size = int(nbytes[0])
    same = bool((nbytes == size).all())
    first = table.holding(addr, nbytes, size if same else None)
    if first >= 0:  # one region holds them all: no search per piece
        cuts, found = [0, n], [first]
    else:
        pos, inside = table.locate(addr, nbytes)
        if not inside.all():
            return None
        change = np.flatnonzero(pos[1:] != pos[:-1]) + 1
        if len(change) >= max_runs:
            return None
        cuts = [0, *change.tolist(), n]
        found = pos[cuts[:-1]].tolist()
    out = []
    for a, b, k in zip(cuts, cuts[1:], found):
        rel = addr[a:b] - table.starts[k]
        sizes = nbytes[a:b]
        unit = _unit(sizes, rel, same=same or None)
        offsets = _div(rel, unit)
        counts = None if same and unit == size else sizes // unit
        top = int(offsets[-1] if len(offsets) == 1 else offsets.max()) + (1 if counts is None else int(counts.max()))
        if top > MAX_OFFSET:
            return None
        out.append(RegionPieces(int(table.index[k]), unit, offsets.astype("<u4"),
                                None if counts is None else counts.astype("<u4")))
    return out


def expand(offsets: npt.NDArray[Any], counts: npt.NDArray[Any] | None) -> npt.NDArray[Any]:
    """The unit indices of pieces of ``counts`` units (one each where None) from unit ``offsets``, in order."""
    if counts is None:
        return offsets
    count = counts.astype(np.int64)
    units = int(count.sum())
    step = np.arange(units, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    return np.repeat(offsets.astype(np.int64), count) + step


class UnitRun(NamedTuple):
    """Pieces of one region packed back to back in a slice from byte ``start``: unit ``k`` of the slice from
    there is unit ``offsets[k]`` (``unit`` bytes each) of the memory at ``base``, which holds ``span`` units.
    A gather or scatter of such runs is one copy per run over a view of the region (host: :func:`put_units`;
    GPU: the device seam, ``kvbridge.core.transfer.device``)."""

    base: int
    unit: int
    offsets: npt.NDArray[Any]
    start: int
    span: int


def unit_runs(pieces: Sequence[RegionPieces], regions: Sequence[Region]) -> list[UnitRun]:
    """``pieces`` (of ``regions``: :func:`region_pieces`) as unit runs packed back to back from a slice's start."""
    runs, start = [], 0
    for p in pieces:
        r = regions[p.region]
        offsets = expand(p.offsets, p.counts)
        runs.append(UnitRun(r.addr, p.unit, offsets, start, r.nbytes // p.unit))
        start += len(offsets) * p.unit
    return runs


def put_units(slice_: npt.NDArray[np.uint8], runs: Sequence[UnitRun]) -> None:
    """Copy each run's units from ``slice_`` (host memory) into place: one ``numpy.put`` per run, from the
    slice as it lies. ``put`` is a loop of one memmove an index; a fancy assignment goes through numpy's
    index iterator, about 0.1 ms more a window of 32,768 units of 128 B (head slices, TP 2 -> 1:
    docs/performance.md, "Decode's side of a staged window")."""
    for r in runs:
        near = slice_[r.start:r.start + len(r.offsets) * r.unit].view(f"V{r.unit}")
        if len(near) != len(r.offsets):  # put would repeat the values it has: never scatter what is not there
            raise ValueError(f"a run of {len(r.offsets)} units of {r.unit} B from byte {r.start} passes the end of "
                             f"a slice of {len(slice_)} B")
        np.put(np.asarray(_Raw(r.base, r.span, r.unit)), r.offsets, near, mode="raise")
