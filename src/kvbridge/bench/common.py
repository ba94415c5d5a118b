"""What every ``kvbridge bench`` part shares: ``--json``, ``--plot FILE.png``, statistics, the plot itself.

Plots need matplotlib, an optional extra (``pip install 'kvbridge[plot]'``).
Without it a part still runs and prints its results; ``--plot`` then says on
stderr that no plot was written and the part exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge import ui

PLOT_HINT = "matplotlib is not installed; `pip install 'kvbridge[plot]'` adds it"


def add_output_arguments(parser: argparse.ArgumentParser, units: str) -> None:
    """``--json`` and ``--plot FILE.png``."""
    parser.add_argument("--json", action="store_true", help=f"print results as one JSON document ({units})")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the results into FILE.png (needs kvbridge[plot])")


def cuda_problem() -> str | None:
    """Why ``--device cuda`` cannot run here (a usage error naming the device), or None."""
    if importlib.util.find_spec("torch") is None:
        return "argument --device: cuda needs PyTorch with CUDA, and torch is not installed"
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"argument --device: cuda was asked for but torch sees no CUDA device (torch {torch.__version__}, "
                f"{build}); use --device cpu here, or run on a host with a GPU")
    return None


def spread(samples: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median, minimum and maximum of ``samples`` (times ``scale``)."""
    return {"median": statistics.median(samples) * scale, "min": min(samples) * scale, "max": max(samples) * scale}


def can_plot() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def check_plot(args: argparse.Namespace, prog: str) -> None:
    """Warn before a long run that ``--plot`` will not be drawn."""
    if getattr(args, "plot", None) and not can_plot():
        print(f"{prog}: warning: --plot {args.plot} will be skipped: {PLOT_HINT}", file=sys.stderr)


def finish(args: argparse.Namespace, prog: str, results: Any, table: Callable[[], Any],
           plot: Callable[[Any, str], None], ok: bool = True) -> int:
    """Print ``results`` (JSON or the table), draw the plot if asked; the exit status."""
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        ui.print_table(table())
    if getattr(args, "plot", None):
        if not can_plot():
            print(f"{prog}: error: no plot written to {args.plot}: {PLOT_HINT}", file=sys.stderr)
            return ui.EXIT_FAILED
        plot(results, args.plot)
        print(f"{prog}: plot written to {args.plot}", file=sys.stderr)
    return ui.EXIT_OK if ok else ui.EXIT_FAILED


def finish_backends(args: argparse.Namespace, prog: str, results: list[dict[str, Any]],
                    table: Callable[[], Any], plot: Callable[[Any, str], None]) -> int:
    """:func:`finish` for per-backend results that each carry ``problems`` and a ``result`` (PASS or not)."""
    for res in results:
        for p in res["problems"][:5]:
            print(f"{prog}: error: {res['backend']}: {p}", file=sys.stderr)
    return finish(args, prog, results, table, plot, all(r["result"] == "PASS" for r in results))


def bars(path: str, title: str, labels: Sequence[str], series: dict[str, Sequence[float | None]], ylabel: str,
         *, log: bool = False, errors: dict[str, Sequence[tuple[float, float]]] | None = None,
         note: str = "") -> None:
    """Grouped horizontal bars, one group per label, one bar per series; ``errors``: (min, max) per bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(series)
    height = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) * max(n, 1) + 1.4), dpi=90)
    for i, (name, values) in enumerate(series.items()):
        ys = [j + i * height for j in range(len(labels))]
        vals = [v if v is not None else 0.0 for v in values]
        xerr = None
        if errors and name in errors:
            lo_hi = errors[name]
            xerr = [[max(v - lo, 0.0) for v, (lo, _) in zip(vals, lo_hi)],
                    [max(hi - v, 0.0) for v, (_, hi) in zip(vals, lo_hi)]]
        ax.barh(ys, vals, height=height, label=name, xerr=xerr, capsize=2)
    ax.set_yticks([j + height * (n - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="best")
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def finish_child(child: subprocess.Popen[str], timeout: float = 120) -> None:
    """Tell the decode child (waiting on stdin) to close, then reap it."""
    if child.stdin:
        child.stdin.write("done\n")
        child.stdin.close()
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
