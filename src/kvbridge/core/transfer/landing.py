"""Decode's staging buffer: windows land here as a few large descriptors and are scattered into place.

Staging on both sides (``docs/architecture.md``, "Staging"): a prefill rank
gathers a window of small pieces into its own staging slice
(:mod:`kvbridge.core.transfer.staging`), writes it as one descriptor into a slot of
this buffer, then sends ``Staged`` naming the window's rooms and where its
pieces go: per run of pieces in one of this rank's regions, the region's place
in its ``KVArgs.regions``, a unit and each piece's unit offset from the
region's start (4 bytes a piece). Decode checks them with bounds arithmetic
(the region is one of this buffer's memory, every piece ends inside it, the
pieces fit the slot), scatters the slot into place (one ``numpy.put`` per
run over a view of the region, :func:`kvbridge.core.planning.stage_index.put_units`)
and answers ``Unstaged`` so the slot may be written again. ``Staged`` travels before the rooms' ``Done`` on the
same connection, so every scatter happens before a room can reach SUCCESS; it
happens under the decode manager's lock and only while every room named is
live there (a room given up, fenced or not, has nothing scattered into pages
the host may already have handed back).

Memory is bounded: :data:`SLOTS` slices of ``SLICE_BYTES`` registered once
with the rank's regions, two lent to each prefill rank this rank handshakes
with (double buffering: one slot lands while the other is scattered); a
prefill rank offered none (the pool is lent out) writes every piece into
place as before.

GPU memory (``device=``): a decode rank whose pages are on a GPU reached through an
engine lane lends slots of a buffer on that GPU instead (one offer a rank: the
``Hello`` carries one), and scatters them with the device seam
(:mod:`kvbridge.core.transfer.device`: one indexed copy a window over the same unit
runs, complete before ``Unstaged`` is sent and before any room can reach SUCCESS).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import numpy as np

from ..description.layout import Region, StagingOffer
from ..planning.stage_index import UnitRun, expand, put_units
from .device import Buffer, OnDevice
from .staging import DEVICE_SLICE_BYTES, SLICE_BYTES

__all__ = ["Landing", "ScatterError", "SLOTS", "SLOTS_PER_PEER", "DEVICE_LANDING_BYTES", "device_slots"]

log = logging.getLogger(__name__)

#: Slots of decode's staging buffer; each prefill rank gets :data:`SLOTS_PER_PEER`.
SLOTS = 8
#: Slots lent to one prefill rank: one lands while the other is scattered.
SLOTS_PER_PEER = 2
#: GPU memory one decode rank's landing buffer may hold: :data:`SLOTS` slots of the default GPU slice
#: (``staging.DEVICE_SLICE_BYTES``). Larger slots (``SessionConfig.gpu_staging_slice_bytes``) are fewer
#: (:func:`device_slots`): fewer prefill ranks are lent slots, the others write their GPU pages as planned.
DEVICE_LANDING_BYTES = SLOTS * DEVICE_SLICE_BYTES


def device_slots(slice_bytes: int) -> int:
    """Slots of a GPU landing buffer of ``slice_bytes`` slots: as many as fit :data:`DEVICE_LANDING_BYTES`, at most
    :data:`SLOTS`, at least :data:`SLOTS_PER_PEER` (one prefill rank's: then 2 x ``slice_bytes``)."""
    return max(SLOTS_PER_PEER, min(SLOTS, DEVICE_LANDING_BYTES // slice_bytes))



class StagedRun(Protocol):
    """A ``StagedRegion`` (kvbridge.core.control.protocol): pieces of one region, as uint32 unit offsets (and
    counts, empty: one unit each) in bytes."""

    @property
    def region(self) -> int: ...
    @property
    def unit(self) -> int: ...
    @property
    def offsets(self) -> bytes: ...
    @property
    def counts(self) -> bytes: ...


class StagedWindow(Protocol):
    """What a ``Staged`` message tells the scatter: the slot, and where its pieces go, run by run."""

    @property
    def slot(self) -> int: ...
    @property
    def pieces(self) -> Sequence[StagedRun]: ...


class ScatterError(ValueError):
    """A ``Staged`` message asked for a scatter outside this rank's memory or its slot."""


class Landing:
    """Decode's staging slots, lent to prefill ranks, and the scatter out of them (host memory, or GPU
    memory with ``device``)."""

    def __init__(self, regions: Sequence[Region], slots: int = SLOTS, slice_bytes: int = SLICE_BYTES,
                 device: OnDevice | None = None, order: Sequence[Region] | None = None) -> None:
        """``regions``: this rank's regions registered with the lane; ``order``: every region of the rank, in
        the order ``Staged`` names them (its ``KVArgs.regions``, as its ``Hello`` sends them; default
        ``regions``). A ``Staged`` run may name those of ``order`` in this buffer's memory only."""
        if slots < SLOTS_PER_PEER or slice_bytes <= 0:
            raise ValueError(f"a landing buffer needs at least {SLOTS_PER_PEER} slots and slice_bytes > 0, "
                             f"got {slots} and {slice_bytes}")
        self.slice_bytes = slice_bytes
        self.device = device
        self._mem = Buffer("kvbridge-landing", slots, slice_bytes, regions, device)
        self._buf, self._dests, self.region = self._mem.host, self._mem.table, self._mem.region
        self._where = "host regions" if device is None else f"regions on GPU {device.index}"
        order = regions if order is None else order
        mine = set(zip(self._dests.starts.tolist(), self._dests.ends.tolist()))
        #: Per region of ``order`` (what ``Staged`` names): its name, address and size, or None where it is not
        #: this buffer's memory.
        self._order = [(r.name, r.addr, r.nbytes) if (r.addr, r.end) in mine else None for r in order]
        self._free = list(range(slots - SLOTS_PER_PEER, -1, -SLOTS_PER_PEER))
        self._lent: dict[Hashable, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        #: Counters for ``explain()``: windows scattered, their pieces and bytes, windows dropped.
        self.windows = self.pieces = self.bytes = self.dropped = 0

    def offer(self, rank: Hashable) -> StagingOffer | None:
        """The slots lent to prefill ``rank`` (the same ones again when it handshakes again); None when
        every slot is lent out."""
        with self._lock:
            slots = self._lent.get(rank)
            if slots is None:
                if not self._free:
                    log.info("landing: every staging slot is lent out; prefill rank %r writes into place", rank)
                    return None
                first = self._free.pop()
                slots = self._lent[rank] = tuple(range(first, first + SLOTS_PER_PEER))
        return StagingOffer(region=self.region, slots=slots, slice_bytes=self.slice_bytes)

    def scatter(self, rank: Hashable, msg: StagedWindow) -> None:
        """Copy slot ``msg.slot`` into the pieces ``msg`` names. Raises :class:`ScatterError` (nothing
        written) if the slot is not ``rank``'s, a run names a region not of this buffer's memory, a piece
        ends past its region's end or the pieces do not fit one slot."""
        if msg.slot not in self._lent.get(rank, ()):
            raise ScatterError(f"Staged names staging slot {msg.slot}, not one lent to this prefill rank "
                               f"({self._lent.get(rank, ())})")
        start = msg.slot * self.slice_bytes
        runs, pieces, total = self._runs(msg.pieces)
        if self.device is not None:  # an indexed copy, complete on return (core/transfer/device.py)
            self.device.copy.scatter_units(self.region.addr + start, runs, self.device.index)
        else:
            put_units(self._buf[start:start + total], runs)
        with self._lock:
            self.windows += 1
            self.pieces += pieces
            self.bytes += total

    def _runs(self, named: Sequence[StagedRun]) -> tuple[list[UnitRun], int, int]:
        """``Staged``'s runs checked by bounds arithmetic (no search per piece), as unit runs packed from the
        slot's start; also the pieces and bytes. :class:`ScatterError` says what is wrong."""
        runs, pieces, total = [], 0, 0
        for i, run in enumerate(named):
            place = self._order[run.region] if 0 <= run.region < len(self._order) else None
            if place is None:
                raise ScatterError(f"Staged run {i} names region {run.region}, not one of this rank's registered "
                                   f"{self._where} (it has {len(self._order)} regions)")
            name, base, size = place
            counted = not run.counts or len(run.counts) == len(run.offsets)
            if run.unit <= 0 or not run.offsets or len(run.offsets) % 4 or not counted:
                raise ScatterError(f"Staged run {i} (region {name!r}) has unit {run.unit}, {len(run.offsets)} bytes of "
                                   f"offsets and {len(run.counts)} of counts: a unit > 0, at least one piece, uint32 "
                                   "offsets and (if any) one count a piece are needed")
            offsets = np.frombuffer(run.offsets, "<u4")
            counts = np.frombuffer(run.counts, "<u4") if run.counts else None
            if counts is None:
                end, units = int(offsets.max()) + 1, len(offsets)
            else:
                if not counts.all():
                    raise ScatterError(f"Staged run {i} (region {name!r}) has a piece of 0 units")
                end, units = int((offsets.astype(np.int64) + counts).max()), int(counts.sum(dtype=np.int64))
            if end * run.unit > size:
                raise ScatterError(f"Staged run {i} reaches unit {end} of {run.unit} B in region {name!r}, past its "
                                   f"end ({size} B)")
            if total + units * run.unit > self.slice_bytes:  # checked before any index of units is made
                raise ScatterError(f"Staged scatters {total + units * run.unit} B or more from a slot of "
                                   f"{self.slice_bytes} B; the pieces must fit one slot")
            runs.append(UnitRun(base, run.unit, expand(offsets, counts), total, size // run.unit))
            pieces += len(offsets)
            total += units * run.unit
        if not runs:
            raise ScatterError("Staged names no pieces")
        return runs, pieces, total

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"slots": self.region.nbytes // self.slice_bytes, "slice_bytes": self.slice_bytes, "mem": self.region.mem,
                    "lent": len(self._lent) * SLOTS_PER_PEER, "windows": self.windows, "pieces": self.pieces,
                    "bytes": self.bytes, "dropped": self.dropped}
