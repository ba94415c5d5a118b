"""A HiSparse decode (SGLang's MLATokenToKVPoolHost over a HiSparseDSATokenToKVPool): described as SGLang registers it, moved byte-exact.

The host pool is built with ``pin_memory=False``, the one departure from SGLang's
own construction (see sglang_hisparse.py): pinning needs CUDA.
"""

import itertools

import pytest
import sglang_hisparse as hs
import sglang_rig as rig

from kvbridge.core import METADATA_SPACE, describe
from kvbridge.core.description.plugins import get_registry
from kvbridge.integrations.sglang.crosscheck import compare
from kvbridge.integrations.sglang.hisparse import HiSparseDecodePools

_rooms = itertools.count(3000)


def describe_decode(rank):
    return describe([rank.target, rank.metadata], dtype="bfloat16", page_size=rank.target.device.page_size,
                    tp_rank=rank.tp_rank, tp_size=rank.tp_size)


@pytest.mark.parametrize("tp", [(0, 1), (1, 2)], ids=["tp1", "tp2-rank1"])
def test_hisparse_decode_description_agrees_with_sglang_kv_args(tp):
    rank = hs.make_decode(*tp)
    ours = describe_decode(rank)
    assert compare(rank.kv_args, ours) == []
    host, device = rank.target.host, rank.target.device
    kv = [r for r in ours.regions if r.state_type == "kv"]
    # The KV entries are the host pool's buffers (SGLang's DRAM entries), never the device pool's latents.
    assert [r.addr for r in kv] == [host.kv_buffer[i].data_ptr() for i in range(rig.LAYERS)]
    assert {r.mem for r in kv} == {"dram"}
    assert not {b.data_ptr() for b in device.kv_buffer} & {r.addr for r in ours.regions}
    indexer = [r for r in ours.regions if r.state_type == "dsa"]
    assert [r.addr for r in indexer] == rank.kv_args.state_data_ptrs[0]
    spaces = {s.name: (s.count, s.tokens) for s in ours.index_spaces}
    # Host pages: 2 x 8 device pages + 1; the indexer's logical pages likewise, beyond the device's 9 KV pages.
    assert spaces == {"kv_page": (17, 64), "dsa_page": (17, 64), METADATA_SPACE: (rig.ROWS, 1)}


def test_the_hisparse_record_resolves_to_its_handler_and_the_host_pool_alone_to_none():
    resolver = get_registry().state_resolver()
    rank = hs.make_decode(0, 1)
    assert resolver.resolve(rank.target).name == "sglang_hisparse"
    assert resolver.resolve(rank.target.device).name == "sglang_dsa"  # HiSparseDSATokenToKVPool is a DSATokenToKVPool
    with pytest.raises(LookupError, match="MLATokenToKVPoolHost"):  # only with its device pool, as SGLang registers it
        resolver.resolve(rank.target.host)


def test_a_device_only_description_of_a_hisparse_decode_disagrees_with_sglang_entry_by_entry():
    """Describing the device pool (what a plugin that forgot the host pool would do) is refused, not moved."""
    rank = hs.make_decode(0, 1)
    wrong = describe([rank.target.device, rank.metadata], dtype="bfloat16", page_size=64)
    problems = compare(rank.kv_args, wrong)
    assert sum("is not a kvbridge region" in p for p in problems) == rig.LAYERS  # SGLang's host entries
    assert any("kvbridge describes regions SGLang does not register" in p for p in problems)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_a_host_layout_other_than_layer_first_is_refused_by_name(layout):
    device = hs.make_device()
    host = hs.make_host(device)
    host.layout = layout  # the coordinator builds layer_first; another layout's buffers are not per-layer slabs
    with pytest.raises(ValueError, match=f"host layout '{layout}'.*use SGLang's own transfer backend"):
        describe([HiSparseDecodePools(host=host, device=device)], dtype="bfloat16", page_size=64)


def test_a_draft_pool_beside_a_hisparse_dsa_decode_is_refused(monkeypatch):
    """SGLang addresses such a draft's KV by the logical pages while the target's goes to host pages."""
    import sglang_pd as pd
    from sglang.srt.disaggregation.utils import DisaggregationMode

    monkeypatch.setenv("KVBRIDGE_SGLANG_BACKEND", "memory")
    rank = hs.make_decode(0, 1)
    rank.draft = rig.make_pool("dsa", 1, draft=True)
    with pytest.raises(ValueError, match="HiSparse decode with a draft pool"):
        pd.manager(rank, DisaggregationMode.DECODE, 1)


