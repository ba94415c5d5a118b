"""The ``kvbridge`` command (also ``python -m kvbridge``); its conventions are in ``docs/cli.md``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import kvbridge
from kvbridge import ui
from kvbridge.core.description.plugins import PluginError, get_registry
from kvbridge.config import TransferConfig, add_transfer_args  # noqa: F401  (host servers import these from here)


# -- kvbridge plugins ---------------------------------------------------------------------
def _cmd_plugins(args: argparse.Namespace) -> int:
    registry = get_registry()
    rows = registry.rows()
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no kvbridge plugins installed")
    else:
        tables = [t for t in (_backends_table(rows), _handlers_table(rows), _options_table(rows)) if t.row_count]
        for i, table in enumerate(tables):
            if i:
                print()
            ui.print_table(table)
    # One broken plugin never fails the listing of the others; --strict (a plugin's CI) makes it an error.
    level = "error" if args.strict else "warning"
    for err in registry.errors:
        print(f"kvbridge plugins: {level}: {err} (the other plugins loaded)", file=sys.stderr)
    for dep in registry.deprecations:
        print(f"kvbridge plugins: warning: {dep}", file=sys.stderr)
    return ui.EXIT_FAILED if args.strict and registry.errors else ui.EXIT_OK


def _status(row: dict[str, Any]) -> str:
    if row["available"]:
        return "ok"
    if row.get("extra"):
        return f"needs kvbridge[{row['extra']}]"
    return "needs " + ", ".join(row.get("requires") or ["its engine"])


def _limits(caps: dict[str, Any]) -> str:
    parts = []
    if caps.get("max_descriptors_per_batch"):
        parts.append(f"{caps['max_descriptors_per_batch']} desc/batch")
    if caps.get("max_descriptors_in_flight"):
        parts.append(f"{caps['max_descriptors_in_flight']} in flight")
    if caps.get("max_bytes_per_batch"):
        parts.append(f"{caps['max_bytes_per_batch'] / 2**20:g} MiB/batch")
    return ", ".join(parts)


def _writes(caps: dict[str, Any]) -> str:
    return ", ".join(("one-sided" if caps["one_sided"] else "two-sided",
                      "cross-host" if caps["cross_host"] else "same host"))


def _source(row: dict[str, Any]) -> str:
    """The distribution a registration comes from, with its version."""
    return f"{row['distribution']} {row['version']}" if row.get("version") else str(row["distribution"])


def _backends_table(rows: list[dict[str, Any]]) -> Any:
    return ui.table(
        ["backend", "from", "status", "memory", "limits", "writes"],
        [(r["name"], _source(r), _status(r), r["capabilities"]["memory_kinds"], _limits(r["capabilities"]),
          _writes(r["capabilities"])) for r in rows if r["kind"] == "backend"],
        title=f"Transfer backends (--transfer-backend NAME, or lanes NAME,NAME; default here: {_default_lanes()})",
        nowrap=["backend"],
    )


def _default_lanes() -> str:
    """The lanes a manager gets when it names none, as ``--transfer-backend`` would write them."""
    from kvbridge.core.description.plugins import PluginError, get_registry

    try:
        return ",".join(get_registry().default_lanes())
    except PluginError:
        return "none available"


def _handlers_table(rows: list[dict[str, Any]]) -> Any:
    return ui.table(
        ["state handler", "from", "index spaces", "hetero TP", "layouts", "draft"],
        [(r["name"], _source(r), r["capabilities"]["index_spaces"], r["capabilities"]["hetero_tp"],
          r["capabilities"]["layouts"], r["capabilities"]["draft"]) for r in rows if r["kind"] == "state_handler"],
        title="State handlers", nowrap=["state handler"],
    )


def _options_table(rows: list[dict[str, Any]]) -> Any:
    return ui.table(
        ["backend", "option", "default", "allowed", "help"],
        [(r["name"], o["name"], o["default"], o["allowed"], o["help"])
         for r in rows if r["kind"] == "backend" for o in r.get("options", ())],
        title="Backend options (--transfer-option KEY=VALUE)", nowrap=["backend", "option"],
    )


# -- the other commands, each in its own module ----------------------------------------------
def _lazy(module: str) -> Callable[[argparse.Namespace], int]:
    """``module.run_from_args``, imported when the command runs (``--help`` stays fast)."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).run_from_args(args))

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=kvbridge.__doc__, formatter_class=ui.HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvbridge {kvbridge.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(subparsers: Any, name: str, summary: str, run: Callable[[argparse.Namespace], int],
                add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = subparsers.add_parser(name, help=summary, description=summary[:1].upper() + summary[1:] + ".",
                                                           formatter_class=ui.HelpFormatter)
        if add_arguments is not None:
            add_arguments(p)
        p.set_defaults(func=run, command_parser=p)
        return p

    plugins = command(sub, "plugins", "list installed backends, state handlers and backend options", _cmd_plugins)
    plugins.add_argument("--json", action="store_true", help="print a JSON list of objects, one per registration")
    plugins.add_argument("--strict", action="store_true",
                         help="exit 1 if a plugin did not load (without it, one is reported on stderr and the rest listed)")

    from kvbridge.demo import add_arguments as add_demo_arguments

    command(sub, "demo", "prefill and decode servers of a tiny hybrid model; every token checked against a colocated run",
            _lazy("kvbridge.demo"), add_demo_arguments)

    from kvbridge.testing.runner import add_arguments as add_conformance_arguments

    command(sub, "conformance", "run the backend conformance suite against an installed backend",
            _lazy("kvbridge.testing.runner"), add_conformance_arguments)

    from kvbridge.scaffold import add_arguments as add_scaffold_arguments

    command(sub, "new-backend", "create a backend plugin project: hook, Backend skeleton, conformance test",
            _lazy("kvbridge.scaffold"), add_scaffold_arguments)

    bench = sub.add_parser("bench", help="benchmarks: plan, transfer, tp, request, scale, layerwise, checksum (each with --json)",
                           description="Benchmarks. Each part prints a table (or --json) and can draw "
                                       "--plot FILE.png (needs kvbridge[plot]).",
                           formatter_class=ui.HelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench", metavar="PART", required=True)
    from kvbridge.bench import checksum, layerwise, plan, request, scale, tp, transfer

    command(bench_sub, "plan", "plan building vs SGLang's plan path, same descriptors", _lazy("kvbridge.bench.plan"),
            plan.add_arguments)
    command(bench_sub, "transfer", "bytes between two processes: kvbridge vs raw engine vs memcpy "
            "(--device cuda: VRAM to VRAM, vs raw NIXL and torch D2D)",
            _lazy("kvbridge.bench.transfer"), transfer.add_arguments)
    command(bench_sub, "tp", "heterogeneous-TP plans: descriptors and time, NHD vs HND", _lazy("kvbridge.bench.tp"),
            tp.add_arguments)
    command(bench_sub, "request", "per-request latency and rate of small requests through the whole control plane",
            _lazy("kvbridge.bench.request"), request.add_arguments)
    command(bench_sub, "scale", "many requests in flight: throughput, memory, fds and threads at start and end",
            _lazy("kvbridge.bench.scale"), scale.add_arguments)
    command(bench_sub, "layerwise", "layer-wise vs per-chunk sending: TTFT and the transfer left exposed after compute",
            _lazy("kvbridge.bench.layerwise"), layerwise.add_arguments)
    command(bench_sub, "checksum", "the end-to-end checksum: hash GB/s, and the share of a room's time it adds",
            _lazy("kvbridge.bench.checksum"), checksum.add_arguments)
    return parser


#: Exit statuses of a run stopped by a signal (Ctrl-C, SIGTERM): 128 + the signal.
INTERRUPTED = (130, 143)


def main(argv: list[str] | None = None) -> int:
    """The ``kvbridge`` command; ``argv`` None: this process's arguments (the program itself)."""
    program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    args: argparse.Namespace | None = None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return ui.EXIT_USAGE
        status = int(args.func(args))
    except PluginError as exc:  # unknown backend, missing engine, duplicate plugin: a usage error, no traceback
        assert args is not None
        ui.usage_error(args.command_parser, str(exc))
    except BrokenPipeError:  # stdout closed early (| head): not an error of the command; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as the shell reports a pipe's writer that stopped there
    except KeyboardInterrupt:
        prog = args.command_parser.prog if args is not None and hasattr(args, "command_parser") else "kvbridge"
        print(f"{prog}: interrupted", file=sys.stderr)
        status = 130
    if program and status in INTERRUPTED:
        # Everything the command started is stopped by now. torch, imported (or half imported) when the
        # signal came, can abort the interpreter's own exit ("terminate called without an active
        # exception", status 134): leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
