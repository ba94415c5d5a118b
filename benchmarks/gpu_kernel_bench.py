"""The fast path's kernel in one process: tuning, heterogeneous TP 2 -> 1 NHD vs equal TP, and where a
write's host time goes (``--host``).

Runs :func:`kvbridge.plugins.cuda_ipc.kernel.copy` with a peer mapped at its own address
(one process: no IPC; the kernel and its host-side work are what the
cross-process fast path runs), next to torch's device-to-device copy of the
same bytes in the same run, and the kernel alone (``kernel_only_GBps``: its
table already on the GPU, timed with CUDA events). Every case is checked byte-exact with torch
indexing. Needs a CUDA GPU.

``--host`` times :func:`~kvbridge.plugins.cuda_ipc.kernel.copy` of 1 GiB of scattered 16 and 64 KiB pages,
planned as ``kvbridge bench transfer --device cuda`` plans them, on the host next to torch's D2D copy
(interleaved, as the transfer bench does), and then, in a traced pass, each step from the copy's start to
its return: the buffers (and current context), the peer's table, each slice's shape, packing, table copy
and launch, and the wait for the GPU (``return``). Every step but the wait is host time the GPU does not
hide before the first launch, or hides behind the slices already launched after it.

    python benchmarks/gpu_kernel_bench.py [--json] [--host]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
import time

import numpy as np
import torch

from kvbridge.plugins.cuda_ipc import ipc, kernel, split
from kvbridge.core.layout import IndexSpace, KVArgs, Region, Shard
from kvbridge.core.pairing import pair_layouts

GiB = 1 << 30


def timed(fn, reps: int) -> float:
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_only(part, peer: ipc.GpuPeer, reps: int) -> float:
    """Seconds of the copy kernel alone (CUDA events; its table already on the GPU, one launch)."""
    h = np.empty(6 * (len(part[0]) + len(part[2])), np.int64)
    sh = split.shape(part)
    sizes, r, end = kernel._pack(part, sh, h, 0)
    table = torch.from_numpy(h[:end]).cuda()
    starts, deltas, steps, allocs = peer.on_device(0)
    kernel.copy(0, [part], peer)  # compiles the kernel
    stream = torch.cuda.current_stream().cuda_stream
    run = lambda: kernel._run(sh, sizes, len(part[0]), len(part[2]), table.data_ptr() + 8 * r, table.data_ptr(),  # noqa: E731
                           starts, deltas, steps, allocs, stream, 0)
    run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def identity_peer(t: torch.Tensor, allocations: int = 1) -> ipc.GpuPeer:
    """``t`` as a peer's memory mapped at its own address, cut into ``allocations`` (the kernel searches them)."""
    size = t.numel() * t.element_size()
    starts = t.data_ptr() + np.arange(allocations, dtype=np.int64) * (size // allocations)
    ends = np.append(starts[1:], t.data_ptr() + size)
    return ipc.GpuPeer(starts, ends, np.zeros(allocations, np.int64))


def pages(reps: int, tunings: list[tuple[int, int]]) -> list[dict]:
    src = torch.arange(2 * GiB // 8, dtype=torch.int64, device="cuda")
    dst = torch.zeros(2 * GiB // 8, dtype=torch.int64, device="cuda")
    peer = identity_peer(dst)
    d2d = GiB / timed(lambda: dst[: GiB // 8].copy_(src[: GiB // 8]), reps) / 1e9
    rows = []
    for kib in (4, 16, 64, 256, 1024):
        page = kib << 10
        n = GiB // page
        rng = np.random.default_rng(kib)
        s_idx = rng.choice(2 * n, n, replace=False)
        d_idx = rng.choice(2 * n, n, replace=False)
        s_addr = src.data_ptr() + s_idx.astype(np.int64) * page
        d_addr = dst.data_ptr() + d_idx.astype(np.int64) * page
        nb = np.full(n, page, np.int64)
        parts = [split.arrays_part(s_addr, d_addr, nb)]
        row = {"page_kib": kib, "descriptors": n, "d2d_GBps": d2d}
        for tile, warps in tunings:
            split.TILE_BYTES, kernel.NUM_WARPS = tile, warps
            dst.zero_()
            torch.cuda.synchronize()
            secs = timed(lambda: kernel.copy(0, parts, peer), reps)
            w = page // 8
            got = dst.view(-1, w)[torch.as_tensor(d_idx, device="cuda")]
            want = src.view(-1, w)[torch.as_tensor(s_idx, device="cuda")]
            row[f"GBps_t{tile}_w{warps}"] = GiB / secs / 1e9
            row[f"ok_t{tile}_w{warps}"] = bool(torch.equal(got, want))
        split.TILE_BYTES, kernel.NUM_WARPS = tunings[0]
        row["kernel_only_GBps"] = GiB / kernel_only(parts[0], peer, reps) / 1e9
        row["GBps_8_allocations"] = GiB / timed(lambda: kernel.copy(0, parts, identity_peer(dst, 8)), reps) / 1e9
        # where the time goes: the host-side part alone (shape + packing)
        t0 = time.perf_counter()
        for _ in range(reps):
            split.shape(parts[0])
            np.concatenate([s_addr, d_addr, nb])
        row["host_ms"] = (time.perf_counter() - t0) / reps * 1e3
        idx_s, idx_d = torch.as_tensor(s_idx, device="cuda"), torch.as_tensor(d_idx, device="cuda")
        w = page // 8
        row["torch_index_GBps"] = GiB / timed(lambda: dst.view(-1, w).index_copy_(0, idx_d, src.view(-1, w)[idx_s]), reps) / 1e9
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    del src, dst
    torch.cuda.empty_cache()
    return rows


def host(reps: int) -> list[dict]:
    """copy() of 1 GiB of scattered pages next to D2D, and its steps (medians of ``reps``; see the docstring)."""
    src = torch.arange(GiB // 8, dtype=torch.int64, device="cuda")
    dst = torch.zeros(GiB // 8, dtype=torch.int64, device="cuda")
    other = torch.empty_like(src)
    peer = identity_peer(dst)

    def d2d() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        other.copy_(src)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    marks: list[tuple[str, float]] = []

    def traced(name, fn):
        def step(*args, **kwargs):
            got = fn(*args, **kwargs)
            marks.append((name, time.perf_counter()))
            return got
        return step

    rows = []
    for kib in (16, 64):
        page = kib << 10

        def pool(t: torch.Tensor) -> KVArgs:
            region = Region(name="pool", addr=t.data_ptr(), nbytes=GiB, stride=page, role="kv", index_space="p",
                            layer=0, mem="vram", device=0)
            return KVArgs(regions=(region,), index_spaces=(IndexSpace("p", GiB // page),), dtype="int64", page_size=1)

        n = GiB // page
        perm = np.random.default_rng(kib).permutation(n)
        plan = pair_layouts(pool(src), pool(dst)).plan({"p": np.arange(n)}, {"p": perm})
        # as the backend hands it over: columns as the plan keeps them (in items where it does), scaled as packed
        go = lambda: kernel.copy(0, plan.factors(in_units=True), peer, lambda: None, plan.hints(), plan.units())  # noqa: E731
        go()
        ok = torch.equal(dst.view(-1, page // 8)[torch.as_tensor(perm, device="cuda")], src.view(-1, page // 8))
        copies, d2ds = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            go()
            copies.append(time.perf_counter() - t0)
            d2ds.append(d2d())
        go()  # the staging buffers exist before the traced pass
        patched = {"shape": split.shape, "_pack": kernel._pack, "_run": kernel._run}
        names = {"shape": "shape", "_pack": "pack", "_run": "launch"}
        h2d = ipc._lib.cuMemcpyHtoDAsync_v2
        try:
            for attr, fn in patched.items():
                setattr(kernel, attr, traced(names[attr], fn))
            ipc._lib.cuMemcpyHtoDAsync_v2 = traced("table copy", h2d)
            kernel._staging.get = traced("buffers", type(kernel._staging).get.__get__(kernel._staging))
            peer.on_device = traced("peer table", type(peer).on_device.__get__(peer))
            steps: dict[str, list[float]] = {}
            for _ in range(reps):
                d2d()
                marks.clear()
                t0 = time.perf_counter()
                go()
                marks.append(("return", time.perf_counter()))
                seen: dict[str, int] = {}
                prev = t0
                for name, t in marks:
                    seen[name] = seen.get(name, 0) + 1
                    steps.setdefault(name if seen[name] == 1 else f"{name}#{seen[name]}", []).append(t - prev)
                    prev = t
        finally:
            for attr, fn in patched.items():
                setattr(kernel, attr, fn)
            ipc._lib.cuMemcpyHtoDAsync_v2 = h2d
            del kernel._staging.get, peer.on_device
        row = {"page_kib": kib, "columns": len(plan.factors()[0][2]), "copy_ms": statistics.median(copies) * 1e3,
               "d2d_ms": statistics.median(d2ds) * 1e3, "ok": bool(ok),
               "steps_us": {k: statistics.median(v) * 1e6 for k, v in steps.items()}}
        row["copy_vs_d2d"] = row["d2d_ms"] / row["copy_ms"]
        rows.append(row)
        print(f"{kib:>4}K x {n} scattered, 1 GiB: copy {row['copy_ms']:.3f} ms, D2D {row['d2d_ms']:.3f} ms, "
              f"{row['copy_vs_d2d']:.2f} of D2D, ok={ok}; steps (us): "
              + ", ".join(f"{k} {v:.1f}" for k, v in row["steps_us"].items()), file=sys.stderr, flush=True)
    del src, dst, other
    torch.cuda.empty_cache()
    return rows


HEADS, HEAD_DIM, LAYERS, PAGE = 8, 128, 32, 16


def kv(t: torch.Tensor, rank: int, tp: int, layout: str, pool: int) -> KVArgs:
    heads = HEADS // tp
    item = PAGE * heads * HEAD_DIM * 2
    shard = (Shard(kind="split", outer=PAGE, totals=(HEADS,), unit_nbytes=HEAD_DIM * 2) if layout == "nhd"
             else Shard(kind="split", outer=1, totals=(HEADS,), unit_nbytes=PAGE * HEAD_DIM * 2))
    regions = tuple(Region(name=f"{role}{layer}", addr=t.data_ptr() + (2 * layer + k) * pool * item, nbytes=pool * item,
                           stride=item, role=role, index_space="kv_page", layer=layer, shard=shard, mem="vram")
                    for layer in range(LAYERS) for k, role in enumerate(("k", "v")))
    return KVArgs(regions=regions, index_spaces=(IndexSpace("kv_page", pool, PAGE),), dtype="bfloat16",
                  page_size=PAGE, tp_rank=rank, tp_size=tp)


def hetero(reps: int) -> list[dict]:
    """One request of ~1 GiB (all layers' K and V) from TP 1 and from TP 2 (two ranks, two threads) to TP 1."""
    item = PAGE * HEADS * HEAD_DIM * 2
    n = GiB // (2 * LAYERS * item)  # pages of the request
    pool = 2 * n
    words = 2 * LAYERS * pool * item // 2
    dst = torch.zeros(words, dtype=torch.int16, device="cuda")
    peer = identity_peer(dst)
    rng = np.random.default_rng(7)
    s_idx, d_idx = rng.choice(pool, n, replace=False), rng.choice(pool, n, replace=False)
    rows = []
    workers = ThreadPoolExecutor(2)
    for layout in ("nhd", "hnd"):
        for tp in (1, 2):
            srcs = [torch.randint(-30000, 30000, (words // tp,), dtype=torch.int16, device="cuda") for _ in range(tp)]
            routes = [pair_layouts(kv(srcs[r], r, tp, layout, pool), kv(dst, 0, 1, layout, pool)) for r in range(tp)]
            t0 = time.perf_counter()
            plans = [r.plan({"kv_page": s_idx}, {"kv_page": d_idx}) for r in routes]
            plan_ms = (time.perf_counter() - t0) * 1e3

            def go():  # each rank on its own long-lived thread, as each prefill rank's worker is
                for f in [workers.submit(kernel.copy, 0, p.factors(), peer) for p in plans]:
                    f.result()

            dst.zero_()
            torch.cuda.synchronize()
            secs = timed(go, reps)
            # oracle: global [layer, kv, page, token, head, dim] (nhd) / [.., page, head, token, dim] (hnd) from rank slices
            heads = HEADS // tp
            shape = (2 * LAYERS, pool, PAGE, heads, HEAD_DIM) if layout == "nhd" else (2 * LAYERS, pool, heads, PAGE, HEAD_DIM)
            full = torch.cat([s.view(shape) for s in srcs], dim=3 if layout == "nhd" else 2)
            dshape = (2 * LAYERS, pool, PAGE, HEADS, HEAD_DIM) if layout == "nhd" else (2 * LAYERS, pool, HEADS, PAGE, HEAD_DIM)
            ok = torch.equal(dst.view(dshape)[:, torch.as_tensor(d_idx, device="cuda")],
                             full[:, torch.as_tensor(s_idx, device="cuda")])
            row = {"layout": layout, "prefill_tp": tp, "bytes": sum(p.total_bytes for p in plans),
                   "table_words": sum(len(f[0]) * 2 + len(f[2]) * 3 for p in plans for f in p.factors()),
                   "descriptors": sum(len(p) for p in plans), "plan_ms": plan_ms,
                   "GBps": sum(p.total_bytes for p in plans) / secs / 1e9, "ok": bool(ok)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            del srcs, full
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tune", action="store_true", help="try several program sizes (bytes) and warp counts")
    p.add_argument("--json", action="store_true")
    p.add_argument("--host", action="store_true", help="only where a write's host time goes (copy() vs D2D, by step)")
    a = p.parse_args()
    tunings = [(split.TILE_BYTES, kernel.NUM_WARPS)] + ([(2048, 2), (4096, 4), (8192, 2), (8192, 4), (16384, 8)] if a.tune else [])
    if a.host:
        out = {"host": host(max(a.reps, 20))}
    else:
        out = {"pages": pages(a.reps, tunings), "hetero": hetero(a.reps), "host": host(max(a.reps, 20))}
    if a.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