CASES = [(p, d, b) for b in ("memory", "nixl") for p, d in ((1, 1), (2, 1), (1, 2))]


@pytest.mark.parametrize("prefill_tp,decode_tp,backend", CASES, ids=[f"tp{p}to{d}-{b}" for p, d, b in CASES])
def test_dsa_prefill_lands_byte_exact_in_the_hisparse_host_pool(prefill_tp, decode_tp, backend, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_SGLANG_BACKEND", backend)
    room = next(_rooms)
    assert hs.transfer(prefill_tp, decode_tp, seed=room, room=room, backend=backend) == []


def test_the_hisparse_oracle_reports_a_decode_that_received_nothing():
    g = rig.global_tensors("dsa", False, seed=1)
    problems = hs.check_decode(hs.make_decode(0, 1), g)
    assert len(problems) == 2 * rig.LAYERS + len(rig.metadata_rows(rig.make_metadata()))


def sglang_init_kv_manager_hisparse_then_transfer() -> dict:
    """SGLang's own _init_kv_manager after load_plugins(): a DSA prefill queue and a HiSparse decode queue, one request.

    The queues are SGLang's classes with the attributes their scheduler would set (as in
    test_plugin.py); the decode's scheduler has ``enable_hisparse`` and a coordinator holding
    the host pool, which is all SGLang's ``_init_kv_manager`` reads of HiSparse.
    """
    import json
    import os
    import tempfile
    import types

    import numpy as np
    import sglang_pd as pd
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import TransferBackend, is_mla_backend
    from sglang.srt.mem_cache.common import kv_to_page_indices, suffix_page_indices
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from kvbridge.integrations.sglang.conn import KVBridgeKVBootstrapServer, KVBridgeKVReceiver

    load_plugins()
    boot = KVBridgeKVBootstrapServer("127.0.0.1", 0)
    port = int(boot.address.rsplit(":", 1)[1])
    model = tempfile.mkdtemp()  # a model's config only: resolving ServerArgs reads it, nothing loads weights
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
                   "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "num_hidden_layers": rig.LAYERS, "vocab_size": 128, "max_position_embeddings": 256,
                   "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}, f)
    args = ServerArgs(model_path=model, device="cpu", tp_size=1, skip_tokenizer_init=True, host="127.0.0.1",
                      disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                      disaggregation_bootstrap_port=port)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    g = rig.global_tensors("dsa", False, seed=11)
    prefill = rig.make_rank("dsa", 0, 1, draft=False, fill=g)
    decode = hs.make_decode(0, 1)  # its pools; its KVArgs are SGLang's own _init_kv_manager's below
    common = dict(rust_server=None, server_args=args, req_to_token_pool=None,
                  tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_cache_dtype_str="bfloat16")),
                  model_config=types.SimpleNamespace(hf_text_config=None, num_hidden_layers=rig.LAYERS,
                                                     get_total_num_kv_heads=lambda: 1))
    schedulers = {"prefill": types.SimpleNamespace(enable_hisparse=False, **common),
                  "decode": types.SimpleNamespace(enable_hisparse=True, **common, hisparse_coordinator=types.SimpleNamespace(
                      mem_pool_host=decode.target.host))}
    pools = {"prefill": (prefill.target, prefill.metadata), "decode": (decode.target.device, decode.metadata)}
    managers = {}
    for role, cls in (("prefill", PrefillBootstrapQueue), ("decode", DecodePreallocQueue)):
        queue = cls.__new__(cls)
        queue.token_to_kv_pool, queue.metadata_buffers = pools[role]
        queue.draft_token_to_kv_pool, queue.scheduler = None, schedulers[role]
        queue.tp_rank, queue.pp_rank, queue.pp_size, queue.gpu_id = 0, 0, 1, 0
        queue.transfer_backend = TransferBackend.NIXL
        queue.is_mla_backend = is_mla_backend(queue.token_to_kv_pool)
        queue.enable_staging = False
        managers[role] = queue._init_kv_manager()  # SGLang's own code, through kvbridge's hooks
    d = managers["decode"]
    out = {"kv_data_mem_kinds": d.kv_args.kv_data_mem_kinds, "state_types": [s.value for s in d.kv_args.state_types],
           "kv_regions_on_host": [r.addr for r in d.description.regions if r.state_type == "kv"]
           == [b.data_ptr() for b in decode.target.host.kv_buffer]}
    try:
        senders = pd.prefill_senders([managers["prefill"]], port, 4343)
        recv = KVBridgeKVReceiver(d, f"127.0.0.1:{port}", 4343)
        recv.init(0)
        # The destination as SGLang's HiSparse pre-allocation makes it: host token slots from the host pool's own
        # alloc_paged_token_slots (after another request took 3 pages), as pages (kv_to_page_indices); the DSA
        # list from the request's logical token row (suffix_page_indices, decode's _dsa_pages_payload).
        host, ps, tokens = decode.target.host, rig.page_size("dsa"), len(pd.SRC_PAGES) * rig.page_size("dsa")
        host.alloc_page(3)
        req_to_host = torch.full((4, 2 * tokens), -1, dtype=torch.int64)
        slots = host.alloc_paged_token_slots(req_to_host, torch.zeros(4, dtype=torch.int64), 1, 0, tokens)
        host_pages = kv_to_page_indices(slots, ps).astype(np.int32)
        req_to_token = torch.zeros((4, tokens), dtype=torch.int32)
        req_to_token[1] = (torch.tensor(hs.DST_DSA_PAGES, dtype=torch.int32)[:, None] * ps
                           + torch.arange(ps, dtype=torch.int32)).reshape(-1)
        dsa_pages = suffix_page_indices(req_to_token, 1, 0, tokens, ps)
        out["destination"] = [host_pages.tolist(), np.asarray(dsa_pages).tolist()]
        recv.send_metadata(host_pages, pd.DST_ROW, [dsa_pages], decode_prefix_len=0)
        out.update(pd.ready_then_sent(senders, [recv], [prefill]))
        out["problems"] = hs.check_decode(decode, g, host_pages.tolist(), np.asarray(dsa_pages).tolist())
    finally:
        for m in managers.values():
            m.close()
        boot.close()
    return out


