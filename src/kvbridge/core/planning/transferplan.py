"""``TransferPlan``: vectorised ``(src_addr, dst_addr, nbytes)`` descriptor arrays.

Everything here works on whole numpy arrays; there is no Python loop per page,
run or descriptor. A backend receives a :class:`TransferPlan` that has been
bounds-checked against both sides' registered regions (:meth:`TransferPlan.validate`)
and moves exactly those bytes, split to its own limits with
:meth:`TransferPlan.batches`. The planners that build plans from index lists are
in :mod:`.plan`; how a plan stores its descriptors is in :mod:`.parts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ..description.layout import Region
from .indices import IntArray, PlanError
from .parts import ArrayPart, OuterPart, Part, by_group
from .regions import RegionTable, nearest_region

__all__ = ["Memory", "memory_of", "PlanError", "TransferPlan"]


class Memory(NamedTuple):
    """Where a batch's descriptors are: the memory kind ("dram", "vram") and device of every source,
    and of every destination (one of each: core splits a write by them before a backend sees it)."""

    src_kind: str
    src_device: int
    dst_kind: str
    dst_device: int


def memory_of(plan: TransferPlan, local: RegionTable, peer: RegionTable) -> Memory:
    """Where the descriptors of a plan core did not post lie (core sets :attr:`TransferPlan.memory` on
    every batch it posts), located once; :class:`PlanError` if they span several memory kinds or
    devices on a side: write such a plan through a ``Transport``, which splits it."""
    found = []
    for table, addr in ((local, plan.src_addr), (peer, plan.dst_addr)):
        places = np.unique(table.place[table.locate(addr, plan.nbytes)[0]]) if len(table) and len(plan) else []
        if len(places) > 1:
            raise PlanError(f"the plan spans {len(places)} memory kinds or devices on one side; "
                            "write it through a Transport, which splits it by them")
        found.append(table.places[int(places[0])] if len(places) else ("dram", 0))
    return Memory(*found[0], *found[1])


def _scaled(p: OuterPart, in_units: bool) -> tuple[IntArray, IntArray]:
    """``p``'s columns in bytes, or as kept (``in_units``)."""
    if in_units or p.unit == 1:
        return p.src_cols, p.dst_cols
    return p.src_cols * p.unit, p.dst_cols * p.unit


