"""KVBridgeConnector's failures: a killed prefill and bad kv_transfer_params end in load errors, per policy."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_harness import (BLOCK, Seen, block_ids, check_bytes, hand_over, make_request, make_server, prefill_request,
                          status, step_until)
from vllm.v1.request import RequestStatus

from kvbridge import Poll

FAST_FAILURE = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "fence_timeout": 1.0}


def test_killed_prefill_reports_exactly_the_requests_blocks_and_decode_recomputes(model, bootstrap, tmp_path):
    model_dir = Path(model.model)
    prompt_len = 4 * BLOCK + 2
    child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("prefill_child.py")), str(model_dir),
                              bootstrap, "r1", str(prompt_len)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    decode = make_server(model, "kv_consumer", {"backend": "memory", **FAST_FAILURE}, policy="recompute")
    seen = Seen(decode)
    try:
        line = child.stdout.readline()
        assert line, f"the prefill process exited with {child.wait(30)} before printing kv_transfer_params"
        params = json.loads(line)
        decode.sched.add_request(make_request("r1", list(range(10, 10 + prompt_len)), 4, params))
        decode.step()
        assert status(decode.sched, "r1") == RequestStatus.WAITING_FOR_REMOTE_KVS
        dst = set(block_ids(decode.sched, "r1")[0])
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # decode finds prefill and asks; prefill's sender is never polled
            decode.step()
            time.sleep(0.05)
        assert status(decode.sched, "r1") == RequestStatus.WAITING_FOR_REMOTE_KVS and not seen.invalid
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        step_until([decode], lambda: status(decode.sched, "r1") != RequestStatus.WAITING_FOR_REMOTE_KVS)
        assert seen.invalid == dst  # exactly the blocks the room was to fill
        assert status(decode.sched, "r1") == RequestStatus.RUNNING
        assert decode.last_output.num_scheduled_tokens["r1"] == prompt_len  # recomputed from scratch, not garbage
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        decode.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_bad_params_fail_that_request_only(model, bootstrap, caplog, policy):
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap}, fill=True)
    decode = make_server(model, "kv_consumer", {"backend": "memory"}, policy=policy)
    seen = Seen(decode)
    bad = {"do_remote_prefill": True, "kvbridge_room": 5, "kvbridge_bootstrap": "no-port-here",
           "kvbridge_block_ids": [[1, 2]], "kvbridge_num_tokens": 40}
    try:
        with caplog.at_level(logging.ERROR, logger="kvbridge"):
            decode.sched.add_request(make_request("bad", list(range(10, 50)), 2, bad))
            step_until([decode], lambda: "bad" in seen.finished or status(decode.sched, "bad") == RequestStatus.RUNNING)
        assert "kvbridge_bootstrap must be HOST:PORT, got 'no-port-here'" in caplog.text
        assert seen.invalid  # the request's blocks were reported, never loaded
        if policy == "fail":
            assert seen.finished["bad"].finish_reason is not None and "bad" not in decode.sched.requests
            assert str(seen.finished["bad"].finish_reason).lower().endswith("error")
        else:
            assert status(decode.sched, "bad") == RequestStatus.RUNNING
            assert decode.last_output.num_scheduled_tokens["bad"] == 40
        hand_over(prefill, decode, "good", 3 * BLOCK)  # the scheduler keeps serving others
    finally:
        decode.close()
        prefill.close()


def test_request_aborted_while_loading_frees_its_blocks_once_the_room_is_fenced(model, bootstrap):
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap}, fill=True)
    decode = make_server(model, "kv_consumer", {"backend": "memory", **FAST_FAILURE})
    seen = Seen(decode)
    pool = decode.sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    try:
        params = prefill_request(prefill, "r1", list(range(10, 10 + 3 * BLOCK)))  # prefill is not stepped again
        decode.sched.add_request(make_request("r1", list(range(10, 10 + 3 * BLOCK)), 4, params))
        decode.step()
        assert status(decode.sched, "r1") == RequestStatus.WAITING_FOR_REMOTE_KVS
        decode.sched.finish_requests({"r1"}, RequestStatus.FINISHED_ABORTED)
        assert pool.get_num_free_blocks() < free_before  # vLLM holds them until the load reports finished
        step_until([decode], lambda: pool.get_num_free_blocks() == free_before)
        assert "r1" not in decode.sched.requests
    finally:
        decode.close()
        prefill.close()


def test_a_restarted_named_decode_engine_fails_its_old_room_on_prefill_at_once_and_is_served(model, bootstrap):
    """A decode engine of ``instance_name`` X replaced by a new one of the same name (its lease is 30 s):
    prefill fails the old engine's room as soon as the new engine's worker handshakes, naming the restart,
    and the new engine's request is moved byte for byte (docs/failures.md, "Decode restarted")."""
    lease = {"heartbeat_interval": 1.0, "heartbeat_timeout": 30.0}
    named = {"backend": "memory", "instance_name": "decode-a:8200", **lease}
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap, **lease}, fill=True)
    old = make_server(model, "kv_consumer", named)
    new = None
    senders = prefill.ranks[0].connector._worker.senders
    try:
        p1, p2 = list(range(10, 10 + 3 * BLOCK)), list(range(20, 20 + 2 * BLOCK + 5))
        params1 = prefill_request(prefill, "r1", p1)
        params2 = prefill_request(prefill, "r2", p2)  # prefill is not stepped after this until the new engine asks
        src = block_ids(prefill.sched, "r2")
        old.sched.add_request(make_request("r1", p1, 4, params1))
        step_until([old], lambda: "r1" in senders and senders["r1"][0].poll() == Poll.WAITING_FOR_INPUT)
        # The old engine is gone from here on (never stepped again, as if killed); its lease would hold 30 s.
        new = make_server(model, "kv_consumer", named)
        new.sched.add_request(make_request("r2", p2, 4, params2))
        start = time.monotonic()
        step_until([new], lambda: senders["r1"][0].poll() == Poll.FAILED, timeout=10)
        elapsed = time.monotonic() - start
        print(f"old room FAILED on prefill {elapsed:.2f}s after the new engine's request was added")
        assert elapsed < 5  # the handshake, not the lease
        reason = senders["r1"][0].failure() or ""
        assert "decode 'decode-a:8200' TP rank 0" in reason and "restarted" in reason, reason
        dst = block_ids(new.sched, "r2")
        step_until([prefill, new], lambda: status(new.sched, "r2") == RequestStatus.RUNNING)
        check_bytes(prefill, new, list(src), list(dst), range(len(p2)))
    finally:
        for server in (new, old, prefill):
            if server is not None:
                server.close()
