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
    assert resolver.resolve(rank.target).name == "sglang_hisparse_dsa"
    assert resolver.resolve(rank.target.device).name == "sglang_dsa"  # HiSparseDSATokenToKVPool is a DSATokenToKVPool


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


def test_a_hisparse_draft_pool_is_refused():
    rank = hs.make_decode(0, 1)
    with pytest.raises(ValueError, match="HiSparse decode with a draft pool"):
        describe([rank.metadata], draft_pools=[rank.target], dtype="bfloat16", page_size=64)


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
