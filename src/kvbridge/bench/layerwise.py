"""Layer-wise vs per-chunk sending: how much of the transfer hides behind prefill compute.

Prefill runs in this process, decode in a child process, both on 127.0.0.1.
Two models:

- **synthetic** (the default): ``--layers`` layers each computing
  ``--compute-ms`` and filling ``--layer-mib`` of scattered 64 KiB KV pages.
  On CPU a layer is a timed wait (the host thread releases the GIL, as it
  does while a GPU or a torch kernel computes). With ``--device cuda`` the
  pools are CUDA tensors and a layer is a GPU sleep kernel then a copy that
  writes the layer's pages, on a side stream; layer-wise sending passes
  ``ready=`` a ``torch.cuda.Event`` recorded after them (the source is zeroed
  before each request, so a transfer that did not wait would be caught);
- **tiny**: the demo's tiny hybrid model (``kvbridge.demo``, every state
  type), one request of ``--prompt-tokens`` tokens prefilled in chunks of
  ``--chunk-size``, its layers announced as the model writes them.

Each request is sent two ways, the two in alternating order, one pair per
repetition:

- **per chunk**: every layer of a chunk computed, then ``Sender.send``;
- **layer-wise**: ``send(..., layerwise=True)`` before computing the chunk,
  then ``Sender.layer_ready`` after each layer (the metadata row filled
  before the last).

TTFT is request start (decode's destination lists in) to decode's SUCCESS
(its first token could be computed then), on one monotonic clock; *exposed*
is the part after the last layer was computed: the transfer compute did not
hide. A row is compute-bound when a layer computes longer than it transfers
(measured from the per-chunk send). Targets: compute-bound, layer-wise
exposes <= 20% of what per-chunk exposes; bandwidth-bound, its throughput
(bytes / TTFT) is >= 95% of per-chunk's. Throughput is compared pair by
pair (the two runs of a repetition ran back to back): the table gives the
median ratio and its interquartile range, and says ``yes`` when even the
lower quartile meets the target, ``no`` when even the upper one misses it,
``noise`` otherwise (run more ``--reps``). ``writes lw`` counts prefill's
writes per layer-wise request (a per-chunk send makes one per chunk; the
metadata row, 64 bytes in host memory, travels inside ``Done``; fewer than
layers: layers coalesced), and ``write cost`` is what one write to decode
costs whatever its size (the peer's measured fixed cost, which layer-wise
sending weighs against waiting for the next layer). ``Done`` stays exposed
after the last layer whatever the sending order, so a ``Done`` near 20% of
the per-chunk exposed time puts the target out of reach. ``lw writes+Done``
splits layer-wise's exposed time into prefill's writes after the last layer
and the ``Done`` message (with the row) to decode's SUCCESS (medians, so
they need not add up).
Decode checks every byte
(synthetic) or decodes a few tokens from what arrived and compares them
with a colocated run of the model (tiny).

    kvbridge bench layerwise [--transfer-backend NAME] [--compute-ms 0,2,10] [--layers 16]
                             [--layer-mib 2] [--reps 11] [--device cpu|cuda] [--json]
    kvbridge bench layerwise --model tiny [--prompt-tokens 64,256] [--chunk-size 64]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench import common
from kvbridge.config import TransferConfig, add_transfer_args
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region
from kvbridge.core.sessions.session import KV_PAGE_SPACE, METADATA_SPACE, DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig

PAGE = 64 << 10
CONFIG = SessionConfig(transfer_timeout=120, waiting_timeout=300, heartbeat_timeout=30)
MODES = ("chunk", "layerwise")
TINY_NEW_TOKENS = 4  # tokens decode generates from what arrived, to check it (tiny model)


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    pages: int  # per layer and request

    @property
    def nbytes(self) -> int:
        return self.layers * self.pages * PAGE


def source_bytes(layer: int, pages: np.ndarray) -> np.ndarray:
    words = (np.uint64(layer + 1) << np.uint64(48)) | pages.astype(np.uint64)[:, None]
    return np.broadcast_to(words, (pages.size, PAGE // 8))


def pages_of(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) pages: every other source page, destinations shuffled: nothing coalesces."""
    rng = np.random.default_rng(0)
    return np.arange(shape.pages) * 2, rng.permutation(2 * shape.pages)[:shape.pages]


