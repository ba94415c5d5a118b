"""``kvbridge demo``: a prefill and a decode process moving a hybrid model's requests, verified.

The two processes run :mod:`kvbridge.testing.hybrid`: multi-layer KV pools plus
a pool for every built-in state handler (SWA, NSA indexer, Mamba, DeepSeek-V4
compressed caches with HiSparse host rows), draft (MTP) pools and metadata
rows, on as many TP ranks per side as asked. Each request is sent in chunks;
decode checks every byte of every buffer on every rank against the source
computed independently, and reports latency per request and bytes per state
type. The pools are where a real tiny model's caches will plug in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import IO, Any

import msgspec

from kvbridge.config import TransferConfig, add_transfer_args
from kvbridge.testing.hybrid import Spec


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's own flags plus the transfer flags every host server gets (``add_transfer_args``)."""
    parser.add_argument("--prefill-tp", type=int, default=1, choices=(1, 2, 4), help="prefill TP size (default: 1)")
    parser.add_argument("--decode-tp", type=int, default=1, choices=(1, 2, 4), help="decode TP size (default: 1)")
    parser.add_argument("--requests", type=_positive, default=64, help="requests to move (default: 64)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_transfer_args(parser)
    parser.set_defaults(demo_parser=parser)


def run_from_args(args: argparse.Namespace) -> int:
    # Checks the backend and its options together; a problem exits 2 with the usage line.
    cfg = TransferConfig.from_args(args, getattr(args, "demo_parser", None))
    spec = Spec(backend=cfg.backend, backend_options=dict(cfg.backend_options),
                prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, requests=args.requests,
                layout="hnd", draft=True, head_dim=64, pages=512, max_request_pages=24, progress=True,
                timeout=60 + 2.0 * args.requests)
    summary = run(spec, progress=None if args.json else sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 0 if summary["result"] == "PASS" else 1


def run(spec: Spec, progress: IO[str] | None) -> dict[str, Any]:
    text = msgspec.json.encode(spec).decode()
    cmd = [sys.executable, "-m", "kvbridge.testing.hybrid"]
    env = {**os.environ}
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
        env.setdefault(key, value)
    prefill = subprocess.Popen([*cmd, "prefill", "--spec", text], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    decode = None
    decode_result: dict[str, Any] | None = None
    try:
        first = prefill.stdout.readline() if prefill.stdout else ""
        if not first.startswith("BOOTSTRAP "):
            prefill.kill()
            raise SystemExit(f"kvbridge demo: the prefill process did not start:\n{prefill.stderr.read() if prefill.stderr else ''}")
        decode = subprocess.Popen([*cmd, "decode", "--spec", text, "--bootstrap", first.split()[1]],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        bar = _Bar(spec.requests, progress)
        assert decode.stdout is not None
        for line in decode.stdout:  # ends when decode exits; decode bounds its own run by spec.timeout
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:  # an engine writing to stdout: not ours, show it
                sys.stderr.write(line)
                continue
            if "progress" in msg:
                bar.update(msg["progress"], msg["ok"])
            else:
                decode_result = msg
        bar.close()
        decode.wait(30)
        p_out, p_err = prefill.communicate(timeout=60)
        d_err = decode.stderr.read() if decode.stderr else ""
    finally:
        for proc in (prefill, decode):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    prefill_result = json.loads(p_out.splitlines()[-1]) if p_out.strip() else None
    return summarize(spec, prefill_result, decode_result, prefill.returncode, decode.returncode, p_err + d_err)


def summarize(spec: Spec, prefill: dict[str, Any] | None, decode: dict[str, Any] | None, p_rc: int, d_rc: int, logs: str) -> dict[str, Any]:
    problems: list[str] = []
    if p_rc or d_rc:
        problems.append(f"exit codes: prefill {p_rc}, decode {d_rc}")
    if decode is None or prefill is None:
        problems.append("a process ended without a result")
        return {"result": "FAIL", "problems": problems, "log_tail": logs[-3000:]}
    ok = 0
    for room, states in decode["rooms"].items():
        sides = states + prefill["rooms"].get(room, [["MISSING", "no prefill result"]])
        if all(s == "SUCCESS" for s, _ in sides):
            ok += 1
        else:
            problems.append(f"room {room}: " + "; ".join(f"{s} {r or ''}".strip() for s, r in sides if s != "SUCCESS"))
    if decode["mismatches"]:
        problems.append(f"{len(decode['mismatches'])} buffers differ from the source: {decode['mismatches'][:3]}")
    total = sum(decode["bytes_by_state"].values())
    lat = sorted(decode["latency_s"][1:] or decode["latency_s"])  # the first request includes connection set-up
    return {
        "result": "PASS" if not problems else "FAIL",
        "backend": spec.backend,
        "prefill_tp": spec.prefill_tp,
        "decode_tp": spec.decode_tp,
        "requests": len(decode["rooms"]),
        "succeeded": ok,
        "bytes_by_state": decode["bytes_by_state"],
        "bytes": total,
        "seconds": decode["seconds"],
        "gbps": total / decode["seconds"] / 1e9 if decode["seconds"] else 0.0,
        "latency_ms_p50": 1e3 * statistics.median(lat) if lat else None,
        "latency_ms_p99": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "verified": not decode["mismatches"],
        "problems": problems,
    }


def format_summary(s: dict[str, Any]) -> str:
    if "backend" not in s:
        return "FAIL\n" + "\n".join(s["problems"]) + "\n" + s.get("log_tail", "")
    rows = [
        ("backend", f"{s['backend']} (prefill TP {s['prefill_tp']} -> decode TP {s['decode_tp']})"),
        ("requests", f"{s['succeeded']}/{s['requests']} succeeded"),
        *((f"  bytes {state}", f"{n:,}") for state, n in sorted(s["bytes_by_state"].items())),
        ("bytes total", f"{s['bytes']:,} in {s['seconds']:.2f} s"),
        ("throughput", f"{s['gbps']:.3f} GB/s"),
        ("latency p50 / p99", f"{s['latency_ms_p50']:.1f} ms / {s['latency_ms_p99']:.1f} ms"),
        ("every byte verified", "yes" if s["verified"] else "NO"),
        ("result", s["result"]),
    ]
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    out += [f"  problem: {p}" for p in s["problems"]]
    return "\n".join(out)


class _Bar:
    """A progress bar on a terminal; a few milestone lines elsewhere (CI logs)."""

    def __init__(self, total: int, stream: IO[str] | None) -> None:
        self.total, self.stream = total, stream
        self.tty = bool(stream and stream.isatty())
        self.failed = 0
        self.next_mark = 0.25
        self.t0 = time.monotonic()

    def update(self, done: int, ok: bool) -> None:
        self.failed += not ok
        if self.stream is None:
            return
        frac = done / self.total
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        text = f"[{bar}] {done}/{self.total} requests, {self.failed} failed, {time.monotonic() - self.t0:.1f}s"
        if self.tty:
            self.stream.write("\r" + text)
            self.stream.flush()
        elif frac >= self.next_mark or done == self.total:
            self.stream.write(text + "\n")
            while self.next_mark <= frac:
                self.next_mark += 0.25

    def close(self) -> None:
        if self.stream is not None and self.tty:
            self.stream.write("\n")
