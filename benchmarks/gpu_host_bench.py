"""The same-host GPU path's host work per request, on a machine without a GPU.

``kvbridge bench transfer --device cuda`` measures the cuda_ipc lane end to end on
a GPU; this runs the same requests (one region of 4 KiB pages per page size,
``state_indices`` scattered by a random permutation, one chunk) through the same
managers, lanes and sessions, with the few calls that touch CUDA replaced: the
IPC handles (``ipc.local_metadata``/``open_peer``: an identity mapping) and the
kernel (``kernel.copy``: nothing is copied, the fence checkpoint still runs).
What is left is every host step a request takes from ``send()`` to prefill's
SUCCESS: planning, checks, the worker hand-off, the lane's batching, the
backend's ``factors()``/``hints()``. Decode runs in a child process, as in the
bench. The second lane is a stand-in for NIXL (its capabilities, no engine):
the peer's pairs all go to the first lane, as on the GPU.

    .venv/bin/python benchmarks/gpu_host_bench.py --page-kib 4 64 --total-mib 64 1024 --reps 7

Prints, per case, the median end-to-end ms, the write's ms (core's metrics, as
the bench's GB/s) and the difference in ns per descriptor. ``--profile FILE``
writes a cProfile of every prefill thread during the timed reps.

The kernel's own host work is kept: its launches are split, shaped and their
tables packed (into a host buffer standing in for the pinned one), only the
table copy, the launch and the wait are left out. ``--trace`` also traces both
processes (:mod:`kvbridge.bench.trace`, decode writing its events to a file)
and prints, per case, the whole request step by step from decode's
``Receiver.init`` to its SUCCESS: decode's checks, the request message,
prefill's checks, planning, the write and ``Done``. Not exercised: anything on the GPU. With ``PYTHONPATH`` pointing at an
older checkout's ``src`` it also runs the code before the lanes (where
``kvbridge.core.gpu`` held the fast path), to compare both on one machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from kvbridge import BootstrapServer, DecodeManager, IndexSpace, KVArgs, Poll, PrefillManager, Receiver, Region, Sender
from kvbridge import SessionConfig

try:  # today's layout
    from kvbridge.core.control import metrics
    from kvbridge.core.description.plugins import get_registry
    from kvbridge.plugins.cuda_ipc import ipc as gpu, kernel
    OLD = False
except ImportError:  # before the lanes (344f725)
    from kvbridge.core import metrics  # type: ignore[no-redef]
    from kvbridge.core.plugins import get_registry  # type: ignore[no-redef]
    from kvbridge.core import gpu  # type: ignore[no-redef]
    kernel = gpu
    OLD = True

CONFIG = SessionConfig(transfer_timeout=300, waiting_timeout=600, heartbeat_timeout=60, heartbeat_interval=1,
                       sender_grace=600)


class FakeNet:
    """The lane after cuda_ipc (NIXL's place): registers and takes peers, never writes here."""

    def __new__(cls, config: Any) -> Any:  # a Backend subclass made at import time of either layout
        return _backend_class()(config)


def _backend_class() -> type:
    from kvbridge.core import Backend

    class _Net(Backend):  # type: ignore[misc, valid-type]
        capabilities = get_registry().backends["nixl"].spec.capabilities

        def register(self, regions: Any) -> None:
            pass

        def metadata(self) -> bytes:
            return b"net"

        def add_peer(self, peer: str, metadata: bytes, regions: Any) -> None:
            pass

        def remove_peer(self, peer: str) -> None:
            pass

        def write(self, peer: str, batch: Any, deadline: float) -> None:
            raise AssertionError("the stand-in network lane was given a write: the pairs should all go to cuda_ipc")

        def close(self) -> None:
            pass

    return _Net


def install() -> None:
    """Replace what touches CUDA, and register the stand-in network lane as ``fakenet``."""
    gpu.available = lambda: True
    gpu.local_metadata = lambda regions: b"fake-ipc"
    gpu.open_peer = lambda metadata, device: gpu.GpuPeer(np.array([0], np.int64), np.array([1 << 62], np.int64),
                                                          np.array([0], np.int64))

    def copy(device: int, parts: Any, peer: Any, check: Any = None, hints: Any = None, units: Any = None) -> None:
        """``kernel.copy``'s host work: its launches, each shaped and its table packed, the fence checked between."""
        if OLD:
            if check is not None:
                check()
            return
        from kvbridge.plugins.cuda_ipc import split

        # Columns in units of an item are scaled as the table is packed (older code: columns in bytes).
        work = split.launches(parts, hints, units) if units is not None else [(*w, 1) for w in split.launches(parts, hints)]
        words = sum(3 * (len(p[0]) + len(p[2])) + 1 for p, _, _ in work)
        if not _table or len(_table[0]) < words:  # the pinned buffer's stand-in: allocated once, touched
            _table[:] = [np.ones(max(words, 1 << 16), np.int64)]
        at = 0
        for i, (piece, hint, unit) in enumerate(work):
            if i and check is not None:
                check()
            scaled = (unit,) if unit != 1 else ()
            _, _, end = kernel._pack(piece, split.shape(piece, hint, *scaled), _table[0], at, *scaled)
            at = end + (end & 1)

    kernel.copy = copy
    if not OLD:
        gpu.allocation_count = lambda metadata: 1
        kernel.warm = lambda device, shapes, steps: 0
    reg = get_registry()
    nixl = reg.backends["nixl"]
    reg.backends["fakenet"] = dataclasses.replace(
        nixl, spec=dataclasses.replace(nixl.spec, name="fakenet", factory=f"{__name__}:FakeNet", requires=()))
    if not OLD:
        ipc = reg.backends["cuda_ipc"]
        reg.backends["cuda_ipc"] = dataclasses.replace(ipc, spec=dataclasses.replace(ipc.spec, requires=()))


_table: list[np.ndarray] = []  # the fake copy's table buffer (kernel.copy's pinned one)


def cases(page_kib: list[int], total_mib: list[int]) -> list[tuple[int, int]]:
    return [(p << 10, t << 20) for t in total_mib for p in page_kib]


def pools(page_kib: list[int], total_mib: list[int]) -> tuple[KVArgs, list[np.ndarray]]:
    size = max(total_mib) << 20
    arrays, regions, spaces = [], [], []
    for i, kib in enumerate(page_kib):
        a = np.zeros(size, np.uint8)  # never touched: no page is faulted in
        arrays.append(a)
        regions.append(Region(name=f"p{kib}k", addr=a.ctypes.data, nbytes=size, stride=kib << 10, role="kv",
                              index_space=f"p{kib}", layer=i, mem="vram", device=0))
        spaces.append(IndexSpace(f"p{kib}", size // (kib << 10)))
    return KVArgs(regions=tuple(regions), index_spaces=tuple(spaces), dtype="int64", page_size=1), arrays


def pages(page: int, total: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    n = total // page
    return np.arange(n), np.random.default_rng(seed).permutation(n)


def _trace_steps() -> None:
    """Trace a request's steps (:func:`kvbridge.bench.trace.install`), and a few more of a large one's."""
    from kvbridge.bench import trace
    from kvbridge.core.planning import indices
    from kvbridge.core.sessions import peers

    trace.install()
    trace._wrap(indices, "check_indices", "check_indices")
    trace._wrap(peers.DecodeRequest, "check", "DecodeRequest.check")
    trace._wrap(kernel, "copy", "kernel.copy (host work)")


def run_decode(args: argparse.Namespace) -> None:
    if args.trace_file:
        _trace_steps()
    kvargs, keep = pools(args.page_kib, args.total_mib)
    mgr = DecodeManager(kvargs, "fakenet", config=CONFIG)
    try:
        room = 0
        for c, (page, total) in enumerate(cases(args.page_kib, args.total_mib)):
            _, dst = pages(page, total, c)
            for _ in range(args.reps + 1):
                room += 1
                recv = Receiver(mgr, room, bootstrap=args.decode)
                recv.init([], state_indices={f"p{page >> 10}": dst})
                assert recv.wait(Poll.SUCCESS, 600) == Poll.SUCCESS, recv.failure()
        if args.trace_file:
            from kvbridge.bench import trace

            with open(args.trace_file, "w") as f:
                json.dump(trace.events(), f)
        print("done", flush=True)
        sys.stdin.readline()
    finally:
        mgr.close()


class _Profiles:
    """cProfile of every thread while enabled (threading.setprofile starts one per new thread's first call)."""

    def __init__(self) -> None:
        import cProfile

        self.cls = lambda: cProfile.Profile(time.thread_time)  # CPU time: a shared machine's waits left out
        self.all: list[Any] = []
        self.on = False
        self._local = threading.local()

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or getattr(self._local, "p", None) is not None:
            return
        p = self._local.p = self.cls()
        self.all.append(p)
        sys.setprofile(None)
        p.enable()

    def start(self) -> None:
        self.on = True
        threading.setprofile(self.hook)
        p = self._local.p = self.cls()
        self.all.append(p)
        p.enable()

    def dump(self, path: str) -> None:
        import pstats

        self.on = False
        for p in self.all:
            p.disable()
        stats = pstats.Stats(self.all[0])
        for p in self.all[1:]:
            stats.add(p)
        stats.dump_stats(path)


#: Phases of one request, by when each began (``--phases``): what the host and the peer's worker did.
PHASES = ("send", "hand-off", "before write", "transport.write", "after write", "wake")


def _trace(mgr: Any, marks: dict[str, float]) -> None:
    """Time stamps at the phase boundaries: the worker's chunk write and the transport's write, wrapped."""
    try:
        from kvbridge.core.sessions import sender as module
        name = "write_chunks"
    except ImportError:
        from kvbridge.core import sender as module  # type: ignore[no-redef]
        name = "_write_chunks"
    inner = getattr(module, name)

    def chunks(writes: Any) -> None:
        marks["chunks"] = time.perf_counter()
        try:
            inner(writes)
        finally:
            marks["chunks_end"] = time.perf_counter()

    setattr(module, name, chunks)
    write = mgr.transport.write

    def transport_write(*a: Any, **k: Any) -> None:
        marks["write"] = time.perf_counter()
        try:
            write(*a, **k)
        finally:
            marks["write_end"] = time.perf_counter()

    mgr.transport.write = transport_write


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    install()
    if args.trace:
        _trace_steps()
    prof = _Profiles() if args.profile else None
    if prof is not None:  # before any thread starts: each then profiles itself (set-up included)
        prof.start()
    kvargs, keep = pools(args.page_kib, args.total_mib)
    server = BootstrapServer("127.0.0.1")
    mgr = PrefillManager(kvargs, "fakenet", bootstrap=server.address, config=CONFIG)
    lanes = getattr(mgr.transport, "name", "")
    marks: dict[str, float] = {}
    if args.phases:
        _trace(mgr, marks)
    trace_file = tempfile.NamedTemporaryFile(prefix="kvbridge-trace-", suffix=".json", delete=False).name if args.trace else None
    child = subprocess.Popen([sys.executable, __file__, "--decode", server.address, "--reps", str(args.reps),
                              "--page-kib", *map(str, args.page_kib), "--total-mib", *map(str, args.total_mib),
                              *(["--trace-file", trace_file] if trace_file else [])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    room = 0
    try:
        for c, (page, total) in enumerate(cases(args.page_kib, args.total_mib)):
            src, _ = pages(page, total, c)
            lat, wrote, cpu, phases, faults = [], [], [], [], []
            for rep in range(args.reps + 1):
                room += 1
                sender = Sender(mgr, room)
                assert sender.wait(Poll.WAITING_FOR_INPUT, 600) == Poll.WAITING_FOR_INPUT, sender.failure()
                metrics.reset()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                c0 = time.process_time()
                t0 = time.perf_counter()
                sender.send([], state_indices={f"p{page >> 10}": src}, last=True)
                marks["sent"] = time.perf_counter()
                sender.wait(Poll.SUCCESS, 600)
                t1 = time.perf_counter()
                c1 = time.process_time()
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                assert sender.poll() == Poll.SUCCESS, sender.failure()
                if rep:
                    lat.append(t1 - t0)
                    cpu.append(c1 - c0)
                    faults.append(f1 - f0)
                    if args.phases:
                        at = [t0, marks["sent"], marks["chunks"], marks["write"], marks["write_end"],
                              marks["chunks_end"], t1]
                        phases.append([b - a for a, b in zip(at, at[1:])])
                    snap = metrics.snapshot()["backends"].get(mgr.backend_name, {})
                    wrote.append(float(snap.get("transfer_seconds", {}).get("sum", 0.0)))
            n = total // page
            row = {"page_bytes": page, "request_bytes": total, "descriptors": n, "lanes": lanes,
                   "end_to_end_ms": statistics.median(lat) * 1e3, "write_ms": statistics.median(wrote) * 1e3}
            row["outside_ns_per_descriptor"] = (row["end_to_end_ms"] - row["write_ms"]) * 1e6 / n
            row["end_to_end_ns_per_descriptor"] = row["end_to_end_ms"] * 1e6 / n
            # A shared machine: the fastest rep is the least disturbed one.
            row["cpu_ms"] = statistics.median(cpu) * 1e3  # every prefill thread's, send() to SUCCESS
            # Pages first touched (minor faults), send() to SUCCESS: fresh temporaries of n descriptors each
            # cost their pages' faults, which measured more than the arithmetic on them.
            row["page_faults"] = statistics.median(faults)
            row["best_end_to_end_ms"] = min(lat) * 1e3
            row["best_outside_ns_per_descriptor"] = min(a - b for a, b in zip(lat, wrote)) * 1e9 / n
            if phases:
                row["phases_ms"] = {k: statistics.median(p[i] for p in phases) * 1e3 for i, k in enumerate(PHASES)}
            rows.append(row)
            print(f"{page >> 10}K {total >> 20}Mi scattered ({n} desc): end to end {row['end_to_end_ms']:.2f} ms, "
                  f"write {row['write_ms']:.2f} ms, {row['end_to_end_ns_per_descriptor']:.1f} ns/desc end to end, "
                  f"{row['outside_ns_per_descriptor']:.1f} outside the write (best rep: {row['best_end_to_end_ms']:.2f} ms, "
                  f"{row['best_outside_ns_per_descriptor']:.1f} ns/desc outside); prefill CPU {row['cpu_ms']:.2f} ms, "
                  f"{row['page_faults']:.0f} page faults", file=sys.stderr, flush=True)
            if phases:
                print("    phases (median ms): " + ", ".join(f"{k} {v:.3f}" for k, v in row["phases_ms"].items()),
                      file=sys.stderr, flush=True)
        if prof is not None:
            prof.dump(args.profile)
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        if trace_file:
            with open(trace_file) as f:
                _print_timelines(rows, args.reps, {"prefill": trace_events(), "decode": [tuple(e) for e in json.load(f)]})
    finally:
        if trace_file:
            os.unlink(trace_file)
        if child.stdin is not None:
            child.stdin.close()
        child.wait(60)
        mgr.close()
        server.close()
    return rows


def trace_events() -> list[Any]:
    from kvbridge.bench import trace

    return trace.events()


def _print_timelines(rows: list[dict[str, Any]], reps: int, sides: dict[str, list[Any]]) -> None:
    """Per case, the steps of its timed requests (each from decode's ``Receiver.init`` to the next one's)."""
    from kvbridge.bench import trace

    inits = sorted(e[0] for e in sides["decode"] if e[2] == "Receiver.init >")
    for c, row in enumerate(rows):
        lo = inits[c * (reps + 1)]
        hi = inits[(c + 1) * (reps + 1)] if (c + 1) * (reps + 1) < len(inits) else float("inf")
        # The case's requests, then the next case's first init: the last request ends there.
        part = {side: [e for e in evs if lo <= e[0] < hi or (e[0] == hi and e[2] == "Receiver.init >")]
                for side, evs in sides.items()}
        if hi == float("inf"):
            part["decode"].append((max(e[0] for evs in sides.values() for e in evs) + 1, "MainThread", "Receiver.init >"))
        steps, n = trace.timeline(part, skip=1)
        row["steps"] = steps
        print(f"\n{row['page_bytes'] >> 10}K {row['request_bytes'] >> 20}Mi scattered: median of {n} requests, "
              "us from decode's Receiver.init ('>' entered, '<' returned)", file=sys.stderr)
        for s in steps:
            print(f"  {s['at_us']:9.0f} {s['delta_us']:+8.0f}  {s['side']:7s} {s['thread']:15s} {s['step']}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-kib", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--total-mib", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per case after one warm-up (median)")
    parser.add_argument("--profile", help="write a cProfile of all prefill threads (set-up included) here")
    parser.add_argument("--phases", action="store_true", help="time stamps: where the end-to-end time goes")
    parser.add_argument("--trace", action="store_true",
                        help="trace both processes: every step of a request from decode's Receiver.init, per case")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--decode", help=argparse.SUPPRESS)
    parser.add_argument("--trace-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode:
        install()
        run_decode(args)
        return 0
    rows = run(args)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
