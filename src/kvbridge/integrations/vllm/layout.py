"""vLLM's registered KV cache tensors as kvbridge regions, with their real layout.

vLLM hands the worker one tensor per attention layer (``register_kv_caches``).
Their logical shapes come from the attention backend; their physical order
from the strides (the layout vLLM resolved: NHD or HND, and for hybrid Mamba
models block-outermost):

- ``(2, blocks, tokens, heads, head_dim)`` (FlashAttention, Triton, ...) or
  ``(blocks, 2, tokens, heads, head_dim)`` (FlashInfer): per layer either a
  K and a V region (K and V stored apart) or one ``kv`` region per block
  (K and V of a block adjacent); heads sharded across TP;
- ``(blocks, tokens, head_dim)`` (MLA): one replicated latent region.

Layers of different KV cache groups alias the same memory in hybrid models
(a block id belongs to one group at a time); such views are registered once,
so every group's blocks address one ``kv_page`` index space.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge import KVArgs, IndexSpace, Region, Shard

__all__ = ["describe_vllm_caches", "ordered_layers"]

log = logging.getLogger(__name__)


def ordered_layers(kv_cache_config: Any) -> list[str]:
    """Every layer name of the KV cache groups, in group order (the same on prefill and decode)."""
    seen: dict[str, None] = {}
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            seen.setdefault(name, None)
    return list(seen)


def _spec_of(kv_cache_config: Any) -> dict[str, Any]:
    return {name: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for name in g.layer_names}


def _mem(t: Any) -> tuple[str, int]:
    return ("vram", t.device.index or 0) if t.is_cuda else ("dram", 0)


def _attention_regions(name: str, layer: int, t: Any, spec: Any, num_blocks: int, total_heads: int) -> list[Region]:
    """K/V (or combined) regions of one attention layer's tensor, checked against its spec."""
    T, H, D = spec.block_size, spec.num_kv_heads, spec.head_size
    elt = t.element_size()
    if t.ndim != 5:
        raise ValueError(f"layer {name!r}: expected a 5-d KV cache tensor (2, blocks, {T}, {H}, {D}) or "
                         f"(blocks, 2, {T}, {H}, {D}), got shape {tuple(t.shape)}")
    shape, stride = tuple(t.shape), t.stride()
    if shape[0] == 2 and shape[1] == num_blocks:
        kv_dim, b_dim = 0, 1
    elif shape[0] == num_blocks and shape[1] == 2:
        kv_dim, b_dim = 1, 0
    else:
        raise ValueError(f"layer {name!r}: shape {shape} has neither (2, {num_blocks}) nor ({num_blocks}, 2) in front")
    if shape[2:] != (T, H, D):
        raise ValueError(f"layer {name!r}: shape {shape} does not end with (tokens, heads, head_dim) = {(T, H, D)} "
                         "of its KV cache spec")
    s_kv, s_b, s_t, s_h, s_d = stride[kv_dim], stride[b_dim], stride[2], stride[3], stride[4]
    page = T * H * D
    if s_d == 1 and s_t == H * D and (s_h == D or H == 1):
        nhd = True  # token-major pages: [tokens][heads][head_dim]
    elif s_d == 1 and s_h == T * D and s_t == D:
        nhd = False  # head-major pages: [heads][tokens][head_dim]
    else:
        raise ValueError(f"layer {name!r}: strides {stride} are neither dense NHD nor dense HND pages of {(T, H, D)}")
    if total_heads < 1:
        raise ValueError(f"layer {name!r}: the model's total KV head count is {total_heads}")
    mem, device = _mem(t)
    base = t.data_ptr()
    if s_kv > s_b:  # K and V apart: two regions of dense pages
        if s_b != page or s_kv < num_blocks * page:
            raise ValueError(f"layer {name!r}: strides {stride} do not describe dense K and V pages")
        shard = (Shard(kind="split", outer=T, totals=(total_heads,), unit_nbytes=D * elt) if nhd
                 else Shard(kind="split", outer=1, totals=(total_heads,), unit_nbytes=T * D * elt))
        return [Region(name=f"{name}.{role}", addr=base + i * s_kv * elt, nbytes=num_blocks * page * elt,
                       stride=page * elt, role=role, index_space="kv_page", layer=layer, mem=mem, device=device,  # type: ignore[arg-type]
                       shard=shard)
                for i, role in enumerate(("k", "v"))]
    if s_b != 2 * page or s_kv != page:  # K and V of a block adjacent: one region of [2][page]
        raise ValueError(f"layer {name!r}: strides {stride} do not describe dense blocks of K and V")
    shard = (Shard(kind="split", outer=2 * T, totals=(total_heads,), unit_nbytes=D * elt) if nhd
             else Shard(kind="split", outer=2, totals=(total_heads,), unit_nbytes=T * D * elt))
    return [Region(name=f"{name}.kv", addr=base, nbytes=num_blocks * 2 * page * elt, stride=2 * page * elt,
                   role="kv", index_space="kv_page", layer=layer, mem=mem, device=device, shard=shard)]  # type: ignore[arg-type]


