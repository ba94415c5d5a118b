"""SGLang's real DeepSeekV4TokenToKVPool on device="cpu", its KVArgs, and one request through kvbridge's adapters.

The pool reads SGLang's published ServerArgs, a process-wide setting, so
every function here runs in a forked child of the test process (``forked.run``).

The oracle is written from SGLang's pool attributes, not from kvbridge's
description: every transferable buffer as ``[rows, bytes]`` and how many rows
one transfer item holds (SGLang's ``item_len`` over the row size). Prefill's
buffers are a seeded *global* tensor (DeepSeek-V4's caches are replicated
across TP, so every rank holds all of it); a decode rank must hold, at each
index SGLang's decode passed, the rows prefill's matching index holds, and
zeros everywhere else (plain torch indexing).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import sglang_rig as rig
import torch

#: The request: 300 tokens (a partial C128 block pends), two 256-token KV pages sent in two chunks, the
#: sliding window's two SWA pages, the request's pool slot on each side (SGLang's req_pool_idx).
TOKENS = 300
SRC_PAGES, DST_PAGES = [3, 5], [6, 1]
SRC_SWA, DST_SWA = [1, 2], [2, 1]
SRC_REQ, DST_REQ = 2, 4
SRC_ROW, DST_ROW = 3, 5


def publish_server_args() -> None:
    """SGLang's pools read the published ServerArgs (a tiny local model config: nothing is downloaded)."""
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    model = tempfile.mkdtemp()
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 128,
                   "max_position_embeddings": 256, "rms_norm_eps": 1e-6}, f)
    publish(ServerArgs(model_path=model, device="cpu", skip_tokenizer_init=True), role="scheduler",
            ranks=SpawnRanks(world_rank=0))


def make_pool(hisparse: bool = False) -> Any:
    """Three layers: sliding-window only, C4 (with indexer), C128; FP8 KV, FP32 compression state.

    Every cache is replicated across attention TP (one latent head), so a rank of any TP size holds the
    same shapes; the pool is built under the one-rank topology the published ServerArgs describe, and
    the TP size reaches kvbridge through the manager's server_args and KVArgs.engine_rank.
    ``hisparse``: SGLang's ``enable_hisparse`` (its C4 KV pool a ``HiSparseC4DevicePool``), a HiSparse decode's.
    """
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1, attn_tp_size=1, attn_tp_rank=0):
        return DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=512, c4_size=256, c128_size=256, c4_state_pool_size=24, c128_state_pool_size=8,
            page_size=256, swa_page_size=256, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=3,
            device="cpu", enable_memory_saver=False, compression_ratios=[0, 4, 128], sliding_window=128,
            enable_hisparse=hisparse)


#: A HiSparse decode's C4 host pages (its host pool has HOST_PAGES, the device C4 pool 8).
HOST_PAGES = 12
DST_HOST_PAGES = [10, 4]


def make_host(pool: Any) -> Any:
    """``HiSparseCoordinator``'s ``DeepSeekV4PagedHostPool`` over ``pool``'s C4 device pool, with
    ``pin_memory=False`` (SGLang's default pins with ``cudaHostRegister``, which needs CUDA)."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    c4 = pool.c4_kv_pool
    return DeepSeekV4PagedHostPool(pool_name="dsv4_hisparse_c4", device_buffers=c4.kv_buffer,
                                   item_bytes=c4.bytes_per_page_padded, num_host_pages=HOST_PAGES,
                                   slot_page_size=c4.page_size, layout="layer_first", pin_memory=False)


def hisparse_kv_args(pool: Any, host: Any, meta: Any, tp_rank: int) -> Any:
    """The KVArgs SGLang's decode ``_init_kv_manager`` fills with ``enable_hisparse`` for DeepSeek-V4: the host
    C4 entries (``DRAM``), then the device pool's entries after its C4 layers; state from the device pool."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos, setup_state_kv_args

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.kv_cache_dtype_str, a.num_draft_entries = tp_rank, 0, "fp8_e4m3", 0
    ptrs, lens, items = get_kv_transfer_buf_infos(host)
    dev = pool.get_contiguous_buf_infos()
    n = host.layer_num  # SGLang's c4_layer_num
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = ptrs + dev[0][n:], lens + dev[1][n:], items + dev[2][n:]
    a.kv_data_mem_kinds = ["DRAM"] * len(ptrs) + ["VRAM"] * len(dev[0][n:])
    a.page_size = pool.page_size
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = meta.get_buf_infos()
    setup_state_kv_args(a, pool, None, len(pool.compression_ratios))
    return a


