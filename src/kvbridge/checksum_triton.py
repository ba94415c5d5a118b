"""``wmix64`` on the GPU in one pass: a Triton kernel that gathers, mixes and sums a region's blocks.

:mod:`kvbridge.checksum_torch` runs the same terms as a dozen torch ops, each a pass over memory;
this kernel reads each word once and keeps the rest in registers, one program per block. It is
used on a device only after :func:`probe` found its digest equal to the torch ops' on that device
(``checksum_torch`` decides, once per device), so a compiler that treats 64-bit overflow or shifts
differently costs speed, never a wrong digest. Blocks of at least :data:`MIN_WORDS` words on an
8-byte aligned region; others go to the torch ops.

With ``TRITON_INTERPRET=1`` set before import, the kernel runs on host tensors (the tests use that).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import triton
import triton.language as tl

from kvbridge.checksum_torch import _C1, _C2, _K_POS, MASK, _rows

__all__ = ["MIN_WORDS", "fused_sum", "probe"]

MIN_WORDS = 64  # smaller blocks leave each program too little to read: the torch ops do better
TILE = 1024  # words a program mixes at once


@triton.jit
def _wmix_rows(region, rows, keys, out, W, K_POS, C1, C2, M33, M35, TILE: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(rows + pid)
    key0 = tl.load(keys + pid)
    acc = tl.zeros([TILE], dtype=tl.int64)
    for start in range(0, W, TILE):
        offs = start + tl.arange(0, TILE).to(tl.int64)
        inside = offs < W
        w = tl.load(region + row * W + offs, mask=inside, other=0)
        x = w ^ (key0 + offs * K_POS)
        x = x * C1
        x = x ^ ((x >> 31) & M33)  # a logical shift: the sign bits masked off
        x = x * C2
        x = x ^ ((x >> 29) & M35)
        acc += tl.where(inside, x, 0)
    tl.store(out + pid, tl.sum(acc, axis=0))


def fused_sum(region: torch.Tensor, block: int, rows: npt.NDArray[np.int64],
              first_key: npt.NDArray[np.uint64]) -> int | None:
    """The sum of the terms of ``rows`` (blocks of ``block`` bytes) of ``region`` (uint8), or None if unsuited."""
    words = block // 8
    if words < MIN_WORDS or region.data_ptr() % 8:
        return None
    region64 = region[: region.numel() // 8 * 8].view(torch.int64)
    idx = torch.from_numpy(rows).to(region.device)
    keys = torch.from_numpy(first_key.view(np.int64)).to(region.device)
    out = torch.empty(len(rows), dtype=torch.int64, device=region.device)
    _wmix_rows[(len(rows),)](region64, idx, keys, out, words, _K_POS, _C1, _C2, (1 << 33) - 1, (1 << 35) - 1,
                             TILE=TILE)
    return int(out.sum(dtype=torch.int64).item()) & MASK


def probe(device: torch.device) -> bool:
    """Whether the kernel's digest equals the torch ops' over random blocks on ``device``."""
    g = torch.Generator().manual_seed(28)
    region = torch.randint(0, 256, (96 * 4096 + 8,), dtype=torch.uint8, generator=g).to(device)
    for block, rows in ((4096, np.array([3, 0, 95, 17, 5, 64])), (512, np.array([700, 1, 2, 767]))):
        keys = np.random.default_rng(block).integers(0, 2**63, len(rows), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        if fused_sum(region, block, rows, keys) != _rows(region, block, rows, keys):
            return False
    return True
