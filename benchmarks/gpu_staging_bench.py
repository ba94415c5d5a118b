"""GPU staging kernels: one gather launch and one scatter launch over a window of scattered pieces, vs a contiguous copy.

For each piece size (4 KiB .. 1 MiB), a 64 MiB window of pieces at scattered offsets of a 256 MiB GPU
buffer is gathered into a slice and scattered back (kvbridge.plugins.cuda_ipc.staging); GB/s is the
median over --reps of the launch plus a stream synchronisation, beside torch's contiguous D2D copy of
the same bytes. The table is built once per size (its host cost is printed apart). ``seam`` columns:
the whole call the write path makes per window (kvbridge.staging_torch: the table, then torch's indexed
copy for pages a whole number of units apart, the Triton kernel otherwise, then a synchronisation);
``--window-mib`` sets the window. Needs CUDA.

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
    rows = []
    for kib in (4, 16, 64, 256, 1024):
        size = kib << 10
        n = window // size
        slots = np.random.default_rng(0).permutation(pool // size)[:n].astype(np.int64)
        addr = memory.data_ptr() + slots * size
        nbytes = np.full(n, size, np.int64)
        t0 = time.perf_counter()
        table = unit_table(addr, np.cumsum(nbytes) - nbytes, nbytes)
        table_ms = (time.perf_counter() - t0) * 1e3
        row = {"piece_KiB": kib, "pieces": n, "units": len(table.far), "table_ms": table_ms}
        for name, fn in (("gather", lambda: gather(table, out.data_ptr())),
                         ("scatter", lambda: scatter(table, out.data_ptr())),
                         ("seam_gather", lambda: staging_torch.gather(addr, nbytes, out.data_ptr(), out.device.index)),
                         ("seam_scatter", lambda: staging_torch.scatter(out.data_ptr(), addr, nbytes, out.device.index)),
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
        gather(table, out.data_ptr())
        torch.cuda.synchronize()
        row["verified"] = bool(torch.equal(out, want))
        out.zero_()
        staging_torch.gather(addr, nbytes, out.data_ptr(), out.device.index)
        row["verified"] = row["verified"] and bool(torch.equal(out, want))
        rows.append(row)
        print(f"{kib:>5} KiB pieces, {args.window_mib} MiB: gather {row['gather_GBps']:.0f} GB/s, scatter "
              f"{row['scatter_GBps']:.0f} GB/s, seam gather {row['seam_gather_GBps']:.0f} GB/s, seam scatter "
              f"{row['seam_scatter_GBps']:.0f} GB/s, contiguous {row['contiguous_GBps']:.0f} GB/s, "
              f"table {table_ms:.2f} ms, bytes ok {row['verified']}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
