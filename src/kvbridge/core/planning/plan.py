"""Transfer plans: vectorised ``(src_addr, dst_addr, nbytes)`` descriptor arrays.

Everything here works on whole numpy arrays; there is no Python loop per page,
run or descriptor. A backend receives a :class:`TransferPlan` that has been
bounds-checked against both sides' registered regions (:meth:`TransferPlan.validate`)
and moves exactly those bytes, split to its own limits with
:meth:`TransferPlan.batches`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, Union

import numpy as np
import numpy.typing as npt

from .indices import Indices, IntArray, PlanError, _as_index_array, check_indices
from ..description.layout import Region

__all__ = [
    "Indices",
    "Memory",
    "memory_of",
    "RegionTable",
    "PlanError",
    "TransferPlan",
    "coalesce_runs",
    "plan_pages",
    "plan_segments",
    "merge_contiguous",
    "check_indices",
]

def coalesce_runs(src_idx: npt.ArrayLike, dst_idx: npt.ArrayLike) -> tuple[IntArray, IntArray, IntArray]:
    """Split paired index lists into maximal runs contiguous on *both* sides.

    Returns ``(src_start, dst_start, run_len)``: run ``r`` covers
    ``src_start[r] + k -> dst_start[r] + k`` for ``k < run_len[r]``.
    """
    src = check_indices("src_idx", src_idx)
    dst = check_indices("dst_idx", dst_idx)
    if src.size != dst.size:
        raise PlanError(
            f"src_idx has {src.size} indices but dst_idx has {dst.size}; they are paired one to one"
        )
    return _runs(src, dst)


def _runs(src: IntArray, dst: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """:func:`coalesce_runs` of checked, equally long int64 lists."""
    n = src.size
    if n <= 1:  # no index or one (a metadata row, a 1-page request): one run or none, no numpy calls
        return src.copy(), dst.copy(), np.ones(n, np.int64)
    # Slices rather than np.diff: on the few-index lists of small requests its call overhead dominated.
    breaks = np.flatnonzero((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)) + 1
    if not breaks.size:
        return src[:1].copy(), dst[:1].copy(), np.array([n], np.int64)
    starts = np.concatenate(([0], breaks))
    run_len = np.diff(np.concatenate((starts, [n])))
    return src[starts], dst[starts], run_len


class _Outer:
    """Descriptors as an outer product, expanded only when read: row ``r``, column ``c`` moves
    ``nbytes[c]`` bytes from ``src_rows[r] + src_cols[c]`` to ``dst_rows[r] + dst_cols[c]``.

    Rows are region pairs, columns are coalesced runs; a 1M-token page-1 request over 61
    layers is ~57M descriptors (1.4 GB as arrays) but a few MB in this form. ``hint`` is what the
    planner knows of the columns without reading them (see :meth:`TransferPlan.hints`).
    """

    __slots__ = ("src_rows", "dst_rows", "src_cols", "dst_cols", "col_nbytes", "hint", "_cum", "_row_bytes")

    def __init__(self, src_rows: IntArray, dst_rows: IntArray, src_cols: IntArray, dst_cols: IntArray,
                 col_nbytes: IntArray, hint: tuple[int, int] = (0, 0)) -> None:
        self.src_rows, self.dst_rows = src_rows, dst_rows
        self.src_cols, self.dst_cols, self.col_nbytes = src_cols, dst_cols, col_nbytes
        self.hint = hint
        self._cum: IntArray | None = None
        # The one column size times the columns where the hint knows it; else summed once, when first asked.
        self._row_bytes: int | None = hint[1] * int(col_nbytes.shape[0]) if hint[1] else None

    def __len__(self) -> int:
        return int(self.src_rows.shape[0] * self.col_nbytes.shape[0])

    @property
    def total_bytes(self) -> int:
        if self._row_bytes is None:  # a pass over the columns (65,536 of a scattered 1 GiB of 16 KiB pages)
            self._row_bytes = int(self.col_nbytes.sum())
        return int(self.src_rows.shape[0]) * self._row_bytes

    def max_nbytes(self) -> int:
        return int(self.col_nbytes.max())

    def cum_bytes(self, k: int) -> int:
        """Bytes of the first ``k`` descriptors."""
        if self._cum is None:
            self._cum = np.concatenate(([0], np.cumsum(self.col_nbytes)))
        cols = self.col_nbytes.shape[0]
        r, c = divmod(k, cols)
        return r * int(self._cum[-1]) + int(self._cum[c])

    def first_over(self, limit: int) -> int:
        """The least ``k`` with ``cum_bytes(k) > limit`` (``len`` + 1 if none)."""
        self.cum_bytes(0)
        assert self._cum is not None
        row = int(self._cum[-1])
        r = limit // row
        if r >= self.src_rows.shape[0]:
            return len(self) + 1
        return r * self.col_nbytes.shape[0] + int(np.searchsorted(self._cum, limit - r * row, side="right"))

    def arrays(self, lo: int, hi: int) -> tuple[IntArray, IntArray, IntArray]:
        """Descriptors ``lo .. hi-1`` (row-major order) as three new int64 arrays."""
        cols = self.col_nbytes.shape[0]
        r0, c0 = divmod(lo, cols)
        r1, c1 = divmod(hi, cols)
        pieces = []
        if r0 == r1:
            pieces.append(self._block(r0, r0 + 1, c0, c1))
        else:
            if c0:
                pieces.append(self._block(r0, r0 + 1, c0, cols))
                r0 += 1
            if r1 > r0:
                pieces.append(self._block(r0, r1, 0, cols))
            if c1:
                pieces.append(self._block(r1, r1 + 1, 0, c1))
        if len(pieces) == 1:
            return pieces[0]
        return tuple(np.concatenate(p) for p in zip(*pieces))  # type: ignore[return-value]

    def _block(self, r0: int, r1: int, c0: int, c1: int) -> tuple[IntArray, IntArray, IntArray]:
        # One pass per output array: each is written once, no temporaries of its size.
        shape = (r1 - r0, c1 - c0)
        src, dst, nbytes = np.empty(shape, np.int64), np.empty(shape, np.int64), np.empty(shape, np.int64)
        np.add(self.src_rows[r0:r1, None], self.src_cols[None, c0:c1], out=src)
        np.add(self.dst_rows[r0:r1, None], self.dst_cols[None, c0:c1], out=dst)
        nbytes[...] = self.col_nbytes[None, c0:c1]
        return src.ravel(), dst.ravel(), nbytes.ravel()


class _Arrays:
    """Descriptors given as three int64 arrays."""

    __slots__ = ("src", "dst", "nbytes", "_cum")

    def __init__(self, src: IntArray, dst: IntArray, nbytes: IntArray) -> None:
        self.src, self.dst, self.nbytes = src, dst, nbytes
        self._cum: IntArray | None = None

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def max_nbytes(self) -> int:
        return int(self.nbytes.max())

    def cum_bytes(self, k: int) -> int:
        if self._cum is None:
            self._cum = np.concatenate(([0], np.cumsum(self.nbytes)))
        return int(self._cum[k])

    def first_over(self, limit: int) -> int:
        self.cum_bytes(0)
        assert self._cum is not None
        return int(np.searchsorted(self._cum, limit, side="right"))

    def arrays(self, lo: int, hi: int) -> tuple[IntArray, IntArray, IntArray]:
        return self.src[lo:hi], self.dst[lo:hi], self.nbytes[lo:hi]


_Part = Union[_Arrays, _Outer]


def _by_group(group: IntArray) -> Iterator[tuple[int, IntArray | slice | None]]:
    """Per group present in ``group``, ascending: its positions, in order (None: all of them). Slices when
    each group is one run and the runs ascend (rows in layer order, the usual plan), else index arrays."""
    n = len(group)
    cuts = np.flatnonzero(group[1:] != group[:-1]) + 1
    if not cuts.size:
        yield int(group[0]), None
        return
    if (np.diff(group[np.concatenate(([0], cuts))]) > 0).all():  # each group one run (sorted): slices
        bounds = [0, *cuts.tolist(), n]
        ids = group[bounds[:-1]].tolist()
        for g, lo, hi in zip(ids, bounds, bounds[1:]):
            yield g, slice(lo, hi)
        return
    order = np.argsort(group, kind="stable")
    ordered = group[order]
    bounds = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), n]
    for lo, hi in zip(bounds, bounds[1:]):
        yield int(ordered[lo]), order[lo:hi]


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
        self._parts: tuple[_Part, ...] = (_Arrays(src_addr, dst_addr, nbytes),) if n[0] else ()
        self._expanded: tuple[IntArray, IntArray, IntArray] | None = (src_addr, dst_addr, nbytes)

    @classmethod
    def _of(cls, parts: Sequence[_Part]) -> TransferPlan:
        plan = cls.__new__(cls)
        plan._parts = tuple(p for p in parts if len(p))
        plan._expanded = None
        return plan

    @classmethod
    def outer(cls, src_rows: IntArray, dst_rows: IntArray, src_cols: IntArray, dst_cols: IntArray,
              col_nbytes: IntArray, hint: tuple[int, int] = (0, 0)) -> TransferPlan:
        """Every (row, column): ``col_nbytes[c]`` bytes from ``src_rows[r] + src_cols[c]`` to
        ``dst_rows[r] + dst_cols[c]``, row by row; nothing is expanded yet. ``hint``: see :meth:`hints`."""
        return cls._of([_Outer(src_rows, dst_rows, src_cols, dst_cols, col_nbytes, hint)])

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
            if len(self._parts) == 1 and isinstance(self._parts[0], _Arrays):
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
            self._parts = (_Arrays(*self._expanded),) if self._parts else ()
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
        return sum(len(p) for p in self._parts)

    @property
    def num_descriptors(self) -> int:
        return len(self)

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for p in self._parts)

    @property
    def max_nbytes(self) -> int:
        """The largest descriptor's size (0 for an empty plan), without expanding the plan."""
        return max((p.max_nbytes() for p in self._parts), default=0)

    def factors(self) -> list[tuple[IntArray, IntArray, IntArray, IntArray, IntArray]]:
        """The plan as outer sums, in order, without expanding it: ``(src_rows, dst_rows, src_cols,
        dst_cols, nbytes)`` each, row ``r`` and column ``c`` moving ``nbytes[c]`` bytes (``nbytes[r]``
        where there is one column per row: a part given as arrays has columns ``[0]``, sizes per row)."""
        zero = np.zeros(1, np.int64)
        return [(p.src_rows, p.dst_rows, p.src_cols, p.dst_cols, p.col_nbytes) if isinstance(p, _Outer)
                else (p.src, p.dst, zero, zero, p.nbytes) for p in self._parts]

    def hints(self) -> list[tuple[int, int]]:
        """Per part of :meth:`factors`, what the planner knew of its columns without reading them:
        ``(align, size)``, a power of two dividing every column offset and size, and the one size of
        every column (0: not known). The GPU copy's launch shape uses them instead of reducing the
        columns (a scattered 1 GiB request of 16 KiB pages has 65,536)."""
        return [p.hint if isinstance(p, _Outer) else (0, 0) for p in self._parts]


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
        out: list[list[_Part]] = [[] for _ in range(groups)]
        for p in self._parts:
            if isinstance(p, _Outer):
                lo = int(p.src_cols.min())
                span = int((p.src_cols + p.col_nbytes).max()) - lo
                group, inside = group_of(p.src_rows + lo, np.full(p.src_rows.shape, span, np.int64))
                if inside.all():
                    for g, take in _by_group(group):
                        out[g].append(p if take is None else _Outer(p.src_rows[take], p.dst_rows[take], p.src_cols,
                                                                    p.dst_cols, p.col_nbytes, p.hint))
                    continue
                p = _Arrays(*p.arrays(0, len(p)))
            group, inside = group_of(p.src, p.nbytes)
            if not inside.all():
                i = int(np.flatnonzero(~inside)[0])
                raise PlanError(f"a descriptor (source {int(p.src[i]):#x}, {int(p.nbytes[i])} B) lies in none of the "
                                "places it is split by")
            for g, take in _by_group(group):
                out[g].append(p if take is None else _Arrays(p.src[take], p.dst[take], p.nbytes[take]))
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
                    f"any registered {side} region{_nearest(a, regions)}"
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


