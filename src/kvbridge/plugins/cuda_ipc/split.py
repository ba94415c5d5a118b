"""How the copy kernel splits a plan into launches and programs, in numpy (tested on CPU).

A plan arrives unexpanded (:meth:`~kvbridge.core.planning.plan.TransferPlan.factors`:
rows x columns, a descriptor being formed on the GPU; columns in units of a part's
``unit`` bytes, scaled where the table is packed); :func:`shape` picks a
launch's element width and pieces, :func:`slices` cuts a part into launches,
and :func:`execute_on_host` runs the kernel's split, masks and address
translation with ``ctypes.memmove`` on host memory: the CPU reference of
:func:`kvbridge.plugins.cuda_ipc.kernel.copy`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvbridge.core.planning.transferplan import TransferPlan

__all__ = ["Mapped", "Part", "Shape", "arrays_part", "execute_on_host", "kernel_shapes", "kernel_translate", "launches", "plan_shapes",
           "row_sizes", "search_steps", "shape", "sizes_mode", "slices"]


class Mapped(Protocol):
    """A peer's allocations as mapped here (sorted starts, and the delta to add to an address in each)."""

    starts: npt.NDArray[np.int64]
    delta: npt.NDArray[np.int64]


IntArray = npt.NDArray[np.int64]
#: Bytes one kernel program copies. On an H200 the kernel alone (table on the GPU, CUDA events) moved
#: 1 GiB of scattered 16-64 KiB pages at 0.95-0.98 of the device-to-device copy with 4 KiB programs of
#: 2 warps, and within a few per cent of that with 16 KiB programs of 8 warps; small programs also
#: give 4 KiB pages one program each (``benchmarks/gpu_kernel_bench.py --tune``).
TILE_BYTES = 4096


# -- the work split (numpy; tested on CPU) ------------------------------------------------------------
#: One part of a plan as an outer sum (:meth:`kvbridge.core.planning.plan.TransferPlan.factors`): descriptor
#: ``(r, c)`` moves ``nbytes`` bytes from ``src_rows[r] + src_cols[c] * unit`` to ``dst_rows[r] + dst_cols[c] * unit``
#: (``unit``: the part's, from ``TransferPlan.units``, 1 where columns are in bytes); ``nbytes`` is per column,
#: or per row where there is one column (a part given as arrays).
Part = tuple[IntArray, IntArray, IntArray, IntArray, IntArray]


def arrays_part(src: IntArray, dst: IntArray, nbytes: IntArray) -> Part:
    """Descriptors given as three arrays, as a part (one column at offset 0, sizes per row)."""
    zero = np.zeros(1, np.int64)
    return src, dst, zero, zero, nbytes


def row_sizes(part: Part) -> bool:
    """Whether ``part``'s sizes are per row (one column) rather than per column."""
    src_rows, _, src_cols, _, nbytes = part
    return len(src_cols) == 1 and len(nbytes) == len(src_rows)


class Shape(NamedTuple):
    """How one launch splits a part's descriptors: element ``width`` in bytes, ``chunk`` elements per
    piece, ``pieces`` per descriptor (of the longest), ``rows`` pieces per program (rows x chunk x width
    = :data:`TILE_BYTES`); ``align16``: every address and size is a multiple of 16 bytes; ``even``: every size is
    a multiple of a piece, so pieces need no per-element mask (loads and stores then vectorise);
    ``uniform``: the one size of every descriptor (its table then has no sizes), or 0."""

    width: int
    chunk: int
    pieces: int
    rows: int
    align16: bool
    even: bool
    uniform: int = 0


def sizes_mode(part: Part, sh: Shape) -> int:
    """Where a launch of ``part`` finds its sizes: 0 one size for all (``sh.uniform``), 1 per row, 2 per column."""
    return 0 if sh.uniform else 1 if row_sizes(part) else 2


