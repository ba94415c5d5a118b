"""A tiny hybrid model using every state handler, moved between multi-rank processes.

The prefill process hosts all prefill ranks (TP x PP), the decode process all
decode ranks, each rank with its own manager and transport. Every buffer has a
*global* tensor (all heads / channels) filled from a seeded generator; a rank
holds its TP slice of it, cut with plain numpy indexing here, independently
of kvbridge's segment computation. Decode checks every rank's every buffer:
destination items equal the global source items sliced to that decode rank,
everything else is still zero.

Run as ``python -m kvbridge.testing.hybrid prefill|decode --spec JSON``;
prefill prints ``BOOTSTRAP host:port`` first, decode one JSON result line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import zlib
from typing import Any

import msgspec
import numpy as np

from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.describe import describe
from kvbridge.core.description.pools import KVPool, MetadataPool
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from kvbridge.state_handlers.dsv4_hisparse import C4_SPACE, C128_SPACE, DSV4HiSparsePool, c4_token_indices
from kvbridge.state_handlers.mamba import SLOT_SPACE, MambaPool
from kvbridge.state_handlers.nsa import NSAPool
from kvbridge.state_handlers.swa import SWA_PAGE_SPACE, SWAPool


class Spec(msgspec.Struct, kw_only=True):
    backend: str
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_pp: int = 1
    layout: str = "nhd"  # full KV and SWA page layout
    mla: bool = False
    draft: bool = False
    requests: int = 4
    seed: int = 0
    # Index-length mismatch cases: decode allocates this many extra SWA pages / mamba slots.
    extra_swa_pages: int = 0
    extra_slots: int = 0
    strict: bool = False
    decode_strict: bool = False  # strict_index_lengths on decode only (negotiated: either side can ask)
    omit_state: list[str] = []  # index spaces whose state list the prefill host leaves out
    c4_row_tokens: int = 3  # decode host rows; prefill device pages hold PAGE // RATIO = 2 (unaligned)
    timeout: float = 60.0
    # Sizes: tiny by default (tests).
    head_dim: int = 2
    pages: int = 40
    max_request_pages: int = 5
    progress: bool = False  # decode prints a JSON progress line per finished request
    backend_options: dict[str, str] = {}  # SessionConfig.backend_options
    # "cuda": every buffer is a torch CUDA tensor (rank r on GPU r % count), except decode's
    # DeepSeek-V4 C4 host rows, which stay in host memory as in HiSparse.
    device: str = "cpu"
    gpu_fast_path: bool = True  # SessionConfig.gpu_fast_path
    # Prefill sends each chunk layer-wise: layer by layer in the first chunk, then all target
    # layers in one call and the draft layers in another.
    layerwise: bool = False
    staging: str = "gather"  # SessionConfig.staging: gather (the default), auto, on, off
    # Prefill sends each request in two chunks (the second with the state lists), or in one: what a busy
    # peer worker writes when it finds both chunks queued (sessions/writes.py, write_chunks).
    chunks: int = 2


PAGE, RATIO = 8, 4
KV_HEADS, SWA_PAGES, SLOTS, ROWS, C4_ROWS = 4, 16, 8, 8, 64
CONV_GROUPS, CONV_ROWS, SSM_HEADS = (4, 4, 8), 3, 4
LAYERS = {"kv": [0, 1], "swa": [2], "mamba": [3], "dsv4": [4]}  # global layer ids
DRAFT_LAYERS = [100]  # draft (MTP) layer ids live in their own band


# -- global tensors and per-rank slices -------------------------------------------------------
def _global(name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # same in every process (hash() is salted)
    return rng.integers(1, 2**16, shape, dtype=np.uint16)  # never 0: 0 means "untouched"


def _units(total: int, rank: int, tp: int) -> np.ndarray:
    per = max(1, total // tp)
    start = rank * total // tp
    return np.arange(start, start + per)


def _channels(rank: int, tp: int) -> np.ndarray:
    out, base = [], 0
    for total in CONV_GROUPS:
        out.append(base + _units(total, rank, tp))
        base += total
    return np.concatenate(out)


class Buffers:
    """All buffers of one rank: ``self.arrays[name]`` plus the pool objects that describe them."""

    def __init__(self, spec: Spec, rank: int, tp: int, layers: set[int] | None, side: str, zero: bool) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.tensors: dict[str, Any] = {}  # device copies of arrays (spec.device == "cuda")
        # How each buffer's global tensor is cut for a rank: (axis, index array) or None (replicated).
        self.cuts: dict[str, tuple[int, np.ndarray] | None] = {}
        heads = _units(KV_HEADS, rank, tp)
        head_axis = 2 if spec.layout == "nhd" else 1

        def buf(name: str, global_shape: tuple[int, ...], cut: tuple[int, np.ndarray] | None) -> np.ndarray:
            g = _global(name, global_shape)
            local = g if cut is None else np.take(g, cut[1], axis=cut[0])
            arr = np.zeros_like(local) if zero else np.ascontiguousarray(local)
            self.arrays[name], self.cuts[name] = arr, cut
            if spec.device == "cuda" and not name.startswith("c4.decode."):
                import torch

                self.tensors[name] = torch.from_numpy(arr).to(f"cuda:{rank % torch.cuda.device_count()}")
                return self.tensors[name]
            return arr

        def kv_shape(pages: int) -> tuple[int, ...]:
            return (pages, PAGE, KV_HEADS, spec.head_dim) if spec.layout == "nhd" else (pages, KV_HEADS, PAGE, spec.head_dim)

        def mine(ids: list[int]) -> list[int]:
            return [i for i in ids if layers is None or i in layers]

        def kv_pool(prefix: str, ids: list[int], pages: int, cls: type = KVPool, **extra: Any) -> Any:
            if spec.mla:
                k = [buf(f"{prefix}{i}.kv", (pages, PAGE * 8), None) for i in ids]
                return cls(k=k, v=None, layer_ids=ids, page_size=PAGE, **extra)
            k = [buf(f"{prefix}{i}.k", kv_shape(pages), (head_axis, heads)) for i in ids]
            v = [buf(f"{prefix}{i}.v", kv_shape(pages), (head_axis, heads)) for i in ids]
            return cls(k=k, v=v, layer_ids=ids, page_size=PAGE, kv_heads=KV_HEADS, layout=spec.layout, **extra)

        self.pools: list[Any] = []
        self.draft_pools: list[Any] = []
        if ids := mine(LAYERS["kv"]):
            self.pools.append(kv_pool("kv", ids, spec.pages))
            self.pools.append(NSAPool(index_k=[buf(f"nsa{i}.k", (spec.pages, PAGE * 4), None) for i in ids],
                                      scales=[buf(f"nsa{i}.s", (spec.pages, PAGE), None) for i in ids], layer_ids=ids, page_size=PAGE))
            if spec.draft:
                self.draft_pools.append(kv_pool("draft.kv", DRAFT_LAYERS, spec.pages))
                self.draft_pools.append(NSAPool(index_k=[buf(f"draft.nsa{i}.k", (spec.pages, PAGE * 4), None) for i in DRAFT_LAYERS],
                                                scales=None, layer_ids=DRAFT_LAYERS, page_size=PAGE))
        if ids := mine(LAYERS["swa"]):
            self.pools.append(kv_pool("swa", ids, SWA_PAGES, SWAPool))
        if ids := mine(LAYERS["mamba"]):
            ch = _channels(rank, tp)
            self.pools.append(MambaPool(
                conv=[buf(f"conv{i}", (SLOTS, CONV_ROWS, sum(CONV_GROUPS)), (2, ch)) for i in ids],
                temporal=[buf(f"ssm{i}", (SLOTS, SSM_HEADS, 2, 3), (1, _units(SSM_HEADS, rank, tp))) for i in ids],
                layer_ids=ids, conv_groups=CONV_GROUPS, temporal_heads=SSM_HEADS))
        if ids := mine(LAYERS["dsv4"]):
            # Prefill: device pages of PAGE // RATIO compressed tokens; decode: host rows of c4_row_tokens.
            per_item = PAGE // RATIO if side == "prefill" else spec.c4_row_tokens
            items = spec.pages if side == "prefill" else C4_ROWS
            swa_part = kv_pool("dsv4swa", ids, SWA_PAGES, DSV4HiSparsePool,
                               c4=[buf(f"c4.{side}.{i}", (items, per_item, 6), None) for i in ids],
                               c4_tokens_per_item=per_item,
                               indexer=[buf(f"dsv4idx{i}", (spec.pages, 16), None) for i in ids],
                               c128=[buf(f"c128.{i}", (SLOTS, 10), None) for i in ids],
                               compressed_layer_ids=ids, ratio=RATIO)
            self.pools.append(swa_part)
        if layers is None or max(layers) == max(sum(LAYERS.values(), [])):  # the last stage owns the metadata
            self.pools.append(MetadataPool(buffers=[buf("meta", (ROWS, 16), None)]))


    def fetch(self) -> None:
        """Copy device buffers back into :attr:`arrays` (for checking)."""
        for name, t in self.tensors.items():
            self.arrays[name][...] = t.cpu().numpy()


# -- requests -------------------------------------------------------------------------------------
class Request(msgspec.Struct):
    room: int
    tokens: int
    src_pages: list[int]
    dst_pages: list[int]
    src_swa: list[int]
    dst_swa: list[int]
    src_slot: list[int]
    dst_slot: list[int]
    dst_c4_rows: list[int]
    src_meta: int
    dst_meta: int


def requests(spec: Spec) -> list[Request]:
    """The schedule both processes derive from the seed. Requests run one after
    another, so each allocates afresh and may reuse earlier requests' items (the
    oracle applies them in order)."""
    rng = np.random.default_rng(spec.seed)
    out = []
    for i in range(spec.requests):
        tokens = int(rng.integers(PAGE, spec.max_request_pages * PAGE + 1))
        n = -(-tokens // PAGE)
        n_swa = min(n, 3)
        rows = -(-(tokens // RATIO) // spec.c4_row_tokens)
        slots = rng.choice(SLOTS, 2 + spec.extra_slots, replace=False)
        out.append(Request(
            room=1000 + i, tokens=tokens,
            src_pages=np.sort(rng.choice(spec.pages, n, replace=False)).tolist(),
            dst_pages=rng.choice(spec.pages, n, replace=False).tolist(),
            src_swa=rng.choice(SWA_PAGES, n_swa, replace=False).tolist(),
            dst_swa=rng.choice(SWA_PAGES, n_swa + spec.extra_swa_pages, replace=False).tolist(),
            src_slot=[int(slots[0])], dst_slot=[int(x) for x in slots[1:]],
            dst_c4_rows=rng.choice(C4_ROWS, rows, replace=False).tolist(), src_meta=i % ROWS, dst_meta=(i + 3) % ROWS,
        ))
    return out


def config(spec: Spec, side: str = "prefill") -> SessionConfig:
    strict = spec.strict or (side == "decode" and spec.decode_strict)
    return SessionConfig(bootstrap_timeout=30, waiting_timeout=spec.timeout, transfer_timeout=30,
                         heartbeat_interval=0.3, heartbeat_timeout=5, strict_index_lengths=strict,
                         backend_options=dict(spec.backend_options), gpu_fast_path=spec.gpu_fast_path,
                         staging=spec.staging)


def stage_layers(stage: int, pp: int) -> set[int] | None:
    if pp == 1:
        return None
    all_layers = sorted(sum(LAYERS.values(), []))
    per = -(-len(all_layers) // pp)
    return set(all_layers[stage * per:(stage + 1) * per])


def _close_all(managers: list[Any]) -> None:
    # Engines take about a second each to shut down; close the ranks together.
    threads = [threading.Thread(target=m.close) for m in managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def _wait(rooms: list[Any], deadline: float) -> None:
    while time.monotonic() < deadline and any(r.poll() not in (Poll.SUCCESS, Poll.FAILED) for r in rooms):
        time.sleep(0.002)


# -- prefill --------------------------------------------------------------------------------------
def run_prefill(spec: Spec) -> int:
    server = BootstrapServer("127.0.0.1")
    print(f"BOOTSTRAP {server.address}", flush=True)
    ranks = []
    for stage in range(spec.prefill_pp):
        for r in range(spec.prefill_tp):
            b = Buffers(spec, r, spec.prefill_tp, stage_layers(stage, spec.prefill_pp), "prefill", zero=False)
            args = describe(b.pools, draft_pools=b.draft_pools, dtype="bf16", page_size=PAGE, tp_rank=r,
                            tp_size=spec.prefill_tp, pp_rank=stage, pp_size=spec.prefill_pp)
            ranks.append((b, PrefillManager(args, spec.backend, bootstrap=server.address, config=config(spec))))
    deadline = time.monotonic() + spec.timeout
    states: dict[str, list[Any]] = {}
    try:
        for req in requests(spec):
            senders = [Sender(m, req.room, metadata_row=req.src_meta) for _, m in ranks]
            while time.monotonic() < deadline and any(s.poll() == Poll.BOOTSTRAPPING for s in senders):
                time.sleep(0.002)
            half = len(req.src_pages) // 2
            c4 = c4_token_indices(req.src_pages, PAGE // RATIO, req.tokens, RATIO)
            # Every rank gets every list, as a host would pass them: core routes each
            # pipeline stage its own index spaces.
            state = {SWA_PAGE_SPACE: req.src_swa, SLOT_SPACE: req.src_slot, C4_SPACE: c4, C128_SPACE: req.src_slot}
            state = {k: v for k, v in state.items() if k not in spec.omit_state}
            for (b, m), s in zip(ranks, senders):
                if spec.layerwise:
                    s.send(req.src_pages[:half], layerwise=True)
                    for layer, draft in s.layers:
                        s.layer_ready(layer, draft=draft)
                    s.send(req.src_pages[half:], state_indices=state, last=True, layerwise=True)
                    for draft in (False, True):
                        if ids := [layer for layer, d in s.layers if d == draft]:
                            s.layer_ready(ids, draft=draft)
                elif spec.chunks == 1:
                    s.send(req.src_pages, state_indices=state, last=True)
                else:
                    s.send(req.src_pages[:half])
                    s.send(req.src_pages[half:], state_indices=state, last=True)
            _wait(senders, deadline)
            states[str(req.room)] = [[s.poll().name, s.failure()] for s in senders]
        time.sleep(0.3)
        # Windows written through host staging (kvbridge.core.transfer.staging), summed over the ranks.
        staged = sum(m.transport.describe().get("staging", {}).get("windows", 0) for _, m in ranks)
        # The lanes (backends) that moved something to a decode peer, over the ranks.
        lanes = sorted({name for _, m in ranks for names in m.transport.describe()["lanes"].values() for name in names})
    finally:
        _close_all([m for _, m in ranks])
        server.close()
    print(json.dumps({"role": "prefill", "rooms": states, "staged_windows": staged, "lanes": lanes}), flush=True)
    return 0


# -- decode ---------------------------------------------------------------------------------------
def run_decode(spec: Spec, bootstrap: str) -> int:
    ranks = []
    for r in range(spec.decode_tp):
        b = Buffers(spec, r, spec.decode_tp, None, "decode", zero=True)
        args = describe(b.pools, draft_pools=b.draft_pools, dtype="bf16", page_size=PAGE, tp_rank=r, tp_size=spec.decode_tp)
        ranks.append((b, DecodeManager(args, spec.backend, config=config(spec, "decode"))))
    deadline = time.monotonic() + spec.timeout
    reqs = requests(spec)
    result: dict[str, Any] = {"role": "decode", "rooms": {}, "mismatches": [], "latency_s": [], "bytes_by_state": {}}
    t_start = time.monotonic()
    try:
        for i, req in enumerate(reqs):
            t0 = time.monotonic()
            recvs = [Receiver(m, req.room, bootstrap=bootstrap) for _, m in ranks]
            c4 = c4_token_indices(req.dst_c4_rows, spec.c4_row_tokens, req.tokens, RATIO)
            for recv in recvs:
                recv.init(req.dst_pages, state_indices={SWA_PAGE_SPACE: req.dst_swa, SLOT_SPACE: req.dst_slot,
                                                        C4_SPACE: c4, C128_SPACE: req.dst_slot[:1]},
                          metadata_row=req.dst_meta)
            _wait(recvs, deadline)
            result["latency_s"].append(time.monotonic() - t0)
            result["rooms"][str(req.room)] = [[r.poll().name, r.failure()] for r in recvs]
            if all(r.poll() == Poll.SUCCESS for r in recvs):
                for b, _ in ranks:
                    for name, arr in b.arrays.items():
                        state, nbytes = moved(spec, name, arr, req)
                        result["bytes_by_state"][state] = result["bytes_by_state"].get(state, 0) + nbytes
            if spec.progress:
                print(json.dumps({"progress": i + 1, "of": len(reqs), "ok": recvs[0].poll() == Poll.SUCCESS}), flush=True)
        result["seconds"] = time.monotonic() - t_start
        for b, _ in ranks:
            b.fetch()
        ok = [q for q in reqs if all(s == "SUCCESS" for s, _ in result["rooms"][str(q.room)])]
        failed = [q for q in reqs if q not in ok]
        for rank, (b, _) in enumerate(ranks):
            for name, got in b.arrays.items():
                want = expected(spec, name, b.cuts[name], ok)
                # A failed room's own destination items may hold a partial write: don't care.
                # Everything else (other rooms, untouched items) must be exact.
                care = expected(spec, name, None, failed, mark=True)
                want = np.where(care.reshape(care.shape[0], -1).any(1).reshape(-1, *([1] * (want.ndim - 1))), got, want)
                if not np.array_equal(got, want):
                    result["mismatches"].append({"rank": rank, "buffer": name,
                                                 "differing_items": int((got != want).reshape(len(got), -1).any(1).sum())})
    finally:
        _close_all([m for _, m in ranks])
    print(json.dumps(result), flush=True)
    return 0


def moved(spec: Spec, name: str, arr: np.ndarray, q: Request) -> tuple[str, int]:
    """(state type, bytes) that request ``q`` wrote into one decode buffer (from the request, not kvbridge)."""
    if name.startswith("c4.decode."):
        return "dsv4", (q.tokens // RATIO) * arr.shape[2] * arr.itemsize
    item = arr[0].nbytes
    for prefix, state, items in (
        ("draft.", "draft", len(q.dst_pages)), ("kv", "kv", len(q.dst_pages)), ("nsa", "nsa", len(q.dst_pages)),
        ("swa", "swa", min(len(q.src_swa), len(q.dst_swa))), ("dsv4swa", "dsv4", min(len(q.src_swa), len(q.dst_swa))),
        ("dsv4idx", "dsv4", len(q.dst_pages)), ("c128", "dsv4", 1), ("conv", "mamba", 1), ("ssm", "mamba", 1),
        ("meta", "metadata", 1),
    ):
        if name.startswith(prefix):
            return state, items * item
    raise KeyError(name)


def expected(spec: Spec, name: str, cut: tuple[int, np.ndarray] | None, reqs: list[Request], mark: bool = False) -> np.ndarray:
    """What a decode buffer must hold after ``reqs``: plain numpy, from the global tensors.

    With ``mark=True``, the items ``reqs`` write are non-zero and the rest zero.
    """
    def local(g: np.ndarray) -> np.ndarray:
        g = np.ones_like(g) if mark else g
        return g if cut is None else np.take(g, cut[1], axis=cut[0])

    if name.startswith("c4.decode."):
        layer = name.split(".")[-1]
        src = local(_global(f"c4.prefill.{layer}", (spec.pages, PAGE // RATIO, 6))).reshape(-1, 6)
        out = np.zeros((C4_ROWS * spec.c4_row_tokens, 6), np.uint16)
        for q in reqs:
            n = q.tokens // RATIO
            t = np.arange(n)
            src_tok = np.asarray(q.src_pages)[t // (PAGE // RATIO)] * (PAGE // RATIO) + t % (PAGE // RATIO)
            dst_tok = np.asarray(q.dst_c4_rows)[t // spec.c4_row_tokens] * spec.c4_row_tokens + t % spec.c4_row_tokens
            out[dst_tok] = src[src_tok]
        return out.reshape(C4_ROWS, spec.c4_row_tokens, 6)
    g = _global(name, _shape_of(spec, name))
    out = np.zeros_like(local(g))
    g = np.ones_like(g) if mark else g
    for q in reqs:
        if name.startswith(("kv", "draft.kv", "nsa", "draft.nsa", "dsv4idx")):
            out[q.dst_pages] = local(g)[q.src_pages]
        elif name.startswith(("swa", "dsv4swa")):
            n = min(len(q.src_swa), len(q.dst_swa))
            out[q.dst_swa[:n]] = local(g)[q.src_swa[:n]]
        elif name.startswith(("conv", "ssm", "c128")):
            out[q.dst_slot[:1]] = local(g)[q.src_slot]
        elif name == "meta":
            out[q.dst_meta] = g[q.src_meta]
    return out


def _shape_of(spec: Spec, name: str) -> tuple[int, ...]:
    kv = (PAGE, KV_HEADS, spec.head_dim) if spec.layout == "nhd" else (KV_HEADS, PAGE, spec.head_dim)
    if name.startswith(("kv", "draft.kv")):
        return (spec.pages, PAGE * 8) if spec.mla else (spec.pages, *kv)
    if name.startswith(("swa", "dsv4swa")):
        return (SWA_PAGES, PAGE * 8) if spec.mla else (SWA_PAGES, *kv)
    if name.startswith(("nsa", "draft.nsa")):
        return (spec.pages, PAGE * 4) if name.endswith(".k") else (spec.pages, PAGE)
    if name.startswith("conv"):
        return (SLOTS, CONV_ROWS, sum(CONV_GROUPS))
    if name.startswith("ssm"):
        return (SLOTS, SSM_HEADS, 2, 3)
    if name.startswith("dsv4idx"):
        return (spec.pages, 16)
    if name.startswith("c128"):
        return (SLOTS, 10)
    if name == "meta":
        return (ROWS, 16)
    raise KeyError(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.hybrid")
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--bootstrap")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = msgspec.json.decode(args.spec, type=Spec)
    if args.role == "prefill":
        return run_prefill(spec)
    return run_decode(spec, args.bootstrap)


if __name__ == "__main__":
    sys.exit(main())
