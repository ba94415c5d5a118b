"""Failure reasons a host reads in ``failure()``: they name the cause and what to check, once."""

import numpy as np

from kvbridge import BootstrapServer, DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig, describe
from kvbridge.core.description.pools import KVPool, MetadataPool


def _kvargs(pages: int = 8):
    kv = KVPool(k=[np.zeros((pages, 4, 1, 64), np.uint8)], v=[np.zeros((pages, 4, 1, 64), np.uint8)],
                layer_ids=[0], page_size=4)
    return describe([kv, MetadataPool([np.zeros((4, 64), np.uint8)])], dtype="bfloat16", page_size=4)


def test_a_sender_whose_decode_never_called_init_says_so_after_bootstrap_timeout():
    bootstrap = BootstrapServer("127.0.0.1")
    prefill = PrefillManager(_kvargs(), "memory", bootstrap=bootstrap.address,
                             config=SessionConfig(bootstrap_timeout=0.5))
    try:
        send = Sender(prefill, 11, metadata_row=0)
        assert send.wait(Poll.WAITING_FOR_INPUT, timeout=20) == Poll.FAILED
        reason = send.failure() or ""
        assert reason.startswith("no request from decode for room 11 within bootstrap_timeout=0.5 s"), reason
        assert "did decode create a Receiver for room 11 and call init()?" in reason, reason
    finally:
        prefill.close()
        bootstrap.close()


def test_abort_with_the_default_reason_reads_once_on_both_sides():
    bootstrap = BootstrapServer("127.0.0.1")
    prefill = PrefillManager(_kvargs(), "memory", bootstrap=bootstrap.address)
    decode = DecodeManager(_kvargs(), "memory")
    try:
        recv = Receiver(decode, 12, bootstrap=bootstrap.address)
        recv.init(page_indices=[0, 1], metadata_row=0)
        send = Sender(prefill, 12, metadata_row=0)
        assert send.wait(Poll.WAITING_FOR_INPUT, timeout=20) == Poll.WAITING_FOR_INPUT, send.failure()
        recv.abort()
        assert recv.wait(Poll.SUCCESS, timeout=20) == Poll.FAILED
        assert send.wait(Poll.SUCCESS, timeout=20) == Poll.FAILED
        assert recv.failure() == "abort() called by decode's host"
        assert send.failure() == "aborted by decode: abort() called by decode's host"
    finally:
        for obj in (decode, prefill, bootstrap):
            obj.close()
