"""State handlers for SGLang's own pool classes (SGLang 0.5.23), registered by ``"module:QualName"``.

kvbridge never imports SGLang to register these: the pool types are strings,
resolved against a pool object's class hierarchy only when a host describes
one (rule 4), so a subclass SGLang adds later is served by its base's handler.

What each describes, in kvbridge's terms (every buffer a region, paired by
(state type, role, layer, draft) with the peer's):

- ``MHATokenToKVPool``: per layer K and V, token-major buffers
  ``[slots, heads_local, head_dim]``; one item is one page of ``page_size``
  tokens (what SGLang's ``get_contiguous_buf_infos`` registers), KV heads sliced
  under heterogeneous TP (``nhd`` only: SGLang's PD transfer refuses ``hnd``).
- ``MLATokenToKVPool``: per layer one latent buffer ``[slots, 1, dim]``, replicated.
- ``DSATokenToKVPool`` (an MLA pool): the MLA latents plus, per layer, the
  sparse-attention indexer cache (keys with their scales, one item per
  indexer page, replicated) -- SGLang's ``StateType.DSA``, addressed by its
  own page list (index space ``dsa_page``), as SGLang sends it: with the last
  chunk. A HiSparse decode's host pool is described in :mod:`.hisparse`.
- ``SWAKVPool``: its full-attention sub-pool as above (``kv_page``), its
  sliding-window sub-pool in the ``swa_page`` index space -- SGLang's
  ``StateType.SWA``, addressed by the window's own page list.
- ``MambaPool``: per Mamba layer the conv state (each channel sub-block of
  ``conv_shard_groups`` sliced on its own under heterogeneous TP) and the
  temporal (SSM) state (sliced by heads), one item per request slot (index
  space ``slot``) -- SGLang's ``StateType.MAMBA``;
- ``HybridLinearKVPool``: its full-attention sub-pool (MHA or MLA) at the
  model's full-attention layer ids, and its ``MambaPool``;
- ``DeepSeekV4TokenToKVPool`` (a ``BaseSWAKVPool``, not an ``SWAKVPool``):
  in SGLang's ``get_contiguous_buf_infos`` order, per compression ratio the
  compressed KV of each layer of that ratio (role ``c4`` / ``c128``, one item
  per full KV page; the C4 KV in ``c4_page``, a list of its own, because a
  HiSparse decode receives it in host pages) and the ratio's indexer pages
  (``c4_indexer``); as
  SGLang's ``StateType.SWA`` (``swa_page``, the window's own pages) the
  sliding-window latents of every layer (role ``kv``) and the page-scoped
  compression state rings (``c4_state``, ``c4_indexer_state``: one item is
  ``ring_size`` rows); as ``StateType.DSV4_REQUEST_STATE`` (``c128_state``,
  index space ``c128_slot``) the request-scoped C128 rings. All replicated
  across TP. Unified-KV, request-window, ring-SWA, DSpark-draft and ratio-1/2
  layouts are refused by name.
- ``MetadataBuffers``: the per-request metadata rows, in SGLang's
  ``get_buf_infos`` order (the commit point, written last).

Layer ids are the model's global layer ids (``start_layer`` + local index;
the SWA pool's mapping for its two sub-pools), so prefill and decode pair
entries by layer, not by position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbridge.core import (KV_PAGE_SPACE, METADATA_SPACE, DescribeContext, Description, HandlerCapabilities, IndexSpace,
                           Region, Shard, StateHandlerSpec, buffer_region, hookimpl, item_count)
from kvbridge.core.description.describe import paged_kv  # not re-exported by kvbridge.core

__all__ = ["C128_SPACE", "C128_STATE", "C4_PAGE_SPACE", "DSA_PAGE_SPACE", "DSA_STATE", "POOL_TYPES", "SLOT_SPACE", "SWA_PAGE_SPACE",
           "kvbridge_register_state_handlers"]

#: SGLang's sliding-window pages (the window's own page list), as kvbridge's swa handler names them.
SWA_PAGE_SPACE = "swa_page"
#: The state type of DSA indexer regions (SGLang's ``StateType.DSA``).
DSA_STATE = "dsa"
#: The DSA indexer's pages, addressed by SGLang's ``StateType.DSA`` list (the device pool's logical pages).
DSA_PAGE_SPACE = "dsa_page"
#: DeepSeek-V4's C4 KV pages: the KV page list on prefill and on a device decode; a HiSparse decode's host
#: pages (SGLang's KV list there, while its ``device_kv_indices`` address the other KV entries).
C4_PAGE_SPACE = "c4_page"
#: Request slots of the Mamba state (kvbridge's mamba handler's index space).
SLOT_SPACE = "slot"
#: DeepSeek-V4's request-scoped C128 state rings (SGLang's ``StateType.DSV4_REQUEST_STATE``, wire value
#: ``c128_state``), by the ring page SGLang's ``request_state_transfer_indices`` names (kvbridge's
#: dsv4_hisparse handler's ``c128_slot`` space).
C128_SPACE = "c128_slot"
C128_STATE = "c128_state"

_POOLS = "sglang.srt.mem_cache.memory_pool"
#: Every SGLang class a handler here serves, by handler name.
POOL_TYPES: dict[str, tuple[str, ...]] = {
    "sglang_mha": (f"{_POOLS}:MHATokenToKVPool",),
    "sglang_mla": (f"{_POOLS}:MLATokenToKVPool",),
    "sglang_dsa": (f"{_POOLS}:DSATokenToKVPool",),
    "sglang_swa": ("sglang.srt.mem_cache.swa_memory_pool:SWAKVPool",),
    "sglang_mamba": (f"{_POOLS}:MambaPool",),
    "sglang_hybrid_linear": (f"{_POOLS}:HybridLinearKVPool",),
    "sglang_dsv4": ("sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool",),
    "sglang_metadata": ("sglang.srt.disaggregation.utils:MetadataBuffers",),
    # kvbridge's own record of a HiSparse decode's host and device pools (the plugin builds it).
    "sglang_hisparse": ("kvbridge.integrations.sglang.hisparse:HiSparseDecodePools",),
}
#: Roles of DeepSeek-V4 regions beyond core's (per compression ratio; SGLang 0.5.23 has ratios 4 and 128).
DSV4_ROLES = ("c4", "c128", "c4_indexer", "c4_state", "c4_indexer_state")


def _pages(buf: Any, page_size: int, what: str) -> Any:
    """``buf`` ([slots, heads, dim], token-major) viewed as [pages, page_size, heads, dim]."""
    slots = int(buf.shape[0])
    if slots % page_size:
        raise ValueError(f"{what}: {slots} token slots are not a whole number of pages of {page_size} tokens; "
                         "SGLang allocates size + page_size slots with size a multiple of page_size")
    return buf.view(slots // page_size, page_size, *buf.shape[1:])


def _layer_ids(pool: Any) -> list[int]:
    return [int(pool.start_layer) + i for i in range(int(pool.layer_num))]


def describe_paged(pool: Any, ctx: DescribeContext, *, state_type: str, index_space: str,
                   layer_ids: Sequence[int] | None = None) -> Description:
    """An SGLang MHA or MLA token pool as paged KV regions (``layer_ids`` default: the pool's own)."""
    ids = list(layer_ids) if layer_ids is not None else _layer_ids(pool)
    page = int(pool.page_size)
    name = type(pool).__name__
    if hasattr(pool, "k_buffer"):  # MHA / GQA
        layout = getattr(pool, "kv_cache_layout", "nhd")
        if layout != "nhd":
            raise ValueError(f"{name}: kv_cache_layout {layout!r} is not supported; SGLang's PD transfer (and "
                             "kvbridge's SGLang integration) moves token-major 'nhd' pools only -- unset SGLANG_USE_HND_KVCACHE")
        k = [_pages(b, page, f"{name} K layer {i}") for i, b in zip(ids, pool.k_buffer)]
        v = [_pages(b, page, f"{name} V layer {i}") for i, b in zip(ids, pool.v_buffer)]
        # SGLang keeps this rank's heads; the model's total is heads x TP (replicated heads, TP > heads,
        # are refused by the adapter, which knows SGLang's total_kv_head_num).
        return paged_kv(k, v, layer_ids=ids, kv_heads=int(pool.head_num) * ctx.tp_size, layout="nhd", ctx=ctx,
                        state_type=state_type, index_space=index_space, page_size=page)
    if hasattr(pool, "kv_buffer"):  # MLA: one replicated latent buffer per layer
        kv = [_pages(b, page, f"{name} latent layer {i}") for i, b in zip(ids, pool.kv_buffer)]
        return paged_kv(kv, None, layer_ids=ids, kv_heads=1, layout="nhd", ctx=ctx, state_type=state_type,
                        index_space=index_space, page_size=page)
    raise TypeError(f"{name} has neither k_buffer/v_buffer (MHA) nor kv_buffer (MLA); kvbridge cannot describe it")


class MHAHandler:
    """``MHATokenToKVPool`` (and subclasses): K and V per layer, heads sliced under heterogeneous TP."""

    def describe(self, pool: Any, ctx: DescribeContext) -> Description:
        return describe_paged(pool, ctx, state_type="kv", index_space=KV_PAGE_SPACE)


class MLAHandler:
    """``MLATokenToKVPool``: one latent buffer per layer, replicated across TP."""

    def describe(self, pool: Any, ctx: DescribeContext) -> Description:
        return describe_paged(pool, ctx, state_type="kv", index_space=KV_PAGE_SPACE)


def describe_dsa_indexer(pool: Any, ctx: DescribeContext) -> Description:
    """A ``DSATokenToKVPool``'s indexer cache (keys with scales), one item per indexer page, in ``dsa_page``.

    SGLang addresses it by its ``StateType.DSA`` list, not by the KV pages: on a
    HiSparse decode the KV pages are host pages while the indexer stays in the
    device pool's logical pages (``HiSparseDSATokenToKVPool`` sizes it for the
    logical capacity, ``host_to_device_ratio`` times the device KV).
    """
    desc = Description()
    rows: list[int] = []
    for layer, buf in zip(_layer_ids(pool), pool.index_k_with_scale_buffer):
        if buf.numel() == 0:  # a layer sharing another's top-k owns a 0-row placeholder (SGLang skips it too)
            continue
        desc.regions.append(buffer_region(buf, name=f"{DSA_STATE}.indexer{layer}", role="indexer",
                                          index_space=DSA_PAGE_SPACE, layer=layer, state_type=DSA_STATE,
                                          draft=ctx.draft))
        rows.append(item_count(buf))
    if rows:  # as many pages as the smallest layer holds: every index must lie inside every region
        desc.index_spaces.append(IndexSpace(DSA_PAGE_SPACE, min(rows), int(pool.page_size), "page"))
    return desc


class DSAHandler:
    """``DSATokenToKVPool``: the MLA latents per KV page plus the indexer cache per indexer page."""

    def describe(self, pool: Any, ctx: DescribeContext) -> Description:
        desc = describe_paged(pool, ctx, state_type="kv", index_space=KV_PAGE_SPACE)
        indexer = describe_dsa_indexer(pool, ctx)
        desc.regions.extend(indexer.regions)
        desc.index_spaces.extend(indexer.index_spaces)
        return desc


class SWAHandler:
    """``SWAKVPool``: full-attention layers by KV page, sliding-window layers by the window's own pages."""

    def describe(self, pool: Any, ctx: DescribeContext) -> Description:
        full_ids = _ids_of(pool, swa=False)
        swa_ids = _ids_of(pool, swa=True)
        desc = describe_paged(pool.full_kv_pool, ctx, state_type="kv", index_space=KV_PAGE_SPACE, layer_ids=full_ids)
        swa = describe_paged(pool.swa_kv_pool, ctx, state_type="swa", index_space=SWA_PAGE_SPACE, layer_ids=swa_ids)
        desc.regions.extend(swa.regions)
        desc.index_spaces.extend(swa.index_spaces)
        return desc


def _ids_of(pool: Any, *, swa: bool) -> list[int]:
    """Global layer ids of an ``SWAKVPool``'s full (or SWA) sub-pool, in the sub-pool's buffer order."""
    mapping: dict[int, tuple[int, bool]] = pool.layers_mapping
    return [g for g, (_, is_swa) in sorted(mapping.items(), key=lambda kv: kv[1][0]) if is_swa == swa]


def describe_mamba(pool: Any, ctx: DescribeContext) -> Description:
    """A ``MambaPool``: conv and temporal state per Mamba layer, one item per request slot.

    SGLang's per-slot conv state is ``[channels, K-1]`` (``conv_slice_axis`` 0) or
    ``[K-1, channels]`` (1, Kimi); its channels are the concatenation of
    ``conv_shard_groups`` sub-blocks (q|k|v of a gated delta net), each split
    across TP on its own. The temporal state ``[heads, head_dim, state]`` is
    split by heads.
    """
    cache = pool.mamba_cache
    if len(cache.conv) != 1:
        raise ValueError(f"MambaPool with {len(cache.conv)} conv state tensors per layer: kvbridge's SGLang integration "
                         "describes one (Mamba2, gated delta net)")
    if any(getattr(cache, f, None) is not None for f in ("replayssm_d", "replayssm_k", "replayssm_g")):
        raise ValueError("MambaPool with ReplaySSM buffers: not described by kvbridge's SGLang integration "
                         "(disable --enable-linear-replayssm)")
    conv, temporal = cache.conv[0], cache.temporal
    axis = int(getattr(pool, "conv_slice_axis", 0))
    channels = int(conv.shape[2 + axis])
    # SGLang's own per-tensor sub-block sizes (conv tensors first); None: one block of all channels.
    declared = pool.get_state_conv_shard_groups()[0] if hasattr(pool, "get_state_conv_shard_groups") else None
    groups = tuple(int(n) for n in declared) if declared else (channels * ctx.tp_size,)
    conv_shard = (Shard(kind="split", outer=1, totals=groups, unit_nbytes=int(conv.shape[3]) * conv.element_size())
                  if axis == 0 else Shard(kind="split", outer=int(conv.shape[2]), totals=groups,
                                          unit_nbytes=conv.element_size()))
    heads = int(temporal.shape[2])
    t_shard = Shard(kind="split", outer=1, totals=(heads * ctx.tp_size,),
                    unit_nbytes=int(temporal[0, 0, 0].numel()) * temporal.element_size())
    desc = Description()
    for role, buf, shard in (("conv", conv, conv_shard), ("temporal", temporal, t_shard)):
        for li, layer in enumerate(pool.mamba_layer_ids):
            desc.regions.append(buffer_region(buf[li], name=f"mamba.{role}{layer}", role=role, index_space=SLOT_SPACE,
                                              layer=int(layer), state_type="mamba", draft=ctx.draft, shard=shard))
    desc.index_spaces.append(IndexSpace(SLOT_SPACE, int(conv.shape[1]), 1, "slot"))
    return desc


class MambaHandler:
    """``MambaPool``: conv and temporal state per Mamba layer, by request slot."""

    def describe(self, pool: Any, ctx: DescribeContext) -> Description:
        return describe_mamba(pool, ctx)


class HybridLinearHandler:
    """``HybridLinearKVPool``: the full-attention sub-pool by KV page, the Mamba pool by request slot."""

    def describe(self, pool: Any, ctx: DescribeContext) -> Description:
        if getattr(pool, "use_dsa", False):
            raise ValueError("HybridLinearKVPool with use_dsa: not described by kvbridge's SGLang integration yet")
        mapping: dict[int, int] = pool.full_attention_layer_id_mapping
        full_ids = [g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1])]
        desc = describe_paged(pool.full_kv_pool, ctx, state_type="kv", index_space=KV_PAGE_SPACE, layer_ids=full_ids)
        mamba = describe_mamba(pool.mamba_pool, ctx)
        desc.regions.extend(mamba.regions)
        desc.index_spaces.extend(mamba.index_spaces)
        return desc