class RegionTable:
    """Regions sorted by address, to find which one holds each address of a whole array.

    Regions do not overlap (KVArgs checks), so the only candidate for an
    address is the last region starting at or before it: one
    ``searchsorted`` per array. ``vram`` and ``device`` give each region's
    memory kind and device, in the same (sorted) order.
    """

    def __init__(self, regions: Sequence[Region]) -> None:
        ordered = sorted(regions, key=lambda r: r.addr)
        self.starts = np.array([r.addr for r in ordered], np.int64)
        self.ends = np.array([r.end for r in ordered], np.int64)
        self.vram = np.array([r.mem == "vram" for r in ordered], bool)
        self.device = np.array([r.device for r in ordered], np.int64)
        #: The (memory kind, device) pairs of the regions, and each region's index into them.
        places = [(r.mem, r.device) for r in ordered]
        self.places: list[tuple[str, int]] = sorted(set(places))
        self.place = np.array([self.places.index(p) for p in places], np.int64)

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def locate(self, addrs: IntArray, nbytes: IntArray) -> tuple[IntArray, npt.NDArray[np.bool_]]:
        """Per descriptor: the index of its region (0 where none) and whether it lies wholly inside it."""
        if not len(self):
            return np.zeros(addrs.shape, np.int64), np.zeros(addrs.shape, bool)
        pos = np.searchsorted(self.starts, addrs, side="right") - 1
        ok = pos >= 0
        pos = np.where(ok, pos, 0)
        return pos, ok & (addrs + nbytes <= self.ends[pos])


