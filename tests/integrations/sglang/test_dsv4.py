"""SGLang's real DeepSeekV4TokenToKVPool: described as SGLang's KVArgs registers it, one request moved byte-exact.

Each test runs in a forked child (the pool reads SGLang's published ServerArgs, a process-wide setting).
"""

import itertools

import forked
import pytest
import sglang_dsv4 as dsv4

# Imported before any fork: a forked child then imports nothing.
from sglang.srt.mem_cache import deepseek_v4_memory_pool  # noqa: F401
from sglang.srt import server_args  # noqa: F401

_rooms = itertools.count(5000)
_ENV = {"HF_HUB_OFFLINE": "1", "KVBRIDGE_SGLANG_BACKEND": "memory"}


def test_the_pool_resolves_to_kvbridges_dsv4_handler_by_class_name():
    assert forked.run(dsv4.handler_name, _ENV, timeout=120) == "sglang_dsv4"


def test_description_agrees_with_sglang_kv_args_entry_by_entry():
    *problems, regions, state_types, spaces = forked.run(dsv4.describe_and_compare, _ENV, timeout=120)
    assert problems == []
    assert state_types == "state types: swa,c128_state"
    # SGLang's order: C4 KV (layer 1), C4 indexer, C128 KV (layer 2); window latents of every layer, the C4 rings; C128 ring.
    assert regions == ("regions: kv/c4/1/c4_page, kv/c4_indexer/1/kv_page, kv/c128/2/kv_page, swa/kv/0/swa_page, "
                       "swa/kv/1/swa_page, swa/kv/2/swa_page, swa/c4_state/1/swa_page, swa/c4_indexer_state/1/swa_page, "
                       "c128_state/state/2/c128_slot"), regions
    # kv_page: as many pages as its smallest region (the C4 indexer's 132 rows); the C4 KV's 8 pages are c4_page's.
    assert spaces.startswith("spaces: kv_page=132,c4_page=8,swa_page=3,c128_slot=7"), spaces


def test_a_nextn_draft_pool_is_described_as_sglang_registers_it():
    """SGLang's setup_state_kv_args appends a DeepSeek-V4 draft's window latents as a second StateType.SWA
    component (the target's SWA page list addresses it); its paged-KV list is empty (a window-only layer)."""
    *problems, regions, state_types, _ = forked.run(dsv4.describe_and_compare, _ENV, True, timeout=120)
    assert problems == []
    assert state_types == "state types: swa,c128_state,swa"
    assert regions.endswith("c128_state/state/2/c128_slot, draft swa/kv/0/swa_page"), regions


def test_request_with_a_draft_pool_lands_byte_exact():
    """TP 1 -> 2 over nixl: both decode ranks get the draft's window pages from the one prefill rank."""
    room = next(_rooms)
    env = {**_ENV, "KVBRIDGE_SGLANG_BACKEND": "nixl"}
    assert forked.run(dsv4.transfer, env, 1, 2, room, room, "nixl", dsv4.TOKENS, True, timeout=120) == []


# (prefill TP, decode TP, backend): every cache is replicated, so TP 2 -> 1 sends from one prefill rank and
# TP 1 -> 2 fills both decode ranks from the one prefill rank.
CASES = [(1, 1, "memory"), (2, 1, "memory"), (1, 2, "memory"), (2, 1, "nixl"), (1, 2, "nixl")]


@pytest.mark.parametrize("prefill_tp,decode_tp,backend", CASES, ids=[f"tp{p}to{d}-{b}" for p, d, b in CASES])
def test_request_lands_byte_exact(prefill_tp, decode_tp, backend):
    room = next(_rooms)
    env = {**_ENV, "KVBRIDGE_SGLANG_BACKEND": backend}
    assert forked.run(dsv4.transfer, env, prefill_tp, decode_tp, room, room, backend, timeout=120) == []


def test_a_request_at_a_c128_block_boundary_sends_no_c128_state():
    """512 tokens: SGLang's c128_state lists are empty on both sides; the rest still lands, the C128 rings stay zero."""
    room = next(_rooms)
    assert forked.run(dsv4.transfer, _ENV, 1, 1, room, room, "memory", 512, timeout=120) == []


def test_the_oracle_reports_a_decode_rank_that_received_nothing():
    assert forked.run(dsv4.untouched_decode_problems, _ENV, 7, timeout=120) == 0


def test_a_layout_kvbridge_does_not_move_is_refused_by_name():
    """A ratio-2 kv-source layer (SGLang's low-ratio layout): describe() names the ratio and what to do."""
    text = forked.run(dsv4.describe_with_ratio_2_layer, _ENV, timeout=120)
    assert text == ("DeepSeekV4TokenToKVPool with compression ratios [2]: only ratios 4 and 128 are described by kvbridge's "
                    "SGLang integration; use SGLang's own transfer backend for this model"), text
