"""``RegionTable``: which registered region holds each address of a whole array (one ``searchsorted``).

Used wherever descriptors meet regions: bounds checks (:meth:`TransferPlan.validate`), a write's
lane and memory place per descriptor (the transport), host staging and checksums.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..description.layout import Region
from .indices import IntArray

__all__ = ["RegionTable", "nearest_region"]


class RegionTable:
    """Regions sorted by address, to find which one holds each address of a whole array.

    Regions do not overlap (KVArgs checks), so the only candidate for an
    address is the last region starting at or before it: one
    ``searchsorted`` per array. ``vram`` and ``device`` give each region's
    memory kind and device, in the same (sorted) order.
    """

    def __init__(self, regions: Sequence[Region]) -> None:
        order = sorted(range(len(regions)), key=lambda i: regions[i].addr)
        ordered = [regions[i] for i in order]
        #: Each (sorted) region's position in ``regions`` as given (a region index both sides agree on:
        #: ``Staged`` names decode's regions by their place in its ``KVArgs.regions``).
        self.index = np.array(order, np.int64)
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

    def holding(self, addrs: IntArray, nbytes: IntArray, size: int | None = None) -> int:
        """The (sorted) position of the one region holding every range, or -1 when none does (they span
        several regions, or lie outside): two reductions and one search of the bounds, no search per range.
        ``size``: every range's size where the caller knows they are all one size (no array of ends)."""
        if not len(self) or not len(addrs):
            return -1
        hi = int(addrs.max()) + size if size is not None else int((addrs + nbytes).max())
        first = int(np.searchsorted(self.starts, int(addrs.min()), side="right")) - 1
        return first if first >= 0 and hi <= int(self.ends[first]) else -1

    def split(self, addrs: IntArray, nbytes: IntArray) -> tuple[IntArray, IntArray]:
        """The ranges cut wherever a region starts inside one, in order.

        Ranges merged because they continue each other (a checksum's) can run from one region into
        the next where regions are adjacent (one allocation described per layer); cut there, each
        piece can lie inside one region. A piece still crossing a region's end into memory no
        region holds stays whole, for the caller's bounds check to refuse.
        """
        if not len(self) or not len(addrs):
            return addrs, nbytes
        ends = addrs + nbytes
        lo = np.searchsorted(self.starts, addrs, side="right")  # the first region starting after each range starts
        cuts = np.searchsorted(self.starts, ends, side="left") - lo  # region starts strictly inside each range
        if not cuts.any():
            return addrs, nbytes
        which = np.repeat(np.arange(len(addrs)), cuts + 1)
        j = np.arange(len(which)) - np.repeat(np.cumsum(cuts + 1) - (cuts + 1), cuts + 1)  # piece j of its range
        last = len(self) - 1
        start = np.where(j == 0, addrs[which], self.starts[np.clip(lo[which] + j - 1, 0, last)])
        end = np.where(j == cuts[which], ends[which], self.starts[np.clip(lo[which] + j, 0, last)])
        return start, end - start


def nearest_region(addr: int, regions: Sequence[Region]) -> str:
    """`` (nearest: NAME [start, end))``: for an error about an address outside every region."""
    if not regions:
        return " (no regions registered)"
    r = min(regions, key=lambda r: min(abs(addr - r.addr), abs(addr - r.end)))
    return f" (nearest: {r.name!r} [{r.addr:#x}, {r.end:#x}))"