def _rows_region(t: Any, *, stride: int, name: str, role: str, index_space: str, layer: int, state_type: str,
                 draft: bool) -> Region:
    """A replicated region over the whole 2-D ``t`` whose items are ``stride`` bytes (SGLang's item_len)."""
    if not t.is_contiguous():
        raise ValueError(f"DeepSeekV4TokenToKVPool buffer {name!r} is not contiguous; kvbridge registers whole buffers")
    nbytes = t.numel() * t.element_size()
    return Region(name=f"draft.{name}" if draft else name, addr=t.data_ptr(), nbytes=nbytes, stride=int(stride),
                  role=role, index_space=index_space, layer=layer, state_type=state_type, draft=draft,
                  mem="vram" if t.is_cuda else "dram", device=(t.device.index or 0) if t.is_cuda else 0)


def _space(name: str, regions: Sequence[Region], tokens: int, kind: str) -> IndexSpace | None:
    """The index space ``name`` as large as its smallest region (items past it are padding SGLang never addresses)."""
    mine = [r for r in regions if r.index_space == name]
    if not mine:
        return None
    return IndexSpace(name, min(r.nbytes // r.stride for r in mine), tokens, kind)  # type: ignore[arg-type]


class DSV4Handler:
    """``DeepSeekV4TokenToKVPool``: compressed KV by page, window and page-scoped state by SWA page, C128 state by ring page.

    Mirrors SGLang 0.5.23's ``get_contiguous_buf_infos``, ``get_state_buf_infos``
    and ``get_request_state_buf_infos`` entry by entry (same buffers, same item
    sizes, same order); the layer ids are the model's global ones.
    """

    def describe(self, pool: Any, ctx: DescribeContext) -> Description:
        name = type(pool).__name__
        for flag, why in (("_unified_kv", "unified KV (SGLANG_DSV4 unified_kv / triton)"),
                          ("request_window", "encoder-replay request windows"),
                          ("swa_req_ring_size", "a per-request SWA ring"), ("swa_valid_from", "a DSpark draft's SWA mark"),
                          ("uniform_fp8", "the trtllm uniform-FP8 layout")):
            if getattr(pool, flag, None):
                raise ValueError(f"{name} with {why}: not described by kvbridge's SGLang integration "
                                 "(it moves the paged layout only); use SGLang's own transfer backend")
        ratios = [int(r) for r in pool.compression_ratios]
        start, end = int(pool._stage_start), int(pool._stage_end)
        stage = ratios[start:end]
        odd = sorted({r for r in pool.kv_pools} - {4, 128})
        if odd:
            raise ValueError(f"{name} with compression ratios {odd}: only ratios 4 and 128 are described by kvbridge's "
                             "SGLang integration; use SGLang's own transfer backend for this model")
        regions: list[Region] = []
        common = {"draft": ctx.draft}
        for ratio, kv_pool in pool.kv_pools.items():
            layers = [start + i for i, r in enumerate(stage) if r == ratio]
            if kv_pool is not None:
                for layer, buf in zip(layers, kv_pool.kv_buffer):
                    regions.append(_rows_region(buf, stride=buf[0].nbytes, name=f"dsv4.c{ratio}.{layer}", role=f"c{ratio}",
                                                index_space=C4_PAGE_SPACE if ratio == 4 else KV_PAGE_SPACE, layer=layer,
                                                state_type="kv", **common))
            index_pool = pool.index_pools.get(ratio)
            if index_pool is not None:
                for layer, buf in zip(layers, index_pool.contiguous_page_row_buffers()):
                    regions.append(_rows_region(buf, stride=buf[0].nbytes, name=f"dsv4.c{ratio}_indexer.{layer}",
                                                role=f"c{ratio}_indexer", index_space=KV_PAGE_SPACE, layer=layer,
                                                state_type="kv", **common))
        swa = pool.swa_kv_pool
        per_logical = int(pool.swa_page_size) // int(swa.page_size)  # SGLang's physical pages per logical SWA page
        for i, buf in enumerate(swa.kv_buffer):
            regions.append(_rows_region(buf, stride=buf[0].nbytes * per_logical, name=f"dsv4.swa.{start + i}", role="kv",
                                        index_space=SWA_PAGE_SPACE, layer=start + i, state_type="swa", **common))
        for what, pools in (("", pool.compress_state_pools), ("_indexer", pool.indexer_compress_state_pools)):
            for layer, p in enumerate(pools):
                if p is None or p.request_scoped:
                    continue
                t = p.kv_score_buffer.kv_score
                regions.append(_rows_region(t, stride=t[0].nbytes * int(p.ring_size), name=f"dsv4.c{p.ratio}{what}_state.{layer}",
                                            role=f"c{p.ratio}{what}_state", index_space=SWA_PAGE_SPACE, layer=layer,
                                            state_type="swa", **common))
        for layer, p in enumerate(pool.compress_state_pools):
            if p is None or not p.request_scoped:
                continue
            if int(p.ratio) != 128:
                raise ValueError(f"{name}: request-scoped ratio-{p.ratio} state (layer {layer}) is not described by "
                                 "kvbridge's SGLang integration (ratio 128 only)")
            t = p.kv_score_buffer.kv_score
            rows = 1 if p.online else 128  # SGLang's item: the online row, or one 128-token ring page
            regions.append(_rows_region(t, stride=t[0].nbytes * rows, name=f"dsv4.c128_state.{layer}", role="state",
                                        index_space=C128_SPACE, layer=layer, state_type=C128_STATE, **common))
        desc = Description(regions=regions)
        for space, tokens, kind in ((KV_PAGE_SPACE, int(pool.page_size), "page"), (C4_PAGE_SPACE, int(pool.page_size), "page"),
                                    (SWA_PAGE_SPACE, int(pool.swa_page_size), "page"), (C128_SPACE, 1, "slot")):
            declared = _space(space, regions, tokens, kind)
            if declared is not None:
                desc.index_spaces.append(declared)
        return desc


#: ``MetadataBuffers`` attributes in the order of SGLang's ``get_buf_infos`` (absent ones are None there too).
METADATA_FIELDS = (
    "output_ids", "cached_tokens", "output_token_logprobs_val", "output_token_logprobs_idx",
    "output_top_logprobs_val", "output_top_logprobs_idx", "output_token_sampling_mask_len",
    "output_token_sampling_mask_idx", "output_token_sampling_logprobs", "output_topk_p", "output_topk_index",
    "output_hidden_states", "output_dsa_topk_indices", "bootstrap_room", "kv_checksum",
)


class MetadataHandler:
    """``MetadataBuffers``: one region per metadata buffer, one item per request row."""

    def describe(self, pool: Any, ctx: DescribeContext) -> Description:
        if ctx.draft:
            raise ValueError("SGLang's MetadataBuffers belong to the target model; pass them with the target pools")
        bufs = [(f, getattr(pool, f, None)) for f in METADATA_FIELDS]
        bufs = [(f, b) for f, b in bufs if b is not None]
        desc = Description()
        for i, (fname, buf) in enumerate(bufs):
            desc.regions.append(buffer_region(buf, name=f"metadata.{fname}", role="metadata", index_space=METADATA_SPACE,
                                              layer=i, state_type="metadata"))
        desc.index_spaces.append(IndexSpace(METADATA_SPACE, item_count(bufs[0][1]), 1, "row"))
        return desc


@hookimpl
def kvbridge_register_state_handlers() -> list[StateHandlerSpec]:
    here = "kvbridge.integrations.sglang.handlers"
    kv = HandlerCapabilities(index_spaces=(KV_PAGE_SPACE,), layouts=("nhd",), draft=True,
                             hetero_tp="slice KV heads (MHA/GQA), replicate (MLA)")
    mamba = HandlerCapabilities(index_spaces=(SLOT_SPACE,), draft=True,
                                hetero_tp="slice each conv sub-block and the SSM heads")
    return [
        StateHandlerSpec(name="sglang_mha", factory=f"{here}:MHAHandler", pool_types=POOL_TYPES["sglang_mha"],
                         capabilities=kv, description="SGLang MHATokenToKVPool: K/V per layer, token-major pages"),
        StateHandlerSpec(name="sglang_mla", factory=f"{here}:MLAHandler", pool_types=POOL_TYPES["sglang_mla"],
                         capabilities=kv, description="SGLang MLATokenToKVPool: one latent buffer per layer"),
        StateHandlerSpec(name="sglang_dsa", factory=f"{here}:DSAHandler", pool_types=POOL_TYPES["sglang_dsa"],
                         capabilities=HandlerCapabilities(index_spaces=(KV_PAGE_SPACE, DSA_PAGE_SPACE), draft=True,
                                                          hetero_tp="replicated"),
                         description="SGLang DSATokenToKVPool: MLA latents and the sparse-attention indexer cache"),
        StateHandlerSpec(name="sglang_hisparse", factory="kvbridge.integrations.sglang.hisparse:HiSparseHandler",
                         pool_types=POOL_TYPES["sglang_hisparse"],
                         capabilities=HandlerCapabilities(index_spaces=(KV_PAGE_SPACE, DSA_PAGE_SPACE, C4_PAGE_SPACE,
                                                                        SWA_PAGE_SPACE, C128_SPACE),
                                                          roles=DSV4_ROLES, hetero_tp="replicated"),
                         description="SGLang HiSparse decode: KV in the host pool by host page (DSA: MLATokenToKVPoolHost; "
                                     "DeepSeek-V4: the C4 KV in DeepSeekV4PagedHostPool), the rest on the device"),
        StateHandlerSpec(name="sglang_swa", factory=f"{here}:SWAHandler", pool_types=POOL_TYPES["sglang_swa"],
                         capabilities=HandlerCapabilities(index_spaces=(KV_PAGE_SPACE, SWA_PAGE_SPACE), layouts=("nhd",),
                                                          draft=True, hetero_tp="slice KV heads (MHA), replicate (MLA)"),
                         description="SGLang SWAKVPool: full KV by page, the sliding window by its own pages"),
        StateHandlerSpec(name="sglang_mamba", factory=f"{here}:MambaHandler", pool_types=POOL_TYPES["sglang_mamba"],
                         capabilities=mamba, description="SGLang MambaPool: conv and SSM state per request slot"),
        StateHandlerSpec(name="sglang_hybrid_linear", factory=f"{here}:HybridLinearHandler",
                         pool_types=POOL_TYPES["sglang_hybrid_linear"],
                         capabilities=HandlerCapabilities(index_spaces=(KV_PAGE_SPACE, SLOT_SPACE), layouts=("nhd",), draft=True,
                                                          hetero_tp="slice KV heads; conv sub-blocks and SSM heads"),
                         description="SGLang HybridLinearKVPool: full-attention KV by page, Mamba state by slot"),
        StateHandlerSpec(name="sglang_dsv4", factory=f"{here}:DSV4Handler", pool_types=POOL_TYPES["sglang_dsv4"],
                         capabilities=HandlerCapabilities(index_spaces=(KV_PAGE_SPACE, C4_PAGE_SPACE, SWA_PAGE_SPACE, C128_SPACE),
                                                          roles=DSV4_ROLES, hetero_tp="replicated"),
                         description="SGLang DeepSeekV4TokenToKVPool: C4/C128 KV by page, window and state by SWA page, "
                                     "C128 rings by request"),
        StateHandlerSpec(name="sglang_metadata", factory=f"{here}:MetadataHandler", pool_types=POOL_TYPES["sglang_metadata"],
                         capabilities=HandlerCapabilities(index_spaces=(METADATA_SPACE,), hetero_tp="replicated"),
                         description="SGLang MetadataBuffers: per-request metadata rows, written last"),
    ]
