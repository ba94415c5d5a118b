"""Per-request latency and rate of small requests through the whole control plane, per backend.

Prefill runs in this process, decode in a child process, both on 127.0.0.1,
one pair per backend. A request is what a host server does for one room:
decode creates a ``Receiver`` and calls ``init`` (its pages and metadata
row); prefill's host, which created the ``Sender`` ahead (as a host does when
the request reaches it), sees it ready, calls ``send(pages, last=True)``;
decode's host sees SUCCESS (pages and metadata row landed). Both hosts wait
with ``Room.wait`` / ``TransferManager.wait_any`` (woken by the change, no
polling sleeps). Latency is decode's ``init`` to decode's host seeing SUCCESS.

Cells: 1 and 64 pages of 4 KiB (+ a 64-byte metadata row), with 1
(sequential), 8 and 64 requests in flight. In the same run, the references:

- **raw write**: the backend's engine writing one prepared 4 KiB
  descriptor to the same peer with its own calls (``kvbridge.bench.transfer``'s
  raw loops; none for ``memory``);
- **zmq RTT**: a bare pyzmq DEALER -> ROUTER -> DEALER round trip of a
  small message between the same two processes.

``overhead`` is kvbridge's p50 for a 1-page sequential request minus the
raw write's p50. Every request's bytes are checked at decode in the
sequential cells; the concurrent cells check every slot at the end.

    kvbridge bench request [--backends nixl,ucx,...] [--requests N] [--json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from kvbridge import ui
from kvbridge.bench import common, trace
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region
from kvbridge.core.sessions.room import Room
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

PAGE = 4096
META = 64
MAX_INFLIGHT = 64
MAX_PAGES = 64
ROUNDS = 5  # a cell's requests are timed in this many rounds: rate = median (min-max) of the rounds
CONFIG = SessionConfig(transfer_timeout=60, waiting_timeout=120, bootstrap_timeout=120, heartbeat_timeout=30)
ENGINES = ("mooncake", "nixl", "ucx", "memory")


@dataclass(frozen=True)
class Cell:
    pages: int
    inflight: int
    requests: int

    @property
    def label(self) -> str:
        return f"{self.pages} page{'s' * (self.pages > 1)}, {self.inflight} in flight"


def cells(requests: int) -> list[Cell]:
    return [Cell(p, c, requests) for p in (1, 64) for c in (1, 8, 64)]


def encode_cells(cs: Sequence[Cell]) -> str:
    return ",".join(f"{c.pages}:{c.inflight}:{c.requests}" for c in cs)


def decode_cells(text: str) -> list[Cell]:
    return [Cell(*map(int, part.split(":"))) for part in text.split(",")]


def pools(fill: bool) -> tuple[np.ndarray, np.ndarray, KVArgs]:
    """A 4 KiB-page KV pool (one slot of 64 pages per request in flight) and a metadata pool."""
    pages = MAX_INFLIGHT * MAX_PAGES
    kv = np.zeros((pages, PAGE), np.uint8)
    meta = np.zeros((MAX_INFLIGHT, META), np.uint8)
    if fill:
        kv[:] = source_pages(np.arange(pages))
        meta[:] = np.arange(1, META + 1, dtype=np.uint8)
    regions = (Region(name="kv", addr=kv.ctypes.data, nbytes=kv.nbytes, stride=PAGE, role="kv",
                      index_space=KV_PAGE_SPACE, layer=0),
               Region(name="meta", addr=meta.ctypes.data, nbytes=meta.nbytes, stride=META, role="metadata",
                      index_space=METADATA_SPACE))
    args = KVArgs(regions=regions, index_spaces=(IndexSpace(KV_PAGE_SPACE, pages, 16), IndexSpace(METADATA_SPACE, MAX_INFLIGHT)),
                  dtype="bfloat16", page_size=16)
    return kv, meta, args


def source_pages(pages: np.ndarray) -> np.ndarray:
    # Each page's bytes name the page (low and high byte of its number, then a running count).
    p = pages.astype(np.uint32)[:, None]
    return ((p * 131 + np.arange(PAGE, dtype=np.uint32)[None, :] * 7 + (p >> 8)) & 0xFF).astype(np.uint8)


def room_id(cell: int, i: int) -> int:
    return (cell + 1) * 10**7 + i


def src_pages(cell: Cell, i: int) -> np.ndarray:
    # Spread over the source pool so consecutive requests read different pages.
    start = (i * 61) % (MAX_INFLIGHT * MAX_PAGES - cell.pages)
    return np.arange(start, start + cell.pages)


def dst_pages(cell: Cell, i: int) -> np.ndarray:
    slot = i % cell.inflight
    return np.arange(slot * MAX_PAGES, slot * MAX_PAGES + cell.pages)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


# -- decode child ------------------------------------------------------------------------------
def _echo(ctx: zmq.Context[Any], sock: zmq.Socket[Any], stop: threading.Event) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            sock.send_multipart(sock.recv_multipart())


def run_decode(backend: str, bootstrap: str, cell_list: list[Cell], trace_file: str | None = None) -> int:
    kv, meta, args = pools(fill=False)
    if trace_file:
        trace.install()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    echo = ctx.socket(zmq.ROUTER)
    port = echo.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    threading.Thread(target=_echo, args=(ctx, echo, stop), daemon=True).start()
    mgr = DecodeManager(args, backend, config=CONFIG)
    print(json.dumps({"echo": f"tcp://127.0.0.1:{port}"}), flush=True)  # up: engine started, memory registered
    src_kv, src_meta, _ = pools(fill=True)
    ok = True
    try:
        for c, cell in enumerate(cell_list):
            lat, problems, elapsed = _decode_cell(mgr, bootstrap, c, cell, kv, meta, src_kv, src_meta)
            ok = ok and not problems
            print(json.dumps({"cell": c, "latency_s": lat, "round_s": elapsed, "problems": problems[:5]}), flush=True)
        sys.stdin.readline()  # stay up while prefill measures the references
        if trace_file:
            with open(trace_file, "w") as f:
                json.dump(trace.events(), f)
    finally:
        stop.set()
        mgr.close()
    return 0 if ok else 1


def _decode_cell(mgr: DecodeManager, bootstrap: str, c: int, cell: Cell, kv: np.ndarray, meta: np.ndarray, src_kv: np.ndarray,
                 src_meta: np.ndarray) -> tuple[list[float], list[str], list[float]]:
    lat: list[float] = []
    problems: list[str] = []
    rounds = [cell.requests * k // ROUNDS for k in range(ROUNDS + 1)]
    elapsed: list[float] = []
    for r in range(ROUNDS):
        live: dict[int, tuple[Receiver, float, int]] = {}
        nxt, end = rounds[r], rounds[r + 1]
        t_round = time.perf_counter()
        while nxt < end or live:
            while nxt < end and len(live) < cell.inflight:
                dst = dst_pages(cell, nxt)
                if cell.inflight == 1:  # sequential: every request's bytes are checked
                    kv[dst] = 0
                    meta[nxt % cell.inflight] = 0
                recv = Receiver(mgr, room_id(c, nxt), bootstrap=bootstrap)
                t0 = time.perf_counter()
                recv.init(dst, metadata_row=nxt % cell.inflight)
                live[recv.room] = (recv, t0, nxt)
                nxt += 1
            if cell.inflight == 1:
                (recv, t0, i), = live.values()
                recv.wait(Poll.SUCCESS, 60)
            else:
                mgr.wait_any([v[0] for v in live.values()], 60)
            now = time.perf_counter()
            for room, (recv, t0, i) in list(live.items()):
                state = recv.poll()
                if state == Poll.SUCCESS:
                    lat.append(now - t0)
                    del live[room]
                    if cell.inflight == 1:
                        problems += _check(kv, meta, src_kv, src_meta, cell, i)
                elif state == Poll.FAILED:
                    problems.append(f"room {room}: {recv.failure()}")
                    del live[room]
                elif now - t0 > 60:
                    problems.append(f"room {room}: still {state.name} after 60 s")
                    recv.abort("benchmark gave up")
                    del live[room]
        elapsed.append(time.perf_counter() - t_round)
    if cell.inflight > 1:  # the last request of every slot
        for i in range(max(0, cell.requests - cell.inflight), cell.requests):
            problems += _check(kv, meta, src_kv, src_meta, cell, i)
    return lat, problems, elapsed


def _check(kv: np.ndarray, meta: np.ndarray, src_kv: np.ndarray, src_meta: np.ndarray, cell: Cell, i: int) -> list[str]:
    out = []
    if not np.array_equal(kv[dst_pages(cell, i)], src_kv[src_pages(cell, i)]):
        out.append(f"request {i}: pages differ from the source")
    if not np.array_equal(meta[i % cell.inflight], src_meta[0]):
        out.append(f"request {i}: metadata row differs from the source")
    return out


# -- prefill (this process) --------------------------------------------------------------------
def serve_cell(mgr: PrefillManager, c: int, cell: Cell, deadline: float) -> list[str]:
    """The prefill host for one cell: senders created ahead, each sent as soon as decode's request is in."""
    problems: list[str] = []
    window = 2 * cell.inflight
    live: dict[int, tuple[Sender, int]] = {}
    seen: dict[Room, Poll] = {}  # the state each sender had when this host last acted on it
    created = done = 0
    while done < cell.requests and time.monotonic() < deadline:
        while created < cell.requests and len(live) < window:
            s = Sender(mgr, room_id(c, created), metadata_row=0)
            live[s.room] = (s, created)
            seen[s] = Poll.BOOTSTRAPPING
            created += 1
        mgr.wait_any(list(seen), 1.0, seen)
        for room, (s, i) in list(live.items()):
            state = s.poll()
            if state == Poll.WAITING_FOR_INPUT:
                s.send(src_pages(cell, i), last=True)
                state = s.poll()
            if state in (Poll.SUCCESS, Poll.FAILED):
                if state == Poll.FAILED:
                    problems.append(f"prefill room {room}: {s.failure()}")
                del live[room], seen[s]
                done += 1
            else:
                seen[s] = state
    if done < cell.requests:
        problems.append(f"prefill served {done} of {cell.requests} requests before the deadline")
    return problems


