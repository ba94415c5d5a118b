"""GPU staging kernels: one gather launch and one scatter launch over a window of scattered pieces, vs a contiguous copy.

For each piece size (4 KiB .. 1 MiB), a 64 MiB window of pieces at scattered offsets of a 256 MiB GPU
buffer is gathered into a slice and scattered back (kvbridge.plugins.cuda_ipc.staging); GB/s is the
median over --reps of the launch plus a stream synchronisation, beside torch's contiguous D2D copy of
the same bytes. The table is built once per size (its host cost is printed apart). ``seam`` columns:
the whole call the write path makes per window, the window said as unit runs first
(``stage_index.region_pieces`` and ``unit_runs``, then kvbridge.staging_torch's ``gather_units`` /
``scatter_units``: torch's indexed copy over rows of the region, then a synchronisation); ``addr seam``:
the same window given by piece addresses (``gather`` / ``scatter``: the unit table, then the same indexed
copy, or the Triton kernel for pieces at odd distances), the path a prefill gather falls back to and
every GPU window took before ``Staged`` carried unit offsets. ``--window-mib`` sets the window. Needs CUDA.

    python benchmarks/gpu_staging_bench.py [--reps 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main() -> int:
    import torch

    from kvbridge.core.description.layout import Region
    from kvbridge.core.planning.regions import RegionTable
    from kvbridge.core.planning.stage_index import region_pieces, unit_runs
    from kvbridge.plugins.cuda_ipc.staging import gather, scatter, unit_table

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--window-mib", type=int, default=64)
    args = parser.parse_args()
    from kvbridge import staging_torch

    window = args.window_mib << 20
    pool = max(256 << 20, 4 * window)
    memory = torch.randint(0, 256, (pool,), dtype=torch.uint8, device="cuda")
    out = torch.empty(window, dtype=torch.uint8, device="cuda")
    regions = [Region(name="pool", addr=memory.data_ptr(), nbytes=pool, stride=4096, role="k", index_space="kv_page",
                      mem="vram", device=memory.device.index or 0)]
    table = RegionTable(regions)
    rows = []
    for kib in (4, 16, 64, 256, 1024):
        size = kib << 10
        n = window // size
        slots = np.random.default_rng(0).permutation(pool // size)[:n].astype(np.int64)
        addr = memory.data_ptr() + slots * size
        nbytes = np.full(n, size, np.int64)
        t0 = time.perf_counter()
        utable = unit_table(addr, np.cumsum(nbytes) - nbytes, nbytes)
        table_ms = (time.perf_counter() - t0) * 1e3
        row = {"piece_KiB": kib, "pieces": n, "units": len(utable.far), "table_ms": table_ms}

        def runs() -> list:
            pieces = region_pieces(addr, nbytes, table)
            assert pieces is not None
            return unit_runs(pieces, regions)
        for name, fn in (("gather", lambda: gather(utable, out.data_ptr())),
                         ("scatter", lambda: scatter(utable, out.data_ptr())),
                         ("seam_gather", lambda: staging_torch.gather_units(runs(), out.data_ptr(), out.device.index)),
                         ("seam_scatter", lambda: staging_torch.scatter_units(out.data_ptr(), runs(), out.device.index)),
                         ("addr_seam_gather", lambda: staging_torch.gather(addr, nbytes, out.data_ptr(), out.device.index)),
                         ("addr_seam_scatter", lambda: staging_torch.scatter(out.data_ptr(), addr, nbytes,
                                                                             out.device.index)),
                         ("contiguous", lambda: out.copy_(memory[:window]))):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            row[f"{name}_GBps"] = window / statistics.median(times) / 1e9
        want = memory.view(-1, size)[torch.from_numpy(slots).cuda()].view(-1)
        gather(utable, out.data_ptr())
        torch.cuda.synchronize()
        row["verified"] = bool(torch.equal(out, want))
        for seam in (lambda: staging_torch.gather(addr, nbytes, out.data_ptr(), out.device.index),
                     lambda: staging_torch.gather_units(runs(), out.data_ptr(), out.device.index)):
            out.zero_()
            seam()
            row["verified"] = row["verified"] and bool(torch.equal(out, want))
        kept = memory.clone()  # the unit runs' scatter puts the pieces back into zeroed pages
        memory.view(-1, size)[torch.from_numpy(slots).cuda()] = 0
        staging_torch.scatter_units(out.data_ptr(), runs(), out.device.index)
        row["verified"] = row["verified"] and bool(torch.equal(memory, kept))
        del kept
        rows.append(row)
        print(f"{kib:>5} KiB pieces, {args.window_mib} MiB: gather {row['gather_GBps']:.0f} GB/s, scatter "
              f"{row['scatter_GBps']:.0f} GB/s, seam gather {row['seam_gather_GBps']:.0f} GB/s, seam scatter "
              f"{row['seam_scatter_GBps']:.0f} GB/s (by address {row['addr_seam_gather_GBps']:.0f} / "
              f"{row['addr_seam_scatter_GBps']:.0f}), contiguous {row['contiguous_GBps']:.0f} GB/s, "
              f"table {table_ms:.2f} ms, bytes ok {row['verified']}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