def _nearest(addr: int, regions: Sequence[Region]) -> str:
    if not regions:
        return " (no regions registered)"
    r = min(regions, key=lambda r: min(abs(addr - r.addr), abs(addr - r.end)))
    return f" (nearest: {r.name!r} [{r.addr:#x}, {r.end:#x}))"


def plan_pages(
    src_bases: npt.ArrayLike,
    dst_bases: npt.ArrayLike,
    item_nbytes: npt.ArrayLike,
    src_idx: npt.ArrayLike,
    dst_idx: npt.ArrayLike,
) -> TransferPlan:
    """One descriptor per coalesced run per region pair.

    Region pair ``e`` moves item ``src_idx[k]`` of the source region based at
    ``src_bases[e]`` to item ``dst_idx[k]`` of the destination region based at
    ``dst_bases[e]``; both have items of ``item_nbytes[e]`` bytes. Descriptors
    are ordered region pair by region pair. Destination indices must be
    unique.
    """
    src_b = _as_index_array("src_bases", src_bases)
    dst_b = _as_index_array("dst_bases", dst_bases)
    item = _as_index_array("item_nbytes", item_nbytes)
    if not (src_b.size == dst_b.size == item.size):
        raise PlanError(
            f"per-region arrays differ in length: src_bases {src_b.size}, "
            f"dst_bases {dst_b.size}, item_nbytes {item.size}"
        )
    if item.size and (item <= 0).any():
        e = int(np.flatnonzero(item <= 0)[0])
        raise PlanError(f"item_nbytes[{e}] = {int(item[e])}; item sizes must be > 0")
    dst = check_indices("dst_idx", dst_idx, unique=True)
    src = check_indices("src_idx", src_idx)
    if src.size != dst.size:
        raise PlanError(f"src_idx has {src.size} indices but dst_idx has {dst.size}; they are paired one to one")
    return _plan_pages(src_b, dst_b, item, src, dst)


