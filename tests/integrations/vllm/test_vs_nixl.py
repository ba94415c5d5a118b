"""The scheduler sees the same thing from KVBridgeConnector as from vLLM's own NixlConnector.

Only the scheduler side: each connector is loaded by vLLM's factory into a real
``Scheduler``; the workers' completions (``finished_recving`` /
``finished_sending``) are the same KVConnectorOutput for both, fed in by the test.
"""

from __future__ import annotations

import pytest
from vllm_harness import BLOCK, TOKEN, kv_cache_config, make_request, status, vllm_config
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager


def scheduler(model, connector: str, role: str, extra: dict) -> Scheduler:
    cfg = vllm_config(model, role, extra)
    if connector == "NixlConnector":
        cfg.kv_transfer_config.kv_connector = "NixlConnector"
        cfg.kv_transfer_config.kv_connector_module_path = None
        cfg.kv_transfer_config.kv_connector_extra_config = {}
    kcc = kv_cache_config(cfg, 1, False, 64)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    return Scheduler(vllm_config=cfg, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(cfg),
                     block_size=BLOCK, log_stats=True)


def step(sched: Scheduler, kv: KVConnectorOutput | None = None):
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[TOKEN] for _ in ids], kv_connector_output=kv)
    result = sched.update_from_output(so, out)
    return so, {o.request_id: o for outs in result.values() for o in outs.outputs}


def observe(model, connector: str, extra_p: dict) -> list:
    """What the two schedulers do with one P/D request, as a list of observations."""
    seen: list = []
    prefill = scheduler(model, connector, "kv_producer", extra_p)
    decode = scheduler(model, connector, "kv_consumer", {"backend": "memory"} if connector != "NixlConnector" else {})
    prompt = list(range(10, 10 + 3 * BLOCK + 5))
    p_free = prefill.kv_cache_manager.block_pool.get_num_free_blocks()
    prefill.add_request(make_request("r", prompt, 1, {"do_remote_decode": True}))
    _, outs = step(prefill)
    params = outs["r"].kv_transfer_params
    seen.append(("prefill finished", outs["r"].finished, status(prefill, "r")))
    seen.append(("prefill holds blocks", p_free - prefill.kv_cache_manager.block_pool.get_num_free_blocks()))
    seen.append(("params name prefill's blocks", [list(g) for g in params["remote_block_ids"]]))  # JSON: lists
    d_free = decode.kv_cache_manager.block_pool.get_num_free_blocks()
    decode.add_request(make_request("r", prompt, 3, params))
    step(decode)
    seen.append(("decode waits", status(decode, "r"), d_free - decode.kv_cache_manager.block_pool.get_num_free_blocks()))
    step(decode, KVConnectorOutput(finished_recving={"r"}))
    so, _ = step(decode)
    seen.append(("decode runs", status(decode, "r"), so.num_scheduled_tokens.get("r"),
                 decode.requests["r"].num_computed_tokens))
    step(prefill, KVConnectorOutput(finished_sending={"r"}))
    seen.append(("prefill freed", "r" in prefill.requests, prefill.kv_cache_manager.block_pool.get_num_free_blocks() == p_free))
    return seen


def test_same_scheduler_behaviour_as_nixl_connector(model, bootstrap):
    ours = observe(model, "KVBridgeConnector", {"backend": "memory", "bootstrap": bootstrap})
    theirs = observe(model, "NixlConnector", {})
    assert ours == theirs
    assert ours[0] == ("prefill finished", True, RequestStatus.FINISHED_LENGTH_CAPPED) and ours[1][1] == 4