def kernel_shapes(parts: Sequence[Part], hints: Sequence[tuple[int, int]] | None,
                  units: Sequence[int] | None = None) -> dict[tuple[int, ...], tuple[Shape, int]]:
    """The launches of ``parts`` (columns in ``units``, as :func:`launches` takes them) as the kernels they
    need: ``(shape, sizes mode)`` by what tells compiled kernels apart (every constant but the piece count;
    counts and sizes are arguments)."""
    out: dict[tuple[int, ...], tuple[Shape, int]] = {}
    for piece, hint, unit in launches(parts, hints, units):
        sh = shape(piece, hint, unit)
        sizes = sizes_mode(piece, sh)
        out.setdefault((sh.rows, sh.chunk, sh.width, sh.align16, sh.even, sizes), (sh, sizes))
    return out


def plan_shapes(plans: Sequence[TransferPlan]) -> dict[tuple[int, ...], tuple[Shape, int]]:
    """:func:`kernel_shapes` of every launch copies of ``plans`` make (as the backend hands them over)."""
    return kernel_shapes([f for p in plans for f in p.factors(in_units=True)], [h for p in plans for h in p.hints()],
                         [u for p in plans for u in p.units()])


def _or(a: IntArray) -> int:
    """The bitwise or of ``a``'s elements (a part's rows are often one: no numpy call then)."""
    return int(a[0]) if len(a) == 1 else int(np.bitwise_or.reduce(a))


