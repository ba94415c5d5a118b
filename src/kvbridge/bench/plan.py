"""Plan-building benchmark: kvbridge's vectorised planner vs a per-layer Python loop.

The reference is what existing engines do per request: coalesce runs, then
for every layer buffer and every run append one ``(src, dst, len)`` tuple.
Both produce the same descriptors (checked once per case, untimed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.core.plan import coalesce_runs, plan_pages


@dataclass(frozen=True)
class Case:
    entries: int
    pages: int
    page_nbytes: int
    fragmented: bool

    @property
    def label(self) -> str:
        kind = "fragmented" if self.fragmented else "contiguous"
        return f"{self.entries} x {self.pages} pages x {self.page_nbytes} B, {kind}"


CASES = (
    Case(61, 131072, 1152, True),
    Case(61, 2048, 73728, True),
    Case(160, 2048, 65536, True),
    Case(160, 2048, 65536, False),
)


def make_inputs(case: Case, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Index arrays are int32; fragmented = a sorted quarter of a 4x larger index space."""
    rng = np.random.default_rng(seed)
    space = 4 * case.pages
    if case.fragmented:
        src = np.sort(rng.choice(space, case.pages, replace=False)).astype(np.int32)
        dst = np.sort(rng.choice(space, case.pages, replace=False)).astype(np.int32)
    else:
        src = np.arange(case.pages, dtype=np.int32)
        dst = np.arange(case.pages, dtype=np.int32) + case.pages
    span = space * case.page_nbytes
    src_bases = (1 << 40) + np.arange(case.entries, dtype=np.int64) * span
    dst_bases = (1 << 41) + np.arange(case.entries, dtype=np.int64) * span
    item = np.full(case.entries, case.page_nbytes, dtype=np.int64)
    return src_bases, dst_bases, item, src, dst


def reference_loop(src_bases, dst_bases, item, src_idx, dst_idx) -> tuple[list[int], list[int], list[int]]:
    """The straightforward per-layer Python loop over coalesced runs."""
    starts_s, starts_d, lens = (a.tolist() for a in coalesce_runs(src_idx, dst_idx))
    src: list[int] = []
    dst: list[int] = []
    nbytes: list[int] = []
    for sb, db, it in zip(src_bases.tolist(), dst_bases.tolist(), item.tolist()):
        for s, d, n in zip(starts_s, starts_d, lens):
            src.append(sb + s * it)
            dst.append(db + d * it)
            nbytes.append(n * it)
    return src, dst, nbytes


def _median_ms(fn: Callable[[], Any], reps: int, after_each: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        after_each()
    return statistics.median(times) * 1e3


def run(reps: int = 5, cases: tuple[Case, ...] = CASES, tracker: ui.Tracker | None = None) -> list[dict[str, Any]]:
    """One result per case.

    ``tracker`` counts descriptors built by the Python loop (what takes the
    time), so its ETA holds across cases of very different sizes.
    """
    inputs = [make_inputs(case) for case in cases]
    plans = [plan_pages(*args) for args in inputs]
    # Cheap cases get more repetitions so the median is stable; never fewer than `reps`.
    runs = [max(reps, 5 if len(plan) > 10**5 else 50) for plan in plans]
    bar = tracker if tracker is not None else ui.Tracker(0, "", "", None)
    bar.update(0, total=sum((1 + n) * len(plan) for n, plan in zip(runs, plans)))
    results = []
    for case, args, plan, n in zip(cases, inputs, plans, runs):
        ref = reference_loop(*args)
        bar.advance(len(plan))
        if not (
            np.array_equal(plan.src_addr, ref[0])
            and np.array_equal(plan.dst_addr, ref[1])
            and np.array_equal(plan.nbytes, ref[2])
        ):
            raise AssertionError(f"{case.label}: planner and reference loop disagree")
        kv_ms = _median_ms(lambda: plan_pages(*args), n)
        ref_ms = _median_ms(lambda: reference_loop(*args), n, lambda: bar.advance(len(plan)))
        results.append(
            {
                **asdict(case),
                "case": case.label,
                "descriptors": len(plan),
                "kvbridge_ms": kv_ms,
                "python_loop_ms": ref_ms,
                "speedup": ref_ms / kv_ms,
            }
        )
    return results


def format_table(results: list[dict[str, Any]]) -> Any:
    """The results as a :func:`kvbridge.ui.table`."""
    return ui.table(
        ["case", "descriptors", "kvbridge ms", "py-loop ms", "speedup"],
        [(r["case"], r["descriptors"], f"{r['kvbridge_ms']:.3f}", f"{r['python_loop_ms']:.3f}", f"{r['speedup']:.1f}x")
         for r in results],
        title="Plan building: median wall time per request (numpy planner vs per-layer Python loop)",
        right=["descriptors", "kvbridge ms", "py-loop ms", "speedup"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench plan", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print results as JSON (times in milliseconds: *_ms)")
    parser.add_argument("--reps", type=ui.int_at_least(5), default=5, metavar="N",
                        help="timed repetitions per case, at least 5; cheap cases run at least 50")


def run_from_args(args: argparse.Namespace) -> int:
    with ui.progress(0, "descriptors (Python loop)", description="bench plan") as tracker:
        results = run(reps=args.reps, cases=CASES, tracker=tracker)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        ui.print_table(format_table(results))
    return ui.EXIT_OK
