"""Decode's staging buffer: windows land here as a few large descriptors and are scattered into place.

Staging on both sides (``docs/architecture.md``, "Staging"): a prefill rank
gathers a window of small pieces into its own staging slice
(:mod:`kvbridge.core.transfer.staging`), writes it as one descriptor into a slot of
this buffer, then sends ``Staged`` naming the window's rooms and where its
pieces go; decode scatters the slot into place (one fancy assignment over a
unit index, :mod:`kvbridge.core.planning.stage_index`) and answers ``Unstaged`` so the
slot may be written again. ``Staged`` travels before the rooms' ``Done`` on the
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
(:mod:`kvbridge.core.transfer.device`: one kernel launch a window, complete before
``Unstaged`` is sent and before any room can reach SUCCESS).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import numpy as np

from ..description.layout import Region, StagingOffer
from ..planning.stage_index import scatter_from
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



class StagedWindow(Protocol):
    """What a ``Staged`` message (kvbridge.core.control.protocol) tells the scatter: the slot, and where its
    pieces go (int64 addresses and sizes, as bytes)."""

    slot: int
    dst: bytes
    nbytes: bytes

class ScatterError(ValueError):
    """A ``Staged`` message asked for a scatter outside this rank's memory or its slot."""


class Landing:
    """Decode's staging slots, lent to prefill ranks, and the scatter out of them (host memory, or GPU
    memory with ``device``)."""

    def __init__(self, regions: Sequence[Region], slots: int = SLOTS, slice_bytes: int = SLICE_BYTES,
                 device: OnDevice | None = None) -> None:
        if slots < SLOTS_PER_PEER or slice_bytes <= 0:
            raise ValueError(f"a landing buffer needs at least {SLOTS_PER_PEER} slots and slice_bytes > 0, "
                             f"got {slots} and {slice_bytes}")
        self.slice_bytes = slice_bytes
        self.device = device
        self._mem = Buffer("kvbridge-landing", slots, slice_bytes, regions, device)
        self._buf, self._dests, self.region = self._mem.host, self._mem.table, self._mem.region
        self._where = "host regions" if device is None else f"regions on GPU {device.index}"
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
        written) if the slot is not ``rank``'s or a piece lies outside this rank's regions of the buffer's memory."""
        if msg.slot not in self._lent.get(rank, ()):
            raise ScatterError(f"Staged names staging slot {msg.slot}, not one lent to this prefill rank "
                               f"({self._lent.get(rank, ())})")
        if len(msg.dst) != len(msg.nbytes) or len(msg.dst) % 8:
            raise ScatterError(f"Staged carries {len(msg.dst)} bytes of addresses and {len(msg.nbytes)} of sizes; "
                               "both must be int64 arrays of one length")
        dst = np.frombuffer(msg.dst, "<i8").astype(np.int64)
        nbytes = np.frombuffer(msg.nbytes, "<i8").astype(np.int64)
        total = int(nbytes.sum())
        if len(dst) == 0 or (nbytes <= 0).any() or total > self.slice_bytes:
            raise ScatterError(f"Staged scatters {len(dst)} pieces, {total} B, from a slot of {self.slice_bytes} B; "
                               "pieces must be non-empty and fit one slot")
        inside = self._dests.locate(dst, nbytes)[1]
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise ScatterError(f"Staged piece {bad} ({int(nbytes[bad])} B at {int(dst[bad]):#x}) lies outside this "
                               f"rank's registered {self._where}")
        start = msg.slot * self.slice_bytes
        if self.device is not None:  # one launch, complete on return (core/transfer/device.py)
            self.device.copy.scatter(self.region.addr + start, dst, nbytes, self.device.index)
        else:
            scatter_from(self._buf[start:start + total], dst, nbytes, self._dests.locate(dst, nbytes)[0])
        with self._lock:
            self.windows += 1
            self.pieces += len(dst)
            self.bytes += total

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"slots": self.region.nbytes // self.slice_bytes, "slice_bytes": self.slice_bytes, "mem": self.region.mem,
                    "lent": len(self._lent) * SLOTS_PER_PEER, "windows": self.windows, "pieces": self.pieces,
                    "bytes": self.bytes, "dropped": self.dropped}
