"""Sparse-attention (NSA / DSA) indexer cache: index keys and their scales per layer, by KV page.

Replicated across TP (one prefill rank sends each page). With speculative
decoding the draft model's indexer pool is passed in ``draft_pools`` on both
sides and appended symmetrically; without one nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.core import HandlerCapabilities, StateHandlerSpec, hookimpl
from kvbridge.core.description.describe import DescribeContext, Description, buffer_region, item_count
from kvbridge.core.description.layout import IndexSpace
from kvbridge.core.description.pools import KV_PAGE_SPACE


@dataclass
class NSAPool:
    """Per layer an index-key buffer ``[pages, ...]`` and optionally a scale buffer ``[pages, ...]``."""

    index_k: Sequence[Any]
    scales: Sequence[Any] | None
    layer_ids: Sequence[int]
    page_size: int


class NSAHandler:
    def describe(self, pool: NSAPool, ctx: DescribeContext) -> Description:
        desc = Description()
        groups = [("indexer", pool.index_k)] + ([("scale", pool.scales)] if pool.scales is not None else [])
        for role, bufs in groups:
            if len(bufs) != len(pool.layer_ids):
                raise ValueError(f"nsa: {len(bufs)} {role} buffers for {len(pool.layer_ids)} layer ids")
            for layer, buf in zip(pool.layer_ids, bufs):
                desc.regions.append(buffer_region(buf, name=f"nsa.{role}{layer}", role=role, index_space=KV_PAGE_SPACE,
                                                  layer=layer, state_type="nsa", draft=ctx.draft))
        if pool.index_k:
            desc.index_spaces.append(IndexSpace(KV_PAGE_SPACE, item_count(pool.index_k[0]), pool.page_size, "page"))
        return desc


@hookimpl
def kvbridge_register_state_handlers() -> list[StateHandlerSpec]:
    return [StateHandlerSpec(
        name="nsa", factory="kvbridge.state_handlers.nsa:NSAHandler", pool_types=(NSAPool,),
        capabilities=HandlerCapabilities(index_spaces=(KV_PAGE_SPACE,), hetero_tp="replicated", draft=True),
        description="sparse-attention indexer keys and scales per KV page",
    )]
