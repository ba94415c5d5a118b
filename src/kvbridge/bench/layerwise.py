"""Layer-wise vs per-chunk sending: how much of the transfer hides behind prefill compute.

Prefill runs in this process, decode in a child process, both on 127.0.0.1.
A synthetic model of ``--layers`` layers computes ``--compute-ms`` per layer
(a timed wait: the host thread releases the GIL, as it does while a GPU or a
torch kernel computes) and fills ``--layer-mib`` of scattered 64 KiB KV pages
per layer. Each request is sent two ways, alternating:

- **per chunk**: every layer computed, then ``Sender.send(pages, last=True)``;
- **layer-wise**: ``send(pages, last=True, layerwise=True)`` before computing,
  then ``Sender.layer_ready(layer)`` after each layer.

TTFT is request start (decode's destination lists in) to decode's SUCCESS
(its first token could be computed then), on one monotonic clock; *exposed*
is the part after the last layer was computed: the transfer compute did not
hide. A row is compute-bound when a layer computes longer than it transfers
(measured from the per-chunk send). Targets: compute-bound, layer-wise
exposes <= 20% of what per-chunk exposes; bandwidth-bound, its throughput
(bytes / TTFT) is >= 95% of per-chunk's. Decode checks every byte.

    kvbridge bench layerwise [--transfer-backend NAME] [--compute-ms 0,2,10] [--layers 16]
                             [--layer-mib 2] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench import common
from kvbridge.config import TransferConfig, add_transfer_args
from kvbridge.core.bootstrap import BootstrapServer
from kvbridge.core.layout import IndexSpace, KVArgs, Region
from kvbridge.core.session import KV_PAGE_SPACE, METADATA_SPACE, DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig

PAGE = 64 << 10
CONFIG = SessionConfig(transfer_timeout=120, waiting_timeout=300, heartbeat_timeout=30)
MODES = ("chunk", "layerwise")


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    pages: int  # per layer and request

    @property
    def nbytes(self) -> int:
        return self.layers * self.pages * PAGE


def pools(shape: Shape, fill: bool) -> tuple[list[np.ndarray], KVArgs]:
    """One region per layer of ``2 * pages`` pages (requests use half: room to scatter), plus metadata rows."""
    kv = [np.zeros((2 * shape.pages, PAGE // 8), np.uint64) for _ in range(shape.layers)]
    if fill:
        for layer, arr in enumerate(kv):
            arr[:] = source_bytes(layer, np.arange(arr.shape[0]))
    meta = np.zeros((4, 64), np.uint8)
    regions = [Region(name=f"kv{layer}", addr=a.ctypes.data, nbytes=a.nbytes, stride=PAGE, role="kv",
                      index_space=KV_PAGE_SPACE, layer=layer) for layer, a in enumerate(kv)]
    regions.append(Region(name="meta", addr=meta.ctypes.data, nbytes=meta.nbytes, stride=64, role="metadata",
                          index_space=METADATA_SPACE))
    kv.append(meta)  # kept alive with the pools
    return kv, KVArgs(regions=tuple(regions), dtype="bfloat16", page_size=16,
                      index_spaces=(IndexSpace(KV_PAGE_SPACE, 2 * shape.pages, 16), IndexSpace(METADATA_SPACE, 4)))


def source_bytes(layer: int, pages: np.ndarray) -> np.ndarray:
    words = (np.uint64(layer + 1) << np.uint64(48)) | pages.astype(np.uint64)[:, None]
    return np.broadcast_to(words, (pages.size, PAGE // 8))


def pages_of(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) pages: every other source page, destinations shuffled: nothing coalesces."""
    rng = np.random.default_rng(0)
    return np.arange(shape.pages) * 2, rng.permutation(2 * shape.pages)[:shape.pages]


