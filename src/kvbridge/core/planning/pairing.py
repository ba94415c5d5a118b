"""Pairing two ranks' memory descriptions, once per peer at handshake.

:func:`pair_layouts` checks that a prefill rank (source) and a decode rank
(destination) can exchange data and precomputes what moves between them. A
:class:`Route` then turns a request's index lists into a bounds-checked
:class:`~kvbridge.core.planning.plan.TransferPlan` with no per-request pairing work.

Regions pair by key (state type, role, layer, draft), never by position. A
prefill pipeline stage holds a subset of the layers; the decode side (PP 1)
holds all of them, so every prefill region must find its decode peer and the
decode side may hold more.

Heterogeneous TP reduces to one question per region pair: which byte ranges
of a source item land where in the destination item? The answer, a short
list of **segments** ``(src_offset, dst_offset, nbytes)``, is computed here
from the two regions' :class:`~kvbridge.core.description.layout.Shard` and TP positions:

- equal TP: one whole-item segment (pages coalesce into runs);
- split regions (MHA/GQA heads, Mamba channels, each conv sub-block on its
  own): the intersection of the units each rank holds, per row; a unit held
  by several source ranks (TP above the head count) is sent by one of them;
- replicated regions (MLA, indexer caches, metadata): the whole item, sent
  only by prefill rank ``decode_rank % prefill_tp``, so each page arrives once.
"""

from __future__ import annotations

import functools

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..description.layout import KVArgs, Region
from .plan import Indices, PlanError, RegionPairs, TransferPlan, _plan_pages, _plan_segments

__all__ = ["IncompatibleLayoutError", "Route", "Totals", "pair_layouts", "item_segments"]

#: Bytes and descriptors per state type: what :meth:`Route.plan` adds a plan's counts to.
Totals = dict[str, tuple[int, int]]
#: Runs of pages :meth:`Route.samples` plans: every length to 16, then in each octave to 256 its first
#: length and its last (how a kernel splits a run changes at powers of two, and with the largest power of
#: two dividing its length: the two ends of an octave are its two extremes).
SAMPLE_RUNS = (*range(1, 17), *(n for j in range(4, 8) for n in (2 ** j + 1, 2 ** (j + 1))))


class IncompatibleLayoutError(ValueError):
    """The two sides' memory descriptions cannot be paired; the text lists why."""


@dataclass(frozen=True)
class _Group:
    """Region pairs of one index space and state type that share strides and segments."""

    state_type: str
    pairs: RegionPairs
    segments: npt.NDArray[np.int64]  # (S, 3): src_offset, dst_offset, nbytes
    whole_items: bool  # one segment covering equal-sized items: plan by coalesced runs

    @functools.cached_property
    def index_nbytes(self) -> int:
        """Bytes one index moves across the group's regions (coalescing never changes it)."""
        return int(len(self.pairs) * self.segments[:, 2].sum())

    def plan(self, src: Indices, dst: Indices) -> TransferPlan:
        """Descriptors for checked, equally long index lists."""
        if self.whole_items:
            return _plan_pages(self.pairs.src_bases, self.pairs.dst_bases, self.pairs.src_strides, src.array, dst.array,
                               (src.own, dst.own), dst.continuing)
        return _plan_segments(self.pairs, self.segments, src.array, dst.array)


@dataclass(frozen=True)
class SpaceRoute:
    """What moves for one index space (possibly nothing, e.g. MLA on a non-sending rank)."""

    kind: str
    src_count: int
    dst_count: int
    groups: tuple[_Group, ...]

    @property
    def sends(self) -> bool:
        return bool(self.groups)

    @property
    def regions(self) -> int:
        return sum(len(g.pairs) for g in self.groups)


