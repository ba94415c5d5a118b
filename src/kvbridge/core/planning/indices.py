"""Index lists: checked once, where they enter kvbridge (the host's calls, a peer's request).

:class:`Indices` is the checked type the planner trusts; :func:`check_indices`
does the checking and names the first bad value.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

__all__ = ["Indices", "IntArray", "PlanError", "check_index", "check_indices", "continuing"]

IntArray = npt.NDArray[np.int64]


class PlanError(ValueError):
    """A plan cannot be built or would touch memory outside registered regions."""


def _as_index_array(name: str, values: npt.ArrayLike) -> IntArray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise PlanError(f"{name} must be one-dimensional, got shape {arr.shape}")
    # The dtype's kind, not np.issubdtype (a dozen Python calls, several times per request: #27).
    if arr.size and arr.dtype.kind not in "iu":
        raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_indices(name: str, idx: npt.ArrayLike, count: int | None = None, *, unique: bool = False) -> IntArray:
    """Return ``idx`` as int64 after checking range and (optionally) uniqueness.

    Raises :class:`PlanError` naming the first offending position and value.
    """
    arr = _as_index_array(name, idx)
    if arr.size == 0:
        return arr
    if arr.size <= 64:
        # Small lists (most requests' state and metadata lists, small requests' pages): a few
        # Python comparisons cost ~1 us where the numpy path below costs ~8 (profiled per request).
        vals = arr.tolist()
        if min(vals) >= 0 and (count is None or max(vals) < count) and (not unique or len(set(vals)) == len(vals)):
            return arr
    # One reduction, no temporary of the list's size (each costs its pages' first-touch faults at
    # hundreds of thousands of indices): read as unsigned, a negative value is above every count and
    # 2**63, so the largest value says whether all are in range. The positions are looked for only when
    # a value is bad.
    hi = int(arr.view(np.uint64).max())
    if hi >= (2**63 if count is None else count):
        bad = np.flatnonzero(arr < 0) if count is None else np.flatnonzero((arr < 0) | (arr >= count))
        i = int(bad[0])
        limit = "must be >= 0" if count is None else f"valid range is 0..{count - 1}"
        raise PlanError(f"{name}[{i}] = {int(arr[i])} is out of range ({limit})")
    if unique and arr.size > 1 and not _ascending(arr) and not _distinct(arr, hi):
        s = np.sort(arr, kind="stable")
        dup = np.flatnonzero(s[1:] == s[:-1])
        raise PlanError(
            f"{name} contains index {int(s[dup[0]])} more than once; "
            "every destination item may be written once per transfer"
        )
    return arr


def check_index(name: str, value: int, count: int) -> None:
    """One index (a metadata row) checked as ``check_indices(name, [value], count)``: a Python int in
    range costs no array (twice per request, #27); anything else goes the array's way, errors included."""
    if type(value) is not int or not 0 <= value < count:
        check_indices(name, [value], count)


def _ascending(arr: IntArray) -> bool:
    """Whether ``arr`` (two or more values) strictly ascends: sorted input, the common case, needs no sort.
    A list whose first values do not ascend (scattered pages) is told so without a pass over it; the rest
    is compared in blocks through scratch flags, stopping at the first block that does not ascend."""
    head = arr[:_HEAD].tolist()
    if any(b <= a for a, b in zip(head, head[1:])):
        return False
    n = arr.size
    flags = _scratch(min(_BLOCK, n - 1))
    for lo in range(0, n - 1, _BLOCK):
        hi = min(lo + _BLOCK, n - 1)
        out = flags[: hi - lo]
        np.greater(arr[lo + 1 : hi + 1], arr[lo:hi], out=out)
        if not out.all():
            return False
    return True


#: Lists up to this long are planned in one Python pass (numpy's per-call overhead dominates there).
SMALL = 32
#: Values compared in Python before a list is compared whole (:func:`_ascending`).
_HEAD = 16
#: Neighbouring indices are compared in blocks of this many (here and in :mod:`.plan`), through scratch
#: arrays: a request's whole-list temporaries each cost their pages' first-touch faults, which measured
#: more than the arithmetic on them (benchmarks/gpu_host_bench.py: 262,144 scattered pages, 2,016 page
#: faults and 7.2 ms per plan before, 992 and 4.5 ms after; 3.6 -> 2.8 ms without faults).
_BLOCK = 1 << 15
_local = threading.local()


def continuing(idx: IntArray, enough: int | None = None) -> int:
    """How many indices of ``idx`` continue the one before them (``idx[i] == idx[i-1] + 1``), compared
    in blocks; stops counting once past ``enough``. A plan coalesces runs only where enough do."""
    n = idx.size
    if n < 2:
        return 0
    step = np.empty(min(_BLOCK, n - 1), np.int64)
    one = np.empty(step.size, bool)
    count = 0
    for lo in range(0, n - 1, _BLOCK):
        hi = min(lo + _BLOCK, n - 1)
        d, o = step[: hi - lo], one[: hi - lo]
        np.subtract(idx[lo + 1 : hi + 1], idx[lo:hi], out=d)
        np.equal(d, 1, out=o)
        count += int(np.count_nonzero(o))
        if enough is not None and count > enough:
            break
    return count


def _scratch(size: int) -> npt.NDArray[np.bool_]:
    """This thread's scratch flags, at least ``size`` of them, holding whatever the last check left: a
    list's checks reuse them instead of a fresh array each, whose pages would each fault on first touch
    (#27). They never leave the check that asked for them."""
    flags: npt.NDArray[np.bool_] | None = getattr(_local, "flags", None)
    if flags is None or flags.size < size:
        flags = _local.flags = np.zeros(max(size, 1 << 16), np.bool_)
    return flags


#: Values up to this many times the list's length are told apart by marking them in an array of
#: flags (one pass, no sort); sparser lists are sorted.
_DENSE = 8


def _distinct(arr: IntArray, hi: int) -> bool:
    """Whether the values of ``arr`` (all in ``0..hi``) are distinct. A destination list of scattered
    pages (a decode request) is marked in ``hi + 1`` flags rather than sorted: O(n) against O(n log n)
    (262,144 indices: the sort took most of the request's check)."""
    if hi + 1 > _DENSE * arr.size:
        s = np.sort(arr)
        return not bool((s[1:] == s[:-1]).any())
    seen = _scratch(hi + 1)[: hi + 1]
    seen.fill(False)  # a memset: cheaper than fresh pages, which each fault on first touch
    seen[arr] = True
    return int(np.count_nonzero(seen)) == arr.size


class Indices:
    """An index list checked once, where it enters kvbridge; the planner trusts it.

    ``array`` is one-dimensional int64 with every value in ``0 .. count-1``
    (``count`` None: only ``>= 0``), and without repeats when ``unique``
    (destinations: every item is written once per transfer). Built by
    :meth:`check`, which raises :class:`PlanError` naming the first bad value.
    ``own``: the array is kvbridge's, not memory of the caller's, so nobody
    changes it after the check and a plan may keep it instead of a copy.
    """

    __slots__ = ("array", "count", "unique", "own", "_continuing")

    def __init__(self, array: IntArray, count: int | None, unique: bool, own: bool = False) -> None:
        self.array, self.count, self.unique, self.own = array, count, unique, own
        self._continuing: int | None = None

    @classmethod
    def check(cls, name: str, values: Indices | npt.ArrayLike, count: int | None = None, *, unique: bool = False,
              own: bool = False) -> Indices:
        """``values`` checked (an :class:`Indices` already checked at least as strictly is returned as is).
        ``own``: ``values`` is an array the caller made for this and hands over (a peer's decoded list)."""
        if isinstance(values, Indices):
            within = count is None or (values.count is not None and values.count <= count)
            if within and (values.unique or not unique):
                return values
            own, values = values.own, values.array
        arr = check_indices(name, values, count, unique=unique)
        # Made here (from a list, or converted to int64) it is ours too; else it is the caller's memory.
        return cls(arr, count, unique, own or (arr is not values and arr.base is None))

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def __getitem__(self, key: slice) -> Indices:
        """A slice (a view; still checked); the whole list is the list itself."""
        n = int(self.array.shape[0])
        if key.indices(n) == (0, n, 1):
            return self
        return Indices(self.array[key], self.count, self.unique, self.own)

    @property
    def continuing(self) -> int | None:
        """:func:`continuing` of the list, where :meth:`count_continuing` counted it (else None)."""
        return self._continuing

    def count_continuing(self) -> None:
        """Count :attr:`continuing` now: a decode request's lists are counted as they arrive, so that the
        planner, when prefill sends, need not (whether runs are worth coalescing, :mod:`.plan`). Lists of
        at most :data:`SMALL` indices are not: the planner coalesces those without asking."""
        if self._continuing is None and len(self) > SMALL:
            self._continuing = continuing(self.array)