def make_draft_pool() -> Any:
    """The NextN (MTP) draft as SGLang builds it for DeepSeek-V4: one sliding-window-only layer (ratio 0), the
    target's SWA geometry; SGLang's ``setup_state_kv_args`` registers its window latents as a second
    ``StateType.SWA`` component addressed by the target's SWA page list."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1, attn_tp_size=1, attn_tp_rank=0):
        return DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=512, c4_size=256, c128_size=256, c4_state_pool_size=24, c128_state_pool_size=8,
            page_size=256, swa_page_size=256, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=1,
            device="cpu", enable_memory_saver=False, compression_ratios=[0], sliding_window=128, is_draft_worker=True)


def all_buffers(pool: Any, draft: Any) -> dict[str, tuple[torch.Tensor, str, int]]:
    """The target's buffers and (with a draft pool) the draft's, named ``draft.*``."""
    out = buffers(pool)
    if draft is not None:
        out.update({f"draft.{n}": v for n, v in buffers(draft).items()})
    return out


def buffers(pool: Any) -> dict[str, tuple[torch.Tensor, str, int]]:
    """name -> (buffer as [rows, bytes], the index list that addresses it, rows per item), from SGLang's attributes."""
    out: dict[str, tuple[torch.Tensor, str, int]] = {}
    for ratio, kv_pool in pool.kv_pools.items():
        for i, b in enumerate(kv_pool.kv_buffer):
            out[f"c{ratio}.{i}"] = (b, "kv", 1)
    for ratio, index_pool in pool.index_pools.items():
        for i, b in enumerate(index_pool.contiguous_page_row_buffers()):
            out[f"c{ratio}_indexer.{i}"] = (b, "kv", 1)
    for i, b in enumerate(pool.swa_kv_pool.kv_buffer):
        out[f"swa.{i}"] = (b, "swa", 1)
    for what, pools in (("state", pool.compress_state_pools), ("indexer_state", pool.indexer_compress_state_pools)):
        for layer, p in enumerate(pools):
            if p is not None:
                # Page-scoped rings follow the SWA pages; the request-scoped C128 ring travels by its own page.
                out[f"{what}.{layer}"] = (p.kv_score_buffer.kv_score, "c128" if p.request_scoped else "swa",
                                          128 if p.request_scoped else p.ring_size)
    return {n: (b.view(torch.uint8).view(b.shape[0], -1), index, rows) for n, (b, index, rows) in out.items()}


def global_tensors(seed: int, draft: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    bufs = all_buffers(make_pool(), make_draft_pool() if draft else None)
    out = {n: torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen) for n, (b, _, _) in bufs.items()}
    meta = rig.make_metadata()
    for i, size in enumerate(meta.get_buf_infos()[1]):
        out[f"meta{i}"] = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    return out


