"""Index arrays of a staged window: which units of memory a gather reads or a scatter writes.

A staged window is a list of pieces (address, bytes) packed back to back in a
staging slice. Both the gather on prefill (pieces -> slice) and the scatter on
decode (slice -> pieces) move whole *units*: the greatest size dividing every
piece's size and offset from the lowest address, so that a copy is one
``numpy.take`` / fancy assignment (host memory) or one kernel launch over an
index array (GPU memory: ``kvbridge.plugins.cuda_ipc.staging``), never a loop
per piece. Pure numpy; no memory is touched here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["UnitIndex", "unit_index", "MAX_UNITS_PER_PIECE"]

#: A window whose pieces hold more units than this on average is not staged: its index array would
#: outgrow the descriptors it replaces (odd sizes or offsets, so the unit is a few bytes).
MAX_UNITS_PER_PIECE = 4


class UnitIndex(NamedTuple):
    """Where the units of a window's pieces are, relative to ``base``, in staging order."""

    #: Lowest address of any piece.
    base: int
    #: Bytes per unit.
    unit: int
    #: For the k-th unit of the staging slice: its index (in units) from ``base``.
    index: npt.NDArray[np.int64]
    #: Units from ``base`` to the end of the highest piece (the span a raw view must cover).
    span: int


def unit_index(addr: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64],
               max_units_per_piece: int = MAX_UNITS_PER_PIECE) -> UnitIndex | None:
    """The unit index of pieces at ``addr`` of ``nbytes`` each, packed in this order; None when the
    pieces' sizes and offsets share too small a unit (more than ``max_units_per_piece`` units a piece
    on average) or there are no pieces."""
    n = len(addr)
    if n == 0:
        return None
    base = int(addr.min())
    rel = addr - base
    unit = int(np.gcd.reduce(np.concatenate((nbytes, rel))))
    if unit <= 0:
        return None
    units = int(nbytes.sum()) // unit
    if units > max_units_per_piece * n:
        return None
    first = rel // unit
    if units == n:
        index = first
    else:  # pieces of several units: every unit of every piece, in order
        count = nbytes // unit
        index = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(units, dtype=np.int64)
    span = (int((addr + nbytes).max()) - base) // unit
    return UnitIndex(base, unit, index.astype(np.int64, copy=False), span)
