"""Prefill's side of staging on both sides: which windows to stage, and decode's slots lent to it.

Per window, from the descriptors themselves (:func:`choose`): a window of
small pieces (mean at most :data:`MAX_PIECE` bytes on the same host,
:data:`MAX_PIECE_REMOTE` across hosts, where every descriptor costs the
engine a network work request) whose sources are in this rank's registered
host memory and whose destinations are in the peer's host memory is

- ``"both"``: gathered on prefill, written as one descriptor into one of the
  decode slots lent to this rank (:class:`RemoteSlots`), and scattered there
  (:mod:`kvbridge.core.transfer.landing`), when the peer lent slots and merging
  neighbours in the destination would leave runs under :data:`GATHER_RUN`
  bytes on average (scattered pages, prefill TP > decode TP, head slices into
  scattered pages);
- ``"gather"``: gathered on prefill and posted as the runs contiguous in the
  destination (:mod:`kvbridge.core.transfer.staging`), when that at least halves the
  descriptors (prefill TP < decode TP: token rows back to back on decode) and
  ``"both"`` does not apply;
- ``"direct"``: written as planned.

``SessionConfig.staging``: ``auto`` as above, ``on`` stages every window of two
or more host pieces that fits a slice (both sides where the peer lent slots,
else gathered), ``off`` never stages.

GPU memory (:func:`choose_device`): a window whose sources and destinations are
on GPUs, through an engine lane, to a peer that lent slots on its GPU, is staged
on both sides or written as planned; never gathered alone (a GPU window's runs
are pages, and ``both`` is one descriptor whatever they are).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..description.layout import Region, StagingOffer
from ..planning.regions import RegionTable
from ..planning.stage_index import MAX_UNITS_PER_PIECE, RegionPieces, merged, region_pieces
from ..planning.transferplan import TransferPlan

__all__ = ["MODES", "MAX_PIECE", "MAX_PIECE_DEVICE", "MAX_PIECE_REMOTE", "MIN_UNIT", "REMOTE_WINDOW_DESCRIPTORS", "RemoteSlots",
           "choose", "choose_device"]

#: ``SessionConfig.staging`` values.
MODES = ("gather", "auto", "on", "off")
#: Mean bytes per piece up to which ``auto`` stages a window on the same host (copying a piece
#: costs less than posting it there; measured: ``kvbridge bench transfer``, ``kvbridge bench tp``).
MAX_PIECE = 16 << 10
#: The same across hosts: an engine's work request per descriptor costs more on a NIC than a
#: CMA iovec (sgl-project/sglang#35036: 4 KiB entries at 15.5 MB/s against 4,792 MB/s staged).
#: Not measured here (one host).
MAX_PIECE_REMOTE = 256 << 10
#: Mean bytes per piece up to which ``auto`` stages a GPU window (:func:`choose_device`), on this host or
#: across: NIXL VRAM -> VRAM with the same-host fast path off moved 1 GiB of scattered 64 KiB pages at
#: 6.5-7.6 GB/s against 180-300 GB/s contiguous on an H200 (docs/performance.md); larger pieces not measured.
MAX_PIECE_DEVICE = 256 << 10
#: Most pieces in one window staged on both sides: its ``Staged`` message carries 4 bytes a piece (a unit
#: offset; 8 where pieces are of several units), 256 KiB at most. Host slices hold fewer 4 KiB pieces; a
#: 256 MiB GPU slice holds this many (at 16,384 its 4 KiB pages went in 64 MiB windows, 26-30 GB/s on an
#: H200 whatever the slice).
REMOTE_WINDOW_DESCRIPTORS = 65536
#: ``auto`` gathers on prefill alone (no round trip to decode per window) when the runs merging neighbours in
#: the destination leaves average at least this many bytes; below that, with slots lent, both sides
#: (measured, ucx, head slices TP 1 -> 2 of 64 KiB pages: 32 KiB runs gathered 0.38 GB/s, both sides 0.72).
GATHER_RUN = 64 << 10
#: Smallest mean unit (bytes) decode scatters a window of several units a piece in (:meth:`RemoteSlots.pieces`).
MIN_UNIT = 256
#: How often a write waiting for a free decode slot checks its deadline and room.
SLOT_POLL = 0.01


def choose(window: TransferPlan, mode: str, same_host: bool, remote: bool) -> str:
    """``"both"``, ``"gather"`` or ``"direct"`` for ``window`` (module docstring). ``remote``: the
    peer lent slots and this write can announce them; the caller checked the memory kinds."""
    n = len(window)
    if mode == "off" or n < 2:
        return "direct"
    total = window.total_bytes
    limit = MAX_PIECE if same_host else MAX_PIECE_REMOTE
    if mode == "auto" and total > n * limit:
        return "direct"
    dst, nbytes = window.dst_addr, window.nbytes
    runs = n - int(np.count_nonzero(dst[:-1] + nbytes[:-1] == dst[1:]))
    merges = 2 * runs <= n  # gathering alone at least halves the descriptors
    if remote and (mode == "on" or not merges or total < runs * GATHER_RUN):
        return "both"  # one descriptor a window, whatever the destination
    if mode == "on" or merges:
        return "gather"
    return "direct"


def choose_device(window: TransferPlan, mode: str) -> str:
    """``"both"`` or ``"direct"`` for a GPU ``window`` (module docstring); the caller checked the memory
    kinds, the lane, and that the peer lent GPU slots this write can announce."""
    n = len(window)
    if mode not in ("auto", "on") or n < 2:
        return "direct"
    if mode == "auto" and window.total_bytes > n * MAX_PIECE_DEVICE:
        return "direct"
    return "both"


class RemoteSlots:
    """Decode's staging slots lent to this prefill rank for one peer: free ones, taken by writes and
    given back by decode's ``Unstaged`` (the I/O thread); and the peer's regions, in the order its
    ``Hello`` listed them, which ``Staged`` names them by (:meth:`pieces`)."""

    def __init__(self, offer: StagingOffer, regions: Sequence[Region]) -> None:
        self.offer = offer
        self.table = RegionTable(regions)
        self._free = list(offer.slots)
        self._retired = 0
        self._cond = threading.Condition()

    def address(self, slot: int) -> int:
        return self.offer.region.addr + slot * self.offer.slice_bytes

    def pieces(self, window: TransferPlan) -> list[RegionPieces] | None:
        """Where the pieces of a window gathered back to back go, as ``Staged`` says it (pieces continuing each other
        in the peer's memory said as one, :func:`~kvbridge.core.planning.stage_index.merged`): runs of pieces in one of
        the peer's regions, in unit offsets (:func:`~kvbridge.core.planning.stage_index.region_pieces`); None when
        they cannot be said so (a piece outside the peer's regions, too many runs, offsets past uint32) or decode
        would scatter units smaller than :data:`MIN_UNIT` on average, more than ``MAX_UNITS_PER_PIECE`` a piece
        (destinations at odd offsets: its index of units would outgrow the bytes it moves)."""
        # Pieces continuing each other in decode's memory follow each other in the slot too: said as one (a page's
        # head slices when decode holds its heads whole), unless that run crosses into an adjacent region.
        addr, nbytes = merged(window.dst_addr, window.nbytes)
        pieces = region_pieces(addr, nbytes, self.table)
        if pieces is None and len(addr) < len(window):
            pieces = region_pieces(window.dst_addr, window.nbytes, self.table)
        if pieces is None:
            return None
        units = sum(len(p.offsets) if p.counts is None else int(p.counts.sum(dtype=np.int64)) for p in pieces)
        if units > MAX_UNITS_PER_PIECE * len(window) and window.total_bytes < units * MIN_UNIT:
            return None
        return pieces

    def take(self, check: Callable[[str], None]) -> int:
        """A free slot, waiting for decode to give one back; ``check(where)`` raises when the write's
        deadline passed or its room died (the fence) and is called at least every :data:`SLOT_POLL`."""
        while True:
            with self._cond:
                if not self._free:
                    self._cond.wait(SLOT_POLL)
                if self._free:
                    return self._free.pop()
            # Outside the condition's lock: the check takes the manager's lock, which the I/O thread
            # holds while it gives a slot back (give_back), so checking under ours would deadlock.
            check("waiting for decode to free a staging slot")

    def settle(self, check: Callable[[str], None]) -> None:
        """Wait until decode scattered every window announced so far (every slot is back, but those a failed
        write retired): a direct write after a staged one must not land before it, or decode's later scatter
        of the staged window would overwrite newer bytes (a chunk rewriting the page a previous chunk ended in)."""
        while True:
            with self._cond:
                if len(self._free) + self._retired >= len(self.offer.slots):
                    return
                self._cond.wait(SLOT_POLL)
                if len(self._free) + self._retired >= len(self.offer.slots):
                    return
            check("waiting for decode to scatter the staged windows before a direct write")

    def retire(self) -> None:
        """A write into a taken slot failed: the engine may still land bytes there, so it is never written
        again (this peer stages with the slots left; a new handshake lends them afresh)."""
        with self._cond:
            self._retired += 1

    def give_back(self, slot: int) -> bool:
        """Decode scattered (or dropped) ``slot``: free again. False for a slot not lent or not taken."""
        with self._cond:
            if slot not in self.offer.slots or slot in self._free:
                return False
            self._free.append(slot)
            self._cond.notify()
            return True

    def free(self) -> int:
        with self._cond:
            return len(self._free)

    def usable(self) -> int:
        """Slots this rank may still write into: every one lent, but those a failed write retired."""
        with self._cond:
            return len(self.offer.slots) - self._retired

    def idle(self) -> bool:
        """Whether decode scattered every window announced so far (:meth:`settle` would return at once)."""
        with self._cond:
            return len(self._free) + self._retired >= len(self.offer.slots)

