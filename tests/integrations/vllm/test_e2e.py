"""Prefill and decode vLLM schedulers hand a request over through KVBridgeConnector, byte-exact."""

from __future__ import annotations

import random

import pytest
import torch
from harness import BLOCK, KV_HEADS, LAYERS, WINDOW, Server, block_ids, layer_name, make_request, make_server, status, step_until
from vllm.v1.request import RequestStatus


def prefill_request(prefill: Server, req_id: str, prompt: list[int]) -> dict:
    """Run a do_remote_decode request to completion on prefill; its kv_transfer_params."""
    prefill.sched.add_request(make_request(req_id, prompt, 1, {"do_remote_decode": True}))
    finished: dict = {}

    def done() -> bool:
        finished.update({k: v for k, v in prefill.step().items() if v.finished})
        return req_id in finished

    step_until([], done)
    params = finished[req_id].kv_transfer_params
    assert params and params["do_remote_prefill"] and isinstance(params["kvbridge_room"], int), params
    return params


def check_bytes(prefill: Server, decode: Server, src: list[list[int]], dst: list[list[int]], positions: range) -> None:
    """Oracle: for every token position, layer and KV head, decode's page row equals prefill's (heads mapped by TP)."""
    hp, hd = KV_HEADS // len(prefill.ranks), KV_HEADS // len(decode.ranks)
    for layer in range(LAYERS):
        group = 1 if len(src) > 1 and layer % 2 else 0
        for pos in positions:
            s_block, d_block, row = src[group][pos // BLOCK], dst[group][pos // BLOCK], pos % BLOCK
            for rd, drank in enumerate(decode.ranks):
                for j in range(hd):
                    g = rd * hd + j
                    want = prefill.ranks[g // hp].caches[layer_name(layer)][s_block, g % hp, row]
                    got = drank.caches[layer_name(layer)][d_block, j, row]
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer, pos, rd, j)


def hand_over(prefill: Server, decode: Server, req_id: str, prompt_len: int, hybrid: bool = False) -> None:
    prompt = [random.randrange(10, 900) for _ in range(prompt_len)]
    free_before = prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    params = prefill_request(prefill, req_id, prompt)
    src = block_ids(prefill.sched, req_id)
    assert status(prefill.sched, req_id) == RequestStatus.FINISHED_LENGTH_CAPPED  # finished, blocks still held
    assert prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks() < free_before

    decode.sched.add_request(make_request(req_id, prompt, 4, params))
    decode.step()
    assert status(decode.sched, req_id) == RequestStatus.WAITING_FOR_REMOTE_KVS
    dst = block_ids(decode.sched, req_id)
    assert prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks() < free_before  # not before the transfer

    step_until([prefill, decode], lambda: status(decode.sched, req_id) == RequestStatus.RUNNING)
    # Loaded every prompt token but the last, which decode recomputes to sample the next one.
    assert decode.last_output.num_scheduled_tokens[req_id] == 1
    assert decode.sched.requests[req_id].num_computed_tokens == prompt_len
    window = range(prompt_len - WINDOW, prompt_len) if hybrid else range(prompt_len)
    check_bytes(prefill, decode, list(src), list(dst), window if hybrid else range(prompt_len))
    if hybrid:  # the full-attention layers got every position
        check_bytes(prefill, decode, [src[0], src[0]], [dst[0], dst[0]], range(prompt_len))
    step_until([prefill], lambda: req_id not in prefill.sched.requests)  # freed once sent
    assert prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    step_until([decode], lambda: req_id not in decode.sched.requests)  # decode runs it to the end


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