def compute(seconds: float) -> None:
    """One layer's compute: a timed wait (GIL released)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(left)


# -- decode child ----------------------------------------------------------------------------------
def run_decode(backend: str, config: SessionConfig, bootstrap: str, shape: Shape, rooms: int) -> int:
    kv, args = pools(shape, fill=False)
    mgr = DecodeManager(args, backend, config=config)
    src, dst = pages_of(shape)
    try:
        for room in range(1, rooms + 1):
            for arr in kv[:-1]:
                arr[dst] = 0
            recv = Receiver(mgr, room, bootstrap=bootstrap)
            recv.init(dst, metadata_row=0)
            deadline = time.monotonic() + 300
            while recv.poll() not in (Poll.SUCCESS, Poll.FAILED) and time.monotonic() < deadline:
                time.sleep(0.0001)
            landed = time.monotonic()
            ok = recv.poll() == Poll.SUCCESS and all(
                np.array_equal(arr[dst], source_bytes(layer, src)) for layer, arr in enumerate(kv[:-1]))
            print(json.dumps({"room": room, "success_at": landed, "ok": ok, "failure": recv.failure()}), flush=True)
    finally:
        mgr.close()
    return 0


# -- prefill (this process) ------------------------------------------------------------------------
def request(mgr: PrefillManager, room: int, mode: str, shape: Shape, compute_s: float) -> tuple[float, float]:
    """Compute and send one request; returns (start, end of the last layer's compute)."""
    src, _ = pages_of(shape)
    sender = Sender(mgr, room, metadata_row=0)
    deadline = time.monotonic() + 60
    while sender.poll() < Poll.WAITING_FOR_INPUT and time.monotonic() < deadline:
        time.sleep(0.0001)
    if sender.poll() != Poll.WAITING_FOR_INPUT:
        raise RuntimeError(f"room {room}: decode's request did not arrive: {sender.poll().name} {sender.failure()}")
    t0 = time.monotonic()
    if mode == "layerwise":
        sender.send(src, last=True, layerwise=True)
    for layer in range(shape.layers):
        compute(compute_s)
        if mode == "layerwise":
            sender.layer_ready(layer)
    computed = time.monotonic()
    if mode == "chunk":
        sender.send(src, last=True)
    return t0, computed


def run(backend: str, config: SessionConfig, shape: Shape, compute_ms: list[float], reps: int,
        tracker: ui.Tracker | None = None) -> list[dict[str, Any]]:
    """One row per compute time; times in milliseconds (``*_ms``)."""
    kv, args = pools(shape, fill=True)
    server = BootstrapServer("127.0.0.1")
    mgr = PrefillManager(args, backend, bootstrap=server.address, config=config)
    rooms = len(compute_ms) * (reps + 1) * len(MODES)
    options = [f"--transfer-option={k}={v}" for k, v in config.backend_options.items()]
    child = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.bench.layerwise", "--decode", server.address, "--rooms", str(rooms),
         "--transfer-backend", backend, *options, "--layers", str(shape.layers),
         "--layer-mib", str(shape.pages * PAGE / 2**20)],
        stdout=subprocess.PIPE, text=True,
    )
    rows: list[dict[str, Any]] = []
    room = 0
    try:
        for ms in compute_ms:
            got: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "exposed": []} for m in MODES}
            verified = True
            for rep in range(reps + 1):  # rep 0: untimed warm-up
                for mode in MODES if rep % 2 else MODES[::-1]:  # alternate which goes first
                    room += 1
                    t0, computed = request(mgr, room, mode, shape, ms / 1e3)
                    line = json.loads(child.stdout.readline())  # type: ignore[union-attr]
                    if line["room"] != room or line["failure"]:
                        raise RuntimeError(f"room {room} ({mode}): {line}")
                    verified &= bool(line["ok"])
                    if rep:
                        got[mode]["ttft"].append(line["success_at"] - t0)
                        got[mode]["exposed"].append(max(0.0, line["success_at"] - computed))
            med = {m: {k: statistics.median(v) * 1e3 for k, v in got[m].items()} for m in MODES}
            per_layer_ms = med["chunk"]["exposed"] / shape.layers
            row = {"backend": backend, "layers": shape.layers, "layer_MiB": shape.pages * PAGE / 2**20,
                   "compute_ms": ms, "transfer_ms_per_layer": per_layer_ms,
                   "regime": "compute-bound" if ms > per_layer_ms else "bandwidth-bound",
                   **{f"{k}_{m}_ms": med[m][k] for m in MODES for k in ("ttft", "exposed")}, "verified": verified}
            row["exposed_ratio"] = row["exposed_layerwise_ms"] / row["exposed_chunk_ms"]
            row["ttft_ratio"] = row["ttft_layerwise_ms"] / row["ttft_chunk_ms"]
            row["throughput_ratio"] = row["ttft_chunk_ms"] / row["ttft_layerwise_ms"]  # same bytes: 1/TTFT
            rows.append(row)
            if tracker is not None:
                tracker.advance()
    finally:
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
        mgr.close()
        server.close()
    return rows


