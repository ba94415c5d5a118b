"""vLLM's registered KV cache tensors as kvbridge regions, with their real layout.

vLLM (0.33) hands the worker one view per attention layer
(``register_kv_caches``), logically ``[blocks, heads, tokens, content]``
(content: a token's K and V of one head, or an MLA latent) over one backing
allocation; the physical order is the resolved KV cache layout, read here
from the strides: ``LBNHC`` (token-major pages, NHD) or ``LBHNC`` (head-major,
HND). Each layer is one ``kv`` region whose item is a block's page; KV heads
are sharded across TP (one descriptor per token row or per page under
heterogeneous TP), MLA latents are replicated.

Layers of different KV cache groups alias the same memory in hybrid models
(a block id belongs to one group at a time); such views are registered once,
so every group's blocks address one ``kv_page`` index space.

Mamba / linear-attention layers (``MambaSpec``) get a raw ``[blocks, 1, 1,
state bytes]`` int8 view over the same block pool: a block holds one
request's whole state (conv state, then the SSM / temporal state, packed as
vLLM's ``MambaBase.bind_kv_cache`` unpacks them), in a page padded to the
attention page. vLLM overlays each Mamba layer's pages on an attention
layer's (the same bytes, another group's block ids); a Mamba layer over
memory of its own is refused. Its state is described as alias regions
(``KVArgs.aliases``: inside the attention layer's region, which registers the
bytes) in the ``mamba_page`` index space, where the scheduler sends the Mamba
groups' block ids. A Mamba2 state whose model config names ``n_groups`` is
sliced as kvbridge's mamba handler slices one (conv state per x|B|C
sub-block, SSM state by heads), so it moves between any TP sizes whose heads
and groups divide; any other state is one whole item, between equal TP
sizes only (the scheduler side refuses other pairs).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
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


def _attention_region(name: str, layer: int, t: Any, num_blocks: int, total_heads: int, mla: bool) -> Region:
    """The region of one attention layer's ``[blocks, heads, tokens, content]`` view, checked dense."""
    if t.ndim != 4 or t.shape[0] % num_blocks:
        raise ValueError(f"layer {name!r}: expected a 4-d [blocks, heads, tokens, content] KV cache view with "
                         f"a multiple of {num_blocks} blocks, got shape {tuple(t.shape)}")
    elt = t.element_size()
    ratio = t.shape[0] // num_blocks  # kernel blocks per vLLM block (a block split for the attention kernel)
    _, H, N, C = (int(x) for x in t.shape)
    s_b, s_h, s_n, s_c = t.stride()
    if s_c == 1 and s_n == H * C and s_h == C:
        head_major = False  # [tokens][heads][content] pages (NHD)
    elif s_c == 1 and s_h == N * C and s_n == C:
        head_major = True  # [heads][tokens][content] pages (HND)
    else:
        raise ValueError(f"layer {name!r}: strides {t.stride()} of shape {tuple(t.shape)} are neither dense "
                         "[tokens][heads][content] nor dense [heads][tokens][content] pages; use a layer-compact "
                         "KV cache layout (VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC)")
    page = H * N * C * elt
    if s_b * elt != page:
        raise ValueError(
            f"layer {name!r}: blocks are {s_b * elt} bytes apart but hold {page} bytes: a layout that interleaves "
            "layers or heads across blocks is not supported; use a layer-compact KV cache layout "
            "(VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC)"
        )
    if mla:
        shard = Shard()  # one latent per token, the same on every TP rank
    elif head_major:
        shard = Shard(kind="split", outer=ratio, totals=(total_heads,), unit_nbytes=N * C * elt)
    else:
        shard = Shard(kind="split", outer=ratio * N, totals=(total_heads,), unit_nbytes=C * elt)
    mem, device = _mem(t)
    return Region(name=f"{name}.kv", addr=t.data_ptr(), nbytes=num_blocks * ratio * page, stride=ratio * page,
                  role="kv", index_space="kv_page", layer=layer, mem=mem, device=device, shard=shard)  # type: ignore[arg-type]


#: The index space of Mamba state blocks: one request's whole state per index (vLLM's block ids of a Mamba group).
MAMBA_SPACE = "mamba_page"


