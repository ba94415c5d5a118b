"""Decode-first requests: prefill sends each layer while its last prefill step computes (save_kv_layer).

The router sends both legs at once (``decode_first_params``); decode allocates and asks first. The harness's
"model" writes each layer's KV rows of the step's tokens just before that layer's ``save_kv_layer`` (random
bytes, as an attention layer writes them), so a layer sent before it was saved would land stale and fail the
byte-exact oracle; the per-layer test also waits, between two layers of the forward, for the layer just saved
to have landed on decode, which only a layer-wise send can do.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from vllm_harness import (BLOCK, LAYERS, Seen, block_ids, check_bytes, layer_name, make_request, make_server,
                          status, step_until)
from vllm.v1.request import RequestStatus

from kvbridge.integrations.vllm import decode_first_params


def model_writes(server, req_id: str, landed=None):
    """A step's fake forward: layer i's rows of the step's tokens get fresh random bytes before save_kv_layer.

    ``landed(layer)``, if given, is called after each save_kv_layer of the request's last prefill step.
    """
    gen = torch.Generator().manual_seed(1)

    def on_layer(rank: int, layer: int) -> None:
        so = server.last_output
        n = so.num_scheduled_tokens.get(req_id, 0)
        req = server.sched.requests.get(req_id)
        if not n or req is None:
            return
        end = req.num_computed_tokens  # already advanced by this step's schedule()
        if layer < 0:
            if landed is not None and end >= req.num_prompt_tokens:
                landed(-1 - layer)
            return
        blocks = block_ids(server.sched, req_id)[0]
        view = server.ranks[rank].caches[layer_name(layer)]
        for pos in range(end - n, min(end, req.num_prompt_tokens)):
            row = view[blocks[pos // BLOCK], :, pos % BLOCK]
            row.view(torch.uint8).copy_(torch.randint(0, 256, row.view(torch.uint8).shape, dtype=torch.uint8,
                                                      generator=gen))

    server.on_layer = on_layer


def rows(server, req_id_blocks, layer: int, positions: range) -> torch.Tensor:
    """Rank 0's rows of ``layer`` at ``positions`` of a request's blocks, as bytes."""
    blocks = torch.tensor([req_id_blocks[p // BLOCK] for p in positions])
    slots = torch.tensor([p % BLOCK for p in positions])
    return server.ranks[0].caches[layer_name(layer)][blocks, :, slots].contiguous().view(torch.uint8)


def wait_requested(prefill, room: int) -> None:
    """Until decode's request for ``room`` reached every prefill rank (bounded)."""
    deadline = time.monotonic() + 10
    while not all(r.connector._w.prefill.requested(room) for r in prefill.ranks):
        assert time.monotonic() < deadline, "decode's request never reached prefill"
        time.sleep(0.005)


def send_decode_first(prefill, decode, bootstrap: str, req_id: str, prompt_len: int, *, decode_late: bool = False,
                      landed=None, prompt: list[int] | None = None) -> None:
    """One decode-first request end to end, byte-exact, prefill's blocks freed only after the transfer."""
    prompt = prompt or [random.randrange(10, 900) for _ in range(prompt_len)]
    prompt_len = len(prompt)
    p_params, d_params = decode_first_params(bootstrap)
    room = p_params["kvbridge_room"]
    free_before = prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    model_writes(prefill, req_id, landed)
    if not decode_late:  # the usual order: decode allocates and asks while prefill queues
        decode.sched.add_request(make_request(req_id, prompt, 4, d_params))
        decode.step()
        assert status(decode.sched, req_id) == RequestStatus.WAITING_FOR_REMOTE_KVS
        wait_requested(prefill, room)
    prefill.sched.add_request(make_request(req_id, prompt, 1, p_params))
    finished: dict = {}
    step_until([], lambda: finished.update({k: v for k, v in prefill.step().items() if v.finished})
               or req_id in finished)
    src = block_ids(prefill.sched, req_id)  # still held: the room is not done, or done but not yet reported
    if decode_late:
        decode.sched.add_request(make_request(req_id, prompt, 4, d_params))
    step_until([prefill, decode], lambda: status(decode.sched, req_id) == RequestStatus.RUNNING)
    assert decode.sched.requests[req_id].num_computed_tokens == prompt_len
    check_bytes(prefill, decode, list(src), list(block_ids(decode.sched, req_id)), range(prompt_len))
    step_until([prefill], lambda: req_id not in prefill.sched.requests)
    assert prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    step_until([decode], lambda: req_id not in decode.sched.requests)
    prefill.on_layer = None