def test_sglang_init_kv_manager_with_hisparse_builds_a_decode_manager_over_the_host_pool():
    import forked

    got = forked.run(sglang_init_kv_manager_hisparse_then_transfer,
                     {"KVBRIDGE_SGLANG_BACKEND": "memory", "SGLANG_PLUGINS": None, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert got == {"kv_data_mem_kinds": ["DRAM"] * rig.LAYERS, "state_types": ["dsa"], "kv_regions_on_host": True,
                   "destination": [[3, 4, 5, 6], hs.DST_DSA_PAGES], "ready": [2], "polls": [4, 4], "problems": []}



_DSV4_ENV = {"HF_HUB_OFFLINE": "1", "KVBRIDGE_SGLANG_BACKEND": "memory"}


def test_a_deepseek_v4_hisparse_decode_is_described_as_sglang_registers_it():
    import forked
    from sglang.srt.mem_cache import deepseek_v4_memory_pool, memory_pool_host  # noqa: F401 (imported before the fork)

    *problems, kv, spaces, device_c4 = forked.run(hs.describe_dsv4_hisparse, _DSV4_ENV, timeout=120)
    assert problems == []
    # SGLang's kv_data: the host C4 entry first, then the device's C4 indexer and C128 KV.
    assert kv == "kv: c4/1/c4_page/host, c4_indexer/1/kv_page/device, c128/2/kv_page/device"
    # 12 host pages; kv_page as large as its smallest region (the C4 indexer's 132 rows).
    assert spaces.startswith("spaces: c4_page=12,kv_page=132,"), spaces
    assert device_c4 == "device C4 registered: False"


DSV4_CASES = [(1, 1, "memory"), (1, 2, "memory"), (2, 1, "nixl")]


@pytest.mark.parametrize("prefill_tp,decode_tp,backend", DSV4_CASES, ids=[f"tp{p}to{d}-{b}" for p, d, b in DSV4_CASES])
def test_deepseek_v4_prefill_lands_byte_exact_in_the_hisparse_c4_host_pool(prefill_tp, decode_tp, backend):
    import forked
    import sglang_dsv4 as dsv4

    room = next(_rooms)
    assert forked.run(dsv4.transfer, {**_DSV4_ENV, "KVBRIDGE_SGLANG_BACKEND": backend}, prefill_tp, decode_tp, room, room,
                      backend, dsv4.TOKENS, False, True, timeout=120) == []


def test_the_deepseek_v4_hisparse_oracle_reports_a_host_pool_that_received_nothing():
    import forked
    import sglang_dsv4 as dsv4

    problems = forked.run(dsv4.untouched_hisparse_decode_problems, _DSV4_ENV, 7, timeout=120)
    assert "decode TP rank 0: host buffer c4.0 differs from the oracle" in problems
