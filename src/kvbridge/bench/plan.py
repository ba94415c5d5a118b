"""Plan building: kvbridge's planner vs SGLang's plan path, same descriptors, same run.

The reference is SGLang's own per-request plan path (``disaggregation``:
``group_concurrent_contiguous`` in ``common/utils.py``, then the per-layer
``set_transfer_blocks`` loop in ``mooncake/conn.py``'s ``send_kvcache``),
reimplemented here: the paired index lists are split into runs contiguous on
both sides with ``np.split``, each run becomes a Python list, and for every
layer buffer a Python loop appends one ``(src, dst, length)`` tuple per run.
Each layer's list is built and dropped in turn, as SGLang hands it to the
engine layer by layer.

kvbridge is timed twice: ``Route.plan`` (index checks, runs, the plan kept
as region pairs x runs) and the same plus expanding it into the three int64
arrays a backend reads (``expanded``), which is what the speedup uses. Every
case checks, untimed, that both produce the same descriptors in the same
order. The last case (1M tokens) has no reference: the Python loop would
build 57M tuples; it checks the < 100 ms planning target.

    kvbridge bench plan [--json] [--plot FILE.png] [--reps N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench import common
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region
from kvbridge.core.planning.pairing import Route, pair_layouts
from kvbridge.core.planning.plan import merge_contiguous

SPACE = "kv_page"


@dataclass(frozen=True)
class Case:
    entries: int  # layer buffers (MLA: one per layer; MHA: K and V per layer)
    pages: int
    page_nbytes: int
    fragmented: bool
    reference: bool = True  # time SGLang's path too

    @property
    def label(self) -> str:
        kind = "fragmented" if self.fragmented else "contiguous"
        return f"{self.entries} x {self.pages:,} pages x {self.page_nbytes} B, {kind}"


MLA_TOKEN = 1152  # 576 bf16 values: DeepSeek-V3's latent + rope per token
CASES = (
    Case(61, 32768, MLA_TOKEN, True),  # MLA, 32K tokens, page 1
    Case(61, 131072, MLA_TOKEN, True),  # MLA, 128K tokens, page 1
    Case(61, 2048, 64 * MLA_TOKEN, True),  # MLA, 128K tokens, page 64
    Case(160, 2048, 65536, True),  # MHA, 80 layers x K/V
    Case(160, 2048, 65536, False),
    Case(61, 1 << 20, MLA_TOKEN, True, reference=False),  # MLA, 1M tokens, page 1
)


def make_inputs(case: Case, seed: int = 0) -> tuple[Route, np.ndarray, np.ndarray]:
    """The route between two ranks holding ``case``'s buffers, and int32 index lists.

    Fragmented: a sorted quarter of a 4x larger index space on each side.
    Buffers sit at made-up addresses (nothing is written).
    """
    rng = np.random.default_rng(seed)
    space = 4 * case.pages
    if case.fragmented:
        src = np.sort(rng.choice(space, case.pages, replace=False)).astype(np.int32)
        dst = np.sort(rng.choice(space, case.pages, replace=False)).astype(np.int32)
    else:
        src = np.arange(case.pages, dtype=np.int32)
        dst = np.arange(case.pages, dtype=np.int32) + case.pages
    span = space * case.page_nbytes

    def kvargs(base: int) -> KVArgs:
        regions = tuple(Region(name=f"buf{e}", addr=base + e * span, nbytes=span, stride=case.page_nbytes, role="kv",
                               index_space=SPACE, layer=e) for e in range(case.entries))
        return KVArgs(regions=regions, index_spaces=(IndexSpace(SPACE, space, 1),), dtype="bfloat16", page_size=1)

    return pair_layouts(kvargs(1 << 40), kvargs(1 << 44)), src, dst


def _group_concurrent_contiguous(src_indices: np.ndarray, dst_indices: np.ndarray) -> tuple[list[Any], list[Any]]:
    """SGLang's grouping: runs contiguous on both sides, each as a Python list."""
    if src_indices.size == 0:
        return [], []
    brk = np.where((np.diff(src_indices) != 1) | (np.diff(dst_indices) != 1))[0] + 1
    return [g.tolist() for g in np.split(src_indices, brk)], [g.tolist() for g in np.split(dst_indices, brk)]


def sglang_layers(route: Route, src_idx: np.ndarray, dst_idx: np.ndarray) -> Iterator[list[tuple[int, int, int]]]:
    """SGLang's plan path, one layer's ``(src, dst, length)`` list at a time."""
    src_groups, dst_groups = _group_concurrent_contiguous(src_idx, dst_idx)
    (group,) = route.spaces[SPACE].groups
    for src_ptr, dst_ptr, item_len in zip(group.pairs.src_bases.tolist(), group.pairs.dst_bases.tolist(),
                                             group.pairs.src_strides.tolist()):
        blocks = []
        for prefill_run, decode_run in zip(src_groups, dst_groups):
            blocks.append((src_ptr + int(prefill_run[0]) * item_len, dst_ptr + int(decode_run[0]) * item_len,
                           item_len * len(prefill_run)))
        yield blocks


