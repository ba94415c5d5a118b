"""``wmix64``: the checksum's hash that is computed where the bytes are, host memory or GPU memory.

The byte stream (a room's ranges, concatenated in order) is read as little-endian 64-bit words
``w_i`` (the last one zero-padded); each word is mixed with its position and the terms are summed
with 64-bit wrap-around::

    term(i) = fmix(w_i XOR (K0 + i * K_POS))       fmix(x): x *= C1; x ^= x >> 31; x *= C2; x ^= x >> 29
    digest  = final(sum_i term(i) mod 2**64, total bytes)

Why this shape: every step is an elementwise integer op plus one sum, so numpy (host memory) and
torch (GPU memory, :mod:`kvbridge.checksum_torch`, or its one-pass Triton kernel) compute it over
whole arrays, bit for bit the same, and a sum splits freely: each region's blocks are hashed where they lie (their words keep
their global positions) and the parts added, so prefill on host and decode on GPU agree. ``fmix``
is a bijection (xor with a key, multiplications by odd constants, xor-shifts), so a change
confined to one word (any single flipped bit) always changes the digest; the position key makes a
swapped or shifted page change it too (with probability about 1 - 2**-64 for different bytes).
It is an integrity check against accidents, not a MAC (the control plane's seal is, docs/security.md).

Memory is read in blocks of ``B`` bytes: the largest power of two (at most :data:`MAX_BLOCK`) that
divides every range's offset inside its region and its length. ``B >= 8`` is the normal case (pages,
state rows); then the blocks are located (:data:`CHUNK_BLOCKS` at a time) and hashed: on host memory
by numpy, region by region, in slices of :data:`HOST_SLICE`; on GPU memory every region's blocks in
one call per device. Ranges not multiples of 8 bytes are hashed on host memory only, through a contiguous copy
of the stream (small rows); on GPU memory they are refused.

Core imports no torch: GPU regions' parts come from :data:`DEVICE_MODULE`, imported on first use.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from ..planning.regions import RegionTable

__all__ = ["C1", "C2", "CHUNK_BLOCKS", "DEVICE_MODULE", "K_POS", "MAX_BLOCK", "NAME", "BlockSum", "DeviceBlocks", "DeviceSum", "device_sum",
           "digest", "mix_sum", "sum_blocks"]

NAME = "wmix64"
MASK = (1 << 64) - 1
K0 = 0x243F6A8885A308D3  # pi's first fraction bits: the key of word 0
K_POS = 0x9E3779B97F4A7C15  # golden ratio: the key step per word (odd, so positions never collide)
C1 = 0xBF58476D1CE4E5B9  # splitmix64's multipliers (odd: multiplication is a bijection mod 2**64)
C2 = 0x94D049BB133111EB
K_LEN = 0xC2B2AE3D27D4EB4F
MAX_BLOCK = 1 << 16
#: Blocks located per step: bounds the index arrays (about 80 bytes a block); each hash bounds its own gathers.
CHUNK_BLOCKS = 1 << 16
#: Bytes numpy mixes per pass on host memory (a slice of a chunk small enough to stay in cache).
HOST_SLICE = 256 << 10
#: The module hashing GPU regions (torch): outside core, imported on first use (docs/architecture.md).
DEVICE_MODULE = "kvbridge.checksum_torch"

U64 = npt.NDArray[np.uint64]
IntArray = npt.NDArray[np.int64]


class ChecksumError(ValueError):
    """The checksum could not be computed or did not match; the text says why."""


class BlockSum(Protocol):
    """One region's part: the sum of the terms of ``rows`` (blocks of ``block`` bytes) of the region."""

    def __call__(self, addr: int, nbytes: int, device: int, block: int, rows: IntArray, first_key: U64) -> int: ...


class DeviceBlocks(NamedTuple):
    """Blocks on one GPU: block ``i`` is row ``rows[i]`` of region ``region[i]`` (at ``starts``, of ``sizes``
    bytes), its first word's key ``keys[i]``."""

    starts: IntArray
    sizes: IntArray
    region: IntArray
    rows: IntArray
    keys: U64