def kv_args(pool: Any, meta: Any, tp_rank: int, draft: Any = None) -> Any:
    """The KVArgs SGLang's _init_kv_manager fills for this rank, with SGLang's own functions (the draft's
    ``get_contiguous_buf_infos`` entries appended as ``num_draft_entries``, as its decode.py / prefill.py do)."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos, setup_state_kv_args

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.kv_cache_dtype_str, a.num_draft_entries = tp_rank, 0, "fp8_e4m3", 0
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = get_kv_transfer_buf_infos(pool)
    if draft is not None:
        ptrs, lens, items = draft.get_contiguous_buf_infos()  # none: a ratio-0 (window-only) draft has no paged KV
        a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = a.kv_data_ptrs + ptrs, a.kv_data_lens + lens, a.kv_item_lens + items
        a.num_draft_entries = len(ptrs)
    a.page_size = pool.page_size
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = meta.get_buf_infos()
    setup_state_kv_args(a, pool, draft, len(pool.compression_ratios))
    return a


def state_indices(args: Any, pool: Any, swa: list[int], req: int, tokens: int) -> list[Any]:
    """Per ``args.state_types``, the lists SGLang's _send_kv_chunk / decode's pre-allocation pass for this request."""
    lists = {"swa": np.array(swa, dtype=np.int32), "c128_state": pool.request_state_transfer_indices(req, tokens)}
    return [lists[getattr(st, "value", st)] for st in args.state_types]


def describe_and_compare(draft: bool = False) -> list[str]:
    """kvbridge's description of the pool against SGLang's KVArgs (empty: they agree), plus what kvbridge saw."""
    from kvbridge.core import describe
    from kvbridge.integrations.sglang.crosscheck import compare

    publish_server_args()
    pool, meta = make_pool(), rig.make_metadata()
    dpool = make_draft_pool() if draft else None
    ours = describe([pool, meta], draft_pools=[dpool] if draft else (), dtype="fp8_e4m3", page_size=256)
    args = kv_args(pool, meta, 0, dpool)
    summary = [f"{'draft ' if r.draft else ''}{r.state_type}/{r.role}/{r.layer}/{r.index_space}" for r in ours.regions
               if r.state_type != "metadata"]
    return compare(args, ours) + ["regions: " + ", ".join(summary),
                                  "state types: " + ",".join(getattr(s, "value", s) for s in args.state_types),
                                  "spaces: " + ",".join(f"{s.name}={s.count}" for s in ours.index_spaces)]


def transfer(prefill_tp: int, decode_tp: int, seed: int, room: int, backend: str = "memory", tokens: int = TOKENS,
             draft: bool = False, hisparse: bool = False) -> list[str]:
    """One request of ``tokens`` tokens through kvbridge's SGLang adapter classes in SGLang's call order, over
    kvbridge ``backend`` (as ``KVBRIDGE_SGLANG_BACKEND`` chose it); every mismatch (empty: byte-exact).
    At a multiple of 128 tokens nothing pends in C128: SGLang's ``c128_state`` lists are empty on both sides."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvbridge.integrations.sglang.conn import (
        KVBridgeKVBootstrapServer,
        KVBridgeKVManager,
        KVBridgeKVReceiver,
        KVBridgeKVSender,
        sglang_pools,
    )

    publish_server_args()
    g = global_tensors(seed, draft)
    boot = KVBridgeKVBootstrapServer("127.0.0.1", 0)
    port = int(boot.address.rsplit(":", 1)[1])
    managers: list[Any] = []

    hosts: dict[int, Any] = {}  # id(decode pool) -> its HiSparse host pool

    def rank(tp_rank: int, tp_size: int, fill: bool) -> tuple[Any, Any, Any, Any]:
        on_host = hisparse and not fill  # a HiSparse decode
        pool, meta = make_pool(hisparse=on_host), rig.make_metadata()
        dpool = make_draft_pool() if draft else None
        for name, (buf, _, _) in all_buffers(pool, dpool).items():
            # Replicated caches: every prefill rank holds the whole global tensor. Decode starts from zeros
            # (SGLang leaves the compression-state rings uninitialized: torch.empty).
            buf.copy_(g[name]) if fill else buf.zero_()
        if fill:
            for i, rows in enumerate(rig.metadata_rows(meta)):
                rows.view(-1).copy_(g[f"meta{i}"])
        if on_host:
            hosts[id(pool)] = make_host(pool)
            return pool, meta, hisparse_kv_args(pool, hosts[id(pool)], meta, tp_rank), dpool
        return pool, meta, kv_args(pool, meta, tp_rank, dpool), dpool

    def manager(r: tuple[Any, Any, Any, Any], mode: Any, tp_size: int) -> Any:
        from kvbridge.integrations.sglang.hisparse import HiSparseDecodePools

        target = HiSparseDecodePools(host=hosts[id(r[0])], device=r[0]) if id(r[0]) in hosts else r[0]
        with sglang_pools(target, r[3], r[1]):
            m = KVBridgeKVManager(r[2], mode, rig.server_args(tp_size, port), True)
        managers.append(m)
        return m

    def wait(pollers: list[Any], states: set[int]) -> list[int]:
        deadline = time.monotonic() + 30
        while True:
            polls = [int(p.poll()) for p in pollers]
            if all(s in states for s in polls) or time.monotonic() > deadline:
                return polls
            time.sleep(0.005)

    try:
        p_ranks = [rank(r, prefill_tp, True) for r in range(prefill_tp)]
        d_ranks = [rank(r, decode_tp, False) for r in range(decode_tp)]
        p_mgrs = [manager(r, DisaggregationMode.PREFILL, prefill_tp) for r in p_ranks]
        d_mgrs = [manager(r, DisaggregationMode.DECODE, decode_tp) for r in d_ranks]
        used = sorted({m.transfer.backend_name for m in managers})  # lanes, e.g. "cuda_ipc,nixl": CPU bytes take the last
        if any(name.split(",")[-1] != backend for name in used):
            return [f"managers run over lanes {used}, not ending in {backend!r}"]
        senders = [KVBridgeKVSender(m, f"127.0.0.1:{port}", room) for m in p_mgrs]
        recvs = [KVBridgeKVReceiver(m, f"127.0.0.1:{port}", room) for m in d_mgrs]
        for recv, (pool, _, args, _) in zip(recvs, d_ranks):  # decode's pre-allocation queue
            recv.init(0)
            if hisparse:  # SGLang's HiSparse decode: C4 host pages as the KV list, the device entries' pages beside them
                recv.send_metadata(np.array(DST_HOST_PAGES, dtype=np.int32), DST_ROW,
                                   state_indices(args, pool, DST_SWA, DST_REQ, tokens),
                                   device_kv_indices=np.array(DST_PAGES, dtype=np.int32))
            else:
                recv.send_metadata(np.array(DST_PAGES, dtype=np.int32), DST_ROW, state_indices(args, pool, DST_SWA, DST_REQ, tokens))
        polls = wait(senders, {KVPoll.WaitingForInput, KVPoll.Failed})
        if polls != [KVPoll.WaitingForInput] * len(senders):
            return [f"prefill senders polled {polls}: {[s.sender.failure() for s in senders]}"]
        for s in senders:  # prefill: init, then one chunk per page, SGLang's state lists with the last
            s.init(len(SRC_PAGES), SRC_ROW)
        for i, page in enumerate(SRC_PAGES):
            last = i == len(SRC_PAGES) - 1
            for s, (pool, _, args, _) in zip(senders, p_ranks):
                s.send(np.array([page], dtype=np.int32), state_indices(args, pool, SRC_SWA, SRC_REQ, tokens) if last else None,
                       num_kv_tokens=256)
        s_polls = wait(senders, {KVPoll.Success, KVPoll.Failed})
        r_polls = wait(recvs, {KVPoll.Success, KVPoll.Failed})
        if s_polls + r_polls != [KVPoll.Success] * (len(senders) + len(recvs)):
            return [f"polls: prefill {s_polls}, decode {r_polls}; reasons: "
                    f"{[s.sender.failure() for s in senders] + [r.receiver.failure() for r in recvs]}"]
        return [p for tp_rank, (pool, meta, _, dpool) in enumerate(d_ranks)
                for p in check_decode(pool, meta, g, tp_rank, tokens, dpool, hosts.get(id(pool)))]
    finally:
        for m in managers:
            m.close()
        boot.close()


