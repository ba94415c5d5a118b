"""kvbridge's handlers describe SGLang's real pools exactly as SGLang's own KVArgs registers them, and refuse the ones they do not."""

import pytest
import sglang_rig as rig


from kvbridge.core import describe
from kvbridge.core.description.plugins import get_registry
from kvbridge.integrations.sglang.crosscheck import compare


# Draft (MTP) pools: built for MHA, MLA and DSA, whose draft entries SGLang's KVArgs appends (an SWA or Mamba
# draft pool's window / state SGLang does not register, so kvbridge's manager would refuse the extra regions).
CASES = [(kind, draft) for kind in rig.KINDS for draft in (False, True) if not draft or kind in ("mha", "mla", "dsa")]


@pytest.mark.parametrize("kind,draft", CASES, ids=[f"{k}-{'draft' if d else 'target'}" for k, d in CASES])
@pytest.mark.parametrize("tp", [(0, 1), (1, 2)], ids=["tp1", "tp2-rank1"])
def test_description_agrees_with_sglang_kv_args(kind, tp, draft):
    rank = rig.make_rank(kind, *tp, draft=draft, fill=None)
    ours = describe([rank.target, rank.metadata], draft_pools=[rank.draft] if draft else [], dtype="bfloat16",
                    page_size=rank.target.page_size, tp_rank=tp[0], tp_size=tp[1])
    assert compare(rank.kv_args, ours) == []
    expected = {"mha": {"kv", "metadata"}, "mla": {"kv", "metadata"}, "swa": {"kv", "swa", "metadata"},
                "dsa": {"kv", "dsa", "metadata"}, "mamba": {"kv", "mamba", "metadata"}}[kind]
    assert {r.state_type for r in ours.regions} == expected
    assert any(r.draft for r in ours.regions) == draft


def test_sglang_pool_classes_resolve_to_kvbridge_handlers_by_class_name():
    resolver = get_registry().state_resolver()
    names = {kind: resolver.resolve(rig.make_pool(kind, 1)).name for kind in rig.KINDS}
    assert names == {"mha": "sglang_mha", "swa": "sglang_swa", "mla": "sglang_mla", "dsa": "sglang_dsa",
                     "mamba": "sglang_hybrid_linear"}
    assert resolver.resolve(rig.make_pool("mamba", 1).mamba_pool).name == "sglang_mamba"
    assert resolver.resolve(rig.make_metadata()).name == "sglang_metadata"


def test_mha_heads_are_sliced_and_mla_latents_replicated():
    mha = describe([rig.make_pool("mha", 2)], dtype="bfloat16", page_size=4, tp_rank=1, tp_size=2)
    mla = describe([rig.make_pool("mla", 2)], dtype="bfloat16", page_size=4, tp_rank=1, tp_size=2)
    k0 = next(r for r in mha.regions if (r.role, r.layer) == ("k", 0))
    assert (k0.shard.kind, k0.shard.totals, k0.shard.outer, k0.stride) == ("split", (rig.HEADS,), 4, 4 * 2 * rig.HEAD_DIM * 2)
    assert {r.shard.kind for r in mla.regions} == {"replicated"}


def test_swa_layers_keep_their_global_ids_in_their_own_page_space():
    desc = describe([rig.make_pool("swa", 1)], dtype="bfloat16", page_size=4)
    by_space = {(r.state_type, r.index_space, r.role, r.layer) for r in desc.regions}
    assert by_space == {("kv", "kv_page", role, layer) for role in "kv" for layer in (1, 3)} | {
        ("swa", "swa_page", role, layer) for role in "kv" for layer in (0, 2)}
    spaces = {s.name: s.count for s in desc.index_spaces}
    assert spaces == {"kv_page": 9, "swa_page": 5}  # (size + page_size) / page_size


def test_a_disagreement_is_reported_with_the_entry_and_both_sizes():
    rank = rig.make_rank("mha", 0, 1, draft=False, fill=None)
    ours = describe([rank.target, rank.metadata], dtype="bfloat16", page_size=4)
    rank.kv_args.kv_item_lens = [n * 2 for n in rank.kv_args.kv_item_lens]
    problems = compare(rank.kv_args, ours)
    assert len(problems) == 2 * rig.LAYERS
    assert "kv_data_ptrs[0]: SGLang registers" in problems[0] and "256-byte items" in problems[0]


# -- what kvbridge does not describe is refused by name, never moved half-described ---------------


def test_manager_refuses_an_sglang_state_type_it_does_not_move(monkeypatch):
    import sglang_pd as pd
    import sglang_rig as rig
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode

    monkeypatch.setenv("KVBRIDGE_SGLANG_BACKEND", "memory")
    rank = rig.make_rank("mha", 0, 1, draft=False, fill=None)
    rank.kv_args.state_types = [StateType.SWA_RING]  # DeepSeek-V4's unified-KV ring, not moved by kvbridge
    with pytest.raises(ValueError, match=r"SGLang state type 'swa_ring' is not supported .* \(supported: c128_state, dsa, mamba, swa\)"):
        pd.manager(rank, DisaggregationMode.DECODE, 1)


@pytest.mark.parametrize("flag,value", [("pp_size", 2), ("enable_dp_attention", True)])
def test_manager_refuses_pipeline_stages_and_dp_attention_naming_the_flag(flag, value, monkeypatch):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvbridge.integrations.sglang.conn import KVBridgeKVManager, sglang_pools

    monkeypatch.setenv("KVBRIDGE_SGLANG_BACKEND", "memory")
    rank = rig.make_rank("mha", 0, 1, draft=False, fill=None)
    args = rig.server_args(1)
    setattr(args, flag, value)
    with sglang_pools(rank.target, None, rank.metadata), pytest.raises(ValueError, match=f"{flag}={value!r}: not supported"):
        KVBridgeKVManager(rank.kv_args, DisaggregationMode.DECODE, args, False)


def test_regions_sglang_does_not_register_are_reported():
    """An SWA draft pool: SGLang's KVArgs registers its full layers but not its window; kvbridge would move more."""
    rank = rig.make_rank("swa", 0, 1, draft=False, fill=None)
    draft = rig.make_pool("swa", 1)
    ours = describe([rank.target, rank.metadata], draft_pools=[draft], dtype="bfloat16", page_size=4)
    ptrs, lens, items = draft.get_contiguous_buf_infos()  # what SGLang's _init_kv_manager appends for a draft pool
    rank.kv_args.kv_data_ptrs += ptrs
    rank.kv_args.kv_data_lens += lens
    rank.kv_args.kv_item_lens += items
    rank.kv_args.num_draft_entries = len(ptrs)
    problems = compare(rank.kv_args, ours)
    assert problems == ["kvbridge describes regions SGLang does not register: "
                        "['draft.swa.k0', 'draft.swa.k2', 'draft.swa.v0', 'draft.swa.v2']"]
