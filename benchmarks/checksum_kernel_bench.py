"""Where the GPU checksum's time goes: ``wmix64``'s Triton kernel alone, with its host work, and core's digest.

Over ``--mib`` of scattered 64 KiB pages on GPU 0 (one region, and the same bytes as 128 regions),
beside torch's device-to-device copy of the same bytes in the same run (the memory-speed
reference). Rows: the kernel alone (addresses and keys already on the GPU, CUDA events), the
kernel with its host work (``fused_sum``: two index copies, the launch, the sum, the sync), core's
``wmix.digest`` (locating the blocks, then the kernel) and the checksum's two halves (prefill's
``summarise``, decode's ``digest_ranges``). Every digest is checked equal to the torch ops'. Needs a
CUDA GPU and Triton.

    python benchmarks/checksum_kernel_bench.py [--mib 1024] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvbridge import checksum_torch, checksum_triton
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.regions import RegionTable
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.sessions import checksum as C
from kvbridge.core.sessions import wmix

PAGE = 64 << 10


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def events(fn, reps: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return statistics.median(out)


def regions(base: int, nbytes: int, parts: int) -> list[Region]:
    size = nbytes // parts // PAGE * PAGE
    return [Region(name=f"r{i}", addr=base + i * size, nbytes=size if i < parts - 1 else nbytes - i * size, stride=PAGE,
                   role="k", index_space="p", layer=i, mem="vram", device=0) for i in range(parts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    assert checksum_torch.path(0, wait=300) == "triton", "the Triton kernel did not pass its probe here"
    pages = (args.mib << 20) // PAGE
    src = torch.randint(-2**62, 2**62, (pages, PAGE // 8), dtype=torch.int64, device="cuda:0")
    dst = torch.empty_like(src)
    order = np.random.default_rng(pages).permutation(pages)
    base = src.data_ptr()
    addrs = base + order.astype(np.int64) * PAGE
    keys = (np.arange(pages, dtype=np.uint64) * np.uint64(PAGE // 8) * np.uint64(wmix.K_POS) + np.uint64(wmix.K0))
    gb = pages * PAGE / 1e9
    rows: list[tuple[str, float]] = []
    rows.append(("torch D2D copy (reference)", timed(lambda: dst.copy_(src), args.reps)))
    at = torch.from_numpy(addrs).cuda()
    k = torch.from_numpy(keys.view(np.int64)).cuda()
    words = PAGE // 8
    split = min(checksum_triton.SPLIT_WORDS, words)
    parts = -(-words // split)
    out = torch.empty(pages * parts, dtype=torch.int64, device="cuda:0")
    tile = min(checksum_triton.TILE, split)

    def kernel_only() -> None:
        checksum_triton._wmix_at[(pages, parts)](at, k, out, words, split, checksum_torch._K_POS, checksum_torch._C1,
                                                  checksum_torch._C2, (1 << 33) - 1, (1 << 35) - 1, TILE=tile)

    rows.append(("kernel alone (CUDA events)", events(kernel_only, args.reps)))
    for split_, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 4), (8192, 8), (2048, 8)):  # the shape's choices
        parts_ = -(-words // split_)
        out_ = torch.empty(pages * parts_, dtype=torch.int64, device="cuda:0")
        launch = lambda: checksum_triton._wmix_at[(pages, parts_)](  # noqa: E731
            at, k, out_, words, split_, checksum_torch._K_POS, checksum_torch._C1, checksum_torch._C2,
            (1 << 33) - 1, (1 << 35) - 1, TILE=min(checksum_triton.TILE, split_), num_warps=warps)
        rows.append((f"kernel alone, split {split_} words, {warps} warps", events(launch, args.reps)))
        launch()
        assert int(out_.sum().item()) == int(out.sum().item()), f"split {split_}, {warps} warps: another sum"
    dev = torch.device("cuda", 0)
    rows.append(("fused_sum (index copies, launch, sum, sync)",
                 timed(lambda: checksum_triton.fused_sum(dev, PAGE, addrs, keys), args.reps)))
    expect = checksum_torch._rows(torch.as_tensor(checksum_torch._DeviceBytes(base, pages * PAGE), device="cuda:0"),
                                  PAGE, order.astype(np.int64), keys)
    assert checksum_triton.fused_sum(dev, PAGE, addrs, keys) == expect, "the kernel's sum differs from the torch ops'"
    n = np.full(pages, PAGE, np.int64)
    plan = TransferPlan(addrs, dst.data_ptr() + np.arange(pages, dtype=np.int64) * PAGE, n)
    for parts_ in (1, 128):
        table = RegionTable(regions(base, pages * PAGE, parts_))
        rows.append((f"wmix.digest, {parts_} region(s)", timed(lambda: wmix.digest(addrs, n, table), args.reps)))
        regs = regions(base, pages * PAGE, parts_)
        dregs = regions(dst.data_ptr(), pages * PAGE, parts_)
        rows.append((f"summarise (prefill half), {parts_} region(s)",
                     timed(lambda: C.summarise([plan], "wmix64", 64 << 20, regs), args.reps)))
        summary = C.summarise([plan], "wmix64", 64 << 20, regs)
        rows.append((f"digest_ranges (decode half), {parts_} region(s)",
                     timed(lambda: C.digest_ranges(summary, dregs), args.reps)))
    print(f"{args.mib} MiB of scattered 64 KiB pages on {torch.cuda.get_device_name(0)}, median of {args.reps}")
    print(f"{'measure':<48} {'ms':>8} {'GB/s':>8} {'x copy':>7}")
    copy_s = rows[0][1]
    for name, s in rows:
        print(f"{name:<48} {s * 1e3:8.3f} {gb / s:8.1f} {s / copy_s:7.2f}")


if __name__ == "__main__":
    main()
