"""What the end-to-end checksum (``SessionConfig.checksum``) costs.

Two measurements over ``--total-mib`` of scattered 64 KiB pages (the
``bench transfer`` case whose descriptors do not coalesce):

- **hash**: each available algorithm (``xxh3_64`` with ``kvbridge[checksum]``,
  ``crc32``) in this process, both halves: prefill's ``summarise`` (sort the
  descriptors by destination, hash the source bytes) and decode's
  ``digest_ranges`` (check the ranges, hash its own bytes); GB/s of each;
- **transfer**: ``bench transfer``'s kvbridge room (prefill here, decode in a
  child) with the checksum off and on, timed at prefill (until it sends
  ``Done``), and the time it adds; decode verifies after that, so the table
  also gives both halves' hash time against the room's (an upper bound: the
  two run one after the other).

    kvbridge bench checksum [--transfer-backend nixl] [--total-mib 256] [--reps 5] [--json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench import common, transfer
from kvbridge.config import TransferConfig, add_transfer_args
from kvbridge.core.sessions import checksum as C
from kvbridge.core.planning.transferplan import TransferPlan

CASE = "64 KiB pages, scattered"


def hash_rates(total_mib: int, reps: int) -> list[dict[str, Any]]:
    """GB/s of each algorithm's prefill and decode halves over the scattered case."""
    pages = (total_mib << 20) // transfer.PAGE
    (src_kv,), _, src_args = transfer.make_pools(1, pages, fill=True)
    (dst_kv,), _, dst_args = transfer.make_pools(1, pages, fill=False)
    src, dst = transfer.cases(pages)[CASE]
    dst_kv[dst] = src_kv[src]  # decode holds what landed
    plan = TransferPlan(src_kv.ctypes.data + src.astype(np.int64) * transfer.PAGE,
                        dst_kv.ctypes.data + dst.astype(np.int64) * transfer.PAGE,
                        np.full(pages, transfer.PAGE, np.int64))
    gb = pages * transfer.PAGE / 1e9
    rows = []
    for algo in C.ALGORITHMS:
        pre: list[float] = []
        post: list[float] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            summary = C.summarise([plan], algo, 64 << 20)
            pre.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = C.digest_ranges(summary, dst_args.regions)
            post.append(time.perf_counter() - t0)
        rows.append({"algorithm": algo, "bytes": pages * transfer.PAGE, "descriptors": pages,
                     "prefill_GBps": gb / statistics.median(pre), "decode_GBps": gb / statistics.median(post),
                     "match": got == summary.digest})
    return rows


def transfer_cost(backend: str, backend_options: dict[str, str], total_mib: int, reps: int,
                  tracker: ui.Tracker | None) -> dict[str, Any]:
    """The scattered case's kvbridge rate with the checksum off and on, and the time it adds."""
    rates = {}
    verified = True
    for on in (False, True):
        config = dataclasses.replace(transfer.CONFIG, backend_options=backend_options, checksum=on)
        rows = transfer.run(backend, config, reps, 1, total_mib)
        (row,) = [r for r in rows if r["case"] == CASE]
        rates[on] = row["kvbridge_GBps"]
        verified = verified and all(r["verified"] for r in rows)
        if tracker is not None:
            tracker.advance()
    t_off, t_on = 1 / rates[False], 1 / rates[True]
    return {"backend": backend, "case": CASE, "off_GBps": rates[False], "on_GBps": rates[True],
            "added_percent": 100 * (t_on - t_off) / t_off, "algorithm": C.default_algorithm(), "verified": verified}


def format_table(results: dict[str, Any]) -> Any:
    """Both measurements as one :func:`kvbridge.ui.table`."""
    rows: list[tuple[Any, ...]] = []
    for r in results["hash"]:
        rows.append((f"{r['algorithm']}: prefill (sort, hash source)", f"{r['prefill_GBps']:.2f}", None, r["match"]))
        rows.append((f"{r['algorithm']}: decode (check, hash destination)", f"{r['decode_GBps']:.2f}", None, r["match"]))
    t = results["transfer"]
    rows.append((f"{t['backend']} room, checksum off", f"{t['off_GBps']:.2f}", None, t["verified"]))
    rows.append((f"both hash halves vs that room ({t['algorithm']}, serial)", None, f"+{t['hash_percent']:.1f}%", None))
    rows.append((f"{t['backend']} room, checksum on ({t['algorithm']})", f"{t['on_GBps']:.2f}",
                 f"{t['added_percent']:+.1f}%", t["verified"]))
    return ui.table(["measure", "GB/s", "room time added", "ok"], rows, right=["GB/s", "room time added"])


def plot(results: dict[str, Any], path: str) -> None:
    rows = results["hash"]
    common.bars(path, "Checksum throughput (GB/s, higher is better)", [r["algorithm"] for r in rows],
                {"prefill (sort + hash source)": [r["prefill_GBps"] for r in rows],
                 "decode (check + hash destination)": [r["decode_GBps"] for r in rows]}, "GB/s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_transfer_args(parser)
    parser.add_argument("--reps", type=ui.int_at_least(5), default=5, metavar="N",
                        help="timed repetitions, at least 5 (median)")
    parser.add_argument("--total-mib", type=ui.int_at_least(1), default=256, metavar="MIB",
                        help="bytes per room, in MiB (64 KiB pages)")
    common.add_output_arguments(parser, "rates in gigabytes per second: *_GBps")


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or args.command_parser
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    if (args.total_mib << 20) % (transfer.RUN_PAGES * transfer.PAGE):
        parser.error(f"--total-mib must be a multiple of {transfer.RUN_PAGES * transfer.PAGE >> 20} MiB")
    cfg = TransferConfig.from_args(args, parser)
    prog = "kvbridge bench checksum"
    common.check_plot(args, prog)
    with ui.progress(2, "runs", description=f"bench checksum ({cfg.backend})") as tracker:
        results = {"hash": hash_rates(args.total_mib, args.reps),
                   "transfer": transfer_cost(cfg.backend, dict(cfg.backend_options), args.total_mib, args.reps, tracker)}
    def table() -> Any:
        t = format_table(results)
        t.title = f"{args.total_mib} MiB of scattered 64 KiB pages, median of {args.reps}"
        return t

    # Prefill's room ends when it sends Done; decode hashes after that, so the room time
    # above misses decode's half: both halves' hash time against the room, serial, bounds it.
    best = results["hash"][0]
    t = results["transfer"]
    t["hash_percent"] = 100 * t["off_GBps"] * (1 / best["prefill_GBps"] + 1 / best["decode_GBps"])
    ok = all(r["match"] for r in results["hash"]) and results["transfer"]["verified"]
    return common.finish(args, prog, results, table, plot, ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench checksum", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