class TransferPlan:
    """Descriptors to move: ``nbytes[i]`` bytes from ``src_addr[i]`` to ``dst_addr[i]``.

    The three arrays are int64 and of equal length. A plan the planner builds
    by coalesced runs is kept as an outer product (region pairs x runs) and
    expanded only where it is read: :meth:`batches` expands one batch at a
    time, and reading ``src_addr``, ``dst_addr`` or ``nbytes`` expands the
    whole plan once. Batches of a plan given as arrays are views, not copies.
    """

    #: Set by core on each batch it hands a backend (``Backend.write``): where its sources and
    #: destinations are, one memory kind and device a side. None on a plan core did not post.
    memory: Memory | None = None

    def __init__(self, src_addr: IntArray, dst_addr: IntArray, nbytes: IntArray) -> None:
        n = src_addr.shape
        if dst_addr.shape != n or nbytes.shape != n or len(n) != 1:
            raise PlanError(
                f"plan arrays differ in shape: src {src_addr.shape}, "
                f"dst {dst_addr.shape}, nbytes {nbytes.shape}"
            )
        self._parts: tuple[Part, ...] = (ArrayPart(src_addr, dst_addr, nbytes),) if n[0] else ()
        self._expanded: tuple[IntArray, IntArray, IntArray] | None = (src_addr, dst_addr, nbytes)
        # Asked several times per write (batching, the fence, metrics): counted once. Parts never change
        # what they hold (_arrays swaps them for the same descriptors as arrays).
        self._len = int(n[0])
        self._bytes: int | None = None
        self._tuples: list[tuple[int, int, int]] | None = None

    @classmethod
    def _of(cls, parts: Sequence[Part]) -> TransferPlan:
        plan = cls.__new__(cls)
        if len(parts) == 1:  # a planner's one part (most plans): no generators
            n = len(parts[0])
            plan._parts, plan._len = (tuple(parts) if n else ()), n
        else:
            plan._parts = tuple(p for p in parts if len(p))
            plan._len = sum(len(p) for p in plan._parts)
        plan._expanded = None
        plan._bytes = None
        plan._tuples = None
        return plan

    @classmethod
    def outer(cls, src_rows: IntArray, dst_rows: IntArray, src_cols: IntArray, dst_cols: IntArray,
              col_nbytes: IntArray, hint: tuple[int, int] = (0, 0), row_bytes: int | None = None,
              unit: int = 1) -> TransferPlan:
        """Every (row, column): ``col_nbytes[c]`` bytes from ``src_rows[r] + src_cols[c] * unit`` to
        ``dst_rows[r] + dst_cols[c] * unit``, row by row; nothing is expanded yet. ``hint``: see :meth:`hints`.
        ``row_bytes``: ``col_nbytes``' sum where the caller knows it (else summed when first needed).
        The arrays are kept, not copied: the caller must not change them afterwards."""
        return cls._of([OuterPart(src_rows, dst_rows, src_cols, dst_cols, col_nbytes, hint, row_bytes, unit)])

    @classmethod
    def empty(cls) -> TransferPlan:
        return cls._of(())

    @classmethod
    def concat(cls, plans: Iterable[TransferPlan]) -> TransferPlan:
        plans = [p for p in plans if len(p)]
        if len(plans) == 1:
            return plans[0]
        return cls._of([part for p in plans for part in p._parts])

    def _arrays(self) -> tuple[IntArray, IntArray, IntArray]:
        if self._expanded is None:
            if len(self._parts) == 1 and isinstance(self._parts[0], ArrayPart):
                a = self._parts[0]
                self._expanded = (a.src, a.dst, a.nbytes)
            elif not self._parts:
                empty = np.empty(0, np.int64)
                self._expanded = (empty, empty.copy(), empty.copy())
            else:
                pieces = [p.arrays(0, len(p)) for p in self._parts]
                src, dst, nbytes = (pieces[0][i] if len(pieces) == 1 else np.concatenate([p[i] for p in pieces])
                                    for i in range(3))
                self._expanded = (src, dst, nbytes)
            # Batches of an expanded plan are views of it.
            self._parts = (ArrayPart(*self._expanded),) if self._parts else ()
        return self._expanded

    @property
    def src_addr(self) -> IntArray:
        return self._arrays()[0]

    @property
    def dst_addr(self) -> IntArray:
        return self._arrays()[1]

    @property
    def nbytes(self) -> IntArray:
        return self._arrays()[2]

    def __len__(self) -> int:
        return self._len

    @property
    def num_descriptors(self) -> int:
        return len(self)

    @property
    def total_bytes(self) -> int:
        if self._bytes is None:
            parts = self._parts
            self._bytes = parts[0].total_bytes if len(parts) == 1 else sum(p.total_bytes for p in parts)
        return self._bytes

    def descriptors(self) -> list[tuple[int, int, int]]:
        """Every descriptor as ``(src_addr, dst_addr, nbytes)`` Python ints, in order; kept (a plan never
        changes). For small plans read by Python (a backend's descriptor tuples, a metadata row read on the
        CPU): an outer-sum plan is not expanded into arrays first (a 1-page request's ten numpy calls, #27)."""
        if self._tuples is None:
            self._tuples = [d for p in self._parts for d in p.descriptors()]
        return self._tuples

    @property
    def max_nbytes(self) -> int:
        """The largest descriptor's size (0 for an empty plan), without expanding the plan."""
        return max((p.max_nbytes() for p in self._parts), default=0)

    def factors(self, in_units: bool = False) -> list[tuple[IntArray, IntArray, IntArray, IntArray, IntArray]]:
        """The plan as outer sums, in order, without expanding it: ``(src_rows, dst_rows, src_cols,
        dst_cols, nbytes)`` each, row ``r`` and column ``c`` moving ``nbytes[c]`` bytes (``nbytes[r]``
        where there is one column per row: a part given as arrays has columns ``[0]``, sizes per row).

        Column offsets are in bytes; with ``in_units`` they are as the plan keeps them, in units of
        :meth:`units` bytes (an item: a page's column is its index), which costs no new arrays: a
        backend that scales them where it copies them anyway (the GPU copy's table) saves a pass and
        two arrays of the request's length."""
        zero = np.zeros(1, np.int64)
        return [(p.src_rows, p.dst_rows, *_scaled(p, in_units), p.col_nbytes) if isinstance(p, OuterPart)
                else (p.src, p.dst, zero, zero, p.nbytes) for p in self._parts]

    def units(self) -> list[int]:
        """Per part of :meth:`factors`, the bytes one column step is in ``factors(in_units=True)`` (1: bytes)."""
        return [p.unit if isinstance(p, OuterPart) else 1 for p in self._parts]

    def hints(self) -> list[tuple[int, int]]:
        """Per part of :meth:`factors`, what the planner knew of its columns without reading them:
        ``(align, size)``, a power of two dividing every column offset and size, and the one size of
        every column (0: not known). The GPU copy's launch shape uses them instead of reducing the
        columns (a scattered 1 GiB request of 16 KiB pages has 65,536)."""
        return [p.hint if isinstance(p, OuterPart) else (0, 0) for p in self._parts]


    def explain(self, limit: int = 8) -> str:
        """A short human-readable summary, with the first ``limit`` descriptors."""
        n = len(self)
        if n == 0:
            return "TransferPlan: empty (nothing to move)"
        sizes = self.nbytes
        lines = [
            f"TransferPlan: {n} descriptors, {self.total_bytes} bytes "
            f"({self.total_bytes / 2**20:.2f} MiB)",
            f"  descriptor size: min {int(sizes.min())} B, median {int(np.median(sizes))} B, "
            f"max {int(sizes.max())} B",
        ]
        for i in range(min(n, limit)):
            lines.append(
                f"  [{i}] {int(self.src_addr[i]):#x} -> {int(self.dst_addr[i]):#x}  {int(sizes[i])} B"
            )
        if n > limit:
            lines.append(f"  ... {n - limit} more")
        return "\n".join(lines)

    def split(self, group_of: Callable[[IntArray, IntArray], tuple[IntArray, npt.NDArray[np.bool_]]],
              groups: int) -> list[TransferPlan]:
        """The descriptors cut into ``groups`` plans by their source, in this plan's order inside each; nothing expanded.

        ``group_of(addr, nbytes)`` says, per source range, its group and whether the range lies wholly
        in one place of that group. A part kept as rows x columns is asked once per row, for the range
        from its lowest column to the end of its highest: a row goes whole to one group, so splitting a
        plan of region pairs x pages costs a few calls per region, not per descriptor. A part given as
        arrays, or one with a row across two places, is asked per descriptor. Raises :class:`PlanError`
        for a descriptor in no group's place.
        """
        out: list[list[Part]] = [[] for _ in range(groups)]
        for p in self._parts:
            if isinstance(p, OuterPart):
                lo = int(p.src_cols.min()) * p.unit
                # The end of the highest column: with one size for every column, no array of ends is made.
                ends = int(p.src_cols.max()) * p.unit + p.hint[1] if p.hint[1] else int((p.src_cols * p.unit + p.col_nbytes).max())
                span = ends - lo
                group, inside = group_of(p.src_rows + lo, np.full(p.src_rows.shape, span, np.int64))
                if inside.all():
                    for g, take in by_group(group):
                        out[g].append(p if take is None else OuterPart(p.src_rows[take], p.dst_rows[take], p.src_cols,
                                                                    p.dst_cols, p.col_nbytes, p.hint, p._row_bytes, p.unit))
                    continue
                p = ArrayPart(*p.arrays(0, len(p)))
            group, inside = group_of(p.src, p.nbytes)
            if not inside.all():
                i = int(np.flatnonzero(~inside)[0])
                raise PlanError(f"a descriptor (source {int(p.src[i]):#x}, {int(p.nbytes[i])} B) lies in none of the "
                                "places it is split by")
            for g, take in by_group(group):
                out[g].append(p if take is None else ArrayPart(p.src[take], p.dst[take], p.nbytes[take]))
        return [TransferPlan._of(parts) for parts in out]

    def validate(self, src_regions: Sequence[Region], dst_regions: Sequence[Region]) -> None:
        """Check every descriptor lies inside one registered region on each side.

        Raises :class:`PlanError` naming the first offending descriptor before
        anything has moved.
        """
        if len(self) == 0:
            return
        bad = np.flatnonzero(self.nbytes <= 0)
        if bad.size:
            i = int(bad[0])
            raise PlanError(f"descriptor {i} has size {int(self.nbytes[i])}; sizes must be > 0")
        for side, addrs, regions in (
            ("source", self.src_addr, src_regions),
            ("destination", self.dst_addr, dst_regions),
        ):
            inside = RegionTable(regions).locate(addrs, self.nbytes)[1]
            if not inside.all():
                i = int(np.flatnonzero(~inside)[0])
                a, n = int(addrs[i]), int(self.nbytes[i])
                raise PlanError(
                    f"descriptor {i} ({n} B at {side} {a:#x}..{a + n:#x}) is not inside "
                    f"any registered {side} region{nearest_region(a, regions)}"
                )

    def cut(self, max_bytes: int) -> TransferPlan:
        """This plan with every descriptor longer than ``max_bytes`` cut into pieces of at most that size."""
        if max_bytes <= 0:
            raise PlanError(f"max_bytes must be > 0, got {max_bytes}")
        if len(self) == 0 or self.max_nbytes <= max_bytes:
            return self
        pieces = -(-self.nbytes // max_bytes)
        ends = np.cumsum(pieces)
        k = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - pieces, pieces)  # piece number in its descriptor
        offset = k * max_bytes
        nbytes = np.minimum(np.repeat(self.nbytes, pieces) - offset, max_bytes)
        return TransferPlan(np.repeat(self.src_addr, pieces) + offset, np.repeat(self.dst_addr, pieces) + offset, nbytes)

    def batches(self, max_descriptors: int | None = None, max_bytes: int | None = None) -> Iterator[TransferPlan]:
        """Yield consecutive sub-plans within an engine's limits, each expanded as it is reached.

        Each batch has at most ``max_descriptors`` descriptors and at most
        ``max_bytes`` bytes, except that a single descriptor larger than
        ``max_bytes`` forms a batch of its own (descriptors are never split).
        """
        n = len(self)
        if n == 0:
            return
        if max_descriptors is not None and max_descriptors <= 0:
            raise PlanError(f"max_descriptors must be > 0, got {max_descriptors}")
        if max_bytes is not None and max_bytes <= 0:
            raise PlanError(f"max_bytes must be > 0, got {max_bytes}")
        step = n if max_descriptors is None else max_descriptors
        lo = 0
        while lo < n:
            hi = min(lo + step, n)
            if max_bytes is not None:
                hi = min(max(self._first_over(self._cum_bytes(lo) + max_bytes) - 1, lo + 1), hi)
            yield self._slice(lo, hi)
            lo = hi

    # -- positions across parts (a batch may span two parts) --------------------------------
    def _cum_bytes(self, k: int) -> int:
        total = 0
        for p in self._parts:
            if k <= len(p):
                return total + p.cum_bytes(k)
            k -= len(p)
            total += p.total_bytes
        return total

    def _first_over(self, limit: int) -> int:
        """The least ``k`` whose first ``k`` descriptors hold more than ``limit`` bytes (len + 1: none)."""
        before = 0
        for p in self._parts:
            total = p.total_bytes
            if limit < total:
                return before + p.first_over(limit)
            limit -= total
            before += len(p)
        return before + 1

    def _slice(self, lo: int, hi: int) -> TransferPlan:
        pieces = []
        for p in self._parts:
            n = len(p)
            if lo < n and hi > 0:
                pieces.append(p.arrays(max(lo, 0), min(hi, n)))
            lo -= n
            hi -= n
        if len(pieces) == 1:
            return TransferPlan(*pieces[0])
        return TransferPlan(*(np.concatenate([q[i] for q in pieces]) for i in range(3)))
