"""The fragmentation axis of ``kvbridge bench transfer --device cpu``: page sizes, TP pairs, staging on and off.

Prefill ranks run in this process, decode ranks in a child process, both on
127.0.0.1, over host memory; each room is timed from ``send`` until every
sender reports SUCCESS (every byte landed and was scattered, metadata row
last). Cases, per page size (``--page-kib``, 4 KiB to 1 MiB) and staging
setting (``--staging``, set on prefill per room: decode lends its slots):

- **scattered** (TP 1 -> 1): whole pages, the destination a permutation;
- **contiguous** (TP 1 -> 1): the same bytes as one block (the reference
  beside every row, and the raw engine call on the same descriptors);
- **head slices, TP 1 -> 2** and **TP 2 -> 1**: token-major (NHD) pages of 16
  token rows and 8 KV heads, every row cut at the TP boundary, pages
  scattered: strided sources gathered (1 -> 2) or strided destinations
  scattered (2 -> 1).

Decode checks every destination byte of the last room of each case against
plain numpy slicing of the source (regenerated from the seed). The raw engine
call is timed for the contiguous case (the same descriptors kvbridge's plan
holds, through the engine's own call).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvbridge.bench import trace, windows
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import KV_PAGE_SPACE, METADATA_SPACE, IndexSpace, KVArgs, Region, Shard
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from kvbridge.core.transfer import writing
from kvbridge.core.transfer.pipeline import in_flight

#: Token rows per page and KV heads: a head slice at TP 2 is 1/32 of a page.
ROWS, HEADS = 16, 8
#: (prefill TP, decode TP, case) run per page size.
GEOMETRIES = [(1, 1, "scattered"), (1, 1, "contiguous"), (1, 2, "head slices, TP 1->2"), (2, 1, "head slices, TP 2->1")]


def kvargs(rank: int, tp: int, page: int, pages: int, kv: np.ndarray, meta: np.ndarray) -> KVArgs:
    """One NHD region of ``pages`` pages (``page`` bytes at TP 1) split by heads, plus a metadata row region."""
    unit = page // (ROWS * HEADS)
    item = ROWS * (HEADS // tp) * unit
    shard = Shard(kind="split", outer=ROWS, totals=(HEADS,), unit_nbytes=unit)
    regions = (Region(name="k0", addr=kv.ctypes.data, nbytes=pages * item, stride=item, role="k",
                      index_space=KV_PAGE_SPACE, layer=0, shard=shard),
               Region(name="meta", addr=meta.ctypes.data, nbytes=meta.nbytes, stride=64, role="metadata",
                      index_space=METADATA_SPACE))
    return KVArgs(regions=regions, index_spaces=(IndexSpace(KV_PAGE_SPACE, pages, ROWS), IndexSpace(METADATA_SPACE, 4)),
                  dtype="bfloat16", page_size=ROWS, tp_rank=rank, tp_size=tp)


def global_pages(pages: int, page: int) -> np.ndarray:
    """The whole model's pages (TP 1 view), as (pages, rows, heads, unit) bytes; deterministic."""
    unit = page // (ROWS * HEADS)
    return np.random.default_rng(page).integers(0, 256, (pages, ROWS, HEADS, unit), dtype=np.uint8)


def rank_pool(g: np.ndarray, rank: int, tp: int) -> np.ndarray:
    """Rank ``rank`` of ``tp``'s share of every page: its heads of every row (plain numpy slicing)."""
    h = HEADS // tp
    return np.ascontiguousarray(g[:, :, rank * h:(rank + 1) * h, :])


def indices(case: str, pages: int) -> tuple[np.ndarray, np.ndarray]:
    """(source pages, destination pages): the destination a permutation unless contiguous."""
    src = np.arange(pages)
    return src, src.copy() if case == "contiguous" else np.random.default_rng(1).permutation(pages)


def schedule(staging: list[str], reps: int) -> Iterator[tuple[str, int]]:
    """(staging, rep) of every room of one geometry, in order; rep 0 is the warm-up. The settings alternate room
    by room, so a load that comes and goes on a shared host weighs on each alike."""
    for rep in range(reps + 1):
        for mode in staging:
            yield mode, rep


def serial(mode: str) -> bool:
    """Whether a staging setting is measured one at a time (``on/1``, ``auto/1``: ``--one-in-flight``)."""
    return mode.endswith("/1")


# A loaded machine may take a while to start the decode ranks of a geometry: generous bootstrap.
CONFIG = SessionConfig(transfer_timeout=120, waiting_timeout=300, heartbeat_timeout=30, sender_grace=300,
                       bootstrap_timeout=120)


