"""A HiSparse decode rank's transfer destination: KV in SGLang's host pool, the rest on the device.

With ``--enable-hisparse`` SGLang's decode (``DecodePreallocQueue._init_kv_manager``,
0.5.23) registers ``hisparse_coordinator.mem_pool_host`` for the KV entries it
holds (``DRAM``) and the device pool for the rest. Two cases:

- DSA (``HiSparseDSATokenToKVPool``): the host pool is an ``MLATokenToKVPoolHost``
  (``layout="layer_first"``) holding every latent layer; the ``kv_data`` entries are
  all host buffers; ``setup_state_kv_args`` on the device pool adds its indexer
  cache as ``StateType.DSA``. Per request the KV destination is host pages
  (``mem_pool_host.alloc_paged_token_slots``), the ``StateType.DSA`` list the
  device pool's logical pages.
- DeepSeek-V4 (``DeepSeekV4TokenToKVPool`` with ``enable_hisparse``): the host pool
  is a ``DeepSeekV4PagedHostPool`` holding the C4 KV layers; the ``kv_data`` entries
  are the host C4 entries, then the device's others (C4 indexer, C128 KV). Per
  request the KV list is C4 host pages and ``device_kv_indices`` the logical pages
  of the device entries (SGLang's own decode passes them for Mooncake only).

:class:`HiSparseDecodePools` pairs the two pools so one handler describes
them as SGLang registers them. The device's own buffers that the host pool
replaces are never a transfer destination. Prefill describes the same keys in
the same index spaces (``dsa_page`` for the DSA indexer, ``c4_page`` for
DeepSeek-V4's C4 KV), so nothing in the plan knows the destination is host
memory beyond the regions' addresses.

Not described (a clear error): MiniMax M3's ``HiSparseMHATokenToKVPoolHost``,
host layouts other than ``layer_first``, allocator-only (dummy) host pools,
host pools that hold draft layers, a draft pool beside a HiSparse DSA decode,
decode context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbridge.core import KV_PAGE_SPACE, DescribeContext, Description, IndexSpace, buffer_region, item_count
from kvbridge.core.description.describe import paged_kv  # not re-exported by kvbridge.core

from .handlers import C4_PAGE_SPACE, DSV4Handler, _pages, describe_dsa_indexer

__all__ = ["HiSparseDecodePools", "HiSparseHandler", "check_draft"]


@dataclass(frozen=True)
class HiSparseDecodePools:
    """A HiSparse decode rank's pools: ``host`` (``hisparse_coordinator.mem_pool_host``) and ``device``
    (the scheduler's ``token_to_kv_pool``)."""

    host: Any
    device: Any


def _derives(obj: Any, class_name: str) -> bool:
    return any(c.__name__ == class_name for c in type(obj).__mro__)


def check_draft(target: Any, draft: Any) -> None:
    """A draft pool beside a HiSparse DSA decode is refused: SGLang addresses its KV by the logical pages
    (``device_kv_indices``), which kvbridge's DSA description does not separate from the host pages."""
    if isinstance(target, HiSparseDecodePools) and draft is not None and type(target.host).__name__ != "DeepSeekV4PagedHostPool":
        raise _refuse(f"a draft pool ({type(draft).__name__}): SGLang addresses its KV by the device pool's logical "
                      "pages (device_kv_indices) while the target's KV goes to host pages")


def _refuse(what: str) -> ValueError:
    return ValueError(f"HiSparse decode with {what}: not described by kvbridge's SGLang integration "
                      "(it describes an MLATokenToKVPoolHost over a HiSparseDSATokenToKVPool, and a DeepSeekV4PagedHostPool "
                      "beside a DeepSeekV4TokenToKVPool); "
                      "use SGLang's own transfer backend for it")


def describe_mla_host(host: Any, ctx: DescribeContext, layer_ids: list[int]) -> Description:
    """An ``MLATokenToKVPoolHost`` (``layer_first``) as paged MLA latents: one item per host page.

    SGLang's ``get_contiguous_buf_infos`` registers ``kv_buffer[layer]`` whole with
    ``token_stride_size * page_size``-byte items; ``kv_buffer`` is
    ``[layers, host slots, 1, kv_cache_dim]``.
    """
    if getattr(host, "_is_dummy", False) or getattr(host, "kv_buffer", None) is None:
        raise _refuse("an allocator-only (dummy) MLATokenToKVPoolHost, which has no buffers")
    if host.layout != "layer_first":
        raise _refuse(f"host layout {host.layout!r} (HiSparseCoordinator builds 'layer_first')")
    if int(host.layer_num) != int(host.target_layer_num):
        raise _refuse(f"{int(host.layer_num) - int(host.target_layer_num)} draft layers in the host pool")
    if int(getattr(host, "dcp_size", 1) or 1) > 1:
        raise _refuse(f"decode context parallelism (dcp_size {host.dcp_size})")
    if len(layer_ids) != int(host.layer_num):
        raise ValueError(f"MLATokenToKVPoolHost holds {host.layer_num} layers, its device pool {len(layer_ids)}")
    page = int(host.page_size)
    kv = [_pages(host.kv_buffer[i], page, f"MLATokenToKVPoolHost latent layer {layer}")
          for i, layer in enumerate(layer_ids)]
    return paged_kv(kv, None, layer_ids=layer_ids, kv_heads=1, layout="nhd", ctx=ctx, state_type="kv",
                    index_space=KV_PAGE_SPACE, page_size=page)


def describe_dsv4_hisparse(host: Any, device: Any, ctx: DescribeContext) -> Description:
    """A DeepSeek-V4 HiSparse decode: the device pool as :class:`~.handlers.DSV4Handler` describes it, its C4 KV
    replaced by the ``DeepSeekV4PagedHostPool``'s (``layer_first``: one ``[host pages, item_bytes]`` buffer per C4
    layer), in the ``c4_page`` space -- SGLang's ``kv_data`` order: host C4 entries, then the device's others."""
    if host.layout != "layer_first":
        raise _refuse(f"host layout {host.layout!r} (HiSparseCoordinator builds 'layer_first')")
    desc = DSV4Handler().describe(device, ctx)
    c4 = [r for r in desc.regions if r.role == "c4"]
    if len(c4) != int(host.layer_num):
        raise ValueError(f"DeepSeekV4PagedHostPool holds {host.layer_num} layers, the device pool {len(c4)} C4 layers")
    if int(host.page_size) * 4 != int(device.page_size):
        raise ValueError(f"DeepSeekV4PagedHostPool pages hold {host.page_size} C4 tokens, the device pool's KV pages "
                         f"{device.page_size} tokens (SGLang's coordinator builds them page_size // 4)")
    hosted = []
    for region, buf in zip(c4, host.kv_buffer):
        if int(host.item_bytes) != region.stride:
            raise ValueError(f"DeepSeekV4PagedHostPool items are {host.item_bytes} bytes, the device C4 pages "
                             f"{region.stride} (layer {region.layer})")
        hosted.append(buffer_region(buf, name=f"dsv4.c4_host.{region.layer}", role="c4", index_space=C4_PAGE_SPACE,
                                    layer=region.layer, state_type="kv"))
    desc.regions[:] = hosted + [r for r in desc.regions if r.role != "c4"]
    spaces = [s for s in desc.index_spaces if s.name != C4_PAGE_SPACE]
    desc.index_spaces[:] = [IndexSpace(C4_PAGE_SPACE, item_count(host.kv_buffer[0]), int(device.page_size), "page"),
                            *spaces]
    return desc


class HiSparseHandler:
    """:class:`HiSparseDecodePools`: KV in the host pool by host page, the rest on the device by its own pages."""

    def describe(self, pools: HiSparseDecodePools, ctx: DescribeContext) -> Description:
        if ctx.draft:
            raise _refuse("a HiSparse pool record as a draft pool (SGLang's HiSparse draft pool stays on the device)")
        host, device = pools.host, pools.device
        host_name, device_name = type(host).__name__, type(device).__name__
        if host_name == "DeepSeekV4PagedHostPool" and _derives(device, "DeepSeekV4TokenToKVPool"):
            return describe_dsv4_hisparse(host, device, ctx)
        if host_name != "MLATokenToKVPoolHost" or not hasattr(device, "index_k_with_scale_buffer"):
            raise _refuse(f"host pool {host_name} over device pool {device_name}")
        if int(host.page_size) != int(device.page_size):
            raise ValueError(f"HiSparse host pool pages hold {host.page_size} tokens, its device pool's "
                             f"{device.page_size}: SGLang's coordinator builds them equal")
        layer_ids = [int(device.start_layer) + i for i in range(int(device.layer_num))]
        desc = describe_mla_host(host, ctx, layer_ids)
        indexer = describe_dsa_indexer(device, ctx)
        desc.regions.extend(indexer.regions)
        desc.index_spaces.extend(indexer.index_spaces)
        return desc