@dataclass(frozen=True)
class Route:
    """Precomputed region pairs and segments from one source rank to one destination rank."""

    src: KVArgs
    dst: KVArgs
    spaces: Mapping[str, SpaceRoute]

    def plan(
        self,
        src_indices: Mapping[str, Indices | npt.ArrayLike],
        dst_indices: Mapping[str, Indices | npt.ArrayLike],
        totals: Totals | None = None,
    ) -> TransferPlan:
        """Descriptors for the given index lists, per index space, validated.

        Lists that are already :class:`~kvbridge.core.planning.plan.Indices` (checked
        where they entered kvbridge) are trusted; others are checked here.
        Raises :class:`PlanError` (out-of-range or duplicate destination
        index, unequal list lengths, an index space this route lacks) before
        anything moves; every descriptor lies inside both sides' regions
        either way (the index bounds, with the extents :func:`pair_layouts`
        checked once per group, cover every descriptor they generate). If ``totals`` is given, the plan's bytes and
        descriptors are added to it per state type (``state_type -> (bytes,
        descriptors)``), only once the plan is valid.
        """
        if src_indices.keys() != dst_indices.keys():
            raise PlanError(
                f"source index spaces {sorted(src_indices)} differ from destination {sorted(dst_indices)}"
            )
        plans: list[TransferPlan] = []
        counted: list[tuple[str, int, int]] = []
        for space, src_idx in src_indices.items():
            sr = self.spaces.get(space)
            if sr is None:
                raise PlanError(f"no paired regions use index space {space!r} (paired: {sorted(self.spaces)})")
            s = Indices.check(f"source {space} index", src_idx, sr.src_count)
            d = Indices.check(f"destination {space} index", dst_indices[space], sr.dst_count, unique=True)
            n = len(s)
            if n != len(d):
                raise PlanError(f"{space}: {n} source indices but {len(d)} destination indices")
            for g in sr.groups:
                p = g.plan(s, d)
                plans.append(p)
                if totals is not None:
                    counted.append((g.state_type, n * g.index_nbytes, len(p)))
        # Every descriptor is inside its regions: its indices were checked against the
        # index spaces just above, and pair_layouts proved that every index of those
        # spaces, with every segment, lies inside every region of its group. That
        # check covers each descriptor without visiting each one (it cost 80% of a
        # 2M-descriptor plan as a per-descriptor lookup).
        plan = TransferPlan.concat(plans)
        if totals is not None:
            for state_type, nbytes, descriptors in counted:
                b, n = totals.get(state_type, (0, 0))
                totals[state_type] = (b + nbytes, n + descriptors)
        return plan

    def samples(self, spaces: Collection[str] | None = None) -> list[TransferPlan]:
        """Small plans shaped like this route's requests, for the backends to prepare for at the handshake
        (``Backend.warm``): per index space that sends (of ``spaces``; None: all), a run of ``k`` pages for each
        ``k`` of :data:`SAMPLE_RUNS`, and a run of ``k`` pages then, after a gap, one of 1, 2, 4 or the largest
        power of two below ``k`` (runs of two lengths), the same indices on both sides, within both counts."""
        out: list[TransferPlan] = []
        for space, sr in self.spaces.items():
            n = min(sr.src_count, sr.dst_count) if sr.sends and (spaces is None or space in spaces) else 0
            for k in SAMPLE_RUNS:
                if k > n:
                    break
                lists = [np.arange(k, dtype=np.int64)]
                lists += [np.r_[0:k, k + 1:k + 1 + j].astype(np.int64)
                          for j in sorted({1, 2, 4, 1 << max(0, (k - 1).bit_length() - 1)}) if j < k and k + 1 + j <= n]
                out += [self.plan({space: idx}, {space: idx}) for idx in lists]
        return out


def item_segments(src: Region, src_args: KVArgs, dst: Region, dst_args: KVArgs) -> npt.NDArray[np.int64]:
    """``(S, 3)`` segments of one item that this source rank sends to this destination rank.

    Empty when this source rank sends nothing for the region (another rank does).
    Raises :class:`IncompatibleLayoutError` if the two shards describe different data.
    """
    a, b = src.shard, dst.shard
    tp_s, r_s, tp_d, r_d = src_args.tp_size, src_args.tp_rank, dst_args.tp_size, dst_args.tp_rank
    if a.kind != b.kind or (a.kind == "split" and (a.outer, a.totals, a.unit_nbytes) != (b.outer, b.totals, b.unit_nbytes)):
        raise IncompatibleLayoutError(f"{_describe(src)}: layout differs, prefill {a}, decode {b}")
    if a.kind == "replicated":
        if src.stride != dst.stride:
            raise IncompatibleLayoutError(f"{_describe(src)}: item size differs, prefill {src.stride} B, decode {dst.stride} B")
        if r_s != r_d % tp_s:
            return np.empty((0, 3), np.int64)
        return np.array([[0, 0, src.stride]], np.int64)
    unit = a.unit_nbytes
    src_local, dst_local = a.local(r_s, tp_s), b.local(r_d, tp_d)
    src_row = sum(n for _, n in src_local) * unit
    dst_row = sum(n for _, n in dst_local) * unit
    per_row: list[tuple[int, int, int]] = []
    src_off = dst_off = 0  # offsets of the current group inside a row
    for (s0, sn), (d0, dn), owner in zip(src_local, dst_local, a.owns(r_s, tp_s)):
        lo, hi = max(s0, d0), min(s0 + sn, d0 + dn)
        if owner and lo < hi:
            per_row.append((src_off + (lo - s0) * unit, dst_off + (lo - d0) * unit, (hi - lo) * unit))
        src_off += sn * unit
        dst_off += dn * unit
    if not per_row:
        return np.empty((0, 3), np.int64)
    rows = np.arange(a.outer, dtype=np.int64)[:, None]
    seg = np.array(per_row, np.int64)
    out = np.stack(
        [
            (rows * src_row + seg[None, :, 0]).ravel(),
            (rows * dst_row + seg[None, :, 1]).ravel(),
            np.broadcast_to(seg[None, :, 2], (a.outer, len(per_row))).ravel(),
        ],
        axis=1,
    )
    merged = _merge_segments(out)
    return merged


