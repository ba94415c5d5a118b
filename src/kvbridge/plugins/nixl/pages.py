"""NIXL's prepared page tables: the ``prepped`` way to build a request.

Two ways to build a request (``xfer_mode`` option), both measured:

- ``descs`` (A, the default): build both descriptor lists from the plan's
  arrays and call ``initialize_xfer``; NIXL validates and prepares them on
  every write;
- ``prepped`` (B): the page tables of every local region (in :meth:`register`)
  and every peer region (in :meth:`add_peer`) are prepared once as strided
  descriptor lists (one ``(addr, stride, dev, stride, count)`` row per region,
  which NIXL keeps compressed: preparing 4 x 263168 pages took 50 us and no
  memory); a write maps its descriptors back to page indices with numpy
  (``searchsorted`` on the region bases, ``np.repeat`` to expand runs) and
  calls ``make_prepped_xfer``. Descriptors that are not whole pages of one
  size on both sides fall back to ``descs``.

Median ms per ``write`` between two processes (decode in a spawned process,
4 regions x 4096 pages, 9 interleaved repetitions after 2 warm-ups, 2-core
machine shared with other work, so +-10 % is noise); desc is the number of
descriptors, and MiB, A and B are given for each page size:

==========================  ======  =====  =====  =====  ======  =====  =====
page size                           1152-byte pages      65536-byte pages
--------------------------  ------  -------------------  --------------------
plan                        desc    MiB    A      B      MiB     A      B
==========================  ======  =====  =====  =====  ======  =====  =====
1 page, scattered           4       0.004  0.028  0.071  0.25    0.071  0.141
16 pages, scattered         64      0.07   0.264  0.376  4       0.41   0.51
256 pages, scattered        1024    1.1    2.18   2.28   64      10.8   10.5
1024 pages, scattered       4096    4.5    9.79   9.90   256     48.7   47.2
4096 pages, permuted        16380   18     41.5   41.5   1024    166    182
16 pages, contiguous        4       0.07   0.051  0.149  4       0.22   0.28
4096 pages, contiguous      4       18     1.89   2.20   1024    124    121
64 runs of 16 pages         256     4.5    0.92   1.01   256     25.7   25.5
==========================  ======  =====  =====  =====  ======  =====  =====

Moving the bytes dominates every plan of more than a few descriptors, and
there the two are within noise. What B saves inside NIXL (for 16384 page
descriptors ``make_prepped_xfer`` took 0.35-0.66 ms against 1.35 ms for
``initialize_xfer``) its numpy mapping spends again (0.1 ms for 1024
descriptors, 0.5-0.9 ms for 16384), and on small plans, the common case of
one chunk or one metadata row, the mapping's fixed cost (about 35 us of
numpy calls) makes B 40-100 us slower. Decision: A is the default and the
only path used unless ``xfer_mode=prepped`` is set; B stays selectable for
hosts whose wire is fast enough for NIXL's per-request work to matter
(RDMA), where it should be re-measured. Either way the page tables are
prepared in :meth:`add_peer`, which also checks early that a peer's
regions are covered by the memory its agent metadata declares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvbridge.core.description.layout import Region
from kvbridge.core.planning.transferplan import TransferPlan

if TYPE_CHECKING:
    from nixl_cu12 import nixl_prepped_dlist_handle  # or nixl_cu13: same API

__all__ = ["PageTable", "expand", "prepped_indices"]


@dataclass(frozen=True)
class PageTable:
    """The regions of one side as a prepared list of pages, and how to index it.

    Page ``p`` of the region at ``base[r]`` (sorted by address) is entry
    ``offset[r] + p`` of the prepared list ``handle``.
    """

    handle: nixl_prepped_dlist_handle
    base: npt.NDArray[np.int64]
    stride: npt.NDArray[np.int64]
    count: npt.NDArray[np.int64]
    offset: npt.NDArray[np.int64]

    @classmethod
    def rows(cls, regions: Sequence[Region]) -> tuple[npt.NDArray[np.uint64], dict[str, npt.NDArray[np.int64]]]:
        """Strided prep rows ``(addr, stride, dev, stride, count)`` and the index arrays, sorted by address."""
        ordered = sorted(regions, key=lambda r: r.addr)
        base = np.array([r.addr for r in ordered], np.int64)
        stride = np.array([r.stride for r in ordered], np.int64)
        count = np.array([r.nbytes // r.stride for r in ordered], np.int64)
        offset = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
        device = np.array([r.device for r in ordered], np.int64)  # as registered: GPU memory on cuda:1 is device 1
        rows = np.stack([base, stride, device, stride, count], axis=1).astype(np.uint64)
        return rows, {"base": base, "stride": stride, "count": count, "offset": offset}

    def locate(self, addr: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
    ] | None:
        """Each descriptor's first list entry, page count and page size; None unless all are whole pages."""
        pos = np.searchsorted(self.base, addr, side="right") - 1
        if pos.size and pos.min() < 0:
            return None
        if self.stride.size == 1 or (self.stride == self.stride[0]).all():
            stride: Any = int(self.stride[0])  # scalar arithmetic is much cheaper than per-element
        else:
            stride = self.stride[pos]
        page, rem = np.divmod(addr - self.base[pos], stride)
        pages, rem_n = np.divmod(nbytes, stride)
        if rem.any() or rem_n.any() or (page + pages > self.count[pos]).any():
            return None
        return self.offset[pos] + page, pages, np.broadcast_to(stride, pos.shape)


def expand(first: npt.NDArray[np.int64], pages: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
    """Entry indices ``first[i] .. first[i] + pages[i] - 1`` for every descriptor, concatenated."""
    if (pages == 1).all():
        return first.astype(np.int32)
    ends = np.cumsum(pages)
    return (np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(first - (ends - pages), pages)).astype(np.int32)


def prepped_indices(local: PageTable | None, remote: PageTable | None, plan: TransferPlan) -> tuple[
    npt.NDArray[np.int32], npt.NDArray[np.int32]
] | None:
    """Local and remote page-table indices of the plan, or None if a descriptor is not whole pages of
    one size on both sides (the request is then built from descriptor lists)."""
    if local is None or remote is None:
        return None
    src = local.locate(plan.src_addr, plan.nbytes)
    dst = remote.locate(plan.dst_addr, plan.nbytes)
    if src is None or dst is None or not np.array_equal(src[2], dst[2]):
        return None
    if int(src[1].sum()) >= 2**31:  # make_prepped_xfer takes int32 indices
        return None
    return expand(src[0], src[1]), expand(dst[0], dst[1])
