"""Heterogeneous-TP planning: descriptors and plan time, token-major (NHD) vs head-major (HND) pages.

A GQA model (8 KV heads of 128 bf16 values, 32 layers x K and V = 64
regions, 16-token pages) sends one 4096-token request (256 pages, a sorted
quarter of a 4x larger pool: fragmented). For each (prefill TP -> decode TP)
the plans of every (prefill rank, decode rank) pair are built from routes
computed once at handshake; the table gives descriptors and plan time summed
over the pairs, per layout. With HND a head slice is contiguous inside a
page, so a partial head range costs one descriptor per page; with NHD it is
one per token row of the page.

With ``--transfer-backend NAME`` it also writes the request for real: rank 0
of each prefill TP into rank 0 of each decode TP (in a child process), over
fewer layers (:data:`TRANSFER_LAYERS`), NHD without and with host staging
(``kvbridge.core.transfer.staging``: strided token rows gathered into a registered
buffer, one descriptor per destination run) and HND as the reference; it
gives the descriptors the engine was handed, GB/s (median of ``--reps``
writes) and the staged/direct ratio. Every destination byte is checked
against numpy slicing of the source.

    kvbridge bench tp [--transfer-backend NAME] [--json] [--plot FILE.png]      (also benchmarks/tp_bench.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench import common
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region, Shard
from kvbridge.core.planning.pairing import pair_layouts

HEADS, HEAD_DIM, LAYERS, PAGE, TOKENS = 8, 128, 32, 16, 4096
PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (8, 8), (1, 8), (8, 1)]


def kvargs(rank: int, tp: int, layout: str, pool_pages: int) -> KVArgs:
    local_heads = max(1, HEADS // tp)
    item = PAGE * local_heads * HEAD_DIM * 2
    if layout == "nhd":
        shard = Shard(kind="split", outer=PAGE, totals=(HEADS,), unit_nbytes=HEAD_DIM * 2)
    else:
        shard = Shard(kind="split", outer=1, totals=(HEADS,), unit_nbytes=PAGE * HEAD_DIM * 2)
    base = 1 << 40
    regions = tuple(
        Region(name=f"{role}{layer}", addr=base + (2 * layer + kv) * pool_pages * item, nbytes=pool_pages * item,
               stride=item, role=role, index_space="kv_page", layer=layer, shard=shard)
        for layer in range(LAYERS) for kv, role in enumerate(("k", "v"))
    )
    return KVArgs(regions=regions, index_spaces=(IndexSpace("kv_page", pool_pages, PAGE),), dtype="bfloat16",
                  page_size=PAGE, tp_rank=rank, tp_size=tp)


def run(reps: int = 5, tracker: ui.Tracker | None = None) -> list[dict[str, Any]]:
    """One row per (prefill TP, decode TP) of :data:`PAIRS`; ``tracker`` advances as each ends."""
    pages = TOKENS // PAGE
    rng = np.random.default_rng(0)
    src = np.sort(rng.choice(4 * pages, pages, replace=False)).astype(np.int32)
    dst = np.sort(rng.choice(4 * pages, pages, replace=False)).astype(np.int32)
    rows = []
    for tp_p, tp_d in PAIRS:
        row: dict[str, Any] = {"prefill_tp": tp_p, "decode_tp": tp_d}
        for layout in ("nhd", "hnd"):
            routes = [pair_layouts(kvargs(p, tp_p, layout, 4 * pages), kvargs(d, tp_d, layout, 4 * pages))
                      for p in range(tp_p) for d in range(tp_d)]
            plans = [r.plan({"kv_page": src}, {"kv_page": dst}) for r in routes]
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for r in routes:
                    r.plan({"kv_page": src}, {"kv_page": dst})
                times.append(time.perf_counter() - t0)
            row[f"{layout}_descriptors"] = sum(len(p) for p in plans)
            row[f"{layout}_max_per_pair"] = max(len(p) for p in plans)
            row[f"{layout}_ms"] = statistics.median(times) * 1e3
            row[f"{layout}_min_ms"], row[f"{layout}_max_ms"] = min(times) * 1e3, max(times) * 1e3
            row["bytes"] = sum(p.total_bytes for p in plans)
        rows.append(row)
        if tracker is not None:
            tracker.advance()
    return rows


# -- transfers: rank 0 -> rank 0 through a real engine ----------------------------------------------
TRANSFER_LAYERS = 4  # 8 regions: a 4096-token request is 16 MiB per decode rank at TP 4
TRANSFER_PAIRS = {(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)}


def _pool_shape(tp: int, layout: str, pool_pages: int) -> tuple[int, ...]:
    heads = max(1, HEADS // tp)
    return (pool_pages, PAGE, heads, HEAD_DIM * 2) if layout == "nhd" else (pool_pages, heads, PAGE, HEAD_DIM * 2)


def _kvargs_at(addrs: list[int], tp: int, layout: str, pool_pages: int) -> KVArgs:
    """:func:`kvargs` of rank 0 with :data:`TRANSFER_LAYERS` layers at real addresses."""
    like = kvargs(0, tp, layout, pool_pages)
    regions = tuple(Region(name=r.name, addr=a, nbytes=r.nbytes, stride=r.stride, role=r.role, index_space=r.index_space,
                           layer=r.layer, shard=r.shard) for r, a in zip(like.regions[:2 * TRANSFER_LAYERS], addrs))
    return KVArgs(regions=regions, index_spaces=like.index_spaces, dtype=like.dtype, page_size=PAGE, tp_rank=0, tp_size=tp)


def run_transfers(backend: str, rows: list[dict[str, Any]], reps: int, tracker: ui.Tracker | None = None) -> None:
    """Add transfer columns to the rows of :data:`TRANSFER_PAIRS` (rank 0 -> rank 0 of each)."""
    from kvbridge.core.transfer.transport import open_transport
    from kvbridge.testing.pair import SENTINEL, pattern, start_destination

    pages = TOKENS // PAGE
    pool = 4 * pages
    rng = np.random.default_rng(0)
    src_idx = np.sort(rng.choice(pool, pages, replace=False))
    dst_idx = np.sort(rng.choice(pool, pages, replace=False))
    wanted = [r for r in rows if (r["prefill_tp"], r["decode_tp"]) in TRANSFER_PAIRS]
    # Source pools of every prefill TP (rank 0), registered with two engines: one may stage, one may not.
    sources: dict[tuple[int, str], list[np.ndarray]] = {}
    for tp in sorted({r["prefill_tp"] for r in wanted}):
        for layout in ("nhd", "hnd"):
            nbytes = int(np.prod(_pool_shape(tp, layout, pool)))
            sources[tp, layout] = [pattern(e, nbytes) for e in range(2 * TRANSFER_LAYERS)]
    all_regions = []
    for (tp, layout), bufs in sources.items():
        args = _kvargs_at([b.ctypes.data for b in bufs], tp, layout, pool)
        all_regions += [msgspec_replace(r, name=f"{r.name}-tp{tp}-{layout}") for r in args.regions]
    engines = {}
    for mode in ("direct", "staged"):
        t = open_transport(backend, host="127.0.0.1", name=f"bench-tp-{mode}", transfer_timeout=120.0, options={},
                           fast_path=False)  # host memory: the named backend alone
        t.register(all_regions, sends=mode == "staged")
        engines[mode] = t
    counted = {"n": 0}
    for t in engines.values():
        write = t.backend.write

        def counting(peer: str, batch: Any, deadline: float, write: Any = write) -> None:
            counted["n"] += len(batch)
            write(peer, batch, deadline)
        t.backend.write = counting  # type: ignore[method-assign]
    try:
        for tp_d in sorted({r["decode_tp"] for r in wanted}):
            item = int(np.prod(_pool_shape(tp_d, "nhd", pool)[1:]))
            dest = start_destination(backend, [(f"r{e}", item, pool, "kv_page") for e in range(2 * TRANSFER_LAYERS)],
                                     transfer_timeout=120.0)
            try:
                for mode, t in engines.items():
                    t.add_peer("dest", dest.metadata, dest.regions)
                for row in [r for r in wanted if r["decode_tp"] == tp_d]:
                    tp_p = row["prefill_tp"]
                    for layout, mode in (("nhd", "direct"), ("nhd", "staged"), ("hnd", "direct")):
                        src_args = _kvargs_at([b.ctypes.data for b in sources[tp_p, layout]], tp_p, layout, pool)
                        dst_args = _kvargs_at([r.addr for r in dest.regions], tp_d, layout, pool)
                        plan = pair_layouts(src_args, dst_args).plan({"kv_page": src_idx}, {"kv_page": dst_idx})
                        dest.ask("fill")
                        times, posted = [], []
                        for _ in range(reps):
                            counted["n"] = 0
                            t0 = time.perf_counter()
                            engines[mode].write("dest", plan, time.monotonic() + 120.0)
                            times.append(time.perf_counter() - t0)
                            posted.append(counted["n"])
                        ok = _verify(dest.buffers(), sources[tp_p, layout], tp_p, tp_d, layout, pool, src_idx, dst_idx,
                                     SENTINEL)
                        key = f"{layout}_{mode}" if layout == "nhd" else "hnd"
                        row[f"{key}_engine_descriptors"] = posted[-1]
                        row[f"{key}_GBps"] = plan.total_bytes / statistics.median(times) / 1e9
                        row[f"{key}_min_GBps"] = plan.total_bytes / max(times) / 1e9
                        row[f"{key}_max_GBps"] = plan.total_bytes / min(times) / 1e9
                        row["transfer_bytes"] = plan.total_bytes
                        row["verified"] = row.get("verified", True) and ok
                    row["staged_vs_direct"] = row["nhd_staged_GBps"] / row["nhd_direct_GBps"]
                    row["backend"] = backend
                    if tracker is not None:
                        tracker.advance()
            finally:
                for t in engines.values():
                    t.remove_peer("dest")
                dest.stop()
    finally:
        for t in engines.values():
            t.close()


def msgspec_replace(region: Region, **changes: Any) -> Region:
    import msgspec

    return msgspec.structs.replace(region, **changes)


def _verify(got: list[np.ndarray], src: list[np.ndarray], tp_p: int, tp_d: int, layout: str, pool: int,
            src_idx: np.ndarray, dst_idx: np.ndarray, sentinel: int) -> bool:
    """Destination rank 0's bytes equal the source's shared heads at the written pages, sentinel elsewhere."""
    hp, hd = max(1, HEADS // tp_p), max(1, HEADS // tp_d)
    shared = min(hp, hd)  # rank 0 of each holds heads [0, its count)
    for g, s in zip(got, src):
        s4 = s.reshape(_pool_shape(tp_p, layout, pool))
        want = np.full(_pool_shape(tp_d, layout, pool), sentinel, np.uint8)
        if layout == "nhd":
            want[dst_idx, :, :shared] = s4[src_idx, :, :shared]
        else:
            want[dst_idx, :shared] = s4[src_idx, :shared]
        if not np.array_equal(g.reshape(want.shape), want):
            return False
    return True


def format_table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a :func:`kvbridge.ui.table`."""
    columns = ["TP p->d", "MiB", "NHD desc", "NHD max/pair", "NHD ms", "HND desc", "HND max/pair", "HND ms"]
    moved = any("nhd_staged_GBps" in r for r in rows)
    if moved:
        columns += ["engine desc NHD direct/staged/HND", "GB/s NHD direct", "GB/s NHD staged", "staged/direct", "GB/s HND"]

    def transfer(r: dict[str, Any]) -> tuple[Any, ...]:
        if not moved:
            return ()
        if "nhd_staged_GBps" not in r:
            return ("-",) * 5
        return (f"{r['nhd_direct_engine_descriptors']}/{r['nhd_staged_engine_descriptors']}/{r['hnd_engine_descriptors']}",
                f"{r['nhd_direct_GBps']:.2f}", f"{r['nhd_staged_GBps']:.2f}", f"{r['staged_vs_direct']:.2f}",
                f"{r['hnd_GBps']:.2f}")

    title = (f"One {TOKENS}-token request, {HEADS} KV heads x {HEAD_DIM} bf16, {LAYERS} layers, {PAGE}-token pages, "
             "fragmented; summed over all rank pairs")
    if moved:
        title += (f". Transfers ({rows[0].get('backend') or next(r['backend'] for r in rows if 'backend' in r)}): "
                  f"{TRANSFER_LAYERS} layers, prefill rank 0 -> decode rank 0, median GB/s")
    return ui.table(
        columns,
        [(f"{r['prefill_tp']}->{r['decode_tp']}", f"{r['bytes'] / 2**20:.0f}", r["nhd_descriptors"], r["nhd_max_per_pair"],
          f"{r['nhd_ms']:.2f}", r["hnd_descriptors"], r["hnd_max_per_pair"], f"{r['hnd_ms']:.2f}", *transfer(r)) for r in rows],
        title=title,
        right=columns,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_output_arguments(parser, "times in milliseconds: *_ms")
    parser.add_argument("--reps", type=ui.int_at_least(5), default=5, metavar="N",
                        help="timed repetitions, at least 5 (median, min-max)")
    parser.add_argument("--transfer-backend", metavar="NAME",
                        help="also write each request through this backend (rank 0 -> rank 0): NHD direct, "
                             "NHD with host staging, HND; GB/s and the descriptors the engine was handed")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    common.bars(path, f"Heterogeneous TP: descriptors per {TOKENS}-token request (log scale)",
                [f"TP {r['prefill_tp']}->{r['decode_tp']}" for r in rows],
                {"NHD": [r["nhd_descriptors"] for r in rows], "HND": [r["hnd_descriptors"] for r in rows]},
                "descriptors", log=True)


def run_from_args(args: argparse.Namespace) -> int:
    prog = "kvbridge bench tp"
    common.check_plot(args, prog)
    with ui.progress(len(PAIRS), "TP pairs", description="bench tp") as tracker:
        rows = run(args.reps, tracker)
    if args.transfer_backend:
        for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
            os.environ.setdefault(key, value)
        n = sum((r["prefill_tp"], r["decode_tp"]) in TRANSFER_PAIRS for r in rows)
        with ui.progress(n, "TP pairs", description=f"bench tp transfers ({args.transfer_backend})") as tracker:
            run_transfers(args.transfer_backend, rows, args.reps, tracker)
    ok = all(r.get("verified", True) for r in rows)
    return common.finish(args, prog, rows, lambda: format_table(rows), plot, ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench tp", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