def _merge_segments(seg: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    if len(seg) <= 1:
        return seg
    cont = (seg[:-1, 0] + seg[:-1, 2] == seg[1:, 0]) & (seg[:-1, 1] + seg[:-1, 2] == seg[1:, 1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return np.stack([seg[starts, 0], seg[starts, 1], np.add.reduceat(seg[:, 2], starts)], axis=1)


def pair_layouts(src: KVArgs, dst: KVArgs) -> Route:
    """Check compatibility and pair regions; :class:`IncompatibleLayoutError` lists every problem."""
    problems: list[str] = []
    if src.dtype != dst.dtype:
        problems.append(f"KV dtype differs: prefill {src.dtype!r}, decode {dst.dtype!r}")
    if src.page_size != dst.page_size:
        problems.append(f"page size differs: prefill {src.page_size} tokens, decode {dst.page_size}")
    if dst.pp_size != 1:
        problems.append(f"decode PP {dst.pp_size} is not supported; run decode with PP 1 (prefill may use PP > 1)")

    # Aliases (KVArgs.aliases) pair and plan like regions; only registration skips them.
    dst_by_key = {r.key: r for r in dst.all_regions}
    src_keys = {r.key for r in src.all_regions}
    missing = [r for r in src.all_regions if r.key not in dst_by_key]
    if missing:
        problems.append(
            f"decode registered no region for {len(missing)} prefill region(s): "
            + ", ".join(_describe(r) for r in missing[:6])
            + (" ..." if len(missing) > 6 else "")
            + "; both sides must run the same model config"
        )
    if src.pp_size == 1:
        extra = [r for r in dst.all_regions if r.key not in src_keys]
        if extra:
            problems.append(
                f"prefill registered no region for {len(extra)} decode region(s): "
                + ", ".join(_describe(r) for r in extra[:6])
                + (" ..." if len(extra) > 6 else "")
                + "; both sides must run the same model config"
            )

    src_spaces = {s.name: s for s in src.index_spaces}
    dst_spaces = {s.name: s for s in dst.index_spaces}
    # (space, state type, src stride, dst stride, segments) -> [(src region, dst region)]
    grouped: dict[tuple[str, str, int, int, bytes], list[tuple[Region, Region, npt.NDArray[np.int64]]]] = {}
    used_spaces: set[str] = set()
    for s in src.all_regions:
        d = dst_by_key.get(s.key)
        if d is None:
            continue
        if s.index_space != d.index_space:
            problems.append(f"{_describe(s)} is indexed by {s.index_space!r} on prefill but {d.index_space!r} on decode")
            continue
        used_spaces.add(s.index_space)
        try:
            seg = item_segments(s, src, d, dst)
        except IncompatibleLayoutError as exc:
            problems.append(str(exc))
            continue
        if seg.size:
            grouped.setdefault((s.index_space, s.state_type, s.stride, d.stride, seg.tobytes()), []).append((s, d, seg))
    for name in sorted(used_spaces):
        a, b = src_spaces[name], dst_spaces[name]
        if a.tokens != b.tokens or a.kind != b.kind:
            problems.append(
                f"index space {name!r}: prefill has {a.tokens} tokens per index ({a.kind}), "
                f"decode {b.tokens} ({b.kind})"
            )
    for (space, _, s_stride, d_stride, _), pairs in grouped.items():
        seg = pairs[0][2]
        src_reach = (src_spaces[space].count - 1) * s_stride + int((seg[:, 0] + seg[:, 2]).max())
        dst_reach = (dst_spaces[space].count - 1) * d_stride + int((seg[:, 1] + seg[:, 2]).max())
        for s, d, _ in pairs:
            if src_reach > s.nbytes or dst_reach > d.nbytes or (seg[:, :2] < 0).any():
                problems.append(f"{_describe(s)}: its items reach {src_reach} B on prefill ({s.nbytes} B registered) "
                                f"and {dst_reach} B on decode ({d.nbytes} B registered)")
    if problems:
        raise IncompatibleLayoutError("incompatible layouts: " + "; ".join(problems))

    groups: dict[str, list[_Group]] = {name: [] for name in used_spaces}
    for (space, state_type, s_stride, d_stride, _), pairs in grouped.items():
        seg = pairs[0][2]
        whole = len(seg) == 1 and s_stride == d_stride and tuple(seg[0]) == (0, 0, s_stride)
        groups[space].append(
            _Group(
                state_type=state_type,
                pairs=RegionPairs.of([s.addr for s, _, _ in pairs], [d.addr for _, d, _ in pairs],
                                     np.full(len(pairs), s_stride, np.int64), np.full(len(pairs), d_stride, np.int64)),
                segments=seg,
                whole_items=whole,
            )
        )
    spaces = {
        name: SpaceRoute(src_spaces[name].kind, src_spaces[name].count, dst_spaces[name].count, tuple(g))
        for name, g in groups.items()
    }
    return Route(src, dst, spaces)


def _describe(r: Region) -> str:
    layer = f" layer {r.layer}" if r.layer >= 0 else ""
    draft = " (draft)" if r.draft else ""
    return f"{r.state_type}/{r.role}{layer}{draft} ({r.name!r})"
