"""The ``kvbridge`` command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import kvbridge
from kvbridge.core.plugins import PluginError, get_registry
from kvbridge.config import TransferConfig, add_transfer_args, options_table  # noqa: F401  (host servers import these from here)


def _cmd_plugins(args: argparse.Namespace) -> int:
    registry = get_registry()
    rows = registry.rows()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_plugins_table(rows))
        if options_table(rows):
            print("\n" + options_table(rows))
    for err in registry.errors:
        print(f"kvbridge: error: {err}", file=sys.stderr)
    return 1 if registry.errors else 0


def _format_caps(caps: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, (list, tuple)):
            return "+".join(map(str, v))
        return str(v)

    return ", ".join(f"{k}={fmt(v)}" for k, v in caps.items() if v is not None) or "-"


def _plugins_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no kvbridge plugins installed"
    cols = ["name", "kind", "distribution", "version", "status", "capabilities"]
    table = [
        {
            "name": r["name"],
            "kind": r["kind"],
            "distribution": r["distribution"],
            "version": r["version"],
            "status": ("ok" if r.get("available", True) else f"needs kvbridge[{r.get('extra')}]"),
            "capabilities": _format_caps(r["capabilities"]),
        }
        for r in rows
    ]
    widths = {c: max(len(c), *(len(t[c]) for t in table)) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols).rstrip()]
    lines += ["  ".join(t[c].ljust(widths[c]) for c in cols).rstrip() for t in table]
    return "\n".join(lines)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvbridge import demo

    return demo.run_from_args(args)


def _cmd_conformance(args: argparse.Namespace) -> int:
    from kvbridge.testing import runner

    return runner.run_from_args(args)


def _cmd_bench_plan(args: argparse.Namespace) -> int:
    from kvbridge.bench import plan

    return plan.run_from_args(args)


def _bench_transfer(argv: list[str]) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    known, rest = pre.parse_known_args(argv)
    if known.device == "cuda":
        from kvbridge.bench import gpu

        return gpu.main(rest)
    from kvbridge.bench import transfer

    return transfer.main(rest)


def _cmd_bench_tp(args: argparse.Namespace) -> int:
    from kvbridge.bench import tp

    return tp.run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=kvbridge.__doc__)
    parser.add_argument("--version", action="version", version=f"kvbridge {kvbridge.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list installed backends and state handlers")
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.set_defaults(func=_cmd_plugins)

    demo = sub.add_parser("demo", help="prefill and decode processes moving verified requests; ends with a table")
    from kvbridge.demo import add_arguments as add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)

    conformance = sub.add_parser("conformance", help="run the backend conformance suite against an installed backend")
    from kvbridge.testing.runner import add_arguments as add_conformance_arguments

    add_conformance_arguments(conformance)
    conformance.set_defaults(func=_cmd_conformance)

    bench = sub.add_parser("bench", help="run a benchmark")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    bp = bench_sub.add_parser("plan", help="plan building vs a per-layer Python loop")
    from kvbridge.bench.plan import add_arguments

    add_arguments(bp)
    bp.set_defaults(func=_cmd_bench_plan)
    # Parsed by _bench_transfer (its options depend on --device); listed here for help.
    bench_sub.add_parser("transfer", help="bytes between two processes: kvbridge vs raw engine vs memcpy or "
                         "D2D (--device cpu|cuda; `kvbridge bench transfer --device cuda --help`)")
    bt = bench_sub.add_parser("tp", help="heterogeneous-TP plans: descriptors and time, NHD vs HND")
    from kvbridge.bench.tp import add_arguments as add_tp_arguments

    add_tp_arguments(bt)
    bt.set_defaults(func=_cmd_bench_tp)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "transfer"]:
        return _bench_transfer(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except PluginError as exc:  # unknown backend, missing engine, duplicate plugin: no traceback
        print(f"kvbridge: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
