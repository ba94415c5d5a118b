"""Prefill and decode vLLM schedulers hand a request over through KVBridgeConnector, byte-exact."""

from __future__ import annotations

import pytest
from vllm_harness import BLOCK, hand_over, layer_name, make_server


@pytest.mark.parametrize("backend", ["memory", "nixl"])
def test_request_moves_byte_exact(model, bootstrap, backend):
    prefill = make_server(model, "kv_producer", {"backend": backend, "bootstrap": bootstrap}, fill=True)
    decode = make_server(model, "kv_consumer", {"backend": backend})
    try:
        hand_over(prefill, decode, "r1", 5 * BLOCK + 3)
        hand_over(prefill, decode, "r2", 2 * BLOCK)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("p_tp,d_tp,layout", [(1, 2, "LBNHC"), (2, 1, "LBHNC")])
def test_heterogeneous_tp(model, bootstrap, p_tp, d_tp, layout):
    """Token-major (LBNHC: one descriptor per token row) and head-major (LBHNC: per page) KV head slicing."""
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap}, tp=p_tp, fill=True,
                          layout=layout)
    decode = make_server(model, "kv_consumer", {"backend": "memory"}, tp=d_tp, layout=layout)
    _, s_heads, s_tokens, _ = prefill.ranks[0].caches[layer_name(0)].stride()
    assert (s_heads > s_tokens) == (layout == "LBHNC")  # vLLM laid the pages out as asked
    try:
        hand_over(prefill, decode, "r1", 3 * BLOCK + 5)
    finally:
        decode.close()
        prefill.close()


def test_sliding_window_hybrid(model, bootstrap):
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap}, hybrid=True, fill=True,
                          num_blocks=128)
    decode = make_server(model, "kv_consumer", {"backend": "memory"}, hybrid=True, num_blocks=128)
    try:
        assert len(prefill.sched.kv_cache_config.kv_cache_groups) == 2  # full + sliding window, one block pool
        hand_over(prefill, decode, "r1", 6 * BLOCK + 4, hybrid=True)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_mla_latents_are_replicated_across_tp(model, bootstrap, p_tp, d_tp):
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap}, tp=p_tp, fill=True,
                          mla=True)
    decode = make_server(model, "kv_consumer", {"backend": "memory"}, tp=d_tp, mla=True)
    try:
        assert prefill.ranks[0].caches[layer_name(0)].shape[1] == 1  # vLLM's MLA view: one latent "head"
        hand_over(prefill, decode, "r1", 2 * BLOCK + 9)
    finally:
        decode.close()
        prefill.close()


def test_decode_prefix_cache_hit_loads_only_the_missing_tail(model, bootstrap):
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap}, fill=True)
    decode = make_server(model, "kv_consumer", {"backend": "memory"})
    shared = list(range(100, 100 + 2 * BLOCK))
    try:
        hand_over(prefill, decode, "a", 0, prompt=shared + list(range(500, 520)))  # decode caches a's blocks
        loads: dict = {}
        step = decode.step

        def recording_step():
            out = step()
            loads.update(decode.last_output.kv_connector_metadata.to_recv)
            return out

        decode.step = recording_step
        hand_over(prefill, decode, "b", 0, prompt=shared + list(range(600, 630)))
        # b's 62 tokens fill 4 blocks; decode holds the first 2 (a's, same tokens) and loads the other 2.
        assert len(loads["b"].block_ids) == 2
    finally:
        decode.close()
        prefill.close()


def test_kv_both_engines_hand_over_either_way(model, bootstrap):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        other = f"127.0.0.1:{s.getsockname()[1]}"
    one = make_server(model, "kv_both", {"backend": "memory", "bootstrap": bootstrap}, fill=True, seed=1)
    two = make_server(model, "kv_both", {"backend": "memory", "bootstrap": other}, fill=True, seed=2)
    try:
        hand_over(one, two, "r1", 3 * BLOCK + 1)
        hand_over(two, one, "r2", 2 * BLOCK + 7)
    finally:
        two.close()
        one.close()
