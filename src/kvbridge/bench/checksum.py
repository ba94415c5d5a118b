"""What the end-to-end checksum (``SessionConfig.checksum``) costs, on host memory and on GPU memory.

For each ``--device`` (``cpu``: host memory; ``cuda``: GPU 0, the default too wherever torch sees
one), over scattered 64 KiB pages (a random permutation: nothing coalesces), in one run:

- **hash**: over ``--hash-mib``, each hash this device's rooms can use, both halves: prefill's
  ``summarise`` (sort the descriptors by destination, hash the source bytes) and decode's
  ``digest_ranges`` (check the ranges, hash its own bytes); GB/s of each. Host memory: XXH3-64
  (with ``kvbridge[checksum]``), CRC32 and ``wmix64`` in numpy; GPU memory: ``wmix64`` in torch; and
  ``wmix64`` again over the same pages described as 128 regions (as a room's layers are);
- **room**: for each ``--total-mib`` (64 MiB to 4 GiB by default), a room from prefill (here) to
  decode (a child process) with the checksum off and on, alternating, timed from prefill's ``send``
  to decode's ``SUCCESS`` (so both hash halves are inside), and the share of that time the
  checksum adds. The hash a room uses is the one prefill names (``checksum.choose``): ``wmix64``
  with GPU memory on either side, else XXH3-64 or CRC32.

    kvbridge bench checksum [--device cpu cuda] [--total-mib 64 256 1024 4096] [--hash-mib 256]
                            [--transfer-backend nixl] [--reps 5] [--json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import msgspec
import numpy as np

from kvbridge import ui
from kvbridge.bench import checksum_room as R
from kvbridge.bench import common
from kvbridge.config import TransferConfig, add_transfer_args
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.sessions import checksum as C

#: Room sizes by default: the issue's range (#28: 64 MiB to 4 GiB; the target is read at 1 GiB).
TOTAL_MIB = (64, 256, 1024, 4096)


def _address(device: str, pool: Any) -> int:
    return int(pool.data_ptr()) if device == "cuda" else int(pool.ctypes.data)


#: A room spans a region per layer and role; the hash is also timed over the same bytes cut into this many.
LAYER_REGIONS = 128


def _cut(regions: tuple[Any, ...], parts: int) -> tuple[Any, ...]:
    """The one region of ``regions`` described as ``parts`` regions of equal size, one after another."""
    (r,) = regions
    size = r.nbytes // parts // r.stride * r.stride
    return tuple(msgspec.structs.replace(r, name=f"{r.name}{i}", addr=r.addr + i * size, nbytes=size, layer=i)
                 for i in range(parts)) + ((msgspec.structs.replace(r, name=f"{r.name}-rest", addr=r.addr + parts * size,
                                                                    nbytes=r.nbytes - parts * size, layer=parts),)
                                           if r.nbytes > parts * size else ())


def hash_rates(device: str, total_mib: int, reps: int) -> list[dict[str, Any]]:
    """GB/s of each hash's prefill and decode halves over ``total_mib`` of scattered pages in ``device`` memory.

    ``wmix64`` also over the same pages described as :data:`LAYER_REGIONS` regions (as a room's
    layers are): what a hash pays per region shows as the difference.
    """
    pages = (total_mib << 20) // R.PAGE
    src_pool, src_args = R.make_pool(device, pages, fill=True)
    dst_pool, dst_args = R.make_pool(device, pages, fill=False)
    src, dst = R.indices(pages)
    R.fill_pattern(device, dst_pool, dst, src)  # decode holds what landed
    plan = TransferPlan(_address(device, src_pool) + src.astype(np.int64) * R.PAGE,
                        _address(device, dst_pool) + dst.astype(np.int64) * R.PAGE, np.full(pages, R.PAGE, np.int64))
    how = R.device_path(device)
    algorithms = [C.choose(src_args.regions, dst_args.regions)]
    if device == "cpu":  # every hash host memory can use, the default first
        algorithms += [a for a in C.ALGORITHMS if a not in algorithms]
    cases = [(a, 1) for a in algorithms] + [("wmix64", min(LAYER_REGIONS, pages))]
    gb = pages * R.PAGE / 1e9
    rows = []
    for algo, parts in cases:
        src_regions = src_args.regions if parts == 1 else _cut(src_args.regions, parts)
        dst_regions = dst_args.regions if parts == 1 else _cut(dst_args.regions, parts)
        pre: list[float] = []
        post: list[float] = []
        for _ in range(reps + 1):  # the first warms up (CUDA context, caches), left out
            t0 = time.perf_counter()
            summary = C.summarise([plan], algo, 64 << 20, src_regions)
            pre.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = C.digest_ranges(summary, dst_regions)
            post.append(time.perf_counter() - t0)
        rows.append({"device": device, "algorithm": algo, "path": how if algo == "wmix64" else "host",
                     "default": algo == algorithms[0] and parts == 1, "regions": parts, "bytes": pages * R.PAGE,
                     "prefill_GBps": gb / statistics.median(pre[1:]), "decode_GBps": gb / statistics.median(post[1:]),
                     "match": got == summary.digest})
    del src_pool, dst_pool
    return rows


def format_table(results: dict[str, Any]) -> Any:
    """Both measurements as one :func:`kvbridge.ui.table`."""
    rows: list[tuple[Any, ...]] = []
    memory = {"cpu": "host", "cuda": "GPU"}
    for r in results["hash"]:
        used = " *" if r["default"] else ""
        how = f" ({r['path']})" if r["device"] == "cuda" else ""
        regions = f", {r['regions']} regions" if r.get("regions", 1) > 1 else ""
        rows.append((f"{memory[r['device']]} hash {r['algorithm']}{how}{regions}{used}", None, None,
                     f"{r['prefill_GBps']:.2f} / {r['decode_GBps']:.2f}", None, r["match"]))
    for r in results["rooms"]:
        rows.append((f"{memory[r['device']]} room {r['bytes'] >> 20} MiB",
                     f"{r['off_ms']:.1f}", f"{r['on_ms']:.1f}", f"{r['off_GBps']:.2f} / {r['on_GBps']:.2f}",
                     f"{r['added_percent']:+.1f}%", r["verified"]))
    return ui.table(["measure", "off ms", "on ms", "GB/s", "added", "ok"], rows,
                    right=["off ms", "on ms", "GB/s", "added"], nowrap=["measure", "GB/s"])


def plot(results: dict[str, Any], path: str) -> None:
    rows = results["rooms"]
    common.bars(path, "Checksum: room time it adds (%, lower is better)",
                [f"{r['device']} {r['bytes'] >> 20} MiB ({r['algorithm']})" for r in rows],
                {"added": [r["added_percent"] for r in rows]}, "% of the room's time")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_transfer_args(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), nargs="+", default=None, metavar="DEVICE",
                        help="cpu (host memory) and/or cuda (GPU 0) (default: both where torch sees a GPU, else cpu)")
    parser.add_argument("--reps", type=ui.int_at_least(5), default=5, metavar="N",
                        help="timed repetitions, at least 5 (median), after one warm-up")
    parser.add_argument("--total-mib", type=ui.int_at_least(1), nargs="+", default=list(TOTAL_MIB), metavar="MIB",
                        help=f"room sizes in MiB of 64 KiB pages (default: {' '.join(map(str, TOTAL_MIB))})")
    parser.add_argument("--hash-mib", type=ui.int_at_least(1), default=256, metavar="MIB",
                        help="bytes each hash is timed over, in MiB")
    common.add_output_arguments(parser, "rates in gigabytes per second: *_GBps; times in ms")


def _devices(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    if args.device is None:
        return ["cpu"] if common.cuda_problem() else ["cpu", "cuda"]
    if "cuda" in args.device:
        problem = common.cuda_problem()
        if problem:
            ui.usage_error(parser, problem)
    return list(dict.fromkeys(args.device))


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or args.command_parser
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    for flag, mib in (("--total-mib", min(args.total_mib)), ("--hash-mib", args.hash_mib)):
        if (mib << 20) % R.PAGE:
            parser.error(f"{flag} must be a whole number of 64 KiB pages")
    cfg = TransferConfig.from_args(args, parser)
    devices = _devices(args, parser)
    prog = "kvbridge bench checksum"
    common.check_plot(args, prog)
    results: dict[str, Any] = {"hash": [], "rooms": []}
    with ui.progress(len(devices) * (1 + len(args.total_mib)), "steps", description="bench checksum") as tracker:
        for device in devices:
            rates = hash_rates(device, args.hash_mib, args.reps)
            results["hash"] += rates
            tracker.advance()
            rooms = R.run(device, cfg.backend, dict(cfg.backend_options), args.total_mib, args.reps, tracker)
            for r in rooms:
                r["algorithm"], r["path"] = rates[0]["algorithm"], rates[0]["path"]
            results["rooms"] += rooms

    def table() -> Any:
        t = format_table(results)
        t.title = (f"checksum over scattered 64 KiB pages, {cfg.backend}, median of {args.reps}. GB/s: a hash's "
                   "prefill / decode half; a room's off / on. A room: prefill's send to decode's SUCCESS. *: the hash "
                   "that memory's rooms use")
        return t

    ok = all(r["match"] for r in results["hash"]) and all(r["verified"] for r in results["rooms"])
    return common.finish(args, prog, results, table, plot, ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench checksum", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