def format_table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a :func:`kvbridge.ui.table` (lw: layer-wise; ratios lw / per-chunk)."""
    columns = ["compute/layer", "xfer/layer", "regime", "TTFT chunk", "TTFT lw", "exposed chunk", "exposed lw",
               "exposed ratio", "throughput ratio", "ok"]
    return ui.table(
        columns,
        [(f"{r['compute_ms']:g}", f"{r['transfer_ms_per_layer']:.2f}", r["regime"].replace("-bound", ""),
          f"{r['ttft_chunk_ms']:.1f}", f"{r['ttft_layerwise_ms']:.1f}", f"{r['exposed_chunk_ms']:.1f}",
          f"{r['exposed_layerwise_ms']:.1f}", f"{r['exposed_ratio']:.2f}", f"{r['throughput_ratio']:.2f}",
          r["verified"]) for r in rows],
        right=[c for c in columns if c not in ("regime", "ok")],
    )


def _ms_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, e.g. 0,2,10; got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"milliseconds must be >= 0, got {text!r}")
    return values


def _mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value * 2**20 < PAGE:
        raise argparse.ArgumentTypeError(f"expected MiB per layer, at least one 64 KiB page (0.0625), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_transfer_args(parser)
    parser.add_argument("--compute-ms", type=_ms_list, default=[0.0, 2.0, 10.0], metavar="MS[,MS...]",
                        help="compute per layer, one row each (default: 0,2,10)")
    parser.add_argument("--layers", type=ui.int_at_least(1), default=16, metavar="N", help="layers (default: 16)")
    parser.add_argument("--layer-mib", type=_mib, default=2.0, metavar="MIB",
                        help="KV bytes per layer and request, in MiB of 64 KiB pages (default: 2)")
    parser.add_argument("--reps", type=ui.int_at_least(1), default=5, metavar="N", help="timed requests per mode (median)")
    common.add_output_arguments(parser, "times in milliseconds: *_ms")
    parser.add_argument("--decode", metavar="BOOTSTRAP", help=argparse.SUPPRESS)
    parser.add_argument("--rooms", type=int, default=0, help=argparse.SUPPRESS)


def run_from_args(args: argparse.Namespace) -> int:
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    cfg = TransferConfig.from_args(args, args.command_parser)
    config = dataclasses.replace(CONFIG, backend_options=dict(cfg.backend_options))
    shape = Shape(args.layers, int(args.layer_mib * 2**20) // PAGE)
    if args.decode:
        return run_decode(cfg.backend, config, args.decode, shape, args.rooms)
    prog = "kvbridge bench layerwise"
    common.check_plot(args, prog)
    with ui.progress(len(args.compute_ms), "rows", description=f"bench layerwise ({cfg.backend})") as tracker:
        rows = run(cfg.backend, config, shape, args.compute_ms, args.reps, tracker)

    def table() -> Any:
        t = format_table(rows)
        t.title = (f"{shape.layers} layers x {shape.pages * PAGE / 2**20:g} MiB of scattered 64 KiB pages, prefill -> "
                   f"decode over 127.0.0.1 ({cfg.backend}), median of {args.reps}; ms; lw = layer-wise; "
                   "ratios lw / chunk (exposed: <= 0.20 compute-bound; throughput: >= 0.95 bandwidth-bound)")
        return t

    return common.finish(args, prog, rows, table, plot, ok=all(r["verified"] for r in rows))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    common.bars(path, "Layer-wise vs per-chunk send: transfer exposed after the last layer (ms)",
                [f"{r['compute_ms']:g} ms/layer compute" for r in rows],
                {"per chunk": [r["exposed_chunk_ms"] for r in rows], "layer-wise": [r["exposed_layerwise_ms"] for r in rows]},
                "ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench layerwise", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    parser.set_defaults(command_parser=parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
