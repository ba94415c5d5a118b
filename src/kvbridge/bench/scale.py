"""Many requests with many in flight: throughput, and memory, fds and threads at start and end.

``kvbridge bench request``'s machinery (prefill here, decode in a child,
both hosts woken by room changes) runs one long cell: 10,000 requests of
16 pages of 4 KiB with 64 in flight, per backend. Both processes' resident
memory, open file descriptors and threads (native ones included, from
``/proc``) are read once both managers are up (engines started, memory
registered; the handshake comes with the first request) and after the
last request: what a long-running server leaks per request shows as the
difference.

    kvbridge bench scale [--backends nixl] [--requests 10000] [--json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any

from kvbridge import ui
from kvbridge.bench import common, request

PAGES, INFLIGHT = 16, 64


def resources(pid: int) -> dict[str, int]:
    """Resident memory (bytes), open fds and threads of process ``pid`` (Linux ``/proc``)."""
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    return {"rss_bytes": int(status["VmRSS"][0]) * 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"][0])}


def run_backend(backend: str, requests: int, tracker: ui.Tracker | None = None) -> dict[str, Any]:
    seen: dict[str, dict[str, dict[str, int]]] = {}

    def snapshot(stage: str, child: subprocess.Popen[str]) -> None:
        seen[stage] = {"prefill": resources(os.getpid()), "decode": resources(child.pid)}

    res = request.run_backend(backend, [request.Cell(PAGES, INFLIGHT, requests)], tracker, snapshot)
    (cell,) = res["cells"]
    out: dict[str, Any] = {"backend": backend, "requests": cell["requests"], "pages": PAGES, "in_flight": INFLIGHT,
                           "requests_per_s": cell["requests_per_s"], "requests_per_s_min": cell["requests_per_s_min"],
                           "requests_per_s_max": cell["requests_per_s_max"], "p50_us": cell["p50_us"],
                           "p99_us": cell["p99_us"], "result": res["result"], "problems": res["problems"]}
    for side in ("prefill", "decode"):
        for key in ("rss_bytes", "fds", "threads"):
            out[f"{side}_{key}_start"] = seen["start"][side][key]
            out[f"{side}_{key}_end"] = seen["end"][side][key]
    return out


def format_table(results: list[dict[str, Any]]) -> Any:
    columns = ["backend", "requests", "requests/s (min-max)", "p50 us", "p99 us", "side", "RSS MiB start -> end",
               "fds", "threads"]
    rows = []
    for r in results:
        for side in ("prefill", "decode"):
            first = side == "prefill"
            rows.append((r["backend"] if first else "", r["requests"] if first else None,
                         f"{r['requests_per_s']:,.0f} ({r['requests_per_s_min']:,.0f}-{r['requests_per_s_max']:,.0f})"
                         if first else None, f"{r['p50_us']:.0f}" if first else None,
                         f"{r['p99_us']:.0f}" if first else None, side,
                         f"{r[f'{side}_rss_bytes_start'] / 2**20:.0f} -> {r[f'{side}_rss_bytes_end'] / 2**20:.0f}",
                         f"{r[f'{side}_fds_start']} -> {r[f'{side}_fds_end']}",
                         f"{r[f'{side}_threads_start']} -> {r[f'{side}_threads_end']}"))
    return ui.table(columns, rows, title=f"{PAGES}-page requests (4 KiB pages), {INFLIGHT} in flight; "
                    "resources once connected and after the last request", right=columns[1:5], nowrap=["backend"])


def plot(results: list[dict[str, Any]], path: str) -> None:
    common.bars(path, f"Requests per second, {PAGES} pages each, {INFLIGHT} in flight (higher is better)",
                [r["backend"] for r in results], {"requests/s": [r["requests_per_s"] for r in results]},
                "requests per second",
                errors={"requests/s": [(r["requests_per_s_min"], r["requests_per_s_max"]) for r in results]})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_output_arguments(parser, "rates per second, sizes in bytes: *_bytes")
    parser.add_argument("--backends", type=request._backends, default=None, metavar="A,B",
                        help="backends to measure, comma-separated (default: every installed one of "
                             + ", ".join(request.ENGINES) + ")")
    parser.add_argument("--requests", type=ui.int_at_least(request.ROUNDS * INFLIGHT), default=10000, metavar="N",
                        help="requests per backend")


def run_from_args(args: argparse.Namespace) -> int:
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    prog = "kvbridge bench scale"
    common.check_plot(args, prog)
    backends = args.backends or request.available(request.ENGINES)
    with ui.progress(len(backends), "backends", description="bench scale") as tracker:
        results = [run_backend(b, args.requests, tracker) for b in backends]
    return common.finish_backends(args, prog, results, lambda: format_table(results), plot)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench scale", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