def zmq_rtt(address: str, n: int = 2000) -> list[float]:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    payload = b"x" * 64
    out = []
    try:
        for _ in range(n + 50):
            t0 = time.perf_counter()
            sock.send(payload)
            if not sock.poll(5000):
                raise RuntimeError("zmq echo did not answer within 5 s")
            sock.recv()
            out.append(time.perf_counter() - t0)
    finally:
        sock.close()
    return out[50:]


def raw_write(mgr: PrefillManager, backend: str, n: int = 2000) -> list[float] | None:
    from kvbridge.bench.transfer import _raw_for

    raw = _raw_for(backend)
    if raw is None:
        return None
    (peer,) = mgr.peers()
    plan = peer.route.plan({KV_PAGE_SPACE: [0]}, {KV_PAGE_SPACE: [0]})  # one 4 KiB descriptor
    go = raw(mgr, plan)
    out = []
    for _ in range(n + 50):
        t0 = time.perf_counter()
        go()
        out.append(time.perf_counter() - t0)
    return out[50:]


def run_backend(backend: str, cell_list: list[Cell], tracker: ui.Tracker | None = None,
                between: Callable[[str, subprocess.Popen[str]], None] | None = None,
                trace_file: str | None = None) -> dict[str, Any]:
    """Every cell on ``backend``, then the references; one result.

    ``between(stage, child)`` runs at "start" (connected, before the first cell) and "end" (after the last).
    ``trace_file``: trace every step in both processes (:mod:`kvbridge.bench.trace`; the child writes its
    events there) and add the timeline to the result as ``trace``.
    """
    kv, meta, args = pools(fill=True)
    server = BootstrapServer("127.0.0.1")
    mgr = PrefillManager(args, backend, bootstrap=server.address, config=CONFIG)
    if trace_file:
        trace.install(type(mgr.transport.backend))
    child = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.bench.request", "--decode", server.address, "--backends", backend,
         "--cells", encode_cells(cell_list), *(["--trace-file", trace_file] if trace_file else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    rows = []
    cold: dict[str, float] = {}
    problems: list[str] = []
    try:
        assert child.stdout is not None
        echo = json.loads(child.stdout.readline())["echo"]
        if between is not None:
            between("start", child)
        for c, cell in enumerate(cell_list):
            problems += serve_cell(mgr, c, cell, time.monotonic() + 600)
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"decode child for {backend} ended early")
            got = json.loads(line)
            lat_us = [x * 1e6 for x in got["latency_s"]]
            rates = [(cell.requests / ROUNDS) / t for t in got["round_s"]]
            problems += got["problems"]
            if c == 0:  # the first request pays for the handshake; the second is the first after it
                cold = {"first_us": lat_us[0], "second_us": lat_us[1]}
            rows.append({"case": cell.label, "pages": cell.pages, "in_flight": cell.inflight, "requests": len(lat_us),
                         "bytes": cell.pages * PAGE + META, "p50_us": percentile(lat_us, 50),
                         "p99_us": percentile(lat_us, 99), "requests_per_s": statistics.median(rates),
                         "requests_per_s_min": min(rates), "requests_per_s_max": max(rates)})
            if tracker is not None:
                tracker.advance()
        if between is not None:
            between("end", child)
        rtt = [x * 1e6 for x in zmq_rtt(echo)]
        raw = raw_write(mgr, backend)
        raw_us = [x * 1e6 for x in raw] if raw is not None else None
    finally:
        common.finish_child(child)
        mgr.close()
        server.close()
    if child.returncode not in (0, None):
        problems.append(f"decode child exited with status {child.returncode}")
    timeline: tuple[list[dict[str, Any]], int] = ([], 0)
    if trace_file and child.returncode == 0:
        with open(trace_file) as f:
            timeline = trace.timeline({"prefill": trace.events(), "decode": [tuple(e) for e in json.load(f)]})
    seq1 = next((r for r in rows if r["pages"] == 1 and r["in_flight"] == 1), None)
    raw_p50 = percentile(raw_us, 50) if raw_us else None
    return {
        "backend": backend,
        "cells": rows,
        "zmq_rtt_p50_us": percentile(rtt, 50),
        "zmq_rtt_p99_us": percentile(rtt, 99),
        "raw_write_p50_us": raw_p50,
        "raw_write_p99_us": percentile(raw_us, 99) if raw_us else None,
        "overhead_p50_us": seq1["p50_us"] - raw_p50 if seq1 and raw_p50 is not None else None,
        **cold,
        "result": "FAIL" if problems else "PASS",
        "problems": problems,
        **({"trace": timeline[0], "traced_requests": timeline[1]} if trace_file else {}),
    }


