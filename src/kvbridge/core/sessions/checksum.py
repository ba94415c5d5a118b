"""The optional end-to-end checksum (``SessionConfig.checksum``): did the bytes prefill read land unchanged?

The scheme, chosen because decode needs to derive nothing:

- Prefill keeps every plan it wrote for a room to one decode rank (KV pages
  of every chunk, state, the metadata row). After the last write, it sorts
  all their descriptors by *destination* address and hashes the *source*
  bytes in that order. It sends the digest with ``Done``, together with the
  destination ranges it wrote (adjacent ones merged), as :class:`protocol.Checksum`.
- Decode checks that every range lies inside one of its own registered
  regions, hashes its own bytes over the ranges in the same order, and fails
  the room (reason names the checksum) on a difference, before SUCCESS.

Sorting by destination makes the byte stream independent of how the room
was chunked, coalesced, split into batches or sent layer by layer. Each
prefill rank sends its own digest; decode checks each.

Prefill names the hash it used (:func:`choose`):

- a room with a GPU (``vram``) region on either side: ``wmix64``
  (:mod:`.wmix`), a position-keyed word hash that each side computes where
  its bytes are, numpy on host memory and torch on the GPU
  (:mod:`kvbridge.checksum_torch`, imported only then), with identical
  digests, so prefill on host and decode on GPU (or the reverse) agree;
- a room in host memory on both sides: xxHash's XXH3-64 when the ``xxhash``
  package is installed (``pip install kvbridge[checksum]``), else
  ``zlib.crc32``: measured faster on host memory than numpy's ``wmix64``
  (``kvbridge bench checksum``, docs/performance.md).

Decode without the named hash (or without torch and a GPU for ``wmix64`` over
GPU memory) fails the room saying what to install.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..control import protocol as P
from ..description.layout import Region
from ..planning.regions import RegionTable
from ..planning.transferplan import TransferPlan
from . import wmix
from .wmix import ChecksumError

__all__ = ["ALGORITHMS", "ChecksumError", "choose", "default_algorithm", "device_problem", "digest_ranges",
           "summarise", "verify"]

IntArray = npt.NDArray[np.int64]


class _Hash(Protocol):
    def update(self, data: memoryview) -> None: ...

    def intdigest(self) -> int: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


def _xxh3() -> _Hash:
    import xxhash

    h: _Hash = xxhash.xxh3_64()
    return h


def _available() -> dict[str, Callable[[], _Hash]]:
    algos: dict[str, Callable[[], _Hash]] = {"crc32": _Crc32}
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return algos
    return {"xxh3_64": _xxh3, **algos}


#: Streaming hashes of host memory, name -> factory, best first: what this process can compute.
STREAMING: dict[str, Callable[[], _Hash]] = _available()
#: Every hash name this process can check: the streaming ones and ``wmix64`` (host and GPU memory).
ALGORITHMS: tuple[str, ...] = (*STREAMING, wmix.NAME)


def default_algorithm() -> str:
    """The hash for rooms in host memory on both sides: XXH3-64 if ``xxhash`` is installed, else CRC32."""
    return next(iter(STREAMING))


def choose(local: Sequence[Region], peer: Sequence[Region]) -> str:
    """Prefill: the hash for a room between ``local`` and ``peer``'s regions: ``wmix64`` if either has GPU memory."""
    if any(r.mem == "vram" for r in (*local, *peer)):
        return wmix.NAME
    return default_algorithm()


def device_problem(regions: Sequence[Region], side: str) -> str | None:
    """Why the checksum cannot hash ``side``'s GPU ``regions`` in this process (no torch, no CUDA), or None."""
    gpu = [r for r in regions if r.mem == "vram"]
    if not gpu:
        return None
    try:
        wmix.device_sum(sorted({r.device for r in gpu}))
    except ChecksumError as exc:
        return (f"{side} region {gpu[0].name!r} is in GPU memory (vram, device {gpu[0].device}) and {exc}")
    return None


