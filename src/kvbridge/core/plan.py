"""Transfer plans: vectorised ``(src_addr, dst_addr, nbytes)`` descriptor arrays.

Everything here works on whole numpy arrays; there is no Python loop per page,
run or descriptor. A backend receives a :class:`TransferPlan` that has been
bounds-checked against both sides' registered regions (:meth:`TransferPlan.validate`)
and moves exactly those bytes, split to its own limits with
:meth:`TransferPlan.batches`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .indices import Indices, IntArray, PlanError, _as_index_array, check_indices
from .layout import Region

__all__ = [
    "Indices",
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
    if n == 0:
        empty = np.empty(0, np.int64)
        return empty, empty.copy(), empty.copy()
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    run_len = np.diff(np.concatenate((starts, [n])))
    return src[starts], dst[starts], run_len


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Descriptors to move: ``nbytes[i]`` bytes from ``src_addr[i]`` to ``dst_addr[i]``.

    The three arrays are int64 and of equal length; a plan never copies them
    when sliced into batches.
    """

    src_addr: IntArray
    dst_addr: IntArray
    nbytes: IntArray

    def __post_init__(self) -> None:
        n = self.src_addr.shape
        if self.dst_addr.shape != n or self.nbytes.shape != n or len(n) != 1:
            raise PlanError(
                f"plan arrays differ in shape: src {self.src_addr.shape}, "
                f"dst {self.dst_addr.shape}, nbytes {self.nbytes.shape}"
            )

    @classmethod
    def empty(cls) -> TransferPlan:
        return cls(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))

    @classmethod
    def concat(cls, plans: Iterable[TransferPlan]) -> TransferPlan:
        plans = [p for p in plans if len(p)]
        if not plans:
            return cls.empty()
        if len(plans) == 1:
            return plans[0]
        return cls(
            np.concatenate([p.src_addr for p in plans]),
            np.concatenate([p.dst_addr for p in plans]),
            np.concatenate([p.nbytes for p in plans]),
        )

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def num_descriptors(self) -> int:
        return len(self)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

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
        if len(self) == 0 or int(self.nbytes.max()) <= max_bytes:
            return self
        pieces = -(-self.nbytes // max_bytes)
        ends = np.cumsum(pieces)
        k = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - pieces, pieces)  # piece number in its descriptor
        offset = k * max_bytes
        nbytes = np.minimum(np.repeat(self.nbytes, pieces) - offset, max_bytes)
        return TransferPlan(np.repeat(self.src_addr, pieces) + offset, np.repeat(self.dst_addr, pieces) + offset, nbytes)

    def batches(self, max_descriptors: int | None = None, max_bytes: int | None = None) -> Iterator[TransferPlan]:
        """Yield consecutive sub-plans within an engine's limits (views, no copies).

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
        if max_bytes is None:
            bounds = list(range(0, n, step)) + [n]
        else:
            bounds = _byte_bounds(self.nbytes, step, max_bytes)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            yield TransferPlan(self.src_addr[lo:hi], self.dst_addr[lo:hi], self.nbytes[lo:hi])


def _byte_bounds(nbytes: IntArray, step: int, max_bytes: int) -> list[int]:
    # One searchsorted per batch (not per descriptor) on the prefix sums.
    cum = np.cumsum(nbytes)
    n = nbytes.shape[0]
    bounds = [0]
    lo = 0
    while lo < n:
        base = int(cum[lo - 1]) if lo else 0
        hi = int(np.searchsorted(cum, base + max_bytes, side="right"))
        hi = min(max(hi, lo + 1), lo + step, n)
        bounds.append(hi)
        lo = hi
    return bounds


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
    # Outer products: rows are region pairs, columns are runs. Written in place:
    # at millions of descriptors the temporaries would cost as much as the result.
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
    # Shape (regions, indices, segments), flattened in that order so that
    # neighbours in memory are neighbours in the arrays and can merge.
    src = sb[:, None, None] + s_idx[None, :, None] * ss[:, None, None] + seg[None, None, :, 0]
    dst = db[:, None, None] + d_idx[None, :, None] * ds[:, None, None] + seg[None, None, :, 1]
    nbytes = np.broadcast_to(seg[None, None, :, 2], src.shape)
    return merge_contiguous(src.ravel(), dst.ravel(), np.ascontiguousarray(nbytes).ravel())
