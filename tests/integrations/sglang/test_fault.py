"""A killed prefill: decode's KVReceiver.poll() reaches KVPoll.Failed with a failure naming the cause, within kvbridge's deadlines."""

import json
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
import sglang_pd as pd
import sglang_rig as rig
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvbridge.integrations.sglang.conn import KVBridgeKVBootstrapServer

TIMEOUTS = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "transfer_timeout": 2.0, "fence_timeout": 1.0,
            "bootstrap_timeout": 10.0}
ROOM = 77


def prefill_host(conn, kind):
    """The prefill server: bootstrap server, one rank, one request that sends its first chunk, then waits to be killed."""
    import torch

    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork (see forked.py)
    try:
        boot = KVBridgeKVBootstrapServer("127.0.0.1", 0)
        port = int(boot.address.rsplit(":", 1)[1])
        conn.send(("port", port))
        g = rig.global_tensors(kind, False, seed=5)
        rank = rig.make_rank(kind, 0, 1, draft=False, fill=g)
        mgr = pd.manager(rank, DisaggregationMode.PREFILL, port)
        sender = pd.prefill_senders([mgr], port, ROOM)[0]
        polls = pd.wait([sender], {KVPoll.WaitingForInput, KVPoll.Failed}, 20)
        sender.init(len(pd.SRC_PAGES), pd.SRC_ROW)
        sender.send(np.array(pd.SRC_PAGES[:1], dtype=np.int32))  # the first chunk; the last never comes
        conn.send(("sent", polls))
        time.sleep(60)
    except BaseException as exc:  # the parent fails with it
        conn.send(("error", repr(exc)))
    finally:
        os._exit(0)


@pytest.mark.parametrize("backend", ["memory", "nixl"])
def test_killed_prefill_fails_the_receiver_with_a_reason(backend, monkeypatch, tmp_path):
    config = tmp_path / "kvbridge.json"
    config.write_text(json.dumps({"backend": backend, **TIMEOUTS}))
    monkeypatch.delenv("KVBRIDGE_SGLANG_BACKEND", raising=False)
    monkeypatch.setenv("KVBRIDGE_SGLANG_CONFIG", str(config))  # the settings file alone switches kvbridge on
    ctx = multiprocessing.get_context("fork")  # SGLang is imported already: no import in the child
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=prefill_host, args=(child, "mha"))
    proc.start()
    child.close()
    mgr = None
    try:
        assert parent.poll(60), "the prefill host did not start"
        tag, port = parent.recv()
        assert tag == "port", port
        rank = rig.make_rank("mha", 0, 1, draft=False, fill=None)
        mgr = pd.manager(rank, DisaggregationMode.DECODE, port)
        recv = pd.decode_receivers([mgr], [rank], port, ROOM)[0]
        assert parent.poll(60), "the prefill host did not send its first chunk"
        tag, polls = parent.recv()
        assert (tag, polls) == ("sent", [KVPoll.WaitingForInput])
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        final = pd.wait([recv], {KVPoll.Failed, KVPoll.Success}, 30)
        elapsed = time.monotonic() - killed
        assert final == [KVPoll.Failed]
        print(f"{backend}: receiver Failed {elapsed:.2f}s after the kill: {recv.receiver.failure()}")
        limit = TIMEOUTS["heartbeat_timeout"] + TIMEOUTS["fence_timeout"] + TIMEOUTS["transfer_timeout"]
        assert elapsed < limit + 2.0, f"Failed after {elapsed:.1f}s, kvbridge's deadlines allow {limit}s"
        with pytest.raises(KVTransferError) as err:
            recv.failure_exception()
        text = str(err.value).lower()
        assert err.value.bootstrap_room == ROOM
        assert "prefill" in text and ("heartbeat" in text or "silent" in text or "gone" in text or "lost" in text), text
    finally:
        proc.kill()
        proc.join(5)
        if mgr is not None:
            mgr.close()