def same_descriptors(route: Route, src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether kvbridge's plan and SGLang's path give the same descriptors, in the same order, layer by
    layer, once kvbridge's are merged where they continue each other (it leaves pages that would merge
    into fewer than one descriptor in 64 unmerged: :data:`kvbridge.core.planning.plan._FEW_RUNS`)."""
    plan = route.plan({SPACE: src}, {SPACE: dst})
    layers = list(sglang_layers(route, src, dst))
    per_layer = len(plan) // max(1, len(layers))
    if per_layer * len(layers) != len(plan):
        return False
    for e, blocks in enumerate(layers):
        ref = np.array(blocks, np.int64).reshape(-1, 3)
        at = e * per_layer
        got = merge_contiguous(plan.src_addr[at:at + per_layer], plan.dst_addr[at:at + per_layer],
                               plan.nbytes[at:at + per_layer])
        if not all(np.array_equal(g, ref[:, i]) for i, g in enumerate((got.src_addr, got.dst_addr, got.nbytes))):
            return False
    return True


def _times(fn: Callable[[], Any], reps: int, after_each: Callable[[], None] = lambda: None) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        after_each()
    return times


def run(reps: int = 5, cases: tuple[Case, ...] = CASES, tracker: ui.Tracker | None = None) -> list[dict[str, Any]]:
    """One result per case (times in ms: median, min, max of ``reps`` or more runs).

    ``tracker`` counts descriptors built by SGLang's Python loop (what takes
    the time), so its ETA holds across cases of very different sizes.
    """
    inputs = [make_inputs(case) for case in cases]
    sizes = [len(route.plan({SPACE: s}, {SPACE: d})) for route, s, d in inputs]
    # Cheap cases get more repetitions so the median is stable; never fewer than `reps`.
    runs = [max(reps, 5 if n > 10**5 else 50) for n in sizes]
    bar = tracker if tracker is not None else ui.Tracker(0, "", "", None)
    bar.update(0, total=sum((1 + r) * n for case, n, r in zip(cases, sizes, runs) if case.reference))
    results = []
    for case, (route, src, dst), n, reps_here in zip(cases, inputs, sizes, runs):
        row: dict[str, Any] = {**asdict(case), "case": case.label, "descriptors": n}

        def plan() -> Any:
            return route.plan({SPACE: src}, {SPACE: dst})

        def expanded() -> None:
            p = plan()
            p.src_addr, p.dst_addr, p.nbytes  # noqa: B018  (expands the plan into arrays)

        def reference() -> None:
            for _blocks in sglang_layers(route, src, dst):
                pass

        lazy = common.spread(_times(plan, reps_here), 1e3)
        full = common.spread(_times(expanded, reps_here), 1e3)
        row.update(kvbridge_plan_ms=lazy["median"], kvbridge_ms=full["median"], kvbridge_min_ms=full["min"],
                   kvbridge_max_ms=full["max"], sglang_ms=None, sglang_min_ms=None, sglang_max_ms=None,
                   speedup=None, identical=None, runs=reps_here)
        if case.reference:
            row["identical"] = same_descriptors(route, src, dst)
            bar.advance(n)
            ref = common.spread(_times(reference, reps_here, lambda: bar.advance(n)), 1e3)
            row.update(sglang_ms=ref["median"], sglang_min_ms=ref["min"], sglang_max_ms=ref["max"],
                       speedup=ref["median"] / full["median"])
        results.append(row)
    return results


def format_table(results: list[dict[str, Any]]) -> Any:
    """The results as a :func:`kvbridge.ui.table`."""
    def ms(r: dict[str, Any], key: str) -> str | None:
        if r[f"{key}_ms"] is None:
            return None
        return f"{r[f'{key}_ms']:.2f} ({r[f'{key}_min_ms']:.2f}-{r[f'{key}_max_ms']:.2f})"

    columns = ["case", "descriptors", "plan ms", "expanded ms (min-max)", "SGLang ms (min-max)", "speedup", "same"]
    return ui.table(
        columns,
        [(r["case"], r["descriptors"], f"{r['kvbridge_plan_ms']:.2f}", ms(r, "kvbridge"), ms(r, "sglang"),
          f"{r['speedup']:.0f}x" if r["speedup"] else None, r["identical"]) for r in results],
        title="Plan building per request, median (min-max): kvbridge (Route.plan, then expanded to arrays) vs "
              "SGLang's group_concurrent_contiguous + per-layer loop",
        right=columns[1:6],
    )


def plot(results: list[dict[str, Any]], path: str) -> None:
    rows = [r for r in results if r["sglang_ms"] is not None]
    common.bars(path, "Plan building per request (ms, log scale; lower is better)", [r["case"] for r in rows],
                {"SGLang plan path": [r["sglang_ms"] for r in rows],
                 "kvbridge, expanded": [r["kvbridge_ms"] for r in rows]},
                "milliseconds", log=True,
                errors={"SGLang plan path": [(r["sglang_min_ms"], r["sglang_max_ms"]) for r in rows],
                        "kvbridge, expanded": [(r["kvbridge_min_ms"], r["kvbridge_max_ms"]) for r in rows]})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_output_arguments(parser, "times in milliseconds: *_ms")
    parser.add_argument("--reps", type=ui.int_at_least(5), default=5, metavar="N",
                        help="timed repetitions per case, at least 5; cheap cases run at least 50")


def run_from_args(args: argparse.Namespace) -> int:
    prog = "kvbridge bench plan"
    common.check_plot(args, prog)
    with ui.progress(0, "descriptors (SGLang loop)", description="bench plan") as tracker:
        results = run(reps=args.reps, cases=CASES, tracker=tracker)
    ok = all(r["identical"] is not False for r in results)
    if not ok:
        import sys

        print(f"{prog}: error: kvbridge and SGLang's path disagree on "
              + ", ".join(r["case"] for r in results if r["identical"] is False), file=sys.stderr)
    return common.finish(args, prog, results, lambda: format_table(results), plot, ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench plan", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
