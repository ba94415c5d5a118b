"""Sliding-window KV (SWA layers) in its own pool, with its own page index list.

The request's ``swa_page`` list holds the window's pages, not the full
request's. MHA/GQA heads are sliced under heterogeneous TP, MLA replicated,
exactly like the full KV (the same core rules, in another index space).
A pool class derived from :class:`SWAPool` (e.g. a DeepSeek-V4 pool) is
handled here unless a more specific handler is registered for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.core import HandlerCapabilities, StateHandlerSpec, hookimpl
from kvbridge.core.description.describe import DescribeContext, Description, paged_kv
from kvbridge.core.description.pools import KVPool

SWA_PAGE_SPACE = "swa_page"


@dataclass
class SWAPool(KVPool):
    """Per SWA layer a K and V buffer (or one MLA buffer with ``v=None``), paged like
    :class:`~kvbridge.core.description.pools.KVPool`. It is a KV pool, but served by the ``swa``
    handler (the most specific registered class wins) in its own page index space."""


class SWAHandler:
    def describe(self, pool: SWAPool, ctx: DescribeContext) -> Description:
        return paged_kv(pool.k, pool.v, layer_ids=pool.layer_ids, kv_heads=pool.kv_heads, layout=pool.layout,
                        ctx=ctx, state_type="swa", index_space=SWA_PAGE_SPACE, page_size=pool.page_size)


@hookimpl
def kvbridge_register_state_handlers() -> list[StateHandlerSpec]:
    return [StateHandlerSpec(
        name="swa", factory="kvbridge.state_handlers.swa:SWAHandler", pool_types=(SWAPool,),
        capabilities=HandlerCapabilities(index_spaces=(SWA_PAGE_SPACE,), hetero_tp="slice heads (MHA), replicate (MLA)",
                                        layouts=("nhd", "hnd"), draft=True),
        description="sliding-window KV in its own pool and page list",
    )]