def check_decode(pool: Any, meta: Any, g: dict[str, torch.Tensor], tp_rank: int = 0, tokens: int = TOKENS,
                 draft: Any = None, host: Any = None) -> list[str]:
    """Every buffer of a decode rank against the global tensors: asked-for items from prefill's, the rest zero.

    ``host``: a HiSparse decode's C4 host pool, which receives the C4 KV at DST_HOST_PAGES; the device's
    own C4 KV buffers must then stay zero."""
    src_c128 = [int(i) for i in pool.request_state_transfer_indices(SRC_REQ, tokens)]
    dst_c128 = [int(i) for i in pool.request_state_transfer_indices(DST_REQ, tokens)]
    pairs = {"kv": list(zip(SRC_PAGES, DST_PAGES)), "swa": list(zip(SRC_SWA, DST_SWA)), "c128": list(zip(src_c128, dst_c128))}
    problems = []
    hosted = {f"c4.{i}": b for i, b in enumerate(host.kv_buffer)} if host is not None else {}
    for name, b in hosted.items():
        expect = b.new_zeros(b.shape)
        for s, d in zip(SRC_PAGES, DST_HOST_PAGES):
            expect[d] = g[name][s]
        if not b.equal(expect):
            problems.append(f"decode TP rank {tp_rank}: host buffer {name} differs from the oracle")
    for name, (buf, index, rows) in all_buffers(pool, draft).items():
        expect = torch.zeros_like(g[name])
        for s, d in pairs[index] if name not in hosted else ():  # hosted: the device copy receives nothing
            expect[d * rows:(d + 1) * rows] = g[name][s * rows:(s + 1) * rows]
        if not buf.equal(expect):
            problems.append(f"decode TP rank {tp_rank}: buffer {name} differs from the oracle")
    for i, rows in enumerate(rig.metadata_rows(meta)):
        want = rows.new_zeros(rows.shape)
        want[DST_ROW] = g[f"meta{i}"].view(rows.shape)[SRC_ROW]
        if not bool((rows == want).all()):
            problems.append(f"decode TP rank {tp_rank}: metadata buffer {i} differs from the oracle")
    return problems


