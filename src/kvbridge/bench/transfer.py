"""Transfer throughput: kvbridge vs the raw engine call vs memcpy, in one run.

Prefill runs in this process, decode in a child process, both on 127.0.0.1.
For each case the same descriptors are moved three ways in one run:

- **kvbridge**: ``Sender.send(pages, last=True)`` until the sender reports
  SUCCESS (every byte, metadata row last, has landed at decode): planning,
  bounds checks, batching and the control plane included;
- **raw engine**: the same descriptor arrays, precomputed as Python lists,
  pushed through the engine's own call in a loop (for Mooncake,
  ``batch_transfer_sync_write`` in batches of the per-peer in-flight limit);
- **memcpy**: ``numpy.copyto`` of the same bytes inside this process.

Decode verifies the bytes of the last kvbridge repetition of each case.
Cases, over ``--total-mib`` split across ``--regions`` buffers of 64 KiB pages:
scattered pages (no two neighbours coalesce), 1 MiB runs (16 pages moved
together, runs scattered), one block per region.

    kvbridge bench transfer [--transfer-backend NAME] [--transfer-option K=V] [--total-mib 256]
                            [--regions 1] [--reps 5] [--json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench import common
from kvbridge.config import TransferConfig, add_transfer_args
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region
from kvbridge.core.sessions.session import (
    KV_PAGE_SPACE,
    METADATA_SPACE,
    DecodeManager,
    Poll,
    PrefillManager,
    Receiver,
    Sender,
    SessionConfig,
)

PAGE = 64 << 10
RUN_PAGES = 16  # 1 MiB runs
#: Rooms per timed repetition: pipelined (as configured), then one batch in flight (``serial``).
ROOMS_PER_REP = 2


def cases(pages: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(source pages, destination pages) per case; deterministic (seed 0)."""
    rng = np.random.default_rng(0)
    runs = rng.permutation(pages // RUN_PAGES)
    return {
        "64 KiB pages, scattered": (np.arange(pages), rng.permutation(pages)),
        "1 MiB runs, scattered": (np.arange(pages), (runs[:, None] * RUN_PAGES + np.arange(RUN_PAGES)).ravel()),
        "one block per region": (np.arange(pages), np.arange(pages)),
    }


# The decode child may ask for the next room while this side still measures the references: keep its request.
CONFIG = SessionConfig(transfer_timeout=120, waiting_timeout=300, heartbeat_timeout=30, sender_grace=300)


def make_pools(regions: int, pages: int, fill: bool) -> tuple[list[np.ndarray], np.ndarray, KVArgs]:
    kv = [np.zeros((pages, PAGE // 8), np.uint64) for _ in range(regions)]
    if fill:
        for e, arr in enumerate(kv):
            arr[:] = source_bytes(e, np.arange(pages))
    meta = np.zeros((4, 64), np.uint8)
    described = [
        Region(name=f"{'kv'[e % 2]}{e // 2}", addr=a.ctypes.data, nbytes=a.nbytes, stride=PAGE,
               role="kv"[e % 2], index_space=KV_PAGE_SPACE, layer=e // 2)
        for e, a in enumerate(kv)
    ]
    described.append(Region(name="meta", addr=meta.ctypes.data, nbytes=meta.nbytes, stride=64,
                          role="metadata", index_space=METADATA_SPACE))
    args = KVArgs(regions=tuple(described), index_spaces=(IndexSpace(KV_PAGE_SPACE, pages, 16), IndexSpace(METADATA_SPACE, 4)),
                  dtype="bfloat16", page_size=16)
    return kv, meta, args


def source_bytes(region: int, pages: np.ndarray) -> np.ndarray:
    # Every 8-byte word names its region and page: cheap to build, unique per page.
    words = (np.uint64(region) << np.uint64(56)) | pages.astype(np.uint64)[:, None]
    return np.broadcast_to(words, (pages.size, PAGE // 8))


# -- decode child ----------------------------------------------------------------------------
def run_decode(backend: str, config: SessionConfig, bootstrap: str, reps: int, regions: int, pages: int) -> int:
    kv, _meta, args = make_pools(regions, pages, fill=False)
    mgr = DecodeManager(args, backend, config=config)
    ok = True
    try:
        for c, (name, (src, dst)) in enumerate(cases(pages).items()):
            for room in range(ROOMS_PER_REP * reps + 1):  # + the warm-up
                recv = Receiver(mgr, 1000 * c + room + 1, bootstrap=bootstrap)
                recv.init(dst, metadata_row=0)
                if recv.wait(Poll.SUCCESS, 300) != Poll.SUCCESS:
                    print(f"decode: {name} room {room}: {recv.poll().name} {recv.failure()}", file=sys.stderr)
                    ok = False
            for e, arr in enumerate(kv):
                if not np.array_equal(arr[dst], source_bytes(e, src)):
                    print(f"decode: {name}: region {e} differs from the source", file=sys.stderr)
                    ok = False
            print(json.dumps({"case": name, "verified": ok}), flush=True)
        sys.stdin.readline()  # stay registered while prefill runs the raw-engine loop
    finally:
        mgr.close()
    return 0 if ok else 1


# -- prefill (this process) -----------------------------------------------------------------
def raw_mooncake(mgr: PrefillManager, plan: Any) -> Callable[[], None]:
    backend: Any = mgr.backend
    engine, session = backend._engine, next(iter(backend._peers.values()))
    batches = [(b.src_addr.tolist(), b.dst_addr.tolist(), b.nbytes.tolist())
               for b in plan.batches(max_descriptors=mgr.transport.capabilities.batch_descriptors)]

    def go() -> None:
        for s, d, n in batches:
            if engine.batch_transfer_sync_write(session, s, d, n) != 0:
                raise RuntimeError("raw batch_transfer_sync_write failed")
    return go


#: Raw-engine loops by backend, imported only for the backend measured.
RAW = {
    "mooncake": "kvbridge.bench.transfer:raw_mooncake",
    "nixl": "kvbridge.bench.raw_nixl:raw",
    "ucx": "kvbridge.bench.raw_ucx:raw",
}


def _raw_for(backend: str) -> Callable[[PrefillManager, Any], Callable[[], None]] | None:
    target = RAW.get(backend)
    if target is None:
        return None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def run(backend: str, config: SessionConfig, reps: int, regions: int, total_mib: int,
        tracker: ui.Tracker | None = None) -> list[dict[str, Any]]:
    """One row per case; rates in gigabytes (10**9 B) per second (``*_GBps``); ``tracker`` advances per case."""
    pages = (total_mib << 20) // (regions * PAGE)
    kv, meta, args = make_pools(regions, pages, fill=True)
    server = BootstrapServer("127.0.0.1")
    mgr = PrefillManager(args, backend, bootstrap=server.address, config=config)
    options = [f"--transfer-option={k}={v}" for k, v in config.backend_options.items()]
    child = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.bench.transfer", "--decode", server.address, "--transfer-backend", backend,
         *options, *(["--transfer-checksum"] if config.checksum else []), "--transfer-staging", config.staging, "--reps", str(reps), "--regions", str(regions), "--total-mib", str(total_mib)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    results = []
    local = [np.empty_like(a) for a in kv]
    try:
        for c, (name, (src, dst)) in enumerate(cases(pages).items()):
            before = dict(mgr.transport.windows)
            kv_times: list[float] = []
            serial_times: list[float] = []
            raw_times: list[float] = []
            mem_times: list[float] = []
            raw = _raw_for(backend)
            go = None
            plan = None
            # Rep 0 is an untimed warm-up (engines connect on the first write); then
            # kvbridge, raw engine and memcpy alternate so noise hits all three alike.
            for rep in range(reps + 1):
                if rep > 0:  # the same bytes, one batch in flight at a time (before pipelining); rooms in decode's order
                    with serial(mgr):
                        serial_times.append(send(mgr, 1000 * c + ROOMS_PER_REP * rep, src, name))
                elapsed = send(mgr, 1000 * c + ROOMS_PER_REP * rep + 1, src, name)
                if plan is None:
                    (peer,) = mgr.peers()
                    plan = peer.route.plan({KV_PAGE_SPACE: src}, {KV_PAGE_SPACE: dst})
                    go = raw(mgr, plan) if raw is not None else None
                if rep == 0:
                    continue
                kv_times.append(elapsed)
                if go is not None:
                    t0 = time.perf_counter()
                    go()
                    raw_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for a, b in zip(kv, local):
                    np.copyto(b, a)
                mem_times.append(time.perf_counter() - t0)
            # The raw loop rewrote the same bytes, so decode's check still holds.
            verified = json.loads(child.stdout.readline())["verified"]  # type: ignore[union-attr]
            gb = regions * pages * PAGE / 1e9
            row = {
                "case": name,
                "backend": backend,
                "bytes": regions * pages * PAGE,
                "descriptors": len(plan) if plan is not None else 0,
                "kvbridge_GBps": gb / statistics.median(kv_times),
                "kvbridge_min_GBps": gb / max(kv_times),
                "kvbridge_max_GBps": gb / min(kv_times),
                "kvbridge_serial_GBps": gb / statistics.median(serial_times),
                "batches_in_flight": max(lane.in_flight for lane in mgr.transport.lanes),
                "staging": config.staging,
                # Windows of every kvbridge repetition (both columns), by how each was written (core/transfer/relay.py).
                "windows": {k: v - before[k] for k, v in mgr.transport.windows.items()},
                "raw_engine_GBps": gb / statistics.median(raw_times) if raw_times else None,
                "memcpy_GBps": gb / statistics.median(mem_times),
                "verified": verified,
            }
            row["kvbridge_vs_raw"] = row["kvbridge_GBps"] / row["raw_engine_GBps"] if raw_times else None
            results.append(row)
            if tracker is not None:
                tracker.advance()
    finally:
        common.finish_child(child)
        mgr.close()
        server.close()
    return results


def send(mgr: PrefillManager, room: int, src: np.ndarray, name: str) -> float:
    """Seconds from ``send`` until the sender reports SUCCESS (every byte landed at decode)."""
    sender = Sender(mgr, room, metadata_row=0)
    sender.wait(Poll.WAITING_FOR_INPUT, 600)
    t0 = time.perf_counter()
    sender.send(src, last=True)
    # Woken by the change: a host thread polling in a loop would compete with the sender's
    # worker for the GIL, and the write it measures would pay for it.
    sender.wait(Poll.SUCCESS, 600)
    elapsed = time.perf_counter() - t0
    if sender.poll() != Poll.SUCCESS:
        raise RuntimeError(f"{name}: {sender.failure()}")
    return elapsed


@contextlib.contextmanager
def serial(mgr: PrefillManager) -> Iterator[None]:
    """Within: every lane of ``mgr`` posts one batch at a time (as before ``core/transfer/pipeline.py``)."""
    lanes = mgr.transport.lanes
    saved = [lane.in_flight for lane in lanes]
    for lane in lanes:
        lane.in_flight = 1
    try:
        yield
    finally:
        for lane, n in zip(lanes, saved):
            lane.in_flight = n


def format_table(results: list[dict[str, Any]]) -> Any:
    """The results as a :func:`kvbridge.ui.table`."""
    def rate(value: float | None) -> str | None:
        return f"{value:.2f}" if value else None

    columns = ["case", "backend", "desc", "kvbridge GB/s", "1 in flight GB/s", "raw GB/s", "memcpy GB/s", "kvb/raw",
               "bytes ok"]
    return ui.table(
        columns,
        [(r["case"], r["backend"], r["descriptors"], rate(r["kvbridge_GBps"]), rate(r["kvbridge_serial_GBps"]),
          rate(r["raw_engine_GBps"]), rate(r["memcpy_GBps"]), rate(r["kvbridge_vs_raw"]), r["verified"]) for r in results],
        right=columns[2:8], nowrap=["backend"],
    )


#: ``--device cuda``'s defaults where they differ from the host-memory run's (kvbridge.bench.gpu).
CUDA_REPS, CUDA_TOTAL_MIB, CUDA_PAGE_KIB = 10, [64, 1024], [4, 16, 64, 256, 1024]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One parser whatever the device: the options of one device are refused with the other."""
    add_transfer_args(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: host memory, kvbridge vs the raw engine vs memcpy; cuda: VRAM to VRAM, kvbridge's "
                             "fast path vs its plain path vs raw NIXL vs torch D2D")
    parser.add_argument("--reps", type=ui.int_at_least(5), default=None, metavar="N",
                        help=f"timed repetitions per case, at least 5 (median, min-max) (default: 5; cuda: {CUDA_REPS})")
    parser.add_argument("--total-mib", type=ui.int_at_least(1), nargs="+", default=None, metavar="MIB",
                        help="bytes moved per transfer, in MiB; cuda: one case per value "
                             f"(default: 256; cuda: {' '.join(map(str, CUDA_TOTAL_MIB))})")
    parser.add_argument("--regions", type=ui.int_at_least(1), default=None, metavar="N",
                        help="cpu only: buffers the bytes are split across (default: 1)")
    parser.add_argument("--page-kib", type=ui.int_at_least(4), nargs="+", default=None, metavar="KIB",
                        help=f"page sizes in KiB; cuda: one case each (default: {' '.join(map(str, CUDA_PAGE_KIB))}); "
                             "cpu: the fragmentation axis instead of the three fixed cases: per page size, scattered, "
                             "contiguous and head-sliced TP 1->2 and 2->1, each beside the contiguous rate")
    parser.add_argument("--staging", choices=("on", "off", "auto"), nargs="+", default=None, metavar="MODE",
                        help="cpu with --page-kib: prefill's staging setting per row, on, off and/or auto "
                             "(SessionConfig.staging; default: off on); cuda: a plain-path column per mode on or "
                             "auto besides the plain path (off: GPU pages as planned), decode lending GPU slots")
    parser.add_argument("--decode-gpu", type=ui.int_at_least(0), default=None, metavar="N",
                        help="cuda only: the decode process's GPU (default: 0, the prefill's)")
    common.add_output_arguments(parser, "rates in gigabytes per second: *_GBps")
    parser.add_argument("--decode", metavar="BOOTSTRAP", help=argparse.SUPPRESS)
    parser.add_argument("--one-in-flight", action="store_true",
                        help="cpu with --page-kib: each --staging mode on or auto also as MODE/1, with one batch and "
                             "one staged window in flight at a time (as before pipelining), alternating room by room")
    parser.add_argument("--trace", action="store_true",
                        help="cpu with --page-kib (every case) or cuda (staged paths): also trace every staged "
                             "window's steps in both processes and print, per row, where a window's time goes "
                             "(kvbridge.bench.windows)")
    parser.add_argument("--slice-mib", type=ui.int_at_least(1), nargs="+", default=None, metavar="MIB",
                        help="cuda only: GPU staging slice (and decode slot) sizes, one staged path per --staging mode "
                             "and size (SessionConfig.gpu_staging_slice_bytes; default: its default, 32)")
    parser.add_argument("--fragment", metavar="JSON", help=argparse.SUPPRESS)  # the fragmentation decode child's case


def _device_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill the device's defaults; an option of the other device is a usage error."""
    other = ("--decode-gpu", "--slice-mib") if args.device == "cpu" else ("--regions",)
    given = [flag for flag in other if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given:
        ui.usage_error(parser, f"argument {given[0]}: applies to --device {'cuda' if args.device == 'cpu' else 'cpu'} "
                               f"only (this run is --device {args.device})")
    if args.device == "cpu":
        for flag in ("staging", "trace"):
            if getattr(args, flag) and args.page_kib is None:
                ui.usage_error(parser, f"argument --{flag}: applies to the fragmentation axis only; give --page-kib too")
        args.staging = args.staging or ["off", "on"]
        if args.one_in_flight:  # each staged setting also measured as before pipelining, room by room beside
            args.staging += [f"{m}/1" for m in args.staging if m != "off"]
        if args.total_mib is not None and len(args.total_mib) > 1:
            ui.usage_error(parser, f"argument --total-mib: takes one value with --device cpu, got {args.total_mib}")
        args.total_mib = args.total_mib[0] if args.total_mib else 256
        args.reps, args.regions = args.reps or 5, args.regions or 1
    else:
        args.total_mib, args.reps = args.total_mib or list(CUDA_TOTAL_MIB), args.reps or CUDA_REPS
        args.page_kib = args.page_kib or list(CUDA_PAGE_KIB)
        args.decode_gpu = args.decode_gpu or 0
        args.staging = [m for m in dict.fromkeys(args.staging or []) if m != "off"]  # off: the plain column
        if (args.slice_mib or args.trace) and not args.staging:
            ui.usage_error(parser, f"argument {'--slice-mib' if args.slice_mib else '--trace'}: applies to staged paths; "
                                   "give --staging on or auto too")


def plot(results: list[dict[str, Any]], path: str) -> None:
    common.bars(path, f"Transfer throughput ({results[0]['backend']}; GB/s, higher is better)",
                [r["case"] for r in results],
                {"kvbridge": [r["kvbridge_GBps"] for r in results], "raw engine": [r["raw_engine_GBps"] for r in results],
                 "memcpy": [r["memcpy_GBps"] for r in results]}, "GB/s")


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or args.command_parser
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    _device_options(args, parser)
    if args.device == "cuda":
        problem = common.cuda_problem()
        if problem is not None:
            ui.usage_error(parser, problem)
        from kvbridge.bench import gpu  # imports torch

        args.transfer_backend = TransferConfig.from_args(args, parser).backend
        return gpu.run_from_args(args, parser)
    if args.device == "cpu" and (args.page_kib is not None or args.fragment):
        return _run_fragments(args, parser)
    pages = (args.total_mib << 20) // (args.regions * PAGE)
    if pages < RUN_PAGES or pages % RUN_PAGES:
        parser.error(f"--total-mib / --regions must be a multiple of {RUN_PAGES * PAGE >> 20} MiB")
    cfg = TransferConfig.from_args(args, parser)
    config = dataclasses.replace(CONFIG, backend_options=dict(cfg.backend_options), checksum=cfg.checksum,
                                 staging=cfg.staging)
    if args.decode:
        return run_decode(cfg.backend, config, args.decode, args.reps, args.regions, pages)
    prog = "kvbridge bench transfer"
    common.check_plot(args, prog)
    with ui.progress(len(cases(pages)), "cases", description=f"bench transfer ({cfg.backend})") as tracker:
        results = run(cfg.backend, config, args.reps, args.regions, args.total_mib, tracker)

    def table() -> Any:
        t = format_table(results)
        t.title = (f"{args.total_mib} MiB in {args.regions} region(s), prefill -> decode over 127.0.0.1, "
                   f"median of {args.reps} (min-max in --json)")
        return t

    return common.finish(args, prog, results, table, plot, all(r["verified"] for r in results))


def _run_fragments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--device cpu --page-kib ...``: the fragmentation axis (:mod:`kvbridge.bench.fragment`)."""
    from kvbridge.bench import fragment

    cfg = TransferConfig.from_args(args, parser)
    config = dataclasses.replace(fragment.CONFIG, backend_options=dict(cfg.backend_options), checksum=cfg.checksum)
    if args.decode:
        return fragment.run_decode(cfg.backend, config, args.decode, json.loads(args.fragment))
    prog = "kvbridge bench transfer"
    common.check_plot(args, prog)
    n = len(args.page_kib) * len(fragment.GEOMETRIES)
    with tempfile.TemporaryDirectory(prefix="kvbridge-windows-") as tmp, \
            ui.progress(n, "cases", description=f"bench transfer fragmentation ({cfg.backend})") as tracker:
        rows = fragment.run(cfg.backend, config, args.page_kib, args.total_mib, args.staging, args.reps, tracker,
                            tmp if args.trace else None)

    def table() -> Any:
        t = fragment.format_table(rows)
        t.title = (f"{cfg.backend}: {args.total_mib} MiB a room, host memory, prefill -> decode over 127.0.0.1, "
                   f"median of {args.reps}; windows: direct/gathered on prefill/staged on both sides")
        return t

    def draw(results: list[dict[str, Any]], path: str) -> None:
        common.bars(path, f"Fragmented transfers ({cfg.backend}; GB/s)",
                    [f"{r['page_KiB']} KiB {r['case']} {r['staging']}" for r in results],
                    {"kvbridge": [r["kvbridge_GBps"] for r in results],
                     "contiguous": [r["contiguous_GBps"] for r in results]}, "GB/s")

    status = common.finish(args, prog, rows, table, draw, all(r["verified"] for r in rows))
    if args.trace:
        from kvbridge.bench import windows

        windows.print_summaries(args.json, [(f"{r['page_KiB']} KiB {r['case']}, staging {r['staging']}", r["trace"])
                                            for r in rows if r.get("trace", {}).get("windows")])
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench transfer", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