def format_table(results: list[dict[str, Any]]) -> Any:
    columns = ["backend", "case", "p50 us", "p99 us", "requests/s (min-max)", "raw write p50 us", "zmq RTT p50 us",
               "overhead p50 us", "1st / 2nd us"]
    rows = []
    for res in results:
        for i, r in enumerate(res["cells"]):
            first = i == 0
            rows.append((res["backend"] if first else "", r["case"], f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}",
                         f"{r['requests_per_s']:,.0f} ({r['requests_per_s_min']:,.0f}-{r['requests_per_s_max']:,.0f})",
                         f"{res['raw_write_p50_us']:.1f}" if first and res["raw_write_p50_us"] else None,
                         f"{res['zmq_rtt_p50_us']:.0f}" if first else None,
                         f"{res['overhead_p50_us']:.0f}" if first and res["overhead_p50_us"] is not None else None,
                         f"{res['first_us']:,.0f} / {res['second_us']:,.0f}" if first and "first_us" in res else None))
    return ui.table(columns, rows, title="Small requests through the whole control plane (4 KiB pages + 64 B metadata "
                    "row); overhead = 1-page sequential p50 - raw write p50; 1st / 2nd: the first request (it pays for the "
                    "handshake) and the second (the first after it), 1-page sequential", right=columns[2:], nowrap=["backend"])


