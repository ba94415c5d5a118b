"""Diagnose the several-allocations test on a CUDA machine (temporary)."""
import numpy as np
import torch

from kvbridge.core import gpu


def case(unit, longest, mode):
    rng = np.random.default_rng(unit)
    src = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8, device="cuda")
    count = 40
    sizes = rng.integers(1, longest // unit + 1, count) * unit
    parts = [torch.zeros(int(sizes.sum()) + 4096, dtype=torch.uint8, device="cuda") for _ in range(3)]
    fake = [(1 << 44) + i * (1 << 36) for i in range(3)]
    peer = gpu.GpuPeer(np.array(fake, np.int64), np.array([f + p.numel() for f, p in zip(fake, parts)], np.int64),
                       np.array([p.data_ptr() - f for f, p in zip(fake, parts)], np.int64))
    which = rng.integers(0, 3, count)
    dst_off = np.concatenate(([0], np.cumsum(sizes)[:-1]))[rng.permutation(count)]
    src_off = rng.integers(0, (src.numel() - longest) // unit, count) * unit
    torch.cuda.synchronize()
    s_addr = src.data_ptr() + src_off
    d_addr = np.array(fake, np.int64)[which] + dst_off
    nb = sizes.astype(np.int64)
    if mode == "one":
        gpu.copy(0, [gpu.arrays_part(s_addr, d_addr, nb)], peer)
    elif mode == "per-alloc":
        for w in range(3):
            on = which == w
            gpu.copy(0, [gpu.arrays_part(s_addr[on], d_addr[on], nb[on])], peer)
    elif mode == "pretranslated":
        real = np.array([p.data_ptr() for p in parts], np.int64)[which] + dst_off
        ident = gpu.GpuPeer(np.zeros(1, np.int64), np.full(1, 1 << 62, np.int64), np.zeros(1, np.int64))
        gpu.copy(0, [gpu.arrays_part(s_addr, real, nb)], ident)
    torch.cuda.synchronize()
    good = 0
    where = []
    for w, s, d, n in zip(which, src_off, dst_off, sizes):
        ok = torch.equal(parts[w][d:d + n], src[s:s + n])
        good += ok
        if not ok:
            landed = [bool(torch.equal(parts[v][d:d + n], src[s:s + n])) for v in range(3)]
            zero = bool((parts[w][d:d + n] == 0).all())
            where.append((int(w), landed, zero))
    print(unit, mode, f"{good}/{count} ok", where[:6], flush=True)


for unit, longest in [(16 << 10, 64 << 10), (2, 300)]:
    for mode in ("one", "per-alloc", "pretranslated"):
        case(unit, longest, mode)
print("steps(3) =", gpu.search_steps(3))
