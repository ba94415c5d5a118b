"""How a ``TransferPlan`` stores its descriptors: as arrays, or as an outer sum expanded when read.

A plan is a sequence of parts. ``ArrayPart`` holds three int64 arrays; ``OuterPart`` holds region
pairs (rows) x coalesced runs (columns) and expands a slice only when a batch of it is written, so a
long request's plan costs megabytes, not gigabytes. Both answer the same questions (length, bytes,
cumulative bytes, a slice as arrays) so :class:`~.transferplan.TransferPlan` never asks which it has.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Union

import numpy as np

from .indices import IntArray

__all__ = ["ArrayPart", "OuterPart", "Part", "by_group"]


class OuterPart:
    """Descriptors as an outer product, expanded only when read: row ``r``, column ``c`` moves
    ``nbytes[c]`` bytes from ``src_rows[r] + src_cols[c] * unit`` to ``dst_rows[r] + dst_cols[c] * unit``.

    Rows are region pairs, columns are coalesced runs; a 1M-token page-1 request over 61
    layers is ~57M descriptors (1.4 GB as arrays) but a few MB in this form. ``hint`` is what the
    planner knows of the columns without reading them (see :meth:`TransferPlan.hints`). ``unit``:
    what one column step is in bytes (an item's size: the columns are then the index lists
    themselves, kept rather than multiplied into new arrays, 2 MiB each for 262,144 pages: #27).
    """

    __slots__ = ("src_rows", "dst_rows", "src_cols", "dst_cols", "col_nbytes", "hint", "unit", "_cum", "_row_bytes")

    def __init__(self, src_rows: IntArray, dst_rows: IntArray, src_cols: IntArray, dst_cols: IntArray,
                 col_nbytes: IntArray, hint: tuple[int, int] = (0, 0), row_bytes: int | None = None,
                 unit: int = 1) -> None:
        self.src_rows, self.dst_rows = src_rows, dst_rows
        self.src_cols, self.dst_cols, self.col_nbytes = src_cols, dst_cols, col_nbytes
        self.hint = hint
        self.unit = unit
        self._cum: IntArray | None = None
        # Given (the planner knows it), or the one column size times the columns where the hint knows it;
        # else summed once, when first asked (a pass over the columns: a write asks before its first batch).
        if row_bytes is None and hint[1]:
            row_bytes = hint[1] * int(col_nbytes.shape[0])
        self._row_bytes = row_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the columns' sizes summed)."""
        if self._row_bytes is None:
            self._row_bytes = int(self.col_nbytes.sum())
        return self._row_bytes

    def __len__(self) -> int:
        return int(self.src_rows.shape[0] * self.col_nbytes.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.src_rows.shape[0]) * self.row_bytes

    def max_nbytes(self) -> int:
        return self.hint[1] or int(self.col_nbytes.max())

    def cum_bytes(self, k: int) -> int:
        """Bytes of the first ``k`` descriptors."""
        if self._cum is None:
            self._cum = np.concatenate(([0], np.cumsum(self.col_nbytes)))
        cols = self.col_nbytes.shape[0]
        r, c = divmod(k, cols)
        return r * int(self._cum[-1]) + int(self._cum[c])

    def first_over(self, limit: int) -> int:
        """The least ``k`` with ``cum_bytes(k) > limit`` (``len`` + 1 if none)."""
        self.cum_bytes(0)
        assert self._cum is not None
        row = int(self._cum[-1])
        r = limit // row
        if r >= self.src_rows.shape[0]:
            return len(self) + 1
        return r * self.col_nbytes.shape[0] + int(np.searchsorted(self._cum, limit - r * row, side="right"))

    def arrays(self, lo: int, hi: int) -> tuple[IntArray, IntArray, IntArray]:
        """Descriptors ``lo .. hi-1`` (row-major order) as three new int64 arrays."""
        cols = self.col_nbytes.shape[0]
        r0, c0 = divmod(lo, cols)
        r1, c1 = divmod(hi, cols)
        pieces = []
        if r0 == r1:
            pieces.append(self._block(r0, r0 + 1, c0, c1))
        else:
            if c0:
                pieces.append(self._block(r0, r0 + 1, c0, cols))
                r0 += 1
            if r1 > r0:
                pieces.append(self._block(r0, r1, 0, cols))
            if c1:
                pieces.append(self._block(r1, r1 + 1, 0, c1))
        if len(pieces) == 1:
            return pieces[0]
        return tuple(np.concatenate(p) for p in zip(*pieces))  # type: ignore[return-value]

    def descriptors(self) -> list[tuple[int, int, int]]:
        """Every descriptor as ``(src, dst, nbytes)`` Python ints, row-major as :meth:`arrays`: a small
        plan's in one Python pass, without the ten numpy calls of expanding it (#27)."""
        u = self.unit
        cols = list(zip(self.src_cols.tolist(), self.dst_cols.tolist(), self.col_nbytes.tolist()))
        return [(a + c * u, b + d * u, n) for a, b in zip(self.src_rows.tolist(), self.dst_rows.tolist())
                for c, d, n in cols]

    def _block(self, r0: int, r1: int, c0: int, c1: int) -> tuple[IntArray, IntArray, IntArray]:
        # One pass per output array: each is written once, no temporaries of its size.
        shape = (r1 - r0, c1 - c0)
        src, dst, nbytes = np.empty(shape, np.int64), np.empty(shape, np.int64), np.empty(shape, np.int64)
        for out, rows, cols in ((src, self.src_rows, self.src_cols), (dst, self.dst_rows, self.dst_cols)):
            if self.unit == 1:
                np.add(rows[r0:r1, None], cols[None, c0:c1], out=out)
            else:
                np.multiply(cols[None, c0:c1], self.unit, out=out)
                out += rows[r0:r1, None]
        nbytes[...] = self.col_nbytes[None, c0:c1]
        return src.ravel(), dst.ravel(), nbytes.ravel()


class ArrayPart:
    """Descriptors given as three int64 arrays."""

    __slots__ = ("src", "dst", "nbytes", "_cum", "_total")

    def __init__(self, src: IntArray, dst: IntArray, nbytes: IntArray) -> None:
        self.src, self.dst, self.nbytes = src, dst, nbytes
        self._cum: IntArray | None = None
        self._total: int | None = None

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_bytes(self) -> int:
        # Summed once: a write asks a plan's total before each of its batches (the fence's message).
        if self._total is None:
            self._total = int(self.nbytes.sum())
        return self._total

    def max_nbytes(self) -> int:
        return int(self.nbytes.max())

    def cum_bytes(self, k: int) -> int:
        if self._cum is None:
            self._cum = np.concatenate(([0], np.cumsum(self.nbytes)))
        return int(self._cum[k])

    def first_over(self, limit: int) -> int:
        self.cum_bytes(0)
        assert self._cum is not None
        return int(np.searchsorted(self._cum, limit, side="right"))

    def arrays(self, lo: int, hi: int) -> tuple[IntArray, IntArray, IntArray]:
        return self.src[lo:hi], self.dst[lo:hi], self.nbytes[lo:hi]

    def descriptors(self) -> list[tuple[int, int, int]]:
        return list(zip(self.src.tolist(), self.dst.tolist(), self.nbytes.tolist()))


Part = Union[ArrayPart, OuterPart]


def by_group(group: IntArray) -> Iterator[tuple[int, IntArray | slice | None]]:
    """Per group present in ``group``, ascending: its positions, in order (None: all of them). Slices when
    each group is one run and the runs ascend (rows in layer order, the usual plan), else index arrays."""
    n = len(group)
    cuts = np.flatnonzero(group[1:] != group[:-1]) + 1
    if not cuts.size:
        yield int(group[0]), None
        return
    if (np.diff(group[np.concatenate(([0], cuts))]) > 0).all():  # each group one run (sorted): slices
        bounds = [0, *cuts.tolist(), n]
        ids = group[bounds[:-1]].tolist()
        for g, lo, hi in zip(ids, bounds, bounds[1:]):
            yield g, slice(lo, hi)
        return
    order = np.argsort(group, kind="stable")
    ordered = group[order]
    bounds = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), n]
    for lo, hi in zip(bounds, bounds[1:]):
        yield int(ordered[lo]), order[lo:hi]
