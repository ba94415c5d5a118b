"""GPU memory, VRAM -> VRAM between two processes: kvbridge's fast path, its plain path, raw NIXL, torch D2D.

``kvbridge bench transfer --device cuda``. Prefill runs in this process, decode
in a child process, both on GPU 0 (or decode on GPU 1 with ``--decode-gpu 1``
where two are visible). For every page size and request size, pages are
moved scattered (a random permutation: nothing coalesces) and contiguous,
four ways measured in the same run:

- **fast path**: a PrefillManager with ``gpu_fast_path`` on: CUDA IPC and one
  Triton kernel per write (:mod:`kvbridge.plugins.cuda_ipc`);
- **plain**: a second PrefillManager with it off: the same descriptors through
  the backend (NIXL), one descriptor per page;
- **plain, staging MODE** (``--staging on`` / ``auto``): the plain path with
  ``SessionConfig.staging`` MODE, decode lending slots on its GPU: windows of
  pages gathered into a GPU staging slice by one kernel launch, written as one
  descriptor, scattered on decode (:mod:`kvbridge.core.transfer.device`);
- **plain, staging MODE, S MiB slices** (``--slice-mib S ...``): the same with
  ``SessionConfig.gpu_staging_slice_bytes`` S MiB on both sides (decode lends
  slots of that size from a decode manager of its own), one path per mode and size;
- **raw NIXL**: the same descriptor lists through NIXL's own calls, request
  prepared outside the timed loop (:mod:`kvbridge.bench.raw_nixl`);
- **D2D**: ``torch`` copying the same number of bytes inside this process,
  once right after each fast-path write (``fast/D2D``: both medians over the
  same repetitions, the GPU in the same state), and, as measured before, in a
  block after every path (``D2D after``, ``/after``).

kvbridge's columns are transfer time (the writes of the request, from core's
metrics: planning and the control plane excluded; the request's end-to-end
latency is reported beside). ``--trace``: every staged window's steps in both
processes (:mod:`kvbridge.bench.windows`), summarised per case and staged path
over its timed rooms. Decode checks every destination byte of every
case against the source pattern with torch indexing, after each path's rooms
(the destination zeroed before them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench import common, trace, windows
from kvbridge.core.control import metrics
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig

# The decode child asks for the next room while this side still measures raw NIXL and D2D: keep its request.
CONFIG = SessionConfig(transfer_timeout=300, waiting_timeout=600, heartbeat_timeout=60, heartbeat_interval=1, sender_grace=600)


def cases(page_kib: list[int], total_mib: list[int]) -> list[tuple[int, int, str]]:
    return [(p << 10, t << 20, how) for t in total_mib for p in page_kib for how in ("scattered", "contiguous")
            if (t << 20) // (p << 10) >= 1]


def pools(page_kib: list[int], total_mib: list[int], device: int, fill: bool) -> tuple[KVArgs, dict[int, Any]]:
    """One GPU region per page size, as large as the largest request; index space ``p<KiB>``."""
    import torch

    size = max(total_mib) << 20
    tensors, regions, spaces = {}, [], []
    for i, kib in enumerate(page_kib):
        page = kib << 10
        t = torch.zeros(size // 8, dtype=torch.int64, device=f"cuda:{device}")
        if fill:  # word w of page p holds p * 2**20 + w (+ i * 2**40): every byte says where it belongs
            words = page // 8
            t.copy_(torch.arange(size // 8, device=t.device) % words + (torch.arange(size // 8, device=t.device)
                                                                          // words) * 2**20 + i * 2**40)
        tensors[page] = t
        regions.append(Region(name=f"p{kib}k", addr=t.data_ptr(), nbytes=size, stride=page, role="kv",
                              index_space=f"p{kib}", layer=i, mem="vram", device=device))
        spaces.append(IndexSpace(f"p{kib}", size // page))
    return KVArgs(regions=tuple(regions), index_spaces=tuple(spaces), dtype="int64", page_size=1), tensors


def pages_of(page: int, total: int, how: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    n = total // page
    src = np.arange(n)
    dst = np.random.default_rng(seed).permutation(n) if how == "scattered" else np.arange(n)
    return src, dst


def staged_paths(staging: list[str], slice_mib: list[int] | None) -> list[tuple[str, int | None]]:
    """The staged plain paths, in order: (mode, slice MiB or None for the default size)."""
    return [(mode, mib) for mode in staging for mib in (slice_mib or [None])]


def path_name(mode: str, mib: int | None) -> str:
    return f"plain_{mode}" if mib is None else f"plain_{mode}_{mib}M"


def staged_config(mode: str | None, mib: int | None, **more: Any) -> SessionConfig:
    """:data:`CONFIG` with staging ``mode`` (None: as it is) and GPU slices of ``mib`` MiB (None: the default)."""
    fields = {**CONFIG.__dict__, **more, **({"staging": mode} if mode else {})}
    if mib is not None:
        fields["gpu_staging_slice_bytes"] = mib << 20
    return SessionConfig(**fields)


def run_decode(args: argparse.Namespace) -> int:
    import torch

    kvargs, tensors = pools(args.page_kib, args.total_mib, args.decode_gpu, fill=False)
    if args.trace_file:
        windows.install()
    # Staged paths need decode's GPU slots; the fast and plain prefills (staging gather) do not use them. A slot
    # size of its own (--slice-mib) needs a decode manager of its own: its landing buffer lends slots of that size.
    config = staged_config("on" if args.staging else None, None)
    managers = {None: DecodeManager(kvargs, args.transfer_backend, config=config)}
    for mib in args.slice_mib or []:
        managers[mib] = DecodeManager(kvargs, args.transfer_backend, config=staged_config("on", mib))
    mgr_of = [managers[None], managers[None], *(managers[mib] for _, mib in staged_paths(args.staging, args.slice_mib))]
    try:
        room = 0
        for c, (page, total, how) in enumerate(cases(args.page_kib, args.total_mib)):
            src, dst = pages_of(page, total, how, c)
            space = f"p{page >> 10}"
            paths = []
            for address, mgr in zip(args.decode.split(","), mgr_of):  # the fast, the plain, each staged prefill
                tensors[page].zero_()  # what this path's rooms write is checked by itself
                torch.cuda.synchronize()
                ok = True
                for _ in range(args.reps + 1):
                    room += 1
                    recv = Receiver(mgr, room, bootstrap=address)
                    recv.init([], state_indices={space: dst})
                    ok &= recv.wait(Poll.SUCCESS, 600) == Poll.SUCCESS
                words = page // 8
                got = tensors[page].view(-1, words)[torch.as_tensor(dst, device=tensors[page].device)]
                i = args.page_kib.index(page >> 10)
                want = (torch.arange(words, device=got.device)[None, :]
                        + torch.as_tensor(src, device=got.device)[:, None] * 2**20 + i * 2**40)
                paths.append(ok and bool(torch.equal(got, want)))
            print(json.dumps({"case": c, "verified": all(paths), "paths": paths}), flush=True)
        if args.trace_file:
            with open(args.trace_file, "w") as f:
                json.dump(trace.events(), f)
            print(json.dumps({"trace": args.trace_file}), flush=True)
        sys.stdin.readline()
    finally:
        for m in managers.values():
            m.close()
    return 0


def _transfer_seconds(backend: str) -> float:
    snap = metrics.snapshot()["backends"].get(backend, {})
    return float(snap.get("transfer_seconds", {}).get("sum", 0.0))


def _d2d_seconds(a: Any, b: Any) -> float:
    """One device-to-device copy of ``a`` into ``b``, timed on the host as kvbridge's writes are."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    b.copy_(a)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(args: argparse.Namespace, trace_file: str | None = None) -> list[dict[str, Any]]:
    """The rows; ``trace_file``: trace the staged windows (the decode child writes its events there)."""
    import torch

    from kvbridge.bench.raw_nixl import raw
    from kvbridge.bench.common import finish_child

    kvargs, tensors = pools(args.page_kib, args.total_mib, 0, fill=True)
    servers = [BootstrapServer("127.0.0.1"), BootstrapServer("127.0.0.1")]
    managers = {
        "fast": PrefillManager(kvargs, args.transfer_backend, bootstrap=servers[0].address, config=CONFIG),
        "plain": PrefillManager(kvargs, args.transfer_backend, bootstrap=servers[1].address,
                                config=SessionConfig(**{**CONFIG.__dict__, "gpu_fast_path": False})),
    }
    for mode, mib in staged_paths(args.staging, args.slice_mib):  # the plain path with GPU staging (core/transfer/device.py)
        servers.append(BootstrapServer("127.0.0.1"))
        managers[path_name(mode, mib)] = PrefillManager(
            kvargs, args.transfer_backend, bootstrap=servers[-1].address,
            config=staged_config(mode, mib, gpu_fast_path=False))
    if trace_file:
        windows.install()
        trace.reset()
    child = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.bench.gpu", "--decode", ",".join(s.address for s in servers),
         "--transfer-backend", args.transfer_backend, "--reps", str(args.reps), "--decode-gpu", str(args.decode_gpu),
         "--page-kib", *map(str, args.page_kib), "--total-mib", *map(str, args.total_mib),
         *(["--staging", *args.staging] if args.staging else []),
         *(["--slice-mib", *map(str, args.slice_mib)] if args.slice_mib else []),
         *(["--trace-file", trace_file] if trace_file else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    spans: dict[tuple[int, str], list[tuple[int, int]]] = {}  # (row, staged path) -> its timed rooms' (start, end), ns
    seconds: dict[tuple[int, str], float] = {}  # (row, staged path) -> its timed rooms' transfer seconds
    room = 0
    try:
        for c, (page, total, how) in enumerate(cases(args.page_kib, args.total_mib)):
            src, dst = pages_of(page, total, how, c)
            space = f"p{page >> 10}"
            row: dict[str, Any] = {"page_bytes": page, "request_bytes": total, "pattern": how}
            a, b = tensors[page][: total // 8], torch.empty(total // 8, dtype=torch.int64, device="cuda:0")
            d2d = []
            for path, mgr in managers.items():
                times, latencies = [], []
                both = mgr.transport.windows["both"]
                for rep in range(args.reps + 1):
                    room += 1
                    sender = Sender(mgr, room)
                    sender.wait(Poll.WAITING_FOR_INPUT, 600)
                    metrics.reset()
                    t0 = time.perf_counter_ns()
                    sender.send([], state_indices={space: src}, last=True)
                    sender.wait(Poll.SUCCESS, 600)
                    t1 = time.perf_counter_ns()
                    latency = (t1 - t0) / 1e9
                    if sender.poll() != Poll.SUCCESS:
                        raise RuntimeError(f"{path} page {page} {how}: {sender.failure()}")
                    if rep:  # rep 0 warms up (connections, kernel compilation)
                        times.append(_transfer_seconds(mgr.backend_name))
                        latencies.append(latency)
                        spans.setdefault((c, path), []).append((t0, t1))
                    if path == "fast":  # D2D right after each fast write: both see the GPU in the same state
                        d2d.append(_d2d_seconds(a, b))
                row[f"{path}_GBps"] = total / statistics.median(times) / 1e9
                row[f"{path}_latency_ms"] = statistics.median(latencies) * 1e3
                if path.startswith("plain_"):  # windows staged on both sides, per request
                    row[f"{path}_windows"] = (mgr.transport.windows["both"] - both) // (args.reps + 1)
                    seconds[(c, path)] = sum(times)  # for its trace's rates
            # Raw NIXL: the plain manager's plan, through NIXL's calls (one request, re-posted).
            plain = managers["plain"]
            (peer,) = plain.peers()
            plan = peer.route.plan({space: src}, {space: dst})
            row["descriptors"] = len(plan)
            if args.transfer_backend == "nixl":
                go = raw(plain, plan, mem="VRAM", device=0, peer_device=args.decode_gpu)
                go()
                raw_times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    go()
                    raw_times.append(time.perf_counter() - t0)
                row["raw_nixl_GBps"] = total / statistics.median(raw_times) / 1e9
            row["d2d_GBps"] = total / statistics.median(d2d[1:]) / 1e9
            row["fast_vs_d2d"] = row["fast_GBps"] / row["d2d_GBps"]
            # The method before D2D was interleaved: reps + 1 copies after every path, the first left out.
            after = [_d2d_seconds(a, b) for _ in range(args.reps + 1)]
            row["d2d_after_GBps"] = total / statistics.median(after[1:]) / 1e9
            row["fast_vs_d2d_after"] = row["fast_GBps"] / row["d2d_after_GBps"]
            checked = json.loads(child.stdout.readline())  # type: ignore[union-attr]
            row["verified"] = checked["verified"]
            row["verified_by_path"] = dict(zip(managers, checked["paths"]))
            rows.append(row)
            staged = "".join(f", {p} {row[p + '_GBps']:.1f} ({row[p + '_windows']} windows)" for p in managers
                             if p.startswith("plain_"))
            print(f"{page >> 10}K {total >> 20}Mi {how}: fast {row['fast_GBps']:.1f} GB/s, plain "
                  f"{row['plain_GBps']:.1f}{staged}, D2D {row['d2d_GBps']:.1f}, bytes ok: {row['verified_by_path']}",
                  file=sys.stderr, flush=True)
        if trace_file:  # the child wrote its events once every case was checked
            json.loads(child.stdout.readline())  # type: ignore[union-attr]
            with open(trace_file) as f:
                sides = {"prefill": trace.events(), "decode": json.load(f)}
            for c, row in enumerate(rows):
                for path in managers:
                    if path.startswith("plain_"):
                        found = windows.cycles(sides, spans.get((c, path), []))
                        row[f"{path}_trace"] = windows.summarise(found, seconds[(c, path)],
                                                                 row["request_bytes"] * args.reps,
                                                                 row[f"{path}_windows"] * args.reps)
    finally:
        finish_child(child)
        for m in managers.values():
            m.close()
        for s in servers:
            s.close()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode child's options (the user's come from ``kvbridge bench transfer``'s one parser)."""
    parser.add_argument("--transfer-backend", default="nixl", help="backend of the plain path")
    parser.add_argument("--page-kib", type=int, nargs="+", default=[4, 16, 64, 256, 1024], help="page sizes in KiB")
    parser.add_argument("--total-mib", type=int, nargs="+", default=[64, 1024], help="request sizes in MiB")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per case, after one warm-up (median)")
    parser.add_argument("--decode-gpu", type=int, default=0, help="GPU of the decode process")
    parser.add_argument("--staging", nargs="*", default=[], help="staged plain paths (decode lends GPU slots)")
    parser.add_argument("--slice-mib", type=int, nargs="*", default=None, help="GPU staging slice sizes (MiB)")
    parser.add_argument("--trace-file", help="write this process's window trace here (kvbridge.bench.windows)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--decode", help=argparse.SUPPRESS)


def format_table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a :func:`kvbridge.ui.table` (GB/s = 1e9 bytes/s)."""
    def rate(value: float | None) -> str | None:
        return f"{value:.1f}" if value else None

    staged = [k[:-5] for k in (rows[0] if rows else {}) if k.startswith("plain_") and k.endswith("_GBps")
              and k != "plain_GBps"]
    columns = ["page", "request", "pattern", "desc", "fast GB/s", "plain GB/s",
               *[f"plain {p[6:]} GB/s" for p in staged], *[f"{p[6:]} windows" for p in staged],
               "raw NIXL GB/s", "D2D GB/s", "fast/D2D", "D2D after", "/after", "fast ms", "ok"]
    return ui.table(
        columns,
        [(f"{r['page_bytes'] >> 10}K", f"{r['request_bytes'] >> 20}Mi", r["pattern"], r["descriptors"],
          rate(r["fast_GBps"]), rate(r["plain_GBps"]), *[rate(r[p + "_GBps"]) for p in staged],
          *[r[p + "_windows"] for p in staged], rate(r.get("raw_nixl_GBps")), rate(r["d2d_GBps"]),
          f"{r['fast_vs_d2d']:.2f}", rate(r["d2d_after_GBps"]), f"{r['fast_vs_d2d_after']:.2f}",
          f"{r['fast_latency_ms']:.2f}", r["verified"]) for r in rows],
        right=columns[3:-1], nowrap=["page", "request", "pattern"],
    )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    common.bars(path, "VRAM -> VRAM (GB/s, higher is better)",
                [f"{r['page_bytes'] >> 10}K {r['request_bytes'] >> 20}Mi {r['pattern']}" for r in rows],
                {"fast path": [r["fast_GBps"] for r in rows], "plain": [r["plain_GBps"] for r in rows],
                 **{f"plain, staging {k[6:-5]}": [r[k] for r in rows] for k in rows[0]
                    if k.startswith("plain_") and k.endswith("_GBps") and k != "plain_GBps"},
                 "raw NIXL": [r.get("raw_nixl_GBps") for r in rows], "torch D2D": [r["d2d_GBps"] for r in rows]},
                "GB/s")


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """``kvbridge bench transfer --device cuda`` (``parser``: its one parser), or the decode child (``--decode``)."""
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}.items():
        os.environ.setdefault(key, value)
    if args.decode:
        return run_decode(args)
    prog = "kvbridge bench transfer"
    common.check_plot(args, prog)
    with tempfile.TemporaryDirectory(prefix="kvbridge-windows-") as tmp:
        rows = run(args, os.path.join(tmp, "decode.json") if getattr(args, "trace", False) else None)

    def table() -> Any:
        t = format_table(rows)
        t.title = f"VRAM -> VRAM between two processes, median of {args.reps} (GB/s = 1e9 bytes/s)"
        return t

    status = common.finish(args, prog, rows, table, plot, all(r["verified"] for r in rows))
    if getattr(args, "trace", False):
        windows.print_summaries(args.json, [
            (f"{r['page_bytes'] >> 10}K {r['request_bytes'] >> 20}Mi {r['pattern']}, {k[:-6]}", r[k])
            for r in rows for k in r if k.endswith("_trace") and r[k]["windows"]])
    return status


def main(argv: list[str] | None = None) -> int:
    """The decode child's entry point (``python -m kvbridge.bench.gpu --decode ...``)."""
    parser = argparse.ArgumentParser(prog="python -m kvbridge.bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