def _plan_pages(src_b: IntArray, dst_b: IntArray, item: IntArray, src_idx: IntArray, dst_idx: IntArray) -> TransferPlan:
    """:func:`plan_pages` of checked arrays."""
    src_start, dst_start, run_len = _runs(src_idx, dst_idx)
    if src_start.size == 0 or item.size == 0:
        return TransferPlan.empty()
    if item.size == 1 or (item == item[0]).all():
        # Rows are region pairs, columns are runs: kept as an outer sum and
        # expanded batch by batch where it is written (TransferPlan.batches).
        it = int(item[0])
        # Columns are multiples of the item; no run coalesced (as many runs as indices): each is one item.
        hint = (it & -it, it if src_start.size == src_idx.size else 0)
        return TransferPlan.outer(src_b, dst_b, src_start * it, dst_start * it, run_len * it, hint)
    # Items of different sizes per region pair: expanded now, written in place
    # (at millions of descriptors the temporaries would cost as much as the result).
    shape = (item.size, src_start.size)
    src, dst, nbytes = np.empty(shape, np.int64), np.empty(shape, np.int64), np.empty(shape, np.int64)
    np.multiply(item[:, None], src_start[None, :], out=src)
    src += src_b[:, None]
    np.multiply(item[:, None], dst_start[None, :], out=dst)
    dst += dst_b[:, None]
    np.multiply(item[:, None], run_len[None, :], out=nbytes)
    return TransferPlan(src.ravel(), dst.ravel(), nbytes.ravel())


