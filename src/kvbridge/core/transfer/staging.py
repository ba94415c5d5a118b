"""Host staging: strided source pieces gathered into a registered buffer, posted as contiguous runs.

Heterogeneous TP with token-major (NHD) pages, prefill TP < decode TP: each
decode rank gets a slice of every token row, so a page is ``page_size``
pieces strided in the source but back to back in the destination, and the
plan holds one descriptor per token row. Engines cost microseconds per
descriptor; copying a few hundred bytes in memory costs a fraction of that.
So, for source pieces in host memory, :class:`Staging` gathers a window of
the plan (at most one slice of the staging buffer) into that slice with one
``numpy.take`` and the transport posts one descriptor per destination run
instead of one per piece. The plan itself is unchanged (bounds checks,
checksums and layer splits read the real descriptors); staging is how the
transport writes it.

Chosen per window, from the descriptors themselves (so layer-wise slices and
mixed plans qualify alike): the window's sources lie in this rank's
registered host regions, its pieces average at most :data:`MAX_PIECE` bytes,
and merging neighbours contiguous in the destination at least halves the
descriptors. Otherwise, or when every slice is busy (up to two per
concurrently written peer: ``core/transfer/writing.py``, ``STAGED_IN_FLIGHT``),
the window is written as it is. A region whose pieces are too odd to copy by
units is left out of its window (``Staged.rest``), not the whole window.
Memory is bounded: :data:`SLICES` slices of :data:`SLICE_BYTES`, registered
once with the rest.

Prefill TP > decode TP is the mirror case (source contiguous, destination
strided), and scattered small pages are a third: gathering on prefill merges
nothing there. Those windows are staged on both sides (:meth:`Staging.stage_to`
gathers the window into one descriptor aimed at a staging slot decode lent,
``core/transfer/landing.py`` scatters it, ``core/transfer/relay.py`` chooses per window).

GPU memory (``device=``): the same slices in a buffer on the GPU, gathered by the device seam
(:mod:`kvbridge.core.transfer.device`: one copy a window, from the sources' unit offsets in their
regions where they are pages of a pool, else from their addresses) and only ever staged on both
sides (:meth:`Staging.stage_to`), into a GPU landing buffer decode lent; slices of
:data:`DEVICE_SLICE_BYTES` (posted in batches of the lane, each checked by the fence).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..description.layout import Region
from ..planning.transferplan import TransferPlan
from ..planning.stage_index import gather_into, merged, pack, region_pieces, unit_runs
from .device import Buffer, OnDevice

__all__ = ["Staging", "Staged", "wanted", "device_slices", "SLICES", "SLICE_BYTES", "DEVICE_SLICES", "DEVICE_SLICE_BYTES",
           "DEVICE_STAGING_BYTES", "MAX_PIECE"]

#: Slices of the host staging buffer: windows staged at once, up to ``STAGED_IN_FLIGHT`` (2) per peer being
#: written (``core/transfer/writing.py``): four peers at once (prefill TP 1 -> decode TP 4) at full depth.
SLICES = 8
#: The same on a GPU: two peers at once at full depth (GPU memory is dearer; a window finding no free
#: slice is written as planned).
DEVICE_SLICES = 4
#: Bytes of one slice: the most one staged window gathers (and posts, in one or more batches).
SLICE_BYTES = 4 << 20
#: The same on GPU memory: a window's fixed costs (a launch, a synchronise, ``Staged``, the scatter and
#: ``Unstaged``: hundreds of microseconds end to end) are paid once per slice, and at 200 GB/s 16 MiB moves in
#: 80 us, so a window is 32 MiB: two windows in flight are the fence's bound on what is in flight to a peer
#: (64 MiB: ``FENCE_BATCHES_IN_FLIGHT`` x ``FENCE_BATCH_BYTES``; nixl posts each window as one 32 MiB batch).
DEVICE_SLICE_BYTES = 32 << 20
#: GPU memory one prefill rank's staging buffer may hold: :data:`DEVICE_SLICES` slices of the default size. A larger
#: slice (``SessionConfig.gpu_staging_slice_bytes``) gets fewer slices (:func:`device_slices`), at least 2.
DEVICE_STAGING_BYTES = DEVICE_SLICES * DEVICE_SLICE_BYTES
#: Mean bytes per descriptor above which a window is written as it is: there, posting a
#: descriptor costs less than copying its bytes (measured: ``kvbridge bench tp``).
MAX_PIECE = 16 << 10
#: Most descriptors in one window (bounds the index arrays of a window of tiny pieces).
WINDOW_DESCRIPTORS = 1 << 16


def device_slices(slice_bytes: int) -> int:
    """Slices of a GPU staging buffer of ``slice_bytes`` slices: as many as fit :data:`DEVICE_STAGING_BYTES`, at most
    :data:`DEVICE_SLICES`, at least 2 (one peer's ``STAGED_IN_FLIGHT`` windows: then 2 x ``slice_bytes``)."""
    return max(2, min(DEVICE_SLICES, DEVICE_STAGING_BYTES // slice_bytes))


def wanted(regions: Sequence[Region]) -> bool:
    """Whether a rank with these regions may send strided pieces from host memory.

    True when one of them is host memory whose items split into several rows
    across TP (token-major pages, Mamba conv rows): only those give plans that
    staging shortens.
    """
    return any(r.mem == "dram" and r.shard.kind == "split" and r.shard.outer > 1 for r in regions)


class Staging:
    """A bounded pool of registered slices (host memory, or GPU memory with ``device``), and the gather
    that fills them."""

    def __init__(self, sources: Sequence[Region], slices: int = SLICES, slice_bytes: int = SLICE_BYTES,
                 device: OnDevice | None = None) -> None:
        if slices <= 0 or slice_bytes <= 0:
            raise ValueError(f"staging needs slices > 0 and slice_bytes > 0, got {slices} and {slice_bytes}")
        self.slice_bytes = slice_bytes
        self.device = device
        self._mem = Buffer("kvbridge-staging", slices, slice_bytes, sources, device)
        self._buf, self._sources, self.region = self._mem.host, self._mem.table, self._mem.region
        self._free = list(range(slices))
        self._lock = threading.Lock()
        #: Counters for ``Transport.describe()`` and the benchmarks: windows staged, the
        #: descriptors they held and the descriptors posted for them.
        self.windows = self.pieces = self.posted = 0
        #: Most slices held at once (windows gathered and not yet landed), over every peer.
        self.peak = 0

    def stage(self, window: TransferPlan) -> Staged | None:
        """Gather ``window`` (at most one slice) into a free slice if that cuts its descriptors, else ``None``."""
        n = len(window)
        total = window.total_bytes
        if n < 2 or total > self.slice_bytes or total > n * MAX_PIECE or self.device is not None:
            return None
        dst, nbytes = window.dst_addr, window.nbytes
        # Merging neighbours contiguous in the destination must at least halve the descriptors.
        if 2 * (n - int(np.count_nonzero(dst[:-1] + nbytes[:-1] == dst[1:]))) > n:
            return None

        def runs_of(addr: int, packed: TransferPlan) -> TransferPlan:
            # The runs contiguous in the destination follow each other in the slice too: one descriptor each.
            dst, sizes = merged(packed.dst_addr, packed.nbytes)
            return TransferPlan(addr + np.cumsum(sizes) - sizes, dst, sizes)
        return self._gather(window, runs_of)

    def stage_to(self, window: TransferPlan, dst_addr: int) -> Staged | None:
        """Gather ``window`` into a free slice posted as one descriptor to ``dst_addr`` (a staging
        slot of the peer's, scattered there: ``core/transfer/landing.py``; the transport cuts it into fence-sized
        batches), else ``None`` (no free slice, a source outside this rank's host memory, or pieces too odd
        to gather by units)."""
        total = window.total_bytes
        if len(window) < 2 or total > self.slice_bytes:
            return None
        return self._gather(window, lambda addr, packed: TransferPlan(
            np.array([addr], np.int64), np.array([dst_addr], np.int64), np.array([packed.total_bytes], np.int64)))

    def free(self) -> int:
        """Slices free now (another peer's write may take one first)."""
        with self._lock:
            return len(self._free)

    def _gather(self, window: TransferPlan, runs_of: Callable[[int, TransferPlan], TransferPlan]) -> Staged | None:
        """Gather ``window``'s pieces back to back into a free slice; ``runs_of(slice address, pieces packed)``
        says what to post. On host memory the pieces of a region too odd to gather by units are left out
        (:func:`~kvbridge.core.planning.stage_index.pack`), for the caller to write as planned (``Staged.rest``)."""
        src, nbytes = window.src_addr, window.nbytes
        packed, rest, copies, units = window, None, None, None
        if self.device is not None:  # pages of a pool: unit runs (the indexed copy), else by addresses
            pieces = region_pieces(src, nbytes, self._sources)
            if pieces is not None and all(p.counts is None for p in pieces):
                units = unit_runs(pieces, self._mem.regions)
            elif not self._sources.locate(src, nbytes)[1].all():
                return None  # a source outside the GPU memory this buffer stages (a plan built elsewhere)
        else:
            regions = None  # one region holds every source (head slices of a layer, pages of a pool): no search a piece
            if self._sources.holding(src, nbytes) < 0:
                regions, inside = self._sources.locate(src, nbytes)
                if not inside.all():
                    return None  # a source outside the memory this buffer stages (another kind or GPU, or a plan built elsewhere)
            order, copies = pack(src, nbytes, regions)
            if len(order) < 2:
                return None  # odd sizes or offsets: the index arrays would outgrow the descriptors
            if len(order) < len(window):
                left = np.ones(len(window), bool)
                left[order] = False
                rest = TransferPlan(src[left], window.dst_addr[left], nbytes[left])
            if len(order) < len(window) or (regions is not None and (order[1:] < order[:-1]).any()):
                packed = TransferPlan(src[order], window.dst_addr[order], nbytes[order])
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self.peak = max(self.peak, self.region.nbytes // self.slice_bytes - len(self._free))
        try:
            start = slot * self.slice_bytes
            if copies is None:  # one indexed copy or launch, complete on return (core/transfer/device.py)
                assert self.device is not None
                if units is not None:
                    self.device.copy.gather_units(units, self.region.addr + start, self.device.index)
                else:
                    self.device.copy.gather(src, nbytes, self.region.addr + start, self.device.index)
            else:
                gather_into(self._buf[start:start + packed.total_bytes], copies)
            runs = runs_of(self.region.addr + start, packed)
        except BaseException:
            self._release(slot)
            raise
        with self._lock:
            self.windows += 1
            self.pieces += len(packed)
            self.posted += len(runs)
        return Staged(self, slot, runs, packed, rest)

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"slices": self.region.nbytes // self.slice_bytes, "slice_bytes": self.slice_bytes, "mem": self.region.mem,
                    "windows": self.windows, "pieces": self.pieces, "posted": self.posted, "peak_slices": self.peak}


class Staged:
    """A gathered window: its runs to post, holding its slice until :meth:`release`; ``window``: its pieces
    in the order packed (where a scatter puts them back); ``rest``: its pieces left out, to write as planned."""

    def __init__(self, staging: Staging, slot: int, runs: TransferPlan, window: TransferPlan,
                 rest: TransferPlan | None = None) -> None:
        self._staging, self._slot, self.runs, self.window, self.rest = staging, slot, runs, window, rest

    def aim(self, dst_addr: int) -> Staged:
        """A window gathered by :meth:`Staging.stage_to` before its destination was known: its one run now goes to
        ``dst_addr`` (the peer's staging slot taken since)."""
        assert len(self.runs) == 1, "only a window gathered into one descriptor is aimed"
        self.runs = TransferPlan(self.runs.src_addr, np.array([dst_addr], np.int64), self.runs.nbytes)
        return self

    def release(self) -> None:
        """Give the slice back: only once the engine has no work left reading it."""
        if self._slot >= 0:
            self._staging._release(self._slot)
            self._slot = -1