class DeviceSum(Protocol):
    """GPU memory: the sum of the terms of ``blocks`` (of ``block`` bytes), all on CUDA device ``device``.

    One call per device and digest, with every block as arrays, so the device module can hash a
    room in one launch and synchronise once (a room spans a region per layer and role: hundreds).
    """

    def __call__(self, device: int, block: int, blocks: DeviceBlocks) -> int: ...


def mix_sum(words: U64, first_key: U64) -> int:
    """numpy: the sum (mod 2**64) of the terms of ``words`` (k rows of W words), row r's first key ``first_key[r]``.

    ``words`` is overwritten (it is always a fresh gather).
    """
    steps = np.arange(words.shape[1], dtype=np.uint64) * np.uint64(K_POS)
    words ^= first_key[:, None] + steps[None, :]
    words *= np.uint64(C1)
    words ^= words >> np.uint64(31)
    words *= np.uint64(C2)
    words ^= words >> np.uint64(29)
    return int(words.sum(dtype=np.uint64))


def sum_blocks(addr: int, nbytes: int, device: int, block: int, rows: IntArray, first_key: U64) -> int:
    """Host memory (numpy): :class:`BlockSum` over the region at ``addr`` (``device`` unused)."""
    nrows = nbytes // block
    region = np.ctypeslib.as_array((ctypes.c_uint8 * (nrows * block)).from_address(addr)).reshape(nrows, block)
    # Slices that stay in the CPU's cache through the five passes: measured about 2x over one big pass.
    step = max(1, HOST_SLICE // block)
    return sum(mix_sum(region[rows[i:i + step]].view("<u8"), first_key[i:i + step]) for i in range(0, len(rows), step))


def device_sum(devices: Sequence[int] = ()) -> DeviceSum:
    """GPU memory: :data:`DEVICE_MODULE`'s ``sum_device``, or :class:`ChecksumError` saying what is missing.

    ``devices``: GPUs about to be hashed (the module may prepare them in the background).
    """
    try:
        module = importlib.import_module(DEVICE_MODULE)
        fn: DeviceSum = module.sum_device
        problem = module.problem(devices)
    except Exception as exc:  # ImportError (no torch), or torch failing to load its libraries
        raise ChecksumError(f"hashing GPU memory needs torch in this process ({type(exc).__name__}: {exc}); "
                            "install torch with CUDA or turn checksum off") from None
    if problem is not None:
        raise ChecksumError(problem)
    return fn


def _final(acc: int, total: int) -> int:
    x = (acc ^ (total * K_LEN)) & MASK
    x = ((x ^ (x >> 33)) * C1) & MASK
    x = ((x ^ (x >> 29)) * C2) & MASK
    return x ^ (x >> 32)


def _keys(word: npt.NDArray[np.int64]) -> U64:
    """Each word index's key, K0 + i * K_POS mod 2**64."""
    return word.astype(np.uint64) * np.uint64(K_POS) + np.uint64(K0)


def digest(addr: IntArray, nbytes: IntArray, table: RegionTable,
           pick: Callable[[bool], BlockSum] | None = None) -> int:
    """The ``wmix64`` digest of the ranges ``(addr, nbytes)`` in order, each inside a region of ``table``.

    Host regions' blocks are hashed by :func:`sum_blocks` (numpy), a chunk of the stream at a time;
    GPU regions' by :func:`device_sum`, once per device, after every chunk's blocks were located
    (their index arrays, 16 bytes a block, are what is held meanwhile). ``pick(vram)``: tests pass
    a ``BlockSum`` for both kinds (host memory standing in for both), to compare the paths.
    """
    total = int(nbytes.sum())
    if not total:
        return _final(0, 0)
    addr, nbytes = table.split(addr, nbytes)  # a merged range over adjacent regions: a piece in each
    where, inside = table.locate(addr, nbytes)
    if not inside.all():
        i = int(np.flatnonzero(~inside)[0])
        raise ChecksumError(f"range [{int(addr[i]):#x}, +{int(nbytes[i])}) is not inside one registered region")
    off = addr - table.starts[where]
    bits = int(np.bitwise_or.reduce(off | nbytes)) | MAX_BLOCK
    block = bits & -bits
    if block < 8:
        if table.vram[where].any():
            raise ChecksumError(f"the checksum's ranges on GPU memory must be multiples of 8 bytes at 8-byte offsets "
                                f"(a range or offset here is {block} bytes aligned)")
        return _final(_unaligned(addr, nbytes), total)
    count = nbytes // block
    whole = bool((count == 1).all())
    ends = np.cumsum(count)  # block index just past each range
    words = block // 8
    acc = 0
    on_device: dict[int, list[tuple[IntArray, IntArray, U64]]] = {}
    step = CHUNK_BLOCKS
    for k0 in range(0, int(ends[-1]), step):  # a chunk of the stream's blocks at a time: bounded memory
        k = np.arange(k0, min(k0 + step, int(ends[-1])), dtype=np.int64)
        if whole:  # each range one block (pages): block k is range k
            reg, rows = where[k], off[k] // block
        else:
            r = np.searchsorted(ends, k, side="right")
            reg, rows = where[r], off[r] // block + (k - (ends[r] - count[r]))
        keys = _keys(k * words)
        gpu = table.vram[reg] if pick is None else np.zeros(len(reg), bool)
        if gpu.all() and len(devices := np.flatnonzero(np.bincount(table.device[reg]))) == 1:
            on_device.setdefault(int(devices[0]), []).append((reg, rows, keys))  # hashed once per device below
            continue
        if gpu.any():
            dev = table.device[reg]
            for d in np.flatnonzero(np.bincount(dev[gpu])).tolist():
                sel = gpu & (dev == d)
                on_device.setdefault(d, []).append((reg[sel], rows[sel], keys[sel]))
            reg, rows, keys = reg[~gpu], rows[~gpu], keys[~gpu]
        order = np.argsort(reg, kind="stable")
        cuts = np.flatnonzero(np.diff(reg[order])) + 1
        for part in np.split(order, cuts) if len(order) else ():  # one call per region the chunk touches
            g = int(reg[part[0]])
            vram, device = bool(table.vram[g]), int(table.device[g])
            fn = pick(vram) if pick else sum_blocks
            acc += _hashed(lambda: fn(int(table.starts[g]), int(table.ends[g] - table.starts[g]), device, block,
                                      rows[part], keys[part]), vram, device, len(part), block)
    for d, parts in on_device.items():
        blocks = DeviceBlocks(table.starts, table.ends - table.starts, *(np.concatenate(c) for c in zip(*parts)))
        acc += _hashed(lambda: device_sum()(d, block, blocks), True, d, len(blocks.rows), block)
    return _final(acc & MASK, total)


def _hashed(run: Callable[[], int], vram: bool, device: int, blocks: int, block: int) -> int:
    try:
        return run()
    except ChecksumError:
        raise
    except Exception as exc:  # e.g. the device out of memory: the room fails, the thread hashing survives
        where = f"GPU {device}" if vram else "host memory"
        raise ChecksumError(f"hashing {blocks} blocks of {block} bytes in {where} failed: "
                            f"{type(exc).__name__}: {exc}") from exc


def _unaligned(addr: IntArray, nbytes: IntArray) -> int:
    """Host memory, ranges not multiples of 8 bytes: the stream copied contiguous, then hashed as words."""
    stream = bytearray()
    for a, n in zip(addr.tolist(), nbytes.tolist()):  # a rare, small case (odd-sized rows): one copy per range
        stream += (ctypes.c_char * n).from_address(a).raw
    stream += bytes(-len(stream) % 8)
    words = np.frombuffer(stream, "<u8").copy().reshape(-1, 1)
    return mix_sum(words, _keys(np.arange(len(words), dtype=np.int64)))