def test_each_layer_lands_before_the_next_is_computed(model, bootstrap):
    """TP 1 -> 1 over memory: a 300-token prompt (two prefill steps; the layer-wise chunk also carries the
    first step's blocks), then the fallback: decode asks only after prefill finished, sent whole."""
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap})
    decode = make_server(model, "kv_consumer", {"backend": "memory"})
    seen: list[int] = []

    def landed(layer: int) -> None:
        """Between two layers of prefill's forward: the layer just saved reaches decode (bounded wait)."""
        req = prefill.sched.requests["r1"]
        positions = range(req.num_prompt_tokens)
        src, dst = block_ids(prefill.sched, "r1")[0], block_ids(decode.sched, "r1")[0]
        deadline = time.monotonic() + 10
        while not torch.equal(rows(prefill, src, layer, positions), rows(decode, dst, layer, positions)):
            assert time.monotonic() < deadline, f"layer {layer} did not land on decode before layer {layer + 1} ran"
            time.sleep(0.002)
        if layer + 1 < LAYERS:  # the next layer is not computed yet: decode cannot hold its final bytes
            assert not torch.equal(rows(prefill, src, layer + 1, positions), rows(decode, dst, layer + 1, positions))
        seen.append(layer)

    try:
        send_decode_first(prefill, decode, bootstrap, "r1", 300, landed=landed)
        assert seen == list(range(LAYERS))
        send_decode_first(prefill, decode, bootstrap, "r2", 3 * BLOCK + 1, decode_late=True)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("backend,p_tp,d_tp", [("nixl", 2, 1), ("memory", 1, 2)])
def test_heterogeneous_tp(model, bootstrap, backend, p_tp, d_tp):
    """Then a second request sharing the first's two leading blocks: decode (and prefill) hit their prefix
    caches, decode asks only the two missing blocks, and prefill sends the tail of its own."""
    prefill = make_server(model, "kv_producer", {"backend": backend, "bootstrap": bootstrap}, tp=p_tp)
    decode = make_server(model, "kv_consumer", {"backend": backend}, tp=d_tp)
    shared = list(range(100, 100 + 2 * BLOCK))
    try:
        send_decode_first(prefill, decode, bootstrap, "r1", 0, prompt=shared + list(range(500, 539)))
        loads: dict = {}
        step = decode.step

        def recording_step():
            out = step()
            loads.update(decode.last_output.kv_connector_metadata.to_recv)
            return out

        decode.step = recording_step
        send_decode_first(prefill, decode, bootstrap, "r2", 0, prompt=shared + list(range(600, 630)))
        assert len(loads["r2"].block_ids) == 2  # 62 tokens, 4 blocks: 2 from decode's prefix cache
    finally:
        decode.close()
        prefill.close()


def test_prefill_abort_fails_decode_at_once(model, bootstrap):
    """Prefill's vLLM aborts the request before it ran: decode's room fails now (not at a timeout), per policy."""
    slow = {"sender_grace": 60, "bootstrap_timeout": 60}  # no timeout can explain a fast failure
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap, **slow})
    decode = make_server(model, "kv_consumer", {"backend": "memory", **slow}, policy="fail")
    try:
        prompt = list(range(10, 10 + 2 * BLOCK + 3))
        p_params, d_params = decode_first_params(bootstrap)
        decode.sched.add_request(make_request("r1", prompt, 4, d_params))
        decode.step()
        dst = block_ids(decode.sched, "r1")[0]
        wait_requested(prefill, p_params["kvbridge_room"])
        prefill.sched.add_request(make_request("r1", prompt, 1, p_params))
        prefill.sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
        seen = Seen(decode)
        start = time.monotonic()
        step_until([prefill, decode], lambda: "r1" in seen.finished, timeout=20)
        assert time.monotonic() - start < 5  # told, not timed out (sender_grace and bootstrap_timeout are 60 s)
        assert seen.invalid == set(dst)  # exactly the blocks the room was to fill
        assert str(seen.finished["r1"].finish_reason).lower().endswith("error") and "r1" not in decode.sched.requests
        step_until([prefill], lambda: "r1" not in prefill.sched.requests)
    finally:
        decode.close()
        prefill.close()


def test_hybrid_models_are_refused_by_name(model, bootstrap, caplog):
    """Several KV cache groups (full + sliding window): decode fails the request (policy ``fail``) naming why,
    prefill serves it without a transfer and frees its blocks."""
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap}, hybrid=True,
                          num_blocks=128)
    decode = make_server(model, "kv_consumer", {"backend": "memory"}, hybrid=True, num_blocks=128, policy="fail")
    seen = Seen(decode)
    try:
        prompt = list(range(10, 10 + 3 * BLOCK))
        p_params, d_params = decode_first_params(bootstrap)
        with caplog.at_level("ERROR", logger="kvbridge"):
            decode.sched.add_request(make_request("r1", prompt, 4, d_params))
            prefill.sched.add_request(make_request("r1", prompt, 1, p_params))
            step_until([prefill, decode], lambda: "r1" in seen.finished and "r1" not in prefill.sched.requests)
        why = "decode-first (layer-wise) transfers need a model with one KV cache group; this one has 2"
        assert f"{why} (a hybrid model): send it through the default flow" in caplog.text
        assert "prefill runs it without a transfer" in caplog.text  # prefill's side said it too
        assert "are reported as failed loads" in caplog.text  # decode's
        assert str(seen.finished["r1"].finish_reason).lower().endswith("error")
        assert not seen.invalid  # several groups: vLLM takes the failure per request (failed_recving), not per block
    finally:
        decode.close()
        prefill.close()