def merge_contiguous(src: IntArray, dst: IntArray, nbytes: IntArray) -> TransferPlan:
    """Merge neighbouring descriptors that continue each other on both sides."""
    n = nbytes.shape[0]
    if n <= 1:
        return TransferPlan(src, dst, nbytes)
    cont = (src[:-1] + nbytes[:-1] == src[1:]) & (dst[:-1] + nbytes[:-1] == dst[1:])
    if not cont.any():
        return TransferPlan(src, dst, nbytes)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return TransferPlan(src[starts], dst[starts], np.add.reduceat(nbytes, starts))


def plan_segments(
    src_bases: npt.ArrayLike,
    dst_bases: npt.ArrayLike,
    src_strides: npt.ArrayLike,
    dst_strides: npt.ArrayLike,
    segments: npt.ArrayLike,
    src_idx: npt.ArrayLike,
    dst_idx: npt.ArrayLike,
) -> TransferPlan:
    """Descriptors for partial items: every (region pair, index, segment), merged.

    ``segments`` is an ``(S, 3)`` array of ``(src_offset, dst_offset, nbytes)``
    inside one item, shared by all region pairs of the call. Item ``src_idx[k]``
    of source region ``e`` (base ``src_bases[e]``, ``src_strides[e]`` bytes per
    item) sends each segment to item ``dst_idx[k]`` of destination region ``e``.
    Descriptors that continue each other on both sides are merged, so a
    segment that covers whole items costs one descriptor per contiguous run.
    Destination indices must be unique.
    """
    sb = _as_index_array("src_bases", src_bases)
    db = _as_index_array("dst_bases", dst_bases)
    ss = _as_index_array("src_strides", src_strides)
    ds = _as_index_array("dst_strides", dst_strides)
    if not (sb.size == db.size == ss.size == ds.size):
        raise PlanError(
            f"per-region arrays differ in length: src_bases {sb.size}, dst_bases {db.size}, "
            f"src_strides {ss.size}, dst_strides {ds.size}"
        )
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    if seg.size and ((seg[:, 2] <= 0).any() or (seg[:, :2] < 0).any()):
        raise PlanError("segments need offsets >= 0 and sizes > 0")
    s_idx = check_indices("src_idx", src_idx)
    d_idx = check_indices("dst_idx", dst_idx, unique=True)
    if s_idx.size != d_idx.size:
        raise PlanError(f"src_idx has {s_idx.size} indices but dst_idx has {d_idx.size}; they are paired one to one")
    return _plan_segments(sb, db, ss, ds, seg, s_idx, d_idx)


def _plan_segments(
    sb: IntArray, db: IntArray, ss: IntArray, ds: IntArray, seg: IntArray, s_idx: IntArray, d_idx: IntArray
) -> TransferPlan:
    """:func:`plan_segments` of checked arrays."""
    if sb.size == 0 or s_idx.size == 0 or seg.shape[0] == 0:
        return TransferPlan.empty()
    # Rows (region, index), columns segments: kept as an outer sum unless two neighbours continue
    # each other on both sides (then merged below): inside an item, or across rows.
    rows_src = (sb[:, None] + s_idx[None, :] * ss[:, None]).ravel()
    rows_dst = (db[:, None] + d_idx[None, :] * ds[:, None]).ravel()
    first, last = seg[0], seg[-1]
    inner = (seg[:-1, 0] + seg[:-1, 2] == seg[1:, 0]) & (seg[:-1, 1] + seg[:-1, 2] == seg[1:, 1])
    across = ((rows_src[:-1] + (last[0] + last[2] - first[0]) == rows_src[1:])
              & (rows_dst[:-1] + (last[1] + last[2] - first[1]) == rows_dst[1:]))
    if not inner.any() and not across.any():
        return TransferPlan.outer(rows_src, rows_dst, seg[:, 0].copy(), seg[:, 1].copy(), seg[:, 2].copy())
    # Shape (regions, indices, segments), flattened in that order so that
    # neighbours in memory are neighbours in the arrays and can merge.
    src = sb[:, None, None] + s_idx[None, :, None] * ss[:, None, None] + seg[None, None, :, 0]
    dst = db[:, None, None] + d_idx[None, :, None] * ds[:, None, None] + seg[None, None, :, 1]
    nbytes = np.broadcast_to(seg[None, None, :, 2], src.shape)
    return merge_contiguous(src.ravel(), dst.ravel(), np.ascontiguousarray(nbytes).ravel())
