"""Layer-wise sending: a chunk's plan grouped by layer, so each layer can go as soon as it is computed.

A rank's layers are the ``(layer, draft)`` keys of its regions (the metadata
row is not a layer: it is the commit point, written last). A chunk is planned
once, as usual; :meth:`LayerIndex.split` then sorts the plan's descriptors by
the layer of their source region (one ``searchsorted`` and one stable
``argsort`` over the whole plan) and keeps offsets, so posting a layer is
slicing three arrays: no re-planning, no loop per page or descriptor.
Descriptors of regions without a layer (``layer < 0``) form a last group,
posted with the metadata row once every layer has been.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .indices import IntArray, PlanError
from .layout import METADATA_SPACE, KVArgs
from .plan import RegionTable, TransferPlan

__all__ = ["LayerIndex", "LayeredPlan", "ewma", "layer_list"]

LayerKey = tuple[int, bool]  # (layer id, draft)


def ewma(average: float | None, sample: float, weight: float = 0.25) -> float:
    """A moving average (``None``: no sample yet) updated with ``sample``: layer-wise sending's measured costs."""
    return sample if average is None else average + weight * (sample - average)


def layer_list(layers: int | Iterable[int]) -> list[int]:
    """``layers`` (one id, a range or any iterable of ids) as a list of ints; ``ValueError`` for anything else."""
    if isinstance(layers, bool):
        raise ValueError(f"layers must be a layer id, a range or an iterable of layer ids, got {layers!r}")
    if isinstance(layers, (int, np.integer)):
        return [int(layers)]
    try:
        out = list(layers)
    except TypeError:
        raise ValueError(f"layers must be a layer id, a range or an iterable of layer ids, got {layers!r}") from None
    bad = [x for x in out if isinstance(x, bool) or not isinstance(x, (int, np.integer))]
    if bad:
        raise ValueError(f"layer ids must be integers, got {bad[0]!r}")
    return [int(x) for x in out]


@dataclass(eq=False)
class LayeredPlan:
    """A plan sorted by layer group: group ``g`` is ``plan`` rows ``offsets[g]:offsets[g + 1]``.

    Groups ``0 .. len(keys) - 1`` are the rank's layers in :attr:`LayerIndex.keys`
    order; the last group holds descriptors of regions without a layer.
    """

    plan: TransferPlan
    offsets: IntArray

    def group(self, g: int) -> TransferPlan:
        """Group ``g``'s descriptors (views of the sorted arrays)."""
        lo, hi = int(self.offsets[g]), int(self.offsets[g + 1])
        p = self.plan
        return TransferPlan(p.src_addr[lo:hi], p.dst_addr[lo:hi], p.nbytes[lo:hi])

    def nbytes(self, gs: Sequence[int]) -> int:
        """How many bytes groups ``gs`` move."""
        csum = self._csum
        return int(sum(csum[self.offsets[g + 1]] - csum[self.offsets[g]] for g in gs))

    @functools.cached_property
    def _csum(self) -> IntArray:
        return np.concatenate(([0], np.cumsum(self.plan.nbytes)))

    def groups(self, gs: Sequence[int]) -> TransferPlan:
        """The descriptors of groups ``gs``: one view when they are consecutive, else one concatenation."""
        gs = sorted(gs)
        if gs and gs[-1] - gs[0] == len(gs) - 1:
            lo, hi = int(self.offsets[gs[0]]), int(self.offsets[gs[-1] + 1])
            p = self.plan
            return TransferPlan(p.src_addr[lo:hi], p.dst_addr[lo:hi], p.nbytes[lo:hi])
        return TransferPlan.concat(self.group(g) for g in gs)


class LayerIndex:
    """Which layer group each source address belongs to, for one rank's :class:`KVArgs`."""

    def __init__(self, kvargs: KVArgs) -> None:
        layered = [r for r in kvargs.regions if r.index_space != METADATA_SPACE]
        #: This rank's layers, target layers first, each in ascending id order.
        self.keys: tuple[LayerKey, ...] = tuple(sorted({(r.layer, r.draft) for r in layered if r.layer >= 0},
                                                       key=lambda k: (k[1], k[0])))
        self._group = {k: g for g, k in enumerate(self.keys)}
        ordered = sorted(layered, key=lambda r: r.addr)
        self._table = RegionTable(ordered)  # keeps this (address) order
        rest = len(self.keys)
        self._region_group = np.array([self._group.get((r.layer, r.draft), rest) for r in ordered], np.int64)

    @property
    def tail(self) -> int:
        """The group of descriptors from regions without a layer."""
        return len(self.keys)

    def group_of(self, layer: int, draft: bool) -> int | None:
        return self._group.get((layer, draft))

    def describe(self, draft: bool) -> str:
        ids = [layer for layer, d in self.keys if d == draft]
        return f"{'draft ' if draft else ''}layers {_ranges(ids)}" if ids else f"no {'draft ' if draft else ''}layers"

    def split(self, plan: TransferPlan) -> LayeredPlan:
        """``plan`` (validated against this rank's regions) sorted by layer group, order kept inside each."""
        groups = len(self.keys) + 1
        if not len(plan):
            return LayeredPlan(plan, np.zeros(groups + 1, np.int64))
        pos, inside = self._table.locate(plan.src_addr, plan.nbytes)
        if not inside.all():  # validate() ran before: only a plan from another rank gets here
            i = int(np.flatnonzero(~inside)[0])
            raise PlanError(f"descriptor {i} (source {int(plan.src_addr[i]):#x}) is in none of this rank's layer regions")
        group = self._region_group[pos]
        order = np.argsort(group, kind="stable")
        offsets = np.zeros(groups + 1, np.int64)
        np.cumsum(np.bincount(group, minlength=groups), out=offsets[1:])
        return LayeredPlan(TransferPlan(plan.src_addr[order], plan.dst_addr[order], plan.nbytes[order]), offsets)


def _ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for i in sorted(ids):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)
