"""Core's own pools: the full KV cache (MHA/GQA or MLA) and the metadata rows.

They are resolved and described like any state type (the handlers register
through the ``kvbridge`` entry-point group as ``kv`` and ``metadata``), so a
host pool class derived from :class:`KVPool` is handled without registration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .describe import DescribeContext, Description, buffer_region, item_count, paged_kv
from .hookspecs import hookimpl
from .layout import KV_PAGE_SPACE, METADATA_SPACE, IndexSpace
from .records import HandlerCapabilities, StateHandlerSpec

__all__ = ["KVPool", "MetadataPool", "KV_PAGE_SPACE", "METADATA_SPACE"]

@dataclass
class KVPool:
    """Full-attention KV: per layer a K and a V buffer (MHA/GQA), or one latent buffer (MLA, ``v=None``).

    MHA buffers are ``[pages, page_size, kv_heads_local, head_dim]`` (``layout="nhd"``)
    or ``[pages, kv_heads_local, page_size, head_dim]`` (``"hnd"``); ``kv_heads`` is
    the model's total KV head count.
    """

    k: Sequence[Any]
    v: Sequence[Any] | None
    layer_ids: Sequence[int]
    page_size: int
    kv_heads: int = 1
    layout: str = "nhd"


@dataclass
class MetadataPool:
    """Per-request metadata rows (first token, logprobs, ...): each buffer ``[rows, ...]``."""

    buffers: Sequence[Any]


class KVHandler:
    def describe(self, pool: KVPool, ctx: DescribeContext) -> Description:
        return paged_kv(pool.k, pool.v, layer_ids=pool.layer_ids, kv_heads=pool.kv_heads, layout=pool.layout,
                        ctx=ctx, state_type="kv", index_space=KV_PAGE_SPACE, page_size=pool.page_size)


class MetadataHandler:
    def describe(self, pool: MetadataPool, ctx: DescribeContext) -> Description:
        if ctx.draft:
            raise ValueError("metadata rows belong to the target model; pass the MetadataPool in pools, not draft_pools")
        desc = Description()
        for i, buf in enumerate(pool.buffers):
            desc.regions.append(buffer_region(buf, name=f"metadata{i}", role="metadata", index_space=METADATA_SPACE,
                                              layer=i, state_type="metadata"))
        rows = {item_count(b) for b in pool.buffers}
        if len(rows) != 1:
            raise ValueError(f"metadata buffers must have the same number of rows, got {sorted(rows)}")
        desc.index_spaces.append(IndexSpace(METADATA_SPACE, rows.pop(), 1, "row"))
        return desc


@hookimpl
def kvbridge_register_state_handlers() -> list[StateHandlerSpec]:
    return [
        StateHandlerSpec(name="kv", factory="kvbridge.core.description.pools:KVHandler", pool_types=(KVPool,),
                         capabilities=HandlerCapabilities(index_spaces=(KV_PAGE_SPACE,), layouts=("nhd", "hnd"), draft=True,
                                                           hetero_tp="slice heads (MHA/GQA), replicate (MLA)"),
                         description="full-attention KV cache (core)"),
        StateHandlerSpec(name="metadata", factory="kvbridge.core.description.pools:MetadataHandler", pool_types=(MetadataPool,),
                         capabilities=HandlerCapabilities(index_spaces=(METADATA_SPACE,), hetero_tp="replicated"),
                         description="per-request metadata rows, written last (core)"),
    ]
