"""DeepSeek-V4-style compressed caches with HiSparse.

A :class:`DSV4HiSparsePool` is an SWA pool (its sliding-window KV is described
exactly as :mod:`~kvbridge.state_handlers.swa` does) plus:

- **C4 compressed KV** per layer. On prefill it lives in device pages of
  ``page_size // ratio`` compressed tokens; on a HiSparse decode it goes
  straight into a **host-memory** pool of rows holding ``c4_tokens_per_item``
  compressed tokens each (a different geometry). It is addressed per
  compressed token (index space ``c4_token``): each side turns its own page
  or row list into token indices with :func:`c4_token_indices`, converting
  the request's token count through the compression ratio. Where pages line
  up, consecutive tokens coalesce into whole-page (or longer) copies; where
  they do not, the plan falls back to token runs inside the page. No special
  case: it is the planner's run coalescing.
- the **indexer** cache per KV page (``kv_page``, replicated, generic path);
- the **C128** state per request slot (``c128_slot``, generic path).

Index lists: the ``c4_token`` lists of both sides must have the same length
(an error otherwise: they are derived from the same token count); an absent
list means nothing is sent for that cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.core import HandlerCapabilities, StateHandlerSpec, hookimpl
from kvbridge.core.description.describe import DescribeContext, Description, buffer_region, item_count, paged_kv
from kvbridge.core.description.layout import KV_PAGE_SPACE, IndexSpace

from .swa import SWA_PAGE_SPACE, SWAPool

C4_SPACE = "c4_token"
C128_SPACE = "c128_slot"


@dataclass
class DSV4HiSparsePool(SWAPool):
    """SWA pool fields plus the compressed caches.

    ``c4[i]`` is ``[items, c4_tokens_per_item, ...]``: device pages on prefill
    (``c4_tokens_per_item = page_size // ratio``), host rows on a HiSparse decode.
    """

    c4: Sequence[Any] = field(default_factory=list)
    c4_tokens_per_item: int = 1
    indexer: Sequence[Any] = field(default_factory=list)
    c128: Sequence[Any] = field(default_factory=list)
    compressed_layer_ids: Sequence[int] = field(default_factory=list)
    ratio: int = 4


def c4_token_indices(items: npt.ArrayLike, tokens_per_item: int, num_tokens: int, ratio: int = 4) -> npt.NDArray[np.int64]:
    """Compressed-token indices of a request whose C4 cache lives in ``items`` (pages or host rows).

    ``num_tokens`` uncompressed tokens hold ``num_tokens // ratio`` compressed
    ones; token ``t`` lives in ``items[t // tokens_per_item]`` at offset ``t % tokens_per_item``.
    """
    items = np.asarray(items, dtype=np.int64)
    n = num_tokens // ratio
    if n > items.size * tokens_per_item:
        raise ValueError(f"{num_tokens} tokens need {n} compressed tokens but {items.size} items hold only {items.size * tokens_per_item}")
    t = np.arange(n, dtype=np.int64)
    return items[t // tokens_per_item] * tokens_per_item + t % tokens_per_item


class DSV4HiSparseHandler:
    def describe(self, pool: DSV4HiSparsePool, ctx: DescribeContext) -> Description:
        desc = paged_kv(pool.k, pool.v, layer_ids=pool.layer_ids, kv_heads=pool.kv_heads, layout=pool.layout, ctx=ctx,
                        state_type="swa", index_space=SWA_PAGE_SPACE, page_size=pool.page_size)
        ids = pool.compressed_layer_ids
        for what, bufs in (("c4", pool.c4), ("indexer", pool.indexer), ("c128", pool.c128)):
            if bufs and len(bufs) != len(ids):
                raise ValueError(f"dsv4_hisparse: {len(bufs)} {what} buffers for {len(ids)} compressed layer ids")
        for layer, buf in zip(ids, pool.c4):
            # One item per compressed token: a flat view over the pages or rows.
            flat = buf.reshape(buf.shape[0] * pool.c4_tokens_per_item, -1)
            desc.regions.append(buffer_region(flat, name=f"dsv4.c4.{layer}", role="kv", index_space=C4_SPACE,
                                              layer=layer, state_type="dsv4_c4", draft=ctx.draft))
        for layer, buf in zip(ids, pool.indexer):
            desc.regions.append(buffer_region(buf, name=f"dsv4.indexer.{layer}", role="indexer", index_space=KV_PAGE_SPACE,
                                              layer=layer, state_type="dsv4_indexer", draft=ctx.draft))
        for layer, buf in zip(ids, pool.c128):
            desc.regions.append(buffer_region(buf, name=f"dsv4.c128.{layer}", role="state", index_space=C128_SPACE,
                                              layer=layer, state_type="dsv4_c128", draft=ctx.draft))
        if pool.c4:
            desc.index_spaces.append(IndexSpace(C4_SPACE, item_count(pool.c4[0]) * pool.c4_tokens_per_item, 1, "token"))
        if pool.indexer:
            desc.index_spaces.append(IndexSpace(KV_PAGE_SPACE, item_count(pool.indexer[0]), pool.page_size, "page"))
        if pool.c128:
            desc.index_spaces.append(IndexSpace(C128_SPACE, item_count(pool.c128[0]), 1, "slot"))
        return desc


@hookimpl
def kvbridge_register_state_handlers() -> list[StateHandlerSpec]:
    return [StateHandlerSpec(
        name="dsv4_hisparse", factory="kvbridge.state_handlers.dsv4_hisparse:DSV4HiSparseHandler",
        pool_types=(DSV4HiSparsePool,),
        capabilities=HandlerCapabilities(index_spaces=(SWA_PAGE_SPACE, C4_SPACE, KV_PAGE_SPACE, C128_SPACE),
                                        host_destination=True, hetero_tp="replicated (MLA); token runs where rows differ",
                                        draft=True),
        description="DeepSeek-V4 compressed caches; C4 into decode host memory (HiSparse)",
    )]
