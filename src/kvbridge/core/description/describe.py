"""From a host's pool objects to one :class:`~kvbridge.core.description.layout.KVArgs`.

The host passes its pools (and the draft / MTP model's pools); each is
resolved to its state handler through the registry by class hierarchy
(docs/architecture.md, rule 4) and the handler describes it as regions and index spaces.
Prefill and decode run the same code on the same pool types, so both sides'
descriptions are built identically; draft pools are appended symmetrically
with ``draft=True`` so they pair with each other and never with the target.

A state handler is any object with::

    def describe(self, pool, ctx: DescribeContext) -> Description

Buffers may be numpy arrays or torch tensors; :func:`buffer_region` turns one
into a region whose item ``i`` is ``buffer[i]``.

Lifetime: the KVArgs :func:`describe` returns keeps the pool objects it was
given (and through them their buffers) alive for as long as it lives, and a
manager holds its KVArgs, so pools passed as objects cannot be freed under a
registration. A :class:`~kvbridge.core.description.layout.Region` built from a raw address
(or by :func:`buffer_region` alone) holds nothing: that memory is the host's to
keep until the managers are closed.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .layout import ROLES, IndexSpace, KVArgs, MemoryKind, Region, Shard
from .plugins import Registry, get_registry
from .records import StateHandlerSpec

__all__ = ["DescribeContext", "Description", "StateHandler", "buffer_region", "describe", "element_size", "held_by",
           "item_count"]

#: The pool objects each live KVArgs made by describe() holds, by id(); an entry goes when its KVArgs does.
_HELD: dict[int, tuple[Any, ...]] = {}


def held_by(kvargs: KVArgs) -> tuple[Any, ...]:
    """The pool objects ``kvargs`` keeps alive (those :func:`describe` made it from; none for a hand-built one)."""
    return _HELD.get(id(kvargs), ())


@dataclass(frozen=True)
class DescribeContext:
    tp_rank: int = 0
    tp_size: int = 1
    draft: bool = False


@dataclass
class Description:
    regions: list[Region] = field(default_factory=list)
    index_spaces: list[IndexSpace] = field(default_factory=list)


class StateHandler(Protocol):
    def describe(self, pool: Any, ctx: DescribeContext) -> Description: ...


def buffer_region(
    buf: Any,
    *,
    name: str,
    role: str,
    index_space: str,
    layer: int = -1,
    state_type: str = "kv",
    draft: bool = False,
    shard: Shard = Shard(),
) -> Region:
    """A region over ``buf`` (numpy array or torch tensor) whose item ``i`` is ``buf[i]``.

    The region holds no reference to ``buf`` (see the module's note on lifetime).
    """
    if hasattr(buf, "data_ptr"):  # torch
        if not buf.is_contiguous():
            raise ValueError(f"buffer for region {name!r} must be contiguous")
        addr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        stride = buf.stride(0) * buf.element_size()
        mem: MemoryKind = "vram" if buf.is_cuda else "dram"
        device = (buf.device.index or 0) if buf.is_cuda else 0
    else:  # numpy
        if not buf.flags["C_CONTIGUOUS"]:
            raise ValueError(f"buffer for region {name!r} must be C-contiguous")
        addr, nbytes, stride, mem, device = buf.ctypes.data, buf.nbytes, buf.strides[0], "dram", 0  # type: ignore[assignment]
    if draft:
        name = f"draft.{name}"
    return Region(
        name=name, addr=addr, nbytes=nbytes, stride=stride, role=role, index_space=index_space,
        layer=layer, state_type=state_type, draft=draft, mem=mem, device=device, shard=shard,
    )


def item_count(buf: Any) -> int:
    """Items in a buffer (numpy array or torch tensor): its first dimension, the index space's count."""
    return int(buf.shape[0])


def element_size(buf: Any) -> int:
    """Bytes per element of a buffer (numpy array or torch tensor)."""
    return int(buf.element_size() if hasattr(buf, "element_size") else buf.itemsize)


def describe(
    pools: Iterable[Any],
    *,
    dtype: str,
    page_size: int,
    draft_pools: Iterable[Any] = (),
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    registry: Registry | None = None,
) -> KVArgs:
    """Describe every pool with its registered handler and combine them into a KVArgs.

    The KVArgs holds ``pools`` and ``draft_pools`` (and so their buffers) for as
    long as it lives: a manager made from it keeps them allocated while open.
    """
    pools, draft_pools = tuple(pools), tuple(draft_pools)
    registry = registry or get_registry()
    resolver = registry.state_resolver()
    regions: list[Region] = []
    spaces: dict[str, IndexSpace] = {}
    for draft, group in ((False, pools), (True, draft_pools)):
        for pool in group:
            spec = resolver.resolve(pool)
            handler = registry.load_state_handler(spec.name)
            desc = handler.describe(pool, DescribeContext(tp_rank, tp_size, draft))
            _check_roles(spec, desc.regions)
            regions.extend(desc.regions)
            for space in desc.index_spaces:
                known = spaces.setdefault(space.name, space)
                if known != space:
                    raise ValueError(
                        f"index space {space.name!r} is described differently by two pools: {known} and "
                        f"{space} (state handler {spec.name!r})"
                    )
    kvargs = KVArgs(
        regions=tuple(regions), index_spaces=tuple(spaces.values()), dtype=dtype, page_size=page_size,
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
    )
    # Regions are addresses only; without this a host's pools made in a function could be freed while registered.
    _HELD[id(kvargs)] = pools + draft_pools
    weakref.finalize(kvargs, _HELD.pop, id(kvargs), None)
    return kvargs


def _check_roles(spec: StateHandlerSpec, regions: Iterable[Region]) -> None:
    """Every region's role is core's or one its handler declared (an open vocabulary, checked where it is used)."""
    declared = set(spec.capabilities.roles)
    for r in regions:
        if r.role not in ROLES and r.role not in declared:
            raise ValueError(
                f"state handler {spec.name!r} described region {r.name!r} with role {r.role!r}, which it does not "
                f"declare; add it to its HandlerCapabilities(roles=...) (declared: {', '.join(sorted(declared)) or 'none'}; "
                f"core's roles: {', '.join(sorted(ROLES))})"
            )


def paged_kv(
    k: Sequence[Any],
    v: Sequence[Any] | None,
    *,
    layer_ids: Sequence[int],
    kv_heads: int,
    layout: str,
    ctx: DescribeContext,
    state_type: str,
    index_space: str,
    page_size: int,
) -> Description:
    """Regions of a paged KV pool (MHA/GQA K and V, or MLA with ``v=None``).

    Buffers are ``[pages, tokens, heads, head_dim]`` (``layout="nhd"``) or
    ``[pages, heads, tokens, head_dim]`` (``"hnd"``); MLA buffers hold one
    replicated latent per page, any shape.
    """
    if len(k) != len(layer_ids) or (v is not None and len(v) != len(layer_ids)):
        raise ValueError(f"{state_type}: {len(k)} K buffers for {len(layer_ids)} layer ids")
    if layout not in ("nhd", "hnd"):
        raise ValueError(f"{state_type}: layout must be 'nhd' or 'hnd', got {layout!r}")
    desc = Description()
    roles = [("k", k)] if v is None else [("k", k), ("v", v)]
    for role, bufs in roles:
        for layer, buf in zip(layer_ids, bufs):
            if v is None:  # MLA: one latent buffer per layer, the same on every rank
                shard = Shard()
                role = "kv"
            else:
                if buf.ndim != 4:
                    raise ValueError(f"{state_type}: layer {layer} {role} buffer must be 4-d, got shape {tuple(buf.shape)}")
                heads_dim, tokens_dim = (2, 1) if layout == "nhd" else (1, 2)
                head_bytes = int(buf.shape[3]) * element_size(buf)
                if int(buf.shape[tokens_dim]) != page_size:
                    raise ValueError(f"{state_type}: layer {layer} pages hold {buf.shape[tokens_dim]} tokens, page_size is {page_size}")
                shard = (
                    Shard(kind="split", outer=page_size, totals=(kv_heads,), unit_nbytes=head_bytes)
                    if layout == "nhd"
                    else Shard(kind="split", outer=1, totals=(kv_heads,), unit_nbytes=page_size * head_bytes)
                )
                del heads_dim
            desc.regions.append(
                buffer_region(buf, name=f"{state_type}.{role}{layer}", role=role, index_space=index_space,
                              layer=layer, state_type=state_type, draft=ctx.draft, shard=shard)
            )
    count = item_count(k[0]) if k else 0
    if count:
        desc.index_spaces.append(IndexSpace(index_space, count, page_size, "page"))
    return desc
