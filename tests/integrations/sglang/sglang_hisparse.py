"""A HiSparse decode rank (SGLang's real pools on CPU) and a request moved into it from a DSA prefill.

The decode's pools are built as SGLang's ``HiSparseCoordinator`` builds them
(``HiSparseDSATokenToKVPool``, then ``MLATokenToKVPoolHost(buffer_info=
device.get_device_pool_infos()[0].buffer_info, layout="layer_first", ...)``)
with one departure: ``pin_memory=False``. SGLang's default (``True``) registers
the host buffer with ``cudaHostRegister``, which a CPU-only torch cannot do.

Its ``KVArgs`` are filled as SGLang 0.5.23's ``DecodePreallocQueue._init_kv_manager``
fills them with ``enable_hisparse``: ``kv_data`` from the host pool
(``get_kv_transfer_buf_infos(mem_pool_host)``, ``DRAM``), the state components
from the device pool (``setup_state_kv_args``: ``StateType.DSA``, the indexer).

Per request, as SGLang's decode sends it: the KV destination is host pages
(``alloc_paged_token_slots`` on the host pool), the ``StateType.DSA`` list the
device pool's logical pages (``_dsa_pages_payload``); prefill (a plain
``DSATokenToKVPool``) sends its KV pages for both. The oracle is plain torch
indexing of the global tensors: the host latents at the host pages, the indexer
rows at the logical pages, every other byte of the decode still zero --
including the device pool's own latent buffers, which HiSparse never receives into.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import sglang_pd as pd
import sglang_rig as rig
import torch
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode, get_kv_transfer_buf_infos, setup_state_kv_args
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.runtime_context import get_parallel

from kvbridge.integrations.sglang.hisparse import HiSparseDecodePools

HOST_TO_DEVICE_RATIO = 2  # HiSparseCoordinator's default
#: Decode's destinations: host pages for the KV (the host pool has (2 x 8 + 1) pages), logical pages for the
#: indexer (also 2 x 8 + 1: HiSparseDSATokenToKVPool sizes it for the logical capacity). Past the device's 9 pages.
DST_HOST_PAGES = [12, 3, 16, 9]
DST_DSA_PAGES = [10, 2, 15, 7]


def make_device() -> HiSparseDSATokenToKVPool:
    """The decode's device pool, the rig's DSA geometry."""
    with get_parallel().override(attn_dcp_size=1):
        return HiSparseDSATokenToKVPool(size=rig.slots("dsa"), page_size=rig.page_size("dsa"), kv_lora_rank=16,
                                        dtype=rig.DTYPE, qk_rope_head_dim=8, layer_num=rig.LAYERS, device="cpu",
                                        index_head_dim=128, enable_memory_saver=False, kv_cache_dim=24,
                                        host_to_device_ratio=HOST_TO_DEVICE_RATIO)


def make_host(device: HiSparseDSATokenToKVPool) -> MLATokenToKVPoolHost:
    """``HiSparseCoordinator``'s ``mem_pool_host`` for ``device``, with ``pin_memory=False`` (see the module)."""
    return MLATokenToKVPoolHost(
        buffer_info=device.get_device_pool_infos()[0].buffer_info,
        device_capacity_tokens=device.size if device.host_capacity_tokens is None else device.host_capacity_tokens,
        start_layer=device.start_layer, end_layer=device.end_layer, target_layer_num=device.layer_num,
        host_to_device_ratio=HOST_TO_DEVICE_RATIO, host_size=0, page_size=device.page_size, layout="layer_first",
        override_kv_cache_dim=device.kv_cache_dim, pin_memory=False)


def sglang_kv_args(tp_rank: int, host: Any, device: Any, metadata: Any) -> KVArgs:
    """The KVArgs SGLang's decode ``_init_kv_manager`` fills with ``enable_hisparse`` (DSA, no draft)."""
    a = KVArgs()
    a.engine_rank = tp_rank
    a.pp_rank = 0
    a.kv_cache_dtype_str = "bfloat16"
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = get_kv_transfer_buf_infos(host)  # transfer_kv_pool
    a.kv_data_mem_kinds = ["DRAM"] * len(a.kv_data_ptrs)
    a.num_draft_entries = 0
    a.page_size = device.page_size
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = metadata.get_buf_infos()
    setup_state_kv_args(a, device, None, rig.LAYERS)  # the device pool, not the host pool
    return a


def make_decode(tp_rank: int, tp_size: int) -> rig.Rank:
    """A zeroed HiSparse decode rank; its target is kvbridge's record of the two pools."""
    device = make_device()
    host = make_host(device)
    metadata = rig.make_metadata()
    rank = rig.Rank("dsa", tp_rank, tp_size, HiSparseDecodePools(host=host, device=device), None, metadata)
    rank.kv_args = sglang_kv_args(tp_rank, host, device, metadata)
    return rank