def mamba_groups(hf_config: Any) -> int | None:
    """The model's Mamba2 ``n_groups`` (B/C groups) from its HF config, or None where it names none."""
    for attr in ("n_groups", "mamba_n_groups"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def mamba_split(spec: Any, tp_size: int, groups: int | None) -> tuple[int, int, int, int, bool] | None:
    """``(rows, x_units, group_units, unit_channels, dim_first)`` of a Mamba2 conv state that can be sliced
    across TP, or None (not Mamba2, ``n_groups`` unknown, or channels not a whole number of states).

    vLLM's Mamba2 conv state is ``x | B | C`` channels (``(rows, channels)``, or ``(channels, rows)`` under
    the DS layout); x is split by heads, B and C by group, a group replicated on ``tp / n_groups`` ranks
    when there are fewer groups than ranks. One unit is one group's ``state_size`` channels, so core's
    split (which replicates a group of fewer units than ranks) gives each rank the channels vLLM gives it.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    if spec.mamba_type != MambaAttentionBackendEnum.MAMBA2 or groups is None or len(spec.shapes) != 2:
        return None
    conv, ssm = spec.shapes
    if len(conv) != 2 or len(ssm) != 3:
        return None
    dim_first = is_conv_state_dim_first()
    channels, rows = conv if dim_first else conv[::-1]
    heads, head_dim, state = ssm
    x_local = heads * head_dim
    bc_local = (channels - x_local) // 2
    local_groups = max(1, groups // tp_size)
    if x_local % state or bc_local != local_groups * state or groups % tp_size and tp_size % groups:
        return None
    return rows, x_local * tp_size // state, groups, state, dim_first


def _mamba_aliases(name: str, layer: int, t: Any, num_blocks: int, spec: Any, tp_size: int,
                   groups: int | None) -> list[Region]:
    """A Mamba layer's state inside each block page, as alias regions of the attention region they overlay.

    vLLM hands a raw ``[blocks, 1, 1, state bytes]`` view; a page holds the conv state then the SSM /
    temporal state (``MambaBase.bind_kv_cache``'s packing). Mamba2: conv state split per sub-block, SSM
    state by heads (any TP pair); other kinds: the whole state, one item (equal TP only).
    """
    sizes = [math.prod(shape) * _itemsize(dt) for shape, dt in zip(spec.shapes, spec.dtypes)]
    state = sum(sizes)
    if t.ndim != 4 or int(t.shape[0]) != num_blocks or t.shape[1] != 1 or t.shape[2] != 1 or t.stride()[3] != 1 \
            or int(t.shape[3]) * t.element_size() != state:
        raise ValueError(f"Mamba layer {name!r}: expected vLLM's raw [{num_blocks}, 1, 1, {state}-byte] state view "
                         f"(conv + SSM state of shapes {spec.shapes}), got shape {tuple(t.shape)} strides {t.stride()}")
    page = t.stride()[0] * t.element_size()
    if page < state:
        raise ValueError(f"Mamba layer {name!r}: blocks are {page} bytes apart but a state is {state} bytes")
    mem, device = _mem(t)
    common = dict(stride=page, index_space=MAMBA_SPACE, layer=layer, state_type="mamba", mem=mem, device=device)
    split = mamba_split(spec, tp_size, groups)
    if split is None:
        # A replicated item is the whole stride: the page, padding included (the same bytes as the attention page).
        return [Region(name=f"{name}.mamba", addr=t.data_ptr(), nbytes=num_blocks * page, role="state",
                       **common)]  # type: ignore[arg-type]
    rows, x_units, g_units, unit_channels, dim_first = split
    heads, head_dim, d_state = spec.shapes[1]
    conv_elt, ssm_elt = (_itemsize(d) for d in spec.dtypes)
    if dim_first:  # (channels, rows): a sub-block's channels are contiguous, rows inside each
        conv = Shard(kind="split", outer=1, totals=(x_units, g_units, g_units),
                     unit_nbytes=unit_channels * rows * conv_elt)
    else:  # (rows, channels): every row holds this rank's x | B | C channels
        conv = Shard(kind="split", outer=rows, totals=(x_units, g_units, g_units), unit_nbytes=unit_channels * conv_elt)
    ssm = Shard(kind="split", outer=1, totals=(heads * tp_size,), unit_nbytes=head_dim * d_state * ssm_elt)
    base = t.data_ptr()
    return [
        Region(name=f"{name}.conv", addr=base, nbytes=(num_blocks - 1) * page + sizes[0], role="conv", shard=conv,
               **common),  # type: ignore[arg-type]
        Region(name=f"{name}.temporal", addr=base + sizes[0], nbytes=(num_blocks - 1) * page + sizes[1],
               role="temporal", shard=ssm, **common),  # type: ignore[arg-type]
    ]


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def describe_vllm_caches(
    kv_caches: Mapping[str, Any], kv_cache_config: Any, *, total_kv_heads: int, tp_rank: int, tp_size: int,
    owners: dict[str, int] | None = None, mamba_n_groups: int | None = None,
) -> KVArgs:
    """One rank's KVArgs for the tensors vLLM registered (``layer name -> tensor``).

    ``owners``, if given, is filled with each registered vLLM layer's kvbridge layer id: the
    region that holds its bytes (another layer's, where it aliases that layer's memory).
    ``mamba_n_groups``: the model's Mamba2 ``n_groups`` (:func:`mamba_groups`); without it a
    Mamba2 state moves as one item, between equal TP sizes only.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, MLAAttentionSpec

    specs = _spec_of(kv_cache_config)
    num_blocks = kv_cache_config.num_blocks
    regions: list[Region] = []
    aliases: list[Region] = []
    aliased: dict[tuple[int, int, int], tuple[str, int]] = {}  # (addr, stride, nbytes) -> the layer that registered it
    dtypes: set[str] = set()
    mamba_blocks = False
    block_sizes: set[int] = set()
    unknown = sorted(set(kv_caches) - set(specs))
    if unknown:
        raise ValueError(f"register_kv_caches got layers {unknown[:5]} that no KV cache group names")
    # Attention layers first: a Mamba layer over an attention layer's bytes rides in that layer's region.
    order = sorted(enumerate(ordered_layers(kv_cache_config)), key=lambda e: isinstance(specs[e[1]], MambaSpec))
    for layer, name in order:
        if name not in kv_caches:
            continue
        spec, t = specs[name], kv_caches[name]
        if isinstance(spec, AttentionSpec):
            new = [_attention_region(name, layer, t, num_blocks, total_kv_heads, isinstance(spec, MLAAttentionSpec))]
            dtypes.add(str(spec.dtype).removeprefix("torch."))
            block_sizes.add(spec.block_size)
        elif isinstance(spec, MambaSpec):
            # Mamba blocks hold a state, not block_size tokens: their block size is no page size here.
            page = t.stride()[0] * t.element_size() if t.ndim == 4 else 0
            parent = aliased.get((t.data_ptr(), page, num_blocks * page))
            if parent is None:
                # vLLM 0.33's planning overlays every Mamba layer on an attention layer; a Mamba page of its
                # own would be an ordinary region, which no test here exercises (pure Mamba models).
                raise ValueError(
                    f"Mamba layer {name!r}: its state pages share no attention layer's memory ({num_blocks} blocks "
                    f"of {page} bytes at {t.data_ptr():#x}); KVBridgeConnector moves Mamba state only inside the "
                    "block pool pages vLLM overlays on attention layers (hybrid models; pure Mamba models are not "
                    "supported)"
                )
            aliases.extend(_mamba_aliases(name, layer, t, num_blocks, spec, tp_size, mamba_n_groups))
            dtypes.update(f"mamba:{str(d).removeprefix('torch.')}" for d in spec.dtypes)
            mamba_blocks = True
            if owners is not None:
                owners[name] = parent[1]  # its bytes go out with the attention layer it overlays
            continue
        else:
            raise ValueError(
                f"layer {name!r} has a {type(spec).__name__} KV cache: KVBridgeConnector moves attention KV "
                "(full, sliding window, MLA) and Mamba / linear-attention state (MambaSpec) only"
            )
        for r in new:
            key = (r.addr, r.stride, r.nbytes)
            if key in aliased:  # another group's layer over the same bytes (Mamba pages too): one region
                log.debug("layer %s aliases %s's memory; registered once", name, aliased[key][0])
            else:
                aliased[key] = (name, layer)
                regions.append(r)
            if owners is not None:
                owners[name] = aliased[key][1]
    if len(block_sizes) != 1:
        raise ValueError(f"attention KV cache groups use block sizes {sorted(block_sizes)}; KVBridgeConnector needs "
                         "one block size (and at least one attention group)")
    block_size = block_sizes.pop()
    spaces = [IndexSpace("kv_page", num_blocks, block_size)]
    if mamba_blocks:  # a request's state blocks: as many on decode as prefill sends, never trimmed
        spaces.append(IndexSpace(MAMBA_SPACE, num_blocks, 1, kind="slot"))
    try:
        return KVArgs(regions=tuple(regions), index_spaces=tuple(spaces), dtype="+".join(sorted(dtypes)),
                      page_size=block_size, tp_rank=tp_rank, tp_size=tp_size, aliases=tuple(aliases))
    except ValueError as exc:
        raise ValueError(f"vLLM's KV cache tensors cannot be registered with kvbridge: {exc} (layers that alias memory "
                         "with different page sizes are not supported)") from None