def _hash(algorithm: str, addrs: IntArray, nbytes: IntArray, regions: Sequence[Region]) -> int:
    if algorithm == wmix.NAME:
        return wmix.digest(addrs, nbytes, RegionTable(regions))
    try:
        h = STREAMING[algorithm]()
    except KeyError:
        raise ChecksumError(
            f"checksum algorithm {algorithm!r} is not available here (have: {', '.join(ALGORITHMS)}); "
            "install it on both sides: pip install kvbridge[checksum]"
        ) from None
    table = RegionTable(regions)
    where, _ = table.locate(*table.split(addrs, nbytes))
    if len(table) and table.vram[where].any():
        raise ChecksumError(f"{algorithm} hashes host memory only, but a range lies in GPU memory; "
                            f"prefill should have named {wmix.NAME}")
    # One call per contiguous run (the runs are as long as the plan allows), not per byte.
    for addr, n in zip(addrs.tolist(), nbytes.tolist()):
        h.update(memoryview((ctypes.c_char * n).from_address(addr)))
    return h.intdigest()


def _merge(addr: IntArray, nbytes: IntArray) -> tuple[IntArray, IntArray]:
    """Ranges in order, each merged with the next where it continues it exactly."""
    if not len(addr):
        return addr, nbytes
    starts = np.ones(len(addr), bool)
    starts[1:] = addr[:-1] + nbytes[:-1] != addr[1:]
    first = np.flatnonzero(starts)
    ends = np.append(first[1:], len(addr)) - 1
    return addr[first], addr[ends] + nbytes[ends] - addr[first]


def summarise(plans: Sequence[TransferPlan | None], algorithm: str, max_bytes: int,
              regions: Sequence[Region] = ()) -> P.Checksum:
    """Prefill: the digest of the source bytes of ``plans``' descriptors in destination order, and the ranges.

    ``regions`` are prefill's own (where the source bytes lie: host or GPU memory). Raises
    :class:`ChecksumError` if the ranges would not fit in ``max_bytes`` (the control message limit).
    """
    live = [p for p in plans if p is not None and len(p)]
    if live:
        src = np.concatenate([p.src_addr for p in live])
        dst = np.concatenate([p.dst_addr for p in live])
        n = np.concatenate([p.nbytes for p in live])
        order = np.argsort(dst, kind="stable")
        src, dst, n = src[order], dst[order], n[order]
    else:
        src = dst = n = np.zeros(0, np.int64)
    dst_at, dst_n = _merge(dst, n)
    if 16 * len(dst_at) + 4096 > max_bytes:
        raise ChecksumError(
            f"the checksum's {len(dst_at)} destination ranges need {16 * len(dst_at)} bytes, more than "
            f"max_message_bytes={max_bytes}; raise max_message_bytes or turn checksum off"
        )
    ranges = np.stack([dst_at, dst_n], axis=1).astype("<i8").tobytes()
    return P.Checksum(algorithm=algorithm, digest=_hash(algorithm, *_merge(src, n), regions), ranges=ranges)


def digest_ranges(summary: P.Checksum, regions: Sequence[Region]) -> int:
    """Decode: the digest of its own bytes over ``summary``'s ranges, each checked to lie in ``regions``."""
    if len(summary.ranges) % 16:
        raise ChecksumError(f"the checksum's range list has {len(summary.ranges)} bytes, not pairs of int64")
    pairs = np.frombuffer(summary.ranges, "<i8").reshape(-1, 2).astype(np.int64)
    table = RegionTable(regions)
    addr, n = table.split(pairs[:, 0].copy(), pairs[:, 1].copy())  # a merged range over adjacent regions: a piece in each
    where, inside = table.locate(addr, n)
    bad = np.flatnonzero(~inside | (n <= 0))
    if len(bad):
        i = int(bad[0])
        raise ChecksumError(f"prefill's checksum covers [{int(addr[i]):#x}, +{int(n[i])}), which is not inside one "
                            f"registered region of this rank ({len(bad)} such ranges)")
    return _hash(summary.algorithm, addr, n, regions)


def verify(summary: P.Checksum, regions: Sequence[Region]) -> str | None:
    """Decode: why ``summary`` does not match this rank's bytes, or None when it does."""
    try:
        got = digest_ranges(summary, regions)
    except ChecksumError as exc:
        return f"checksum not verified: {exc}"
    if got != summary.digest:
        total = int(np.frombuffer(summary.ranges, "<i8")[1::2].sum())
        return (f"checksum mismatch ({summary.algorithm}): prefill read {summary.digest:#018x}, decode holds "
                f"{got:#018x} over the same {total} bytes; the bytes changed on the way")
    return None
