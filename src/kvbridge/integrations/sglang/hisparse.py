"""A HiSparse decode rank's transfer destination: KV in SGLang's host pool, the DSA indexer on the device.

With ``--enable-hisparse`` SGLang's decode (``DecodePreallocQueue._init_kv_manager``,
0.5.23) registers ``hisparse_coordinator.mem_pool_host`` -- an
``MLATokenToKVPoolHost`` (``layout="layer_first"``) over the
``HiSparseDSATokenToKVPool`` -- for every ``kv_data`` entry (``DRAM``), and the
device pool for the rest: ``setup_state_kv_args`` on the device pool adds its
indexer cache as ``StateType.DSA``. Per request, the KV destination is host
pages (``mem_pool_host.alloc_paged_token_slots``), the ``StateType.DSA`` list
the device pool's logical pages; the device's own latent buffers are never a
transfer destination.

:class:`HiSparseDecodePools` pairs the two pools so one handler describes
them as SGLang registers them: the host pool's latents as the paged KV
(``kv_page``: host pages), the device pool's indexer in ``dsa_page``. Prefill
(any ``DSATokenToKVPool``) describes the same keys, so nothing in the plan
knows the destination is host memory beyond the regions' addresses.

Not described (a clear error): DeepSeek-V4's ``DeepSeekV4PagedHostPool`` and
MiniMax M3's ``HiSparseMHATokenToKVPoolHost`` as HiSparse destinations, host
layouts other than ``layer_first``, allocator-only (dummy) host pools, host
pools that hold draft layers, decode context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbridge.core import KV_PAGE_SPACE, DescribeContext, Description
from kvbridge.core.description.describe import paged_kv  # not re-exported by kvbridge.core

from .handlers import _pages, describe_dsa_indexer

__all__ = ["HiSparseDecodePools", "HiSparseHandler"]


@dataclass(frozen=True)
class HiSparseDecodePools:
    """A HiSparse decode rank's pools: ``host`` (``hisparse_coordinator.mem_pool_host``) and ``device``
    (the scheduler's ``token_to_kv_pool``)."""

    host: Any
    device: Any


def _refuse(what: str) -> ValueError:
    return ValueError(f"HiSparse decode with {what}: not described by kvbridge's SGLang integration "
                      "(it describes an MLATokenToKVPoolHost over a HiSparseDSATokenToKVPool); "
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


class HiSparseHandler:
    """:class:`HiSparseDecodePools`: KV latents by host page, the device pool's DSA indexer by its own pages."""

    def describe(self, pools: HiSparseDecodePools, ctx: DescribeContext) -> Description:
        if ctx.draft:
            raise _refuse("a draft pool (SGLang's own HiSparse draft transfer needs Mooncake's device_kv_indices)")
        host, device = pools.host, pools.device
        host_name, device_name = type(host).__name__, type(device).__name__
        if host_name != "MLATokenToKVPoolHost" or not hasattr(device, "index_k_with_scale_buffer"):
            why = ("; its C4 KV lands in host pages while the C4 indexer and C128 KV stay on the device, addressed by a "
                   "second KV page list (SGLang's device_kv_indices, Mooncake only in SGLang 0.5.23)"
                   if host_name == "DeepSeekV4PagedHostPool" else "")
            raise _refuse(f"host pool {host_name} over device pool {device_name}{why}")
        if int(host.page_size) != int(device.page_size):
            raise ValueError(f"HiSparse host pool pages hold {host.page_size} tokens, its device pool's "
                             f"{device.page_size}: SGLang's coordinator builds them equal")
        layer_ids = [int(device.start_layer) + i for i in range(int(device.layer_num))]
        desc = describe_mla_host(host, ctx, layer_ids)
        indexer = describe_dsa_indexer(device, ctx)
        desc.regions.extend(indexer.regions)
        desc.index_spaces.extend(indexer.index_spaces)
        return desc