def shape(part: Part, hint: tuple[int, int] = (0, 0), unit: int = 1) -> Shape:
    """The launch shape of a part: the widest element every address and size is a multiple of.

    A sum of multiples of 2**k is one, so rows and columns are reduced apart: no descriptor is formed.
    ``hint`` (:meth:`~kvbridge.core.planning.plan.TransferPlan.hints`): a power of two dividing every column
    offset (in bytes) and size, and the one column size, where known (0: not), which are then not reduced.
    ``unit``: the columns' (only the lowest set bit of what is reduced counts: ``c * unit``'s is ``c``'s times ``unit``'s).
    """
    src_rows, dst_rows, src_cols, dst_cols, nbytes = part
    align, size = hint
    if size:
        size_bits = most = least = size
    else:
        most, least = int(nbytes.max()), int(nbytes.min())
        # Sizes are multiples of ``align``: what follows reads only their lowest set bit, which is then at
        # least ``align``, and of a piece's bytes (at most TILE_BYTES) whether it is at least that: one pass
        # over the sizes fewer (a scattered 1 GiB of 16 KiB pages has 65,535 of them).
        size_bits = align if align >= TILE_BYTES else _or(nbytes)
    # columns are multiples of ``align`` where known: the widest element is then at most as wide
    bits = size_bits | _or(src_rows) | _or(dst_rows) | (align if align else (_or(src_cols) | _or(dst_cols)) * unit)
    width = min(8, bits & -bits) if bits else 8
    longest = max(1, most // width)
    tile = TILE_BYTES // width
    chunk = min(tile, 1 << (longest - 1).bit_length())
    # the largest power of two dividing every size, against a piece's bytes
    even = (size_bits & -size_bits) >= chunk * width
    uniform = most if least == most else 0
    return Shape(width, chunk, -(-longest // chunk), tile // chunk, bits % 16 == 0, even, uniform)


#: A part goes to the GPU in slices of about this many bytes, one launch each; a failed room's fence is
#: checked between slices.
SLICE_BYTES = 1 << 30
#: A part of at least ``PIPELINE_BYTES`` goes first as a slice of ``FIRST_SLICE`` of it, so that the
#: rest's table is packed, staged and launched while that slice copies instead of before it. Measured on
#: an H200 (1 GiB scattered, 20 interleaved reps, medians): 16 KiB pages (65,535 columns with sizes, a
#: 170 us pack) 1.03 -> 0.96 ms; 64 KiB pages (a 26 us pack) unchanged at 0.86-0.88 ms, the second
#: launch's fixed host cost hidden but its table copy and the gap between kernels not; first slices of
#: 0.25 and 0.55 measured the same within noise. Later (copy() in one process, 40 reps interleaved with
#: D2D, the later table copied on a side stream): a first slice of 0.25 instead of 0.4 gave 0.876 vs 0.860
#: of D2D for 64 KiB pages but 0.728 vs 0.759 for 16 KiB ones.
PIPELINE_BYTES = 256 << 20
FIRST_SLICE = 0.4


def slices(part: Part) -> list[Part]:
    """``part`` cut into the launches :func:`copy` makes (each has its own :func:`shape`).

    A part is rows x columns; it is cut along whichever is longer (a plan of one region's scattered
    pages is one row of many columns), each slice again rows x columns: a first slice of
    :data:`FIRST_SLICE` of a part of at least :data:`PIPELINE_BYTES`, then slices of :data:`SLICE_BYTES`.
    """
    src_rows, dst_rows, src_cols, dst_cols, nbytes = part
    per_row = row_sizes(part)
    by_rows = len(src_rows) >= len(src_cols)
    count = len(src_rows) if by_rows else len(src_cols)
    if not count:
        return []
    # bytes per unit cut (a row, or a column), estimated from the first
    unit = int(nbytes[0]) if per_row else int(nbytes.sum()) if by_rows else int(nbytes[0]) * len(src_rows)
    step = max(1, SLICE_BYTES // max(1, unit))
    first = step
    if count > 1 and unit * count >= PIPELINE_BYTES:
        first = min(step, max(1, int(count * FIRST_SLICE)))
    bounds = [0, *range(first, count, step), count]
    cuts = list(zip(bounds, bounds[1:]))
    if by_rows:
        return [(src_rows[lo:hi], dst_rows[lo:hi], src_cols, dst_cols, nbytes[lo:hi] if per_row else nbytes)
                for lo, hi in cuts]
    return [(src_rows, dst_rows, src_cols[lo:hi], dst_cols[lo:hi], nbytes[lo:hi]) for lo, hi in cuts]


def launches(parts: Sequence[Part], hints: Sequence[tuple[int, int]] | None = None,
             units: Sequence[int] | None = None) -> list[tuple[Part, tuple[int, int], int]]:
    """Every launch of ``parts`` (none for an empty part): each slice, with its part's hint and unit."""
    return [(piece, hint, unit) for part, hint, unit in zip(parts, hints or [(0, 0)] * len(parts), units or [1] * len(parts))
            if len(part[0]) and len(part[2]) for piece in slices(part)]


def search_steps(allocations: int) -> int:
    """Steps of the kernel's branchless binary search over ``allocations`` sorted starts (none for one)."""
    return (allocations - 1).bit_length()


def kernel_translate(dst: IntArray, starts: IntArray, deltas: IntArray) -> IntArray:
    """The kernel's address translation (last start <= address, by halving steps) in numpy."""
    pos = np.zeros(dst.shape, np.int64)
    steps = search_steps(len(starts))
    for i in range(steps):
        cand = pos + (1 << (steps - 1 - i))
        ok = cand < len(starts)
        take = ok & (starts[np.minimum(cand, len(starts) - 1)] <= dst)
        pos = np.where(take, cand, pos)
    return dst + deltas[pos]


def execute_on_host(parts: Sequence[Part], peer: Mapped, hints: Sequence[tuple[int, int]] | None = None,
                    units: Sequence[int] | None = None) -> None:
    """The kernel's work split, sizes, masks and translation run with ``ctypes.memmove`` on host memory:
    the CPU reference of :func:`copy`, program by program."""
    for part, hint, unit in launches(parts, hints, units):
        src_rows, dst_rows, src_cols, dst_cols, nbytes = part
        src_cols, dst_cols = src_cols * unit, dst_cols * unit  # as the table is packed
        sh = shape(part, hint, unit)
        cols = len(src_cols)
        piece = np.arange(len(src_rows) * cols * sh.pieces, dtype=np.int64)  # as the programs number them
        d, first = piece // sh.pieces, (piece % sh.pieces) * sh.chunk * sh.width
        r, c = d // cols, d % cols
        n = nbytes[r] if row_sizes(part) else nbytes[c]
        piece_bytes = sh.chunk * sh.width
        if sh.even:  # the kernel's per-piece mask: a piece is copied whole or not at all
            size = np.where(first < n, piece_bytes, 0)
        else:
            size = np.minimum(n - first, piece_bytes)
        src = src_rows[r] + src_cols[c]
        dst = kernel_translate(dst_rows[r] + dst_cols[c], peer.starts, peer.delta)
        for s_, t, o, k in zip(src.tolist(), dst.tolist(), first.tolist(), size.tolist()):
            if k > 0:
                ctypes.memmove(t + o, s_ + o, k)

