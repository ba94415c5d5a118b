"""The planners: index lists and region pairs -> a :class:`TransferPlan`.

``plan_pages`` moves whole items (pages, slots) by coalesced runs; ``plan_segments`` moves
partial items (heterogeneous TP, Mamba conv sub-blocks) as (region pair, index, segment),
merged where neighbours continue each other. Both work on whole numpy arrays.
``Route.plan`` (:mod:`.pairing`) calls the checked-input variants per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .indices import _BLOCK, SMALL, Indices, IntArray, PlanError, _as_index_array, check_indices, continuing
from .regions import RegionTable
from .transferplan import Memory, TransferPlan, memory_of

# RegionTable, Memory and memory_of live in .regions and .transferplan; they stay importable from
# here because this module's old path (kvbridge.core.plan) is what plugins written before the
# split import them from.

__all__ = [
    "Indices",
    "Memory",
    "memory_of",
    "RegionTable",
    "PlanError",
    "RegionPairs",
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


_SMALL = SMALL  # lists up to this long are coalesced in one Python pass
#: Where at most one index in this many continues the one before it on one side (so at most that many could
#: merge), runs are not coalesced: every index is its own descriptor, the index lists themselves the plan's
#: columns (no arrays gathered), every size one item's (the GPU copy's table then needs no sizes: 2 words
#: a descriptor, not 3).
_FEW_RUNS = 64


_ONE_ITEM: dict[int, IntArray] = {}


def _one_item(nbytes: int) -> IntArray:
    """``[nbytes]`` as a read-only int64 array, shared by every 1-index plan of that item size (plans only read it)."""
    arr = _ONE_ITEM.get(nbytes)
    if arr is None:
        arr = np.array([nbytes], np.int64)
        arr.flags.writeable = False
        if len(_ONE_ITEM) < 1024:
            _ONE_ITEM[nbytes] = arr
    return arr


def _run_starts(src: IntArray, dst: IntArray) -> npt.NDArray[np.bool_]:
    """Per index of two equally long lists (at least one), whether a run starts there: it does not
    continue the one before it on both sides."""
    n = src.size
    new = np.empty(n, bool)
    new[0] = True
    step = np.empty(min(_BLOCK, n - 1), np.int64)
    other = np.empty(step.size, bool)
    for lo in range(0, n - 1, _BLOCK):
        hi = min(lo + _BLOCK, n - 1)
        d, o, out = step[: hi - lo], other[: hi - lo], new[lo + 1 : hi + 1]
        np.subtract(src[lo + 1 : hi + 1], src[lo:hi], out=d)
        np.not_equal(d, 1, out=out)
        np.subtract(dst[lo + 1 : hi + 1], dst[lo:hi], out=d)
        np.not_equal(d, 1, out=o)
        out |= o
    return new


def _runs(src: IntArray, dst: IntArray, scale: int = 1) -> tuple[IntArray, IntArray, IntArray]:
    """:func:`coalesce_runs` of checked, equally long int64 lists, each result times ``scale`` (an item's
    bytes: the planner's columns, multiplied in place rather than into three more fresh arrays)."""
    n = src.size
    if n <= 1:  # no index or one (a metadata row, a 1-page request): one run or none, no numpy calls
        return src * scale, dst * scale, np.array([scale] * n, np.int64)
    if n <= _SMALL:  # a few pages (small requests): one Python pass costs less than a dozen numpy calls
        s, d = src.tolist(), dst.tolist()
        at = [0, *(i for i in range(1, n) if s[i] - s[i - 1] != 1 or d[i] - d[i - 1] != 1), n]
        return (np.array([s[i] * scale for i in at[:-1]], np.int64), np.array([d[i] * scale for i in at[:-1]], np.int64),
                np.array([(b - a) * scale for a, b in zip(at, at[1:])], np.int64))
    new = _run_starts(src, dst)
    k = int(np.count_nonzero(new))
    if k == n:  # nothing continues its neighbour (scattered pages): no positions to gather by
        return src * scale, dst * scale, np.full(n, scale, np.int64)
    starts = np.flatnonzero(new)
    src_start, dst_start = src[starts], dst[starts]
    run_len = np.empty(k, np.int64)
    np.subtract(starts[1:], starts[:-1], out=run_len[:-1])
    run_len[-1] = n - starts[-1]
    if scale != 1:
        src_start *= scale
        dst_start *= scale
        run_len *= scale
    return src_start, dst_start, run_len


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


def _plan_pages(src_b: IntArray, dst_b: IntArray, item: IntArray, src_idx: IntArray, dst_idx: IntArray,
                keep: tuple[bool, bool] = (False, False), dst_continuing: int | None = None) -> TransferPlan:
    """:func:`plan_pages` of checked arrays. ``keep``: whether the plan may keep ``src_idx``, and
    ``dst_idx``, as they are (kvbridge's own arrays, which nobody changes: :attr:`Indices.own`);
    ``dst_continuing``: :func:`~.indices.continuing` of ``dst_idx`` where known (counted on arrival)."""
    if item.size == 0 or src_idx.size == 0:
        return TransferPlan.empty()
    if item.size == 1 or (item == item[0]).all():
        # Rows are region pairs, columns are runs: kept as an outer sum and
        # expanded batch by batch where it is written (TransferPlan.batches).
        it = int(item[0])
        n = src_idx.size
        few = n // _FEW_RUNS
        if n == 1 or (n > _SMALL and ((dst_continuing if dst_continuing is not None else continuing(dst_idx, few)) <= few
                                      or continuing(src_idx, few) <= few)):
            # (Almost) nothing can coalesce (one side's pages are scattered): the columns are the index lists
            # themselves, in items (the plan's unit), every one of one item's bytes. No array of the
            # request's length is made but a copy of a list the caller may still change: 262,144 scattered
            # pages, one pair of which continued each other, made four of 2 MiB (run starts, gathered
            # starts, lengths), whose first-touch faults cost more than the arithmetic (#27).
            # One index (a 1-page request, a metadata row) is this case too: nothing to coalesce, and no
            # run columns to compute (three numpy calls fewer per request, #27).
            src_cols = src_idx if keep[0] else src_idx.copy()
            dst_cols = dst_idx if keep[1] else dst_idx.copy()
            sizes = _one_item(it) if n == 1 else np.broadcast_to(np.int64(it), (n,))
            return TransferPlan.outer(src_b, dst_b, src_cols, dst_cols, sizes, (it & -it, it), row_bytes=it * n, unit=it)
        src_cols, dst_cols, col_nbytes = _runs(src_idx, dst_idx, it)
        # Columns are multiples of the item; no run coalesced (as many runs as indices): each is one item.
        # A row's bytes are every index's item, known without summing the columns.
        hint = (it & -it, it if src_cols.size == n else 0)
        return TransferPlan.outer(src_b, dst_b, src_cols, dst_cols, col_nbytes, hint, row_bytes=it * n)
    src_start, dst_start, run_len = _runs(src_idx, dst_idx)
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


@dataclass(frozen=True)
class RegionPairs:
    """Region pair ``e``: source region based at ``src_bases[e]`` with ``src_strides[e]`` bytes per
    item, destination region based at ``dst_bases[e]`` with ``dst_strides[e]``. Four int64 arrays of
    one length, checked once when built (:meth:`of`), so the planners never re-check them."""

    src_bases: IntArray
    dst_bases: IntArray
    src_strides: IntArray
    dst_strides: IntArray

    @classmethod
    def of(cls, src_bases: npt.ArrayLike, dst_bases: npt.ArrayLike, src_strides: npt.ArrayLike,
           dst_strides: npt.ArrayLike) -> RegionPairs:
        """Checked pairs: :class:`PlanError` naming the lengths if the four lists differ."""
        sb = _as_index_array("src_bases", src_bases)
        db = _as_index_array("dst_bases", dst_bases)
        ss = _as_index_array("src_strides", src_strides)
        ds = _as_index_array("dst_strides", dst_strides)
        if not (sb.size == db.size == ss.size == ds.size):
            raise PlanError(
                f"per-region arrays differ in length: src_bases {sb.size}, dst_bases {db.size}, "
                f"src_strides {ss.size}, dst_strides {ds.size}; give one entry per region pair"
            )
        return cls(sb, db, ss, ds)

    def __len__(self) -> int:
        return int(self.src_bases.size)


def plan_segments(pairs: RegionPairs, segments: npt.ArrayLike, src_idx: npt.ArrayLike,
                  dst_idx: npt.ArrayLike) -> TransferPlan:
    """Descriptors for partial items: every (region pair, index, segment), merged.

    ``segments`` is an ``(S, 3)`` array of ``(src_offset, dst_offset, nbytes)``
    inside one item, shared by all region pairs. Item ``src_idx[k]`` of source
    region ``e`` sends each segment to item ``dst_idx[k]`` of destination region
    ``e`` (:class:`RegionPairs`). Descriptors that continue each other on both
    sides are merged, so a segment that covers whole items costs one descriptor
    per contiguous run. Destination indices must be unique.
    """
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    if seg.size and ((seg[:, 2] <= 0).any() or (seg[:, :2] < 0).any()):
        raise PlanError("segments need offsets >= 0 and sizes > 0")
    s_idx = check_indices("src_idx", src_idx)
    d_idx = check_indices("dst_idx", dst_idx, unique=True)
    if s_idx.size != d_idx.size:
        raise PlanError(f"src_idx has {s_idx.size} indices but dst_idx has {d_idx.size}; they are paired one to one")
    return _plan_segments(pairs, seg, s_idx, d_idx)


def _plan_segments(pairs: RegionPairs, seg: IntArray, s_idx: IntArray, d_idx: IntArray) -> TransferPlan:
    """:func:`plan_segments` of checked arrays."""
    sb, db, ss, ds = pairs.src_bases, pairs.dst_bases, pairs.src_strides, pairs.dst_strides
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