def compute(seconds: float) -> None:
    """One layer's compute on CPU: a timed wait (GIL released)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(left)


def _kvargs(addrs: list[int], meta: np.ndarray, shape: Shape, mem: str, device: int) -> KVArgs:
    """One region per layer of ``2 * pages`` pages (requests use half: room to scatter), plus metadata rows."""
    regions = [Region(name=f"kv{layer}", addr=a, nbytes=2 * shape.pages * PAGE, stride=PAGE, role="kv",
                      index_space=KV_PAGE_SPACE, layer=layer, mem=mem, device=device)  # type: ignore[arg-type]
               for layer, a in enumerate(addrs)]
    regions.append(Region(name="meta", addr=meta.ctypes.data, nbytes=meta.nbytes, stride=64, role="metadata",
                          index_space=METADATA_SPACE))
    return KVArgs(regions=tuple(regions), dtype="bfloat16", page_size=16,
                  index_spaces=(IndexSpace(KV_PAGE_SPACE, 2 * shape.pages, 16), IndexSpace(METADATA_SPACE, 4)))


class HostPools:
    """The synthetic model's KV in host memory; a layer computes by waiting (the source is filled once)."""

    def __init__(self, shape: Shape, fill: bool) -> None:
        self.kv = [np.zeros((2 * shape.pages, PAGE // 8), np.uint64) for _ in range(shape.layers)]
        if fill:
            for layer, arr in enumerate(self.kv):
                arr[:] = source_bytes(layer, np.arange(arr.shape[0]))
        self.meta = np.zeros((4, 64), np.uint8)
        self.kvargs = _kvargs([a.ctypes.data for a in self.kv], self.meta, shape, "dram", 0)

    def start(self) -> None:
        pass

    def layer(self, layer: int, seconds: float) -> Any:
        compute(seconds)
        return None

    def wait(self, ready: Any) -> None:
        pass

    def clear(self, dst: np.ndarray) -> None:
        for arr in self.kv:
            arr[dst] = 0

    def check(self, src: np.ndarray, dst: np.ndarray) -> bool:
        return all(np.array_equal(arr[dst], source_bytes(layer, src)) for layer, arr in enumerate(self.kv))


class CudaPools:
    """The synthetic model's KV as CUDA tensors. A request starts from a zeroed source; a layer is a GPU
    sleep then a copy writing the layer's pages, on a side stream, and returns an event recorded after them."""

    def __init__(self, shape: Shape, fill: bool, device: int) -> None:
        import torch

        self.torch = torch
        self.dev = torch.device(f"cuda:{device}")
        torch.cuda.set_device(self.dev)
        rows = 2 * shape.pages
        self.kv = [torch.zeros((rows, PAGE // 8), dtype=torch.int64, device=self.dev) for _ in range(shape.layers)]
        self.pattern = [self._pattern(layer, torch.arange(rows, device=self.dev)) for layer in range(shape.layers)] if fill else []
        self.meta = np.zeros((4, 64), np.uint8)
        self.kvargs = _kvargs([t.data_ptr() for t in self.kv], self.meta, shape, "vram", device)
        self.stream = torch.cuda.Stream(self.dev)
        self.cycles_per_s = self._calibrate() if fill else 0.0

    def _pattern(self, layer: int, pages: Any) -> Any:
        """``source_bytes`` on the GPU: every word says its layer and page."""
        words = ((layer + 1) << 48) | pages.to(self.torch.int64)
        return words[:, None].expand(-1, PAGE // 8).contiguous()

    def _calibrate(self) -> float:
        """GPU clock cycles per second of ``torch.cuda._sleep``, timed with events."""
        torch = self.torch
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (begin.elapsed_time(end) / 1e3)

    def start(self) -> None:
        with self.torch.cuda.stream(self.stream):
            for t in self.kv:
                t.zero_()

    def layer(self, layer: int, seconds: float) -> Any:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            if seconds > 0:
                torch.cuda._sleep(int(seconds * self.cycles_per_s))
            self.kv[layer].copy_(self.pattern[layer])
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, ready: Any) -> None:
        ready.synchronize()

    def clear(self, dst: np.ndarray) -> None:
        index = self.torch.as_tensor(dst, device=self.dev)
        for t in self.kv:
            t[index] = 0
        self.torch.cuda.synchronize(self.dev)

    def check(self, src: np.ndarray, dst: np.ndarray) -> bool:
        torch = self.torch
        index, pages = torch.as_tensor(dst, device=self.dev), torch.as_tensor(src, device=self.dev)
        return all(bool(torch.equal(t[index], self._pattern(layer, pages))) for layer, t in enumerate(self.kv))


def make_pools(shape: Shape, fill: bool, device: str, gpu: int) -> HostPools | CudaPools:
    return CudaPools(shape, fill, gpu) if device == "cuda" else HostPools(shape, fill)


# -- the tiny model ----------------------------------------------------------------------------------
def tiny_prompt(tokens: int) -> list[int]:
    from kvbridge.demo.run import TEXT

    return list((TEXT * (tokens // len(TEXT) + 1))[:tokens])


class Tiny:
    """The demo's model and caches on one side (TP 1), sized for one request at a time."""

    def __init__(self, role: str, device: str, longest: int) -> None:
        import torch

        from kvbridge.demo.cache import Caches, Sizes
        from kvbridge.demo.model import TP, Model, ModelConfig

        torch.set_num_threads(1)
        self.cfg = ModelConfig()
        self.dev = torch.device("cuda:0" if device == "cuda" else "cpu")
        self.model = Model(self.cfg, TP(), self.dev)
        pages = -(-(longest + TINY_NEW_TOKENS) // self.cfg.page_size)
        self.caches = Caches(self.cfg, TP(), self.dev, role, Sizes(pages=pages, slots=1))
        self.kvargs = self.caches.kvargs()


def run_tiny_decode(backend: str, config: SessionConfig, bootstrap: str, args: argparse.Namespace) -> int:
    from kvbridge.demo.generate import colocated, generate

    from kvbridge.demo.cache import META

    tiny = Tiny("decode", args.device, max(args.prompt_tokens))
    mgr = DecodeManager(tiny.kvargs, backend, config=config)
    room = 0
    try:
        for tokens in args.prompt_tokens:
            prompt = tiny_prompt(tokens)
            (want,) = colocated(tiny.cfg, [prompt], TINY_NEW_TOKENS, args.device)
            for _ in range((args.reps + 1) * len(MODES)):
                room += 1
                s = tiny.caches.alloc(room, tokens + TINY_NEW_TOKENS)
                assert s is not None
                recv = Receiver(mgr, room, bootstrap=bootstrap)
                pages, state = tiny.caches.transfer_indices(s, tokens)
                recv.init(pages, state_indices=state, metadata_row=s.row)
                landed = _landed(recv)
                ok = recv.poll() == Poll.SUCCESS
                if ok:  # decode from what arrived: the same tokens and draft guesses as the colocated run
                    row = tiny.caches.meta[s.row].tolist()
                    s.length = tokens
                    got = generate(tiny.model, tiny.caches, s, (row[META["first_token"]], row[META["draft_token"]]),
                                   TINY_NEW_TOKENS)
                    ok = row[META["room"]] == room and got.tokens == want.tokens and got.draft == want.draft
                tiny.caches.free(s)
                print(json.dumps({"room": room, "success_at": landed, "ok": ok, "failure": recv.failure()}), flush=True)
    finally:
        mgr.close()
    return 0


def tiny_request(tiny: Tiny, mgr: PrefillManager, room: int, mode: str, prompt: list[int],
                 chunk: int) -> tuple[float, float]:
    """Prefill ``prompt`` in chunks and send it; returns (start, end of the last layer's compute and the row)."""
    from kvbridge.demo.generate import prefill_chunks
    from kvbridge.demo.server import Announcer, fill_row

    caches, n, P = tiny.caches, len(prompt), tiny.cfg.page_size
    s = caches.alloc(room, n)
    assert s is not None
    try:
        sender = _ready_sender(mgr, room, s.row)
        announcer = Announcer(tiny.dev)
        compute = prefill_chunks(tiny.model, caches, s, prompt, chunk, on_layer=announcer)
        t0 = computed = time.monotonic()
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            last = end == n
            pages = s.pages[start // P: -(-end // P) if last else end // P]
            state = caches.transfer_indices(s, n)[1] if last else None
            if mode == "layerwise":
                sender.send(pages, state_indices=state, last=last, layerwise=True)
                announcer.start(sender)
            next(compute)
            if last:
                fill_row(caches, s, room, n)
                computed = time.monotonic()
            if mode == "layerwise":
                announcer.finish()
            else:
                sender.send(pages, state_indices=state, last=last)
        _wait_sent(sender)  # the pool slot is reused by the next request
    finally:
        caches.free(s)
    return t0, computed


# -- decode child (synthetic) --------------------------------------------------------------------------
def run_decode(backend: str, config: SessionConfig, bootstrap: str, shape: Shape, rooms: int,
               device: str = "cpu", gpu: int = 0) -> int:
    pools = make_pools(shape, False, device, gpu)
    mgr = DecodeManager(pools.kvargs, backend, config=config)
    src, dst = pages_of(shape)
    try:
        for room in range(1, rooms + 1):
            pools.clear(dst)
            recv = Receiver(mgr, room, bootstrap=bootstrap)
            recv.init(dst, metadata_row=0)
            landed = _landed(recv)
            ok = recv.poll() == Poll.SUCCESS and pools.check(src, dst)
            print(json.dumps({"room": room, "success_at": landed, "ok": ok, "failure": recv.failure()}), flush=True)
    finally:
        mgr.close()
    return 0


# -- prefill (this process) ------------------------------------------------------------------------
def _ready_sender(mgr: PrefillManager, room: int, row: int) -> Sender:
    sender = Sender(mgr, room, metadata_row=row)
    sender.wait(Poll.WAITING_FOR_INPUT, 60)
    if sender.poll() != Poll.WAITING_FOR_INPUT:
        raise RuntimeError(f"room {room}: decode's request did not arrive: {sender.poll().name} {sender.failure()}")
    return sender


def _wait_sent(sender: Sender) -> None:
    sender.wait(Poll.SUCCESS, 300)


def _landed(recv: Receiver) -> float:
    """When decode's room reached SUCCESS (or failed): woken by the change, timed where it happened."""
    recv.wait(Poll.SUCCESS, 300)
    return recv.ended or time.monotonic()


def request(mgr: PrefillManager, room: int, mode: str, shape: Shape, compute_s: float,
            pools: HostPools | CudaPools | None = None) -> tuple[float, float]:
    """Compute and send one request; returns (start, end of the last layer's compute)."""
    src, _ = pages_of(shape)
    sender = _ready_sender(mgr, room, 0)
    if pools is not None:
        pools.start()
    t0 = time.monotonic()
    if mode == "layerwise":
        sender.send(src, last=True, layerwise=True)
    ready = None
    for layer in range(shape.layers):
        if pools is None:
            compute(compute_s)
        else:
            ready = pools.layer(layer, compute_s)
        if mode == "layerwise":
            sender.layer_ready(layer, ready=ready)
    if pools is not None:
        pools.wait(ready)  # the last layer computed (a GPU queued it all at once)
    computed = time.monotonic()
    if mode == "chunk":
        sender.send(src, last=True)
    return t0, computed


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = np.percentile(values, [25, 50, 75])
    return float(q[0]), float(q[1]), float(q[2])


def _verdict(low: float, high: float, target: float, above: bool) -> str:
    """``yes`` if the whole interquartile range meets the target, ``no`` if none of it does, else ``noise``."""
    if above:
        return "yes" if low >= target else "no" if high < target else "noise"
    return "yes" if high <= target else "no" if low > target else "noise"


class WriteCounter:
    """Counts prefill's writes to decode (``Transport.write`` calls: one per coalesced group of layers; the
    metadata row travels in ``Done``), to show how layer-wise sending coalesced: a per-chunk send makes one;
    and notes when the latest returned (a request's last: every byte but the row landed), which splits what
    stays exposed after the last layer into prefill's writes and decode's ``Done``."""

    def __init__(self, mgr: PrefillManager) -> None:
        self.mgr = mgr
        self.count = 0
        self.ended = 0.0
        write = mgr.transport.write

        def counting(*args: Any, **kwargs: Any) -> None:
            self.count += 1  # one decode peer: one worker thread writes
            write(*args, **kwargs)
            self.ended = time.monotonic()

        mgr.transport.write = counting  # type: ignore[method-assign]

    def write_cost_ms(self) -> float:
        """What one write to decode costs whatever its size (the decode peer's measured ``write_cost``)."""
        costs = [p.write_cost for p in self.mgr.peers() if p.write_cost is not None]
        return max(costs) * 1e3 if costs else float("nan")


def measure(child: subprocess.Popen[str], first_room: int, reps: int,
            one: Callable[[int, str], tuple[float, float]], writes: WriteCounter) -> tuple[dict[str, Any], int]:
    """``reps`` timed pairs (after one untimed) of ``one(room, mode)``, the two modes in alternating order."""
    got: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "exposed": [], "compute": [], "writes_after": [], "done": []}
                                              for m in MODES}
    count: dict[str, list[int]] = {m: [] for m in MODES}
    verified = True
    room = first_room
    for rep in range(reps + 1):  # rep 0: untimed warm-up
        for mode in MODES if rep % 2 else MODES[::-1]:
            room += 1
            before = writes.count
            t0, computed = one(room, mode)
            line = json.loads(child.stdout.readline())  # type: ignore[union-attr]
            count[mode].append(writes.count - before)  # decode's SUCCESS came after prefill's last write
            if line["room"] != room or line["failure"]:
                raise RuntimeError(f"room {room} ({mode}): {line}")
            verified &= bool(line["ok"])
            if rep:
                got[mode]["ttft"].append(line["success_at"] - t0)
                got[mode]["exposed"].append(max(0.0, line["success_at"] - computed))
                got[mode]["compute"].append(computed - t0)
                got[mode]["writes_after"].append(max(0.0, writes.ended - computed))  # ends with the row landed
                got[mode]["done"].append(line["success_at"] - writes.ended)  # then Done, to decode's SUCCESS
    med = {m: {k: statistics.median(v) * 1e3 for k, v in got[m].items()} for m in MODES}
    row: dict[str, Any] = {f"{k}_{m}_ms": med[m][k] for m in MODES for k in ("ttft", "exposed")}
    row["exposed_ratio"] = row["exposed_layerwise_ms"] / row["exposed_chunk_ms"]
    row["ttft_ratio"] = row["ttft_layerwise_ms"] / row["ttft_chunk_ms"]
    # Same bytes: throughput is 1 / TTFT. Paired by repetition (back to back), so slow spells of a shared
    # machine hit both halves of a pair; the spread is the pairs' interquartile range.
    pairs = [c / w for c, w in zip(got["chunk"]["ttft"], got["layerwise"]["ttft"])]
    low, mid, high = _quartiles(pairs)
    row.update(throughput_ratio=mid, throughput_ratio_p25=low, throughput_ratio_p75=high, reps=reps,
               verified=verified, compute_chunk_ms=med["chunk"]["compute"], compute_layerwise_ms=med["layerwise"]["compute"],
               writes_chunk=statistics.median(count["chunk"][1:]), writes_layerwise=statistics.median(count["layerwise"][1:]),
               write_cost_ms=writes.write_cost_ms(),
               **{f"{k}_{m}_ms": med[m][k] for m in MODES for k in ("writes_after", "done")})
    return row, room


def _finish(row: dict[str, Any], compute_per_layer: float, transfer_per_layer: float) -> dict[str, Any]:
    row["regime"] = "compute-bound" if compute_per_layer > transfer_per_layer else "bandwidth-bound"
    if row["regime"] == "compute-bound":
        low = high = row["exposed_ratio"]  # medians' ratio; exposed times vary less than TTFT
        row["target"] = "exposed <= 0.20"
        row["target_met"] = _verdict(low, high, 0.20, above=False)
    else:
        row["target"] = "throughput >= 0.95"
        row["target_met"] = _verdict(row["throughput_ratio_p25"], row["throughput_ratio_p75"], 0.95, above=True)
    return row


def _child(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvbridge.bench.layerwise", *args], stdout=subprocess.PIPE, text=True)


def _stop(child: subprocess.Popen[str]) -> None:
    try:
        child.wait(60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


@contextlib.contextmanager
def _prefill(kvargs: KVArgs, backend: str, config: SessionConfig, decode_args: list[str]
             ) -> Iterator[tuple[PrefillManager, WriteCounter, subprocess.Popen[str]]]:
    """A prefill manager with its bootstrap server, its write counter, and the decode child (given
    ``decode_args``) bootstrapping from it; all closed afterwards."""
    with contextlib.ExitStack() as stack:
        server = BootstrapServer("127.0.0.1")
        stack.callback(server.close)
        mgr = PrefillManager(kvargs, backend, bootstrap=server.address, config=config)
        stack.callback(mgr.close)
        writes = WriteCounter(mgr)
        options = [f"--transfer-option={k}={v}" for k, v in config.backend_options.items()]
        child = _child(["--decode", server.address, "--transfer-backend", backend, *options, *decode_args])
        stack.callback(_stop, child)
        yield mgr, writes, child


def run(backend: str, config: SessionConfig, shape: Shape, compute_ms: list[float], reps: int,
        tracker: ui.Tracker | None = None, device: str = "cpu") -> list[dict[str, Any]]:
    """The synthetic model: one row per compute time; times in milliseconds (``*_ms``)."""
    pools = make_pools(shape, True, device, 0)
    rooms = len(compute_ms) * (reps + 1) * len(MODES)
    gpu = pools if device == "cuda" else None
    rows: list[dict[str, Any]] = []
    room = 0
    with _prefill(pools.kvargs, backend, config, ["--rooms", str(rooms), "--layers", str(shape.layers),
                                                  "--layer-mib", str(shape.pages * PAGE / 2**20), "--device", device]
                  ) as (mgr, writes, child):
        for ms in compute_ms:
            row, room = measure(child, room, reps, lambda r, mode: request(mgr, r, mode, shape, ms / 1e3, gpu), writes)
            per_layer_ms = row["exposed_chunk_ms"] / shape.layers
            rows.append(_finish({"model": "synthetic", "device": device, "backend": backend, "layers": shape.layers,
                                 "layer_MiB": shape.pages * PAGE / 2**20, "compute_ms": ms,
                                 "transfer_ms_per_layer": per_layer_ms, **row}, ms, per_layer_ms))
            if tracker is not None:
                tracker.advance()
    return rows


def run_tiny(backend: str, config: SessionConfig, args: argparse.Namespace,
             tracker: ui.Tracker | None = None) -> list[dict[str, Any]]:
    """The demo's tiny model: one row per prompt length."""
    tiny = Tiny("prefill", args.device, max(args.prompt_tokens))
    rows: list[dict[str, Any]] = []
    room = 0
    with _prefill(tiny.kvargs, backend, config, ["--model", "tiny", "--prompt-tokens", ",".join(map(str, args.prompt_tokens)),
                                                 "--reps", str(args.reps), "--device", args.device]
                  ) as (mgr, writes, child):
        layers = len(mgr.layer_index.keys)
        for tokens in args.prompt_tokens:
            prompt = tiny_prompt(tokens)
            chunks = -(-tokens // args.chunk_size)
            row, room = measure(child, room, args.reps,
                                lambda r, mode: tiny_request(tiny, mgr, r, mode, prompt, args.chunk_size), writes)
            compute_ms = row["compute_chunk_ms"] / (chunks * layers)
            per_layer_ms = row["exposed_chunk_ms"] / layers  # the last chunk's transfer, after its compute
            rows.append(_finish({"model": "tiny", "device": args.device, "backend": backend, "layers": layers,
                                 "prompt_tokens": tokens, "chunk_size": args.chunk_size, "compute_ms": compute_ms,
                                 "transfer_ms_per_layer": per_layer_ms, **row}, compute_ms, per_layer_ms))
            if tracker is not None:
                tracker.advance()
    return rows


def format_table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a :func:`kvbridge.ui.table` (lw: layer-wise; ratios lw / per-chunk)."""
    columns = ["case", "compute/layer", "xfer/layer", "regime", "TTFT chunk", "TTFT lw", "exposed chunk",
               "exposed lw", "lw writes+Done", "exposed ratio", "throughput ratio (IQR)", "target met", "writes lw",
               "write cost", "ok"]

    def case(r: dict[str, Any]) -> str:
        return f"tiny {r['prompt_tokens']} tok" if r["model"] == "tiny" else f"{r['layers']}x{r['layer_MiB']:g}MiB"

    return ui.table(
        columns,
        [(case(r), f"{r['compute_ms']:.2f}", f"{r['transfer_ms_per_layer']:.2f}", r["regime"].replace("-bound", ""),
          f"{r['ttft_chunk_ms']:.1f}", f"{r['ttft_layerwise_ms']:.1f}", f"{r['exposed_chunk_ms']:.1f}",
          f"{r['exposed_layerwise_ms']:.1f}", f"{r['writes_after_layerwise_ms']:.2f}+{r['done_layerwise_ms']:.2f}",
          f"{r['exposed_ratio']:.2f}",
          f"{r['throughput_ratio']:.2f} ({r['throughput_ratio_p25']:.2f}-{r['throughput_ratio_p75']:.2f})",
          r["target_met"], f"{r['writes_layerwise']:g}", f"{r['write_cost_ms']:.2f}", r["verified"]) for r in rows],
        right=[c for c in columns if c not in ("case", "regime", "target met", "ok")],
    )


def _ms_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, e.g. 0,2,10; got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"milliseconds must be >= 0, got {text!r}")
    return values


def _tokens_list(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 1, e.g. 64,256; got {text!r}")
    return [int(p) for p in parts]


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
    parser.add_argument("--model", choices=("synthetic", "tiny"), default="synthetic",
                        help="synthetic: --layers x --layer-mib, --compute-ms per layer; tiny: the demo's model, "
                             "--prompt-tokens in chunks of --chunk-size (default: synthetic)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where pools live and layers compute; cuda: a GPU kernel per layer on a side stream, "
                             "announced with a CUDA event (default: cpu)")
    parser.add_argument("--compute-ms", type=_ms_list, default=[0.0, 2.0, 10.0], metavar="MS[,MS...]",
                        help="synthetic: compute per layer, one row each (default: 0,2,10)")
    parser.add_argument("--layers", type=ui.int_at_least(1), default=16, metavar="N",
                        help="synthetic: layers (default: 16)")
    parser.add_argument("--layer-mib", type=_mib, default=2.0, metavar="MIB",
                        help="synthetic: KV bytes per layer and request, in MiB of 64 KiB pages (default: 2)")
    parser.add_argument("--prompt-tokens", type=_tokens_list, default=[64, 256], metavar="N[,N...]",
                        help="tiny: prompt length, one row each (default: 64,256)")
    parser.add_argument("--chunk-size", type=ui.int_at_least(16), default=64, metavar="N",
                        help="tiny: prefill chunk in tokens, a multiple of 16 (default: 64)")
    parser.add_argument("--reps", type=ui.int_at_least(1), default=11, metavar="N",
                        help="timed pairs of requests, per-chunk and layer-wise back to back (default: 11)")
    common.add_output_arguments(parser, "times in milliseconds: *_ms")
    parser.add_argument("--decode", metavar="BOOTSTRAP", help=argparse.SUPPRESS)
    parser.add_argument("--rooms", type=int, default=0, help=argparse.SUPPRESS)


def _environment_problem(args: argparse.Namespace) -> str | None:
    """Why this run cannot happen here (a usage error), or None."""
    if args.device == "cpu" and args.model == "synthetic":
        return None
    if args.device == "cuda" and common.cuda_problem() is not None:  # names the device, with or without torch
        return common.cuda_problem()
    try:
        import torch
    except ImportError:
        why = "--device cuda" if args.device == "cuda" else "--model tiny"
        return f"{why} needs PyTorch: install it (pip install 'kvbridge[torch]', or torch itself)"
    if args.chunk_size % 16:
        return f"argument --chunk-size: must be a multiple of the page size 16, got {args.chunk_size}"
    return None


def run_from_args(args: argparse.Namespace) -> int:
    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    cfg = TransferConfig.from_args(args, args.command_parser)
    problem = _environment_problem(args)
    if problem is not None:
        ui.usage_error(args.command_parser, problem)
    config = dataclasses.replace(CONFIG, backend_options=dict(cfg.backend_options))
    shape = Shape(args.layers, int(args.layer_mib * 2**20) // PAGE)
    if args.decode:
        if args.model == "tiny":
            return run_tiny_decode(cfg.backend, config, args.decode, args)
        return run_decode(cfg.backend, config, args.decode, shape, args.rooms, args.device)
    prog = "kvbridge bench layerwise"
    common.check_plot(args, prog)
    cases = args.prompt_tokens if args.model == "tiny" else args.compute_ms
    with ui.progress(len(cases), "rows", description=f"bench layerwise ({cfg.backend})") as tracker:
        if args.model == "tiny":
            rows = run_tiny(cfg.backend, config, args, tracker)
        else:
            rows = run(cfg.backend, config, shape, args.compute_ms, args.reps, tracker, args.device)

    def table() -> Any:
        t = format_table(rows)
        what = (f"the demo's tiny model ({rows[0]['layers']} layers), chunks of {args.chunk_size} tokens"
                if args.model == "tiny" else f"{shape.layers} layers x {shape.pages * PAGE / 2**20:g} MiB of scattered 64 KiB pages")
        t.title = (f"{what}, {args.device}, prefill -> decode over 127.0.0.1 ({cfg.backend}), median of {args.reps} "
                   "pairs; ms; lw = layer-wise; ratios lw / chunk (exposed: <= 0.20 compute-bound; throughput: "
                   ">= 0.95 bandwidth-bound, median and interquartile range of the pairs); writes lw: prefill's writes "
                   "per layer-wise request (per chunk: 1 per chunk, the metadata row travels in Done; fewer than layers: "
                   "layers coalesced); lw writes+Done: exposed lw split into prefill's writes after the last layer "
                   "and decode's Done with the row (to its SUCCESS), which no sending order hides; write cost: what "
                   "one write to decode costs whatever its size (measured)")
        return t

    return common.finish(args, prog, rows, table, plot, ok=all(r["verified"] for r in rows))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    common.bars(path, "Layer-wise vs per-chunk send: transfer exposed after the last layer (ms)",
                [str(r.get("compute_ms", r.get("prompt_tokens", i))) for i, r in enumerate(rows)],
                {"per chunk": [r["exposed_chunk_ms"] for r in rows], "layer-wise": [r["exposed_layerwise_ms"] for r in rows]},
                "ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbridge bench layerwise", description=__doc__, formatter_class=ui.HelpFormatter)
    add_arguments(parser)
    parser.set_defaults(command_parser=parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