def untouched_decode_problems(seed: int) -> int:
    """How many buffers the oracle reports on a decode rank that received nothing (the oracle can fail)."""
    publish_server_args()
    pool, meta = make_pool(), rig.make_metadata()
    for buf, _, _ in buffers(pool).values():
        buf.zero_()
    return len(check_decode(pool, meta, global_tensors(seed))) - len(buffers(pool)) - len(rig.metadata_rows(meta))


def handler_name() -> str:
    """The kvbridge state handler SGLang's DeepSeekV4TokenToKVPool resolves to (by its class hierarchy)."""
    from kvbridge.core.description.plugins import get_registry

    publish_server_args()
    return get_registry().state_resolver().resolve(make_pool()).name


def describe_with_ratio_2_layer() -> str:
    """SGLang's pool with a ratio-2 kv-source layer (a layout kvbridge does not move): what describe() says."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from kvbridge.core import describe

    publish_server_args()
    with get_parallel().override(attn_dcp_size=1, attn_tp_size=1, attn_tp_rank=0):
        pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=512, c4_size=256, c128_size=256, c4_state_pool_size=24, c128_state_pool_size=8,
            page_size=256, swa_page_size=256, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=4,
            device="cpu", enable_memory_saver=False, compression_ratios=[0, 4, 128, 2], sliding_window=128,
            kv_source_layers=[3], full_size=512)
    try:
        describe([pool], dtype="fp8_e4m3", page_size=256)
    except ValueError as exc:
        return str(exc)
    return "described"


def untouched_hisparse_decode_problems(seed: int) -> list[str]:
    """What the oracle reports on a HiSparse decode rank (device pool and host pool) that received nothing."""
    publish_server_args()
    pool, meta = make_pool(hisparse=True), rig.make_metadata()
    for buf, _, _ in buffers(pool).values():
        buf.zero_()
    return check_decode(pool, meta, global_tensors(seed), host=make_host(pool))