def _mla_region(name: str, layer: int, t: Any, spec: Any, num_blocks: int) -> Region:
    elt = t.element_size()
    if t.ndim != 3 or t.shape[0] != num_blocks or not t.is_contiguous():
        raise ValueError(f"layer {name!r}: an MLA cache must be a contiguous ({num_blocks}, tokens, dim) tensor, got "
                         f"shape {tuple(t.shape)} strides {t.stride()}")
    mem, device = _mem(t)
    return Region(name=f"{name}.kv", addr=t.data_ptr(), nbytes=t.numel() * elt, stride=t.stride(0) * elt,
                  role="kv", index_space="kv_page", layer=layer, mem=mem, device=device)  # type: ignore[arg-type]


def describe_vllm_caches(
    kv_caches: Mapping[str, Any], kv_cache_config: Any, *, total_kv_heads: int, tp_rank: int, tp_size: int,
) -> KVArgs:
    """One rank's KVArgs for the tensors vLLM registered (``layer name -> tensor``)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    specs = _spec_of(kv_cache_config)
    num_blocks = kv_cache_config.num_blocks
    regions: list[Region] = []
    aliased: dict[tuple[int, int, int], str] = {}  # (addr, stride, nbytes) -> the layer that registered it
    dtypes: set[str] = set()
    block_sizes: set[int] = set()
    unknown = sorted(set(kv_caches) - set(specs))
    if unknown:
        raise ValueError(f"register_kv_caches got layers {unknown[:5]} that no KV cache group names")
    for layer, name in enumerate(ordered_layers(kv_cache_config)):
        if name not in kv_caches:
            continue
        spec, t = specs[name], kv_caches[name]
        if isinstance(spec, MLAAttentionSpec):
            new = [_mla_region(name, layer, t, spec, num_blocks)]
        elif isinstance(spec, AttentionSpec):
            new = _attention_regions(name, layer, t, spec, num_blocks, total_kv_heads)
        else:
            raise ValueError(
                f"layer {name!r} has a {type(spec).__name__} KV cache: KVBridgeConnector moves attention KV "
                "(full, sliding window, MLA) only; Mamba / linear-attention state is not supported yet"
            )
        dtypes.add(str(spec.dtype).removeprefix("torch."))
        block_sizes.add(spec.block_size)
        for r in new:
            key = (r.addr, r.stride, r.nbytes)
            if key in aliased:  # another group's layer over the same bytes: one block pool, one region
                log.debug("layer %s aliases %s's memory; registered once", name, aliased[key])
                continue
            aliased[key] = name
            regions.append(r)
    if len(block_sizes) != 1:
        raise ValueError(f"KV cache groups use block sizes {sorted(block_sizes)}; KVBridgeConnector needs one block size")
    try:
        return KVArgs(regions=tuple(regions), index_spaces=(IndexSpace("kv_page", num_blocks, block_sizes.pop()),),
                      dtype="+".join(sorted(dtypes)), page_size=kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size,
                      tp_rank=tp_rank, tp_size=tp_size)
    except ValueError as exc:
        raise ValueError(f"vLLM's KV cache tensors cannot be registered with kvbridge: {exc} (layers that alias memory "
                         "with different shapes, e.g. Mamba state over attention pages, are not supported)") from None