def run_decode(backend: str, config: SessionConfig, bootstrap: str, argv: dict[str, Any]) -> int:
    """The decode child of one geometry: every decode rank, every room, then the byte check."""
    page, pages, tp_d, case = argv["page"], argv["pages"], argv["tp_d"], argv["case"]
    if argv.get("trace"):  # --trace: this process's steps of every staged window (kvbridge.bench.windows)
        windows.install()
    # Decode lends its staging slots whatever prefill's setting per room (the default, gather, lends none).
    config = dataclasses.replace(config, staging="on")
    pools = [np.zeros((pages, ROWS, HEADS // tp_d, page // (ROWS * HEADS)), np.uint8) for _ in range(tp_d)]
    metas = [np.zeros((4, 64), np.uint8) for _ in range(tp_d)]
    mgrs = [DecodeManager(kvargs(r, tp_d, page, pages, pools[r], metas[r]), backend, config=config) for r in range(tp_d)]
    src, dst = indices(case, pages)
    ok = True
    try:
        for room, _ in enumerate(schedule(argv["staging"], argv["reps"]), start=1):
            recvs = [Receiver(m, room, bootstrap=bootstrap) for m in mgrs]
            for r in recvs:
                r.init(dst, metadata_row=0)
            for r in recvs:
                if r.wait(Poll.SUCCESS, 300) != Poll.SUCCESS:
                    print(f"decode: room {room}: {r.poll().name} {r.failure()}", file=sys.stderr)
                    ok = False
        g = global_pages(pages, page)
        for r, pool in enumerate(pools):
            if not np.array_equal(pool[dst], rank_pool(g, r, tp_d)[src]):
                print(f"decode rank {r}: {case}: bytes differ from the source", file=sys.stderr)
                ok = False
        if argv.get("trace"):
            with open(argv["trace"], "w") as f:
                json.dump(trace.events(), f)
        print(json.dumps({"verified": ok}), flush=True)
        sys.stdin.readline()  # stay registered while prefill runs the raw-engine loop
    finally:
        for m in mgrs:
            m.close()
    return 0 if ok else 1


def run_geometry(backend: str, config: SessionConfig, page_kib: int, total_mib: int, tp_p: int, tp_d: int, case: str,
                 staging: list[str], reps: int, trace_file: str | None = None) -> list[dict[str, Any]]:
    """One row per staging setting for one (page size, TP pair, case). ``trace_file``: trace
    every staged window's steps in both processes (the child writes its events there); each row gets the
    summary of its timed rooms' windows as ``trace`` (:mod:`kvbridge.bench.windows`)."""
    from kvbridge.bench.common import finish_child
    from kvbridge.bench.transfer import _raw_for

    page = page_kib << 10
    pages = max(ROWS, (total_mib << 20) // page)
    g = global_pages(pages, page)
    pools = [rank_pool(g, r, tp_p) for r in range(tp_p)]
    metas = [np.zeros((4, 64), np.uint8) for _ in range(tp_p)]
    server = BootstrapServer("127.0.0.1")
    mgrs = [PrefillManager(kvargs(r, tp_p, page, pages, pools[r], metas[r]), backend, bootstrap=server.address,
                           config=config) for r in range(tp_p)]
    if trace_file:
        windows.install()
        trace.reset()
    spec = {"page": page, "pages": pages, "tp_p": tp_p, "tp_d": tp_d, "case": case, "staging": staging, "reps": reps,
            "trace": trace_file}
    options = [f"--transfer-option={k}={v}" for k, v in config.backend_options.items()]
    child = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.bench.transfer", "--decode", server.address, "--fragment", json.dumps(spec),
         "--transfer-backend", backend, *options],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    src, dst = indices(case, pages)
    staged_in_flight = writing.STAGED_IN_FLIGHT
    times: dict[str, list[float]] = {m: [] for m in staging}
    counted: dict[str, dict[str, int]] = {}
    spans: dict[str, list[tuple[int, int]]] = {m: [] for m in staging}  # each timed room's (start, end) in ns
    rows: list[dict[str, Any]] = []
    try:
        for room, (mode, rep) in enumerate(schedule(staging, reps), start=1):
            before = [dict(m.transport.windows) for m in mgrs]
            for m in mgrs:
                m.transport.staging_mode = mode.removesuffix("/1")  # decode lends slots whatever this says
                for lane in m.transport.lanes:  # /1: one batch and one staged window in flight (before #29's pipelining)
                    lane.in_flight = 1 if serial(mode) else in_flight(lane.capabilities)
            writing.STAGED_IN_FLIGHT = 1 if serial(mode) else staged_in_flight
            senders = [Sender(m, room, metadata_row=0) for m in mgrs]
            for s in senders:
                s.wait(Poll.WAITING_FOR_INPUT, 600)
            t0 = time.perf_counter_ns()
            for s in senders:
                s.send(src, last=True)
            for s in senders:
                s.wait(Poll.SUCCESS, 600)
            t1 = time.perf_counter_ns()
            elapsed = (t1 - t0) / 1e9
            bad = [s.failure() for s in senders if s.poll() != Poll.SUCCESS]
            if bad:
                raise RuntimeError(f"{case}, staging {mode}: {bad[0]}")
            if rep:
                times[mode].append(elapsed)
                spans[mode].append((t0, t1))
                got = counted.setdefault(mode, {"direct": 0, "gather": 0, "both": 0})
                for m, b in zip(mgrs, before):
                    for k, v in m.transport.windows.items():
                        got[k] += v - b[k]
        raw_gbps = None
        plans = [peer.route.plan({KV_PAGE_SPACE: src}, {KV_PAGE_SPACE: dst}) for m in mgrs for peer in m.peers()]
        raw = _raw_for(backend) if tp_p == tp_d == 1 else None
        if raw is not None:
            go = raw(mgrs[0], plans[0])
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                go()
                samples.append(time.perf_counter() - t0)
            raw_gbps = plans[0].total_bytes / statistics.median(samples) / 1e9
        verified = json.loads(child.stdout.readline())["verified"]  # type: ignore[union-attr]
        moved = sum(p.total_bytes for p in plans)  # every head of every page, whatever the TP pair
        decode_events = []
        if trace_file:
            with open(trace_file) as f:
                decode_events = json.load(f)
        for mode in staging:
            rows.append({"backend": backend, "page_KiB": page_kib, "case": case, "tp": f"{tp_p}->{tp_d}", "staging": mode,
                         "bytes": moved, "descriptors": sum(len(p) for p in plans), "windows": counted.get(mode, {}),
                         "kvbridge_GBps": moved / statistics.median(times[mode]) / 1e9, "raw_engine_GBps": raw_gbps,
                         "verified": verified})
            if trace_file:
                found = windows.cycles({"prefill": trace.events(), "decode": decode_events}, spans[mode])
                rows[-1]["trace"] = windows.summarise(found, sum(times[mode]), moved * len(times[mode]),
                                                      counted.get(mode, {}).get("both", 0))
    finally:
        writing.STAGED_IN_FLIGHT = staged_in_flight
        finish_child(child)
        for m in mgrs:
            m.close()
        server.close()
    return rows


def run(backend: str, config: SessionConfig, page_kib: list[int], total_mib: int, staging: list[str], reps: int,
        tracker: Any = None, trace_dir: str | None = None) -> list[dict[str, Any]]:
    """Every geometry at every page size; each row gets the contiguous case's rate beside it (same staging).
    ``trace_dir``: every row also gets its staged windows' trace (:func:`run_geometry`)."""
    rows: list[dict[str, Any]] = []
    for kib in page_kib:
        for g, (tp_p, tp_d, case) in enumerate(GEOMETRIES):
            traced = os.path.join(trace_dir, f"decode-{kib}-{g}.json") if trace_dir else None
            rows += run_geometry(backend, config, kib, total_mib, tp_p, tp_d, case, staging, reps, traced)
            if tracker is not None:
                tracker.advance()
    for r in rows:
        ref = next(c for c in rows if c["page_KiB"] == r["page_KiB"] and c["case"] == "contiguous"
                   and c["staging"] == r["staging"])
        r["contiguous_GBps"] = ref["kvbridge_GBps"]
        r["vs_contiguous"] = r["kvbridge_GBps"] / ref["kvbridge_GBps"]
    return rows


def format_table(rows: list[dict[str, Any]]) -> Any:
    from kvbridge import ui

    columns = ["page", "case", "staging", "desc", "windows d/g/b", "kvbridge GB/s", "contiguous GB/s", "vs contig",
               "raw GB/s", "bytes ok"]

    def rate(v: float | None) -> str:
        return f"{v:.2f}" if v else "-"
    return ui.table(columns, [
        (f"{r['page_KiB']} KiB", r["case"], r["staging"], r["descriptors"],
         "/".join(str(r["windows"].get(k, 0)) for k in ("direct", "gather", "both")), rate(r["kvbridge_GBps"]),
         rate(r["contiguous_GBps"]), rate(r["vs_contiguous"]), rate(r["raw_engine_GBps"]), r["verified"])
        for r in rows], right=columns[3:9])
