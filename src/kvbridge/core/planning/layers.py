"""Layer-wise sending: a chunk's plan grouped by layer, so each layer can go as soon as it is computed.

A rank's layers are the ``(layer, draft)`` keys of its regions (the metadata
row is not a layer: it is the commit point, written last). A chunk is planned
once, as usual; :meth:`LayerIndex.split` then cuts the plan by the layer of
each row's source region (a plan is region pairs x pages, unexpanded: a
``searchsorted`` per part over its rows, not its descriptors), so posting a
layer is taking its rows: no re-planning, no loop per page or descriptor.
Descriptors of regions without a layer (``layer < 0``) form a last group,
posted with the metadata row once every layer has been.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .indices import IntArray
from ..description.layout import METADATA_SPACE, KVArgs
from .regions import RegionTable
from .transferplan import TransferPlan

__all__ = ["LayerIndex", "LayeredPlan", "layer_list"]

LayerKey = tuple[int, bool]  # (layer id, draft)


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
    """A plan split by layer group: ``parts[g]`` is group ``g``'s descriptors, in the plan's order.

    Groups ``0 .. len(keys) - 1`` are the rank's layers in :attr:`LayerIndex.keys`
    order; the last group holds descriptors of regions without a layer.
    """

    parts: list[TransferPlan]

    def group(self, g: int) -> TransferPlan:
        """Group ``g``'s descriptors."""
        return self.parts[g]

    def groups(self, gs: Sequence[int]) -> TransferPlan:
        """The descriptors of groups ``gs``, in group order (no copy: the groups' parts, joined)."""
        return TransferPlan.concat(self.parts[g] for g in sorted(gs))


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
        """``plan`` (validated against this rank's regions) split by layer group, order kept inside each.

        Raises :class:`PlanError` for a descriptor outside this rank's layer regions (validation ran
        before: only a plan from another rank gets there)."""
        return LayeredPlan(plan.split(self._locate, len(self.keys) + 1))

    def _locate(self, addr: IntArray, nbytes: IntArray) -> tuple[IntArray, npt.NDArray[np.bool_]]:
        """Each source range's layer group, and whether it lies wholly in one of this rank's regions."""
        pos, inside = self._table.locate(addr, nbytes)
        return self._region_group[pos], inside


def _ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for i in sorted(ids):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)
