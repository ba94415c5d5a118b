"""Mamba / linear-attention state: conv state and temporal (SSM) state per layer, by request slot.

Buffers are indexed by the request's slot (index space ``slot``, where a
length mismatch is always an error). Under heterogeneous TP each tensor is
sliced along its TP-sharded dimension according to both TP sizes:

- conv state ``[slots, conv_rows, channels_local]``: the channel dimension is
  the concatenation of sub-blocks (``conv_groups``, e.g. q|k|v of a
  gated-delta-net: ``(key_dim, key_dim, value_dim)`` global channels) that
  are each split across TP on their own, so each is sliced on its own;
- temporal state ``[slots, heads_local, ...]``: split by heads
  (``temporal_heads`` in total), everything after the heads dimension moves
  with its head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.core import HandlerCapabilities, StateHandlerSpec, hookimpl
from kvbridge.core.description.describe import DescribeContext, Description, buffer_region, element_size, item_count
from kvbridge.core.description.layout import IndexSpace, Shard

SLOT_SPACE = "slot"


@dataclass
class MambaPool:
    conv: Sequence[Any]
    temporal: Sequence[Any]
    layer_ids: Sequence[int]
    conv_groups: tuple[int, ...]
    temporal_heads: int


class MambaHandler:
    def describe(self, pool: MambaPool, ctx: DescribeContext) -> Description:
        if len(pool.conv) != len(pool.layer_ids) or len(pool.temporal) != len(pool.layer_ids):
            raise ValueError(
                f"mamba: {len(pool.conv)} conv and {len(pool.temporal)} temporal buffers for {len(pool.layer_ids)} layer ids"
            )
        desc = Description()
        for layer, conv, temporal in zip(pool.layer_ids, pool.conv, pool.temporal):
            if conv.ndim != 3:
                raise ValueError(f"mamba: layer {layer} conv state must be [slots, rows, channels], got {tuple(conv.shape)}")
            conv_shard = Shard(kind="split", outer=int(conv.shape[1]), totals=tuple(pool.conv_groups),
                               unit_nbytes=element_size(conv))
            t_unit = math.prod(int(d) for d in temporal.shape[2:]) * element_size(temporal)
            t_shard = Shard(kind="split", outer=1, totals=(pool.temporal_heads,), unit_nbytes=t_unit)
            for role, buf, shard in (("conv", conv, conv_shard), ("temporal", temporal, t_shard)):
                desc.regions.append(buffer_region(buf, name=f"mamba.{role}{layer}", role=role, index_space=SLOT_SPACE,
                                                  layer=layer, state_type="mamba", draft=ctx.draft, shard=shard))
        if pool.conv:
            desc.index_spaces.append(IndexSpace(SLOT_SPACE, item_count(pool.conv[0]), 1, "slot"))
        return desc


@hookimpl
def kvbridge_register_state_handlers() -> list[StateHandlerSpec]:
    return [StateHandlerSpec(
        name="mamba", factory="kvbridge.state_handlers.mamba:MambaHandler", pool_types=(MambaPool,),
        capabilities=HandlerCapabilities(index_spaces=(SLOT_SPACE,), draft=True,
                                        hetero_tp="slice each tensor's sharded dim; conv sub-blocks separately"),
        description="conv and temporal (SSM) state per request slot",
    )]
