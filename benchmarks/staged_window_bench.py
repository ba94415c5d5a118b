"""A window staged on both sides, its host work per window on the CPU: the ``Staged`` message and its handling.

For windows of 1,024 / 16,384 / 65,536 scattered 4 KiB pages (one destination region twice the window's
size), CPU milliseconds (median, this thread's CPU time) of each step a window takes outside the engine:

- ``describe``: prefill says where the pieces go (``RemoteSlots.pieces``) and builds ``Staged``
  (``sessions.writes.announce``);
- ``encode``, ``seal+open`` (authenticated with a secret: the blake2b MAC both ways), ``decode``;
- ``check``: decode's bounds checks of the runs (``Landing._runs``);
- ``scatter``: ``Landing.scatter`` into host memory, checks included, beside ``bare copy``, numpy's one
  fancy assignment of the same pages (what the copy itself costs);
- ``seam prep``: the host work the GPU seam (``kvbridge.staging_torch.scatter_units``) does before its
  launch: the index as int64 for torch;
- ``gather prep``: the host work of prefill's GPU gather of the same pages before its launch (``Staging._gather``:
  the sources as unit runs, ``region_pieces`` and ``unit_runs``, then the seam's int64 index).

Every scatter's bytes are checked against the slot. ``python benchmarks/staged_window_bench.py [PIECES...] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.core.control import protocol as P
from kvbridge.core.control.auth import Auth, Sealer
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.regions import RegionTable
from kvbridge.core.planning.stage_index import region_pieces, unit_runs
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.transfer.landing import Landing
from kvbridge.core.transfer.relay import RemoteSlots

PAGE = 4096


def cpu_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median CPU time of ``fn`` on this thread, in ms."""
    out = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        fn()
        out.append(time.thread_time_ns() - t0)
    return statistics.median(out) / 1e6


def window_row(n: int) -> dict[str, Any]:
    reps = 21 if n <= 16384 else 9
    pages = np.zeros((2 * n, PAGE), np.uint8)
    region = Region(name="k", addr=pages.ctypes.data, nbytes=pages.nbytes, stride=PAGE, role="k", index_space="kv_page")
    landing = Landing([region], slots=2, slice_bytes=n * PAGE)
    offer = landing.offer("p")
    assert offer is not None
    slot = offer.slots[0]
    slots = RemoteSlots(offer, [region])
    rng = np.random.default_rng(0)
    where = rng.permutation(2 * n)[:n].astype(np.int64)
    window = TransferPlan(np.arange(n, dtype=np.int64) * PAGE, pages.ctypes.data + where * PAGE, np.full(n, PAGE, np.int64))
    held = landing._buf[slot * n * PAGE:(slot + 1) * n * PAGE]
    held[:] = rng.integers(0, 256, n * PAGE, dtype=np.uint8)

    def describe() -> P.Staged:
        pieces = slots.pieces(window)
        assert pieces is not None
        return P.Staged(rooms=(1,), slot=slot, pieces=tuple(
            P.StagedRegion(region=p.region, unit=p.unit, offsets=p.offsets.tobytes(),
                           counts=b"" if p.counts is None else p.counts.tobytes()) for p in pieces))

    msg = describe()
    data = P.encode(msg)
    auth, sealer = Auth(b"s" * 32), Sealer()

    def seal_open() -> None:
        auth.open_frame(auth.seal(data, b"d", sealer), {b"d"})

    runs = landing._runs(msg.pieces)[0]
    table = RegionTable([region])
    view, near = pages.view(f"V{PAGE}").ravel(), held.view(f"V{PAGE}")

    def bare() -> None:
        view[where] = near

    row: dict[str, Any] = {
        "pieces": n, "message_bytes": len(data), "describe_ms": cpu_ms(describe, reps),
        "encode_ms": cpu_ms(lambda: P.encode(msg), reps), "seal_open_ms": cpu_ms(seal_open, reps),
        "decode_ms": cpu_ms(lambda: P.decode(data), reps), "check_ms": cpu_ms(lambda: landing._runs(msg.pieces), reps),
        "scatter_ms": cpu_ms(lambda: landing.scatter("p", msg), reps), "bare_copy_ms": cpu_ms(bare, reps),
        "seam_prep_ms": cpu_ms(lambda: [r.offsets.astype(np.int64, copy=False) for r in runs], reps),
        "gather_prep_ms": cpu_ms(lambda: [r.offsets.astype(np.int64, copy=False) for r in unit_runs(
            region_pieces(window.dst_addr, window.nbytes, table) or [], [region])], reps),
    }
    row["verified"] = bool(np.array_equal(pages[where].ravel(), held))
    row["host_total_ms"] = sum(row[k] for k in ("describe_ms", "encode_ms", "seal_open_ms", "decode_ms", "scatter_ms"))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pieces", type=int, nargs="*", default=[1024, 16384, 65536])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for n in args.pieces:
        row = window_row(n)
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
