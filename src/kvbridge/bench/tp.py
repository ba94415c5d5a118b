"""Heterogeneous-TP planning: descriptors and plan time, token-major (NHD) vs head-major (HND) pages.

A GQA model (8 KV heads of 128 bf16 values, 32 layers x K and V = 64
regions, 16-token pages) sends one 4096-token request (256 pages, a sorted
quarter of a 4x larger pool: fragmented). For each (prefill TP -> decode TP)
the plans of every (prefill rank, decode rank) pair are built from routes
computed once at handshake; the table gives descriptors and plan time summed
over the pairs, per layout. With HND a head slice is contiguous inside a
page, so a partial head range costs one descriptor per page; with NHD it is
one per token row of the page.

    kvbridge bench tp [--json] [--plot FILE.png]      (also benchmarks/tp_bench.py)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench import common
from kvbridge.core.layout import IndexSpace, KVArgs, Region, Shard
from kvbridge.core.pairing import pair_layouts

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


def format_table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a :func:`kvbridge.ui.table`."""
    columns = ["TP p->d", "MiB", "NHD desc", "NHD max/pair", "NHD ms", "HND desc", "HND max/pair", "HND ms"]
    return ui.table(
        columns,
        [(f"{r['prefill_tp']}->{r['decode_tp']}", f"{r['bytes'] / 2**20:.0f}", r["nhd_descriptors"], r["nhd_max_per_pair"],
          f"{r['nhd_ms']:.2f}", r["hnd_descriptors"], r["hnd_max_per_pair"], f"{r['hnd_ms']:.2f}") for r in rows],
        title=(f"One {TOKENS}-token request, {HEADS} KV heads x {HEAD_DIM} bf16, {LAYERS} layers, {PAGE}-token pages, "
               "fragmented; summed over all rank pairs"),
        right=columns,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_output_arguments(parser, "times in milliseconds: *_ms")
    parser.add_argument("--reps", type=ui.int_at_least(5), default=5, metavar="N",
                        help="timed repetitions, at least 5 (median, min-max)")


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
    return common.finish(args, prog, rows, lambda: format_table(rows), plot)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench tp", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
