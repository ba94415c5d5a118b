"""SGLang's real pools on device="cpu", filled from global tensors, and the KVArgs SGLang fills from them.

The oracle is here, written without kvbridge: every KV buffer of a rank is its
TP slice (by KV heads, plain torch indexing) of a seeded *global* tensor
holding all heads; MLA latents and DSA indexer pages are the global tensor
itself on every rank. A decode rank is checked item by item against the
global tensor: destination pages equal the source pages sliced to its heads,
every page not asked for is still zero.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import MetadataBuffers, get_kv_transfer_buf_infos, setup_state_kv_args
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    HybridLinearKVPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.runtime_context import get_parallel

KINDS = ("mha", "swa", "mla", "dsa", "mamba")
HEADS = 4  # total KV heads (MHA / SWA)
HEAD_DIM = 8
LAYERS = 2  # target layers (SWA: one full, one sliding-window... see below)
ROWS = 8  # metadata rows
DTYPE = torch.bfloat16


def page_size(kind: str) -> int:
    return 64 if kind == "dsa" else 4  # DSA's indexer cache is laid out per 64-token page


def slots(kind: str) -> int:
    return 8 * page_size(kind)  # pool size in tokens: 8 pages (+1 padding page SGLang adds)


@dataclass
class Rank:
    """One SGLang rank's pools, as its scheduler would hold them."""

    kind: str
    tp_rank: int
    tp_size: int
    target: Any
    draft: Any
    metadata: MetadataBuffers
    kv_args: KVArgs = field(default=None)  # type: ignore[assignment]


def _mha(kind: str, tp: int, layers: int, start: int = 0) -> MHATokenToKVPool:
    return MHATokenToKVPool(size=slots(kind), page_size=page_size(kind), dtype=DTYPE, head_num=HEADS // tp,
                            head_dim=HEAD_DIM, layer_num=layers, device="cpu", enable_memory_saver=False,
                            start_layer=start)


def make_pool(kind: str, tp: int, draft: bool = False) -> Any:
    """SGLang's pool class for ``kind`` (a one-layer draft pool when ``draft``), zero-filled."""
    if kind == "mha":
        return _mha(kind, tp, 1 if draft else LAYERS)
    if kind == "swa":  # layers 0 and 2 sliding-window, 1 and 3 full attention; window pool half the size
        return SWAKVPool(size=slots(kind), size_swa=slots(kind) // 2, page_size=page_size(kind), dtype=DTYPE,
                         head_num=HEADS // tp, head_dim=HEAD_DIM, swa_attention_layer_ids=[0, 2],
                         full_attention_layer_ids=[1, 3], device="cpu")
    if kind == "mla":
        return MLATokenToKVPool(size=slots(kind), page_size=page_size(kind), dtype=DTYPE, kv_lora_rank=16,
                                qk_rope_head_dim=8, layer_num=1 if draft else LAYERS, device="cpu",
                                enable_memory_saver=False)
    if kind == "dsa":
        with get_parallel().override(attn_dcp_size=1):  # DSA reads the decode-context-parallel size
            return DSATokenToKVPool(size=slots(kind), page_size=page_size(kind), kv_lora_rank=16, dtype=DTYPE,
                                    qk_rope_head_dim=8, layer_num=1 if draft else LAYERS, device="cpu", index_head_dim=128,
                                    enable_memory_saver=False, kv_cache_dim=24)
    if kind == "mamba":  # a gated-delta-net hybrid: layers 0 and 2 Mamba, 1 and 3 full attention
        shape = Mamba2StateShape.create(tp_world_size=tp, intermediate_size=16, n_groups=2, num_heads=MAMBA_HEADS,
                                        head_dim=4, state_size=4, conv_kernel=4, conv_shard_groups=list(CONV_GROUPS))
        mamba = MambaPool(size=MAMBA_SLOTS - 1, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
                          mamba_layer_ids=[0, 2], device="cpu")
        return HybridLinearKVPool(size=slots(kind), dtype=DTYPE, page_size=page_size(kind), head_num=HEADS // tp,
                                  head_dim=HEAD_DIM, full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=mamba)
    raise ValueError(kind)


#: The Mamba layers' conv channels: q | k | v sub-blocks, each split across TP on its own.
CONV_GROUPS = (16, 8, 8)
MAMBA_HEADS = 4
MAMBA_SLOTS = 5  # request slots (SGLang adds one to the size it is given)


