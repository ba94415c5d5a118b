"""``wmix64`` on the GPU in one launch: a Triton kernel that reads, mixes and sums every block of a digest.

:mod:`kvbridge.checksum_torch` runs the same terms as a dozen torch ops, each a pass over memory;
this kernel reads each word once and keeps the rest in registers. It takes each block's device
address (any region, any number of regions) and its first key, and splits each block over
programs of at most :data:`SPLIT_WORDS` words, so one launch and one synchronisation hash a whole
room however many regions it touches, with enough programs to keep the device busy. It is used
on a device only after :func:`probe` found its digest equal to the torch ops' on that device
(``checksum_torch`` decides, once per device), so a compiler that treats 64-bit overflow or shifts
differently costs speed, never a wrong digest. Blocks of at least :data:`MIN_WORDS` words at
8-byte aligned addresses; others go to the torch ops.

With ``TRITON_INTERPRET=1`` set before import, the kernel runs on host memory (the tests use that).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import triton
import triton.language as tl

from kvbridge.checksum_torch import _C1, _C2, _K_POS, MASK, _rows

__all__ = ["MIN_WORDS", "SPLIT_WORDS", "fused_sum", "probe"]

MIN_WORDS = 64  # smaller blocks leave each program too little to read: the torch ops do better
SPLIT_WORDS = 4096  # most words one program reads (32 KiB): a 64 KiB block is two programs
TILE = 1024  # words a program mixes at once


@triton.jit
def _wmix_at(addrs, keys, out, W, SPLIT, K_POS, C1, C2, M33, M35, TILE: tl.constexpr):
    blk = tl.program_id(0)
    part = tl.program_id(1)
    base = tl.load(addrs + blk).to(tl.pointer_type(tl.int64))
    first = part * SPLIT
    lane = tl.arange(0, TILE).to(tl.int64)
    lane_key = tl.load(keys + blk) + lane * K_POS  # word i's key is key0 + i * K_POS: one multiply per lane, not per word
    acc = tl.zeros([TILE], dtype=tl.int64)
    for start in range(first, tl.minimum(first + SPLIT, W), TILE):
        offs = start + lane
        inside = offs < W
        w = tl.load(base + offs, mask=inside, other=0)
        x = w ^ (lane_key + start * K_POS)
        x = x * C1
        x = x ^ ((x >> 31) & M33)  # a logical shift: the sign bits masked off
        x = x * C2
        x = x ^ ((x >> 29) & M35)
        acc += tl.where(inside, x, 0)
    tl.store(out + blk * tl.num_programs(1) + part, tl.sum(acc, axis=0))


def fused_sum(device: torch.device, block: int, addrs: npt.NDArray[np.int64],
              first_key: npt.NDArray[np.uint64]) -> int | None:
    """The sum of the terms of the blocks of ``block`` bytes at ``addrs`` (memory of ``device``), or None if unsuited."""
    words = block // 8
    if words < MIN_WORDS or (len(addrs) and int(np.bitwise_or.reduce(addrs)) % 8):
        return None
    if not len(addrs):
        return 0
    at = torch.from_numpy(np.ascontiguousarray(addrs, np.int64)).to(device)
    keys = torch.from_numpy(np.ascontiguousarray(first_key).view(np.int64)).to(device)
    split = min(SPLIT_WORDS, words)
    parts = -(-words // split)
    out = torch.empty(len(addrs) * parts, dtype=torch.int64, device=device)
    tile = min(TILE, triton.next_power_of_2(split))
    _wmix_at[(len(addrs), parts)](at, keys, out, words, split, _K_POS, _C1, _C2, (1 << 33) - 1, (1 << 35) - 1,
                                  TILE=tile)
    return int(out.sum(dtype=torch.int64).item()) & MASK


def probe(device: torch.device) -> bool:
    """Whether the kernel's digest equals the torch ops' over random blocks on ``device``."""
    g = torch.Generator().manual_seed(28)
    region = torch.randint(0, 256, (96 * 4096 + 8,), dtype=torch.uint8, generator=g).to(device)
    # 4096: one program a block; 65536 (a block split over two programs) and 512 (a tile part masked).
    for block, rows in ((4096, np.array([3, 0, 95, 17, 5, 64])), (512, np.array([700, 1, 2, 767])),
                        (65536, np.array([4, 0, 2]))):
        keys = np.random.default_rng(block).integers(0, 2**63, len(rows), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        addrs = region.data_ptr() + rows.astype(np.int64) * block
        if fused_sum(device, block, addrs, keys) != _rows(region, block, rows, keys):
            return False
    return True