def check_decode(rank: rig.Rank, g: dict[str, torch.Tensor], host_pages: list[int] = DST_HOST_PAGES,
                 dsa_pages: list[int] = DST_DSA_PAGES) -> list[str]:
    """Every buffer of a HiSparse decode rank against the oracle (asked-for items from the source, the rest zero)."""
    problems = []
    ps = rig.page_size("dsa")
    host, device = rank.target.host, rank.target.device
    where = f"decode TP rank {rank.tp_rank}/{rank.tp_size}"
    for layer in range(rig.LAYERS):
        got = host.kv_buffer[layer]  # [host slots, 1, kv_cache_dim]
        src = g[f"kv{layer}"]
        want = got.new_zeros(got.shape)
        for s, d in zip(pd.SRC_PAGES, host_pages):
            want[d * ps:(d + 1) * ps] = src[s * ps:(s + 1) * ps]
        if not got.view(torch.uint8).equal(want.view(torch.uint8)):
            problems.append(f"{where}: host latent layer {layer} differs from the oracle")
        got = device.index_k_with_scale_buffer[layer]  # [logical pages, bytes]
        want = got.new_zeros(got.shape)
        for s, d in zip(pd.SRC_PAGES, dsa_pages):
            want[d] = g[f"index{layer}"][s]
        if not got.equal(want):
            problems.append(f"{where}: indexer layer {layer} differs from the oracle")
        if bool(device.kv_buffer[layer].view(torch.uint8).any()):
            problems.append(f"{where}: the device latent buffer of layer {layer} was written (HiSparse receives on the host)")
    for i, rows in enumerate(rig.metadata_rows(rank.metadata)):
        want = rows.new_zeros(rows.shape)
        want[pd.DST_ROW] = g[f"meta{i}"].view(rows.shape)[pd.SRC_ROW]
        if not bool((rows == want).all()):
            problems.append(f"{where}: metadata buffer {i} differs from the oracle")
    return problems


def transfer(prefill_tp: int, decode_tp: int, seed: int, room: int, backend: str) -> list[str]:
    """One request from DSA prefill ranks into HiSparse decode ranks through the adapters; every oracle mismatch."""
    from kvbridge.integrations.sglang.conn import KVBridgeKVBootstrapServer, KVBridgeKVReceiver

    g = rig.global_tensors("dsa", False, seed)
    boot = KVBridgeKVBootstrapServer("127.0.0.1", 0)
    port = int(boot.address.rsplit(":", 1)[1])
    managers: list[Any] = []
    try:
        p_ranks = [rig.make_rank("dsa", r, prefill_tp, draft=False, fill=g) for r in range(prefill_tp)]
        d_ranks = [make_decode(r, decode_tp) for r in range(decode_tp)]
        p_mgrs = [pd.manager(r, DisaggregationMode.PREFILL, port) for r in p_ranks]
        managers += p_mgrs
        d_mgrs = [pd.manager(r, DisaggregationMode.DECODE, port) for r in d_ranks]
        managers += d_mgrs
        used = sorted({m.transfer.backend_name.split(",")[-1] for m in managers})
        if used != [backend]:
            return [f"managers run over {used}, not {backend!r}"]
        senders = pd.prefill_senders(p_mgrs, port, room)
        recvs = [KVBridgeKVReceiver(m, f"127.0.0.1:{port}", room) for m in d_mgrs]
        for r in recvs:  # SGLang's decode: host pages as the KV destination, logical pages in the DSA list
            r.init(0)
            r.send_metadata(np.array(DST_HOST_PAGES, dtype=np.int32), pd.DST_ROW, [np.array(DST_DSA_PAGES, dtype=np.int32)],
                            decode_prefix_len=0)
        polls = pd.wait(senders, {KVPoll.WaitingForInput, KVPoll.Failed}, 30)
        if polls != [KVPoll.WaitingForInput] * len(senders):
            return [f"prefill senders polled {polls}: {[s.sender.failure() for s in senders]}"]
        problems = pd.send_and_finish(senders, recvs, p_ranks)
        return problems or [p for rank in d_ranks for p in check_decode(rank, g)]
    finally:
        for m in managers:
            m.close()
        boot.close()



def describe_dsv4_hisparse() -> list[str]:
    """A DeepSeek-V4 HiSparse decode (SGLang's pool with ``enable_hisparse`` and the coordinator's
    ``DeepSeekV4PagedHostPool``, ``pin_memory=False``): kvbridge's description against SGLang's KVArgs
    (empty: they agree), plus what kvbridge saw."""
    import sglang_dsv4 as dsv4

    from kvbridge.core import describe
    from kvbridge.integrations.sglang.crosscheck import compare

    dsv4.publish_server_args()
    device, meta = dsv4.make_pool(hisparse=True), rig.make_metadata()
    host = dsv4.make_host(device)
    ours = describe([HiSparseDecodePools(host=host, device=device), meta], dtype="fp8_e4m3", page_size=int(device.page_size))
    args = dsv4.hisparse_kv_args(device, host, meta, 0)
    kv = [r for r in ours.regions if r.state_type == "kv"]
    return compare(args, ours) + [
        "kv: " + ", ".join(f"{r.role}/{r.layer}/{r.index_space}/{'host' if r.addr in args.kv_data_ptrs[:host.layer_num] else 'device'}"
                           for r in kv),
        "spaces: " + ",".join(f"{s.name}={s.count}" for s in ours.index_spaces),
        "device C4 registered: " + str(any(r.addr == b.data_ptr() for r in ours.regions for b in device.c4_kv_pool.kv_buffer))]