def local_part(g: torch.Tensor, how: str | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of a global buffer: heads (dim 1), or each conv sub-block's channels (dim 1)."""
    if how is None:
        return g
    if how in ("heads", "temporal"):
        per = g.shape[1] // tp_size
        return g[:, tp_rank * per:(tp_rank + 1) * per]
    if how == "conv":
        parts, start = [], 0
        for total in CONV_GROUPS:
            per = total // tp_size
            parts.append(g[:, start + tp_rank * per:start + (tp_rank + 1) * per])
            start += total
        return torch.cat(parts, dim=1)
    raise ValueError(how)


def make_metadata() -> MetadataBuffers:
    return MetadataBuffers(size=ROWS, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4)


Buffer = tuple[str, torch.Tensor, "str | None", str]


def kv_buffers(pool: Any) -> list[Buffer]:
    """(name, buffer, how TP splits it, what indexes it) of every transferable buffer of an SGLang pool.

    how: None (whole on every rank), "heads", "conv", "temporal" (see local_part); indexed by:
    "kv" (token slots, whole pages), "swa" (the SWA pool's token slots), "kv_rows" (one row per KV page), "slot".
    """
    if isinstance(pool, SWAKVPool):
        return ([(f"full.{n}", b, h, i) for n, b, h, i in kv_buffers(pool.full_kv_pool)]
                + [(f"swa.{n}", b, h, "swa") for n, b, h, _ in kv_buffers(pool.swa_kv_pool)])
    if isinstance(pool, HybridLinearKVPool):
        cache = pool.mamba_pool.mamba_cache
        return ([(f"full.{n}", b, h, i) for n, b, h, i in kv_buffers(pool.full_kv_pool)]
                + [(f"mamba.conv{li}", b, "conv", "slot") for li, b in enumerate(cache.conv[0])]
                + [(f"mamba.temporal{li}", b, "temporal", "slot") for li, b in enumerate(cache.temporal)])
    out: list[Buffer] = []
    if hasattr(pool, "k_buffer"):
        out += [(f"k{i}", b, "heads", "kv") for i, b in enumerate(pool.k_buffer)]
        out += [(f"v{i}", b, "heads", "kv") for i, b in enumerate(pool.v_buffer)]
    else:
        out += [(f"kv{i}", b, None, "kv") for i, b in enumerate(pool.kv_buffer)]
    if isinstance(pool, DSATokenToKVPool):
        out += [(f"index{i}", b, None, "kv_rows") for i, b in enumerate(pool.index_k_with_scale_buffer)]
    return out


def global_tensors(kind: str, draft: bool, seed: int) -> dict[str, torch.Tensor]:
    """Every buffer with all heads (TP 1 shapes), seeded random bytes."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, buf, _, _ in kv_buffers(make_pool(kind, 1)) + (
            [(f"draft.{n}", b, h, i) for n, b, h, i in kv_buffers(make_pool(kind, 1, draft=True))] if draft else []):
        raw = torch.randint(0, 256, (buf.numel() * buf.element_size(),), dtype=torch.uint8, generator=gen)
        out[name] = raw.view(buf.dtype).view(buf.shape)
    meta = make_metadata()
    for i, size in enumerate(meta.get_buf_infos()[1]):
        out[f"meta{i}"] = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    return out


def rank_buffers(rank: Rank) -> dict[str, tuple[torch.Tensor, str | None, str]]:
    out = {n: (b, h, i) for n, b, h, i in kv_buffers(rank.target)}
    if rank.draft is not None:
        out.update({f"draft.{n}": (b, h, i) for n, b, h, i in kv_buffers(rank.draft)})
    return out


def metadata_rows(meta: MetadataBuffers) -> list[torch.Tensor]:
    """Each metadata buffer as [rows, bytes] (SGLang's get_buf_infos order)."""
    ptrs = meta.get_buf_infos()[0]
    bufs = [b for b in (getattr(meta, f) for f in (
        "output_ids", "cached_tokens", "output_token_logprobs_val", "output_token_logprobs_idx",
        "output_top_logprobs_val", "output_top_logprobs_idx", "output_token_sampling_mask_len",
        "output_token_sampling_mask_idx", "output_token_sampling_logprobs", "output_topk_p", "output_topk_index",
        "output_hidden_states", "output_dsa_topk_indices", "bootstrap_room", "kv_checksum")) if b is not None]
    assert [b.data_ptr() for b in bufs] == ptrs, "the rig's metadata buffer list is not SGLang's get_buf_infos order"
    return [b.view(torch.uint8).view(b.shape[0], -1) for b in bufs]


def make_rank(kind: str, tp_rank: int, tp_size: int, *, draft: bool, fill: dict[str, torch.Tensor] | None) -> Rank:
    """A rank's pools; ``fill`` (the global tensors) copies this rank's slice in (prefill), else zeros (decode)."""
    rank = Rank(kind, tp_rank, tp_size, make_pool(kind, tp_size), make_pool(kind, tp_size, draft=True) if draft else None,
                make_metadata())
    if fill is not None:
        for name, (buf, how, _) in rank_buffers(rank).items():
            buf.copy_(local_part(fill[name], how, tp_rank, tp_size))
        for i, rows in enumerate(metadata_rows(rank.metadata)):
            rows.view(-1).copy_(fill[f"meta{i}"])
    rank.kv_args = sglang_kv_args(rank)
    return rank


def sglang_kv_args(rank: Rank) -> KVArgs:
    """The KVArgs SGLang's _init_kv_manager fills for this rank, with SGLang's own functions."""
    a = KVArgs()
    a.engine_rank = rank.tp_rank
    a.pp_rank = 0
    a.kv_cache_dtype_str = "bfloat16"
    ptrs, lens, items = get_kv_transfer_buf_infos(rank.target)
    a.num_draft_entries = 0
    if rank.draft is not None:
        d = rank.draft.get_contiguous_buf_infos()
        ptrs, lens, items = ptrs + d[0], lens + d[1], items + d[2]
        a.num_draft_entries = len(d[0])
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = ptrs, lens, items
    if rank.kind in ("mha", "swa", "mamba"):
        a.kv_head_num = rank.target.head_num
        a.total_kv_head_num = HEADS
    a.page_size = rank.target.page_size
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = rank.metadata.get_buf_infos()
    setup_state_kv_args(a, rank.target, rank.draft, 4)  # 4: the model's layer count (SWA and hybrid kinds)
    return a


def server_args(tp_size: int, port: int = 0) -> Any:
    """The ServerArgs fields kvbridge's manager reads (a real ServerArgs needs a model to load)."""
    return types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=port, tp_size=tp_size)


def is_mla(kind: str) -> bool:
    return kind in ("mla", "dsa")
