"""Pairing two ranks' memory descriptions, once per peer at handshake.

:func:`pair_layouts` checks that a prefill rank (source) and a decode rank
(destination) can exchange data and precomputes, per index space, the region
pairs as arrays. A :class:`Route` then turns a request's index lists into a
bounds-checked :class:`~kvbridge.core.plan.TransferPlan` with no per-request
pairing work.

Regions pair by key (state type, role, layer, draft), never by position. A
prefill pipeline stage holds a subset of the layers; the decode side (PP 1)
holds all of them, so every prefill region must find its decode peer and
the decode side may hold more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .layout import KVArgs, Region
from .plan import PlanError, TransferPlan, check_indices, plan_pages

__all__ = ["IncompatibleLayoutError", "Route", "pair_layouts"]


class IncompatibleLayoutError(ValueError):
    """The two sides' memory descriptions cannot be paired; the text lists why."""


@dataclass(frozen=True)
class _SpacePairs:
    src_bases: npt.NDArray[np.int64]
    dst_bases: npt.NDArray[np.int64]
    item_nbytes: npt.NDArray[np.int64]
    src_count: int
    dst_count: int


@dataclass(frozen=True)
class Route:
    """Precomputed region pairs from one source rank to one destination rank."""

    src: KVArgs
    dst: KVArgs
    spaces: Mapping[str, _SpacePairs]

    def plan(self, src_indices: Mapping[str, npt.ArrayLike], dst_indices: Mapping[str, npt.ArrayLike]) -> TransferPlan:
        """Descriptors for the given index lists, per index space, validated.

        Raises :class:`PlanError` (out-of-range or duplicate destination
        index, unequal list lengths, an index space this route lacks) before
        anything moves.
        """
        if set(src_indices) != set(dst_indices):
            raise PlanError(
                f"source index spaces {sorted(src_indices)} differ from destination {sorted(dst_indices)}"
            )
        plans = []
        for space, src_idx in src_indices.items():
            pairs = self.spaces.get(space)
            if pairs is None:
                raise PlanError(f"no paired regions use index space {space!r} (paired: {sorted(self.spaces)})")
            s = check_indices(f"source {space} index", src_idx, pairs.src_count)
            d = check_indices(f"destination {space} index", dst_indices[space], pairs.dst_count, unique=True)
            plans.append(plan_pages(pairs.src_bases, pairs.dst_bases, pairs.item_nbytes, s, d))
        plan = TransferPlan.concat(plans)
        plan.validate(self.src.regions, self.dst.regions)
        return plan


def pair_layouts(src: KVArgs, dst: KVArgs) -> Route:
    """Check compatibility and pair regions; :class:`IncompatibleLayoutError` lists every problem."""
    problems: list[str] = []
    if src.dtype != dst.dtype:
        problems.append(f"KV dtype differs: prefill {src.dtype!r}, decode {dst.dtype!r}")
    if src.page_size != dst.page_size:
        problems.append(f"page size differs: prefill {src.page_size} tokens, decode {dst.page_size}")
    if src.tp_size != dst.tp_size:
        problems.append(
            f"prefill TP {src.tp_size} -> decode TP {dst.tp_size}: heterogeneous TP is not "
            "supported by this kvbridge version; run both sides with the same TP size"
        )
    if dst.pp_size != 1 and src.pp_size != dst.pp_size:
        problems.append(f"decode PP {dst.pp_size} must be 1 or equal to prefill PP {src.pp_size}")

    dst_by_key = {r.key: r for r in dst.regions}
    src_keys = {r.key for r in src.regions}
    missing = [r for r in src.regions if r.key not in dst_by_key]
    if missing:
        problems.append(
            f"decode registered no region for {len(missing)} prefill region(s): "
            + ", ".join(_describe(r) for r in missing[:6])
            + (" ..." if len(missing) > 6 else "")
            + "; both sides must run the same model config"
        )
    if src.pp_size == 1:
        extra = [r for r in dst.regions if r.key not in src_keys]
        if extra:
            problems.append(
                f"prefill registered no region for {len(extra)} decode region(s): "
                + ", ".join(_describe(r) for r in extra[:6])
                + (" ..." if len(extra) > 6 else "")
                + "; both sides must run the same model config"
            )

    src_spaces = {s.name: s for s in src.index_spaces}
    dst_spaces = {s.name: s for s in dst.index_spaces}
    grouped: dict[str, list[tuple[Region, Region]]] = {}
    for s in src.regions:
        d = dst_by_key.get(s.key)
        if d is None:
            continue
        if s.index_space != d.index_space:
            problems.append(f"{_describe(s)} is indexed by {s.index_space!r} on prefill but {d.index_space!r} on decode")
            continue
        if s.stride != d.stride:
            problems.append(f"{_describe(s)}: item size differs, prefill {s.stride} B, decode {d.stride} B")
            continue
        if s.shard != d.shard:
            problems.append(f"{_describe(s)}: layout (shard) differs, prefill {s.shard}, decode {d.shard}")
            continue
        grouped.setdefault(s.index_space, []).append((s, d))
    for name in grouped:
        a, b = src_spaces[name], dst_spaces[name]
        if a.tokens != b.tokens:
            problems.append(f"index space {name!r}: {a.tokens} tokens per index on prefill, {b.tokens} on decode")
    if problems:
        raise IncompatibleLayoutError("incompatible layouts: " + "; ".join(problems))

    spaces = {
        name: _SpacePairs(
            src_bases=np.array([s.addr for s, _ in pairs], np.int64),
            dst_bases=np.array([d.addr for _, d in pairs], np.int64),
            item_nbytes=np.array([s.stride for s, _ in pairs], np.int64),
            src_count=src_spaces[name].count,
            dst_count=dst_spaces[name].count,
        )
        for name, pairs in grouped.items()
    }
    return Route(src, dst, spaces)


def _describe(r: Region) -> str:
    layer = f" layer {r.layer}" if r.layer >= 0 else ""
    draft = " (draft)" if r.draft else ""
    return f"{r.state_type}/{r.role}{layer}{draft} ({r.name!r})"