def plot(results: list[dict[str, Any]], path: str) -> None:
    labels = [f"{res['backend']}: {r['case']}" for res in results for r in res["cells"]]
    common.bars(path, "Per-request latency, small requests (us, log scale)", labels,
                {"p50": [r["p50_us"] for res in results for r in res["cells"]],
                 "p99": [r["p99_us"] for res in results for r in res["cells"]]}, "microseconds", log=True)


def available(names: Sequence[str]) -> list[str]:
    from kvbridge.config import available_backends

    have = set(available_backends()) | {"memory"}
    return [n for n in names if n in have]


def _backends(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    from kvbridge.core.description.plugins import get_registry

    known = set(get_registry().backends)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {', '.join(bad) or '(none)'}; installed: "
                                         f"{', '.join(sorted(known))}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_output_arguments(parser, "latencies in microseconds: *_us")
    parser.add_argument("--backends", type=_backends, default=None, metavar="A,B",
                        help="backends to measure, comma-separated (default: every installed one of "
                             + ", ".join(ENGINES) + ")")
    parser.add_argument("--requests", type=ui.int_at_least(ROUNDS * MAX_INFLIGHT), default=1000, metavar="N",
                        help=f"requests per cell, at least {ROUNDS * MAX_INFLIGHT} (timed in {ROUNDS} rounds)")
    parser.add_argument("--trace", action="store_true",
                        help="instead of the cells: time every step of 1-page sequential requests in both processes "
                             "and print where a request's time goes (kvbridge.bench.trace)")
    parser.add_argument("--decode", metavar="BOOTSTRAP", help=argparse.SUPPRESS)
    parser.add_argument("--trace-file", help=argparse.SUPPRESS)
    parser.add_argument("--cells", help=argparse.SUPPRESS)


def run_from_args(args: argparse.Namespace) -> int:
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    cell_list = decode_cells(args.cells) if args.cells else cells(args.requests)
    if args.decode:
        return run_decode(args.backends[0], args.decode, cell_list, args.trace_file)
    prog = "kvbridge bench request"
    backends = args.backends or available(ENGINES)
    if args.trace:
        return run_trace(args, prog, backends)
    common.check_plot(args, prog)
    results = []
    with ui.progress(len(cell_list) * len(backends), "cells", description="bench request") as tracker:
        for backend in backends:
            results.append(run_backend(backend, cell_list, tracker))
    return common.finish_backends(args, prog, results, lambda: format_table(results), plot)


def run_trace(args: argparse.Namespace, prog: str, backends: Sequence[str]) -> int:
    """``--trace``: the 1-page sequential cell per backend, traced; a timeline per backend."""
    if args.plot:
        raise SystemExit(f"{prog}: --trace prints a timeline; it has no plot")
    cell = Cell(1, 1, args.requests)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-trace-") as tmp, \
            ui.progress(len(backends), "backends", description="bench request --trace") as tracker:
        for backend in backends:
            results.append(run_backend(backend, [cell], trace_file=os.path.join(tmp, f"{backend}.json")))
            trace.reset()
            tracker.advance()
    ok = all(r["result"] == "PASS" for r in results)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if r["trace"]:
                ui.print_table(trace.format_timeline(r["backend"], r["trace"], r["traced_requests"]))
            print(f"{r['backend']}: p50 {r['cells'][0]['p50_us']:.0f} us traced; {r['result']} {'; '.join(r['problems'][:3])}")
    return ui.EXIT_OK if ok else ui.EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench request", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
