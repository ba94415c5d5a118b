"""What kvbridge keeps alive: pools described from objects live as long as the manager that registered them.

A host that builds its pools inside a function and keeps only the managers must still get its bytes
moved exactly (the arrays cannot be freed and their memory reused under the registration).
"""

import gc
import weakref

import numpy as np

from kvbridge import BootstrapServer, DecodeManager, Poll, PrefillManager, Receiver, Sender, describe
from kvbridge.core.description.describe import held_by
from kvbridge.core.description.pools import KVPool, MetadataPool

PAGES, PAGE_TOKENS, HEAD_BYTES = 64, 16, 256  # 4 KiB pages: one token row is HEAD_BYTES


def _pools(fill: bool) -> tuple[KVPool, MetadataPool]:
    rng = np.random.default_rng(7)
    make = (lambda shape: rng.integers(0, 256, shape, np.uint8)) if fill else (lambda shape: np.zeros(shape, np.uint8))
    kv = KVPool(k=[make((PAGES, PAGE_TOKENS, 1, HEAD_BYTES))], v=[make((PAGES, PAGE_TOKENS, 1, HEAD_BYTES))],
                layer_ids=[0], page_size=PAGE_TOKENS)
    return kv, MetadataPool([make((8, 64))])


def test_a_kvargs_from_describe_holds_its_pools_until_it_is_gone():
    def build():
        kv, meta = _pools(fill=True)
        return describe([kv, meta], dtype="bfloat16", page_size=PAGE_TOKENS), weakref.ref(kv.k[0])

    kvargs, k0 = build()
    gc.collect()
    assert k0() is not None and any(p.k[0] is k0() for p in held_by(kvargs) if isinstance(p, KVPool))
    del kvargs
    gc.collect()
    assert k0() is None  # released with the KVArgs: nothing is held for ever


def test_pools_made_in_a_function_survive_while_the_managers_are_open_and_arrive_byte_exact():
    bootstrap = BootstrapServer("127.0.0.1")
    expected: dict[str, np.ndarray] = {}

    def prefill_rank() -> PrefillManager:  # every reference to the pools ends with this function
        kv, meta = _pools(fill=True)
        expected["k"], expected["meta"] = kv.k[0][[0, 1, 2, 7]].copy(), meta.buffers[0][1].copy()
        return PrefillManager(describe([kv, meta], dtype="bfloat16", page_size=PAGE_TOKENS), "memory",
                              bootstrap=bootstrap.address)

    def decode_rank() -> tuple[DecodeManager, np.ndarray, np.ndarray]:
        kv, meta = _pools(fill=False)
        return (DecodeManager(describe([kv, meta], dtype="bfloat16", page_size=PAGE_TOKENS), "memory"),
                kv.k[0], meta.buffers[0])

    prefill = prefill_rank()
    decode, d_k, d_meta = decode_rank()
    gc.collect()
    garbage = [np.full((PAGES, PAGE_TOKENS, 1, HEAD_BYTES), 0xEE, np.uint8) for _ in range(4)]  # reuse freed memory
    try:
        recv = Receiver(decode, 7, bootstrap=bootstrap.address)
        recv.init(page_indices=[10, 11, 12, 30], metadata_row=5)
        send = Sender(prefill, 7, metadata_row=1)
        assert send.wait(Poll.WAITING_FOR_INPUT, timeout=30) == Poll.WAITING_FOR_INPUT, send.failure()
        send.send([0, 1, 2, 7], last=True)
        assert recv.wait(Poll.SUCCESS, timeout=30) == Poll.SUCCESS, recv.failure()
        assert np.array_equal(d_k[[10, 11, 12, 30]], expected["k"]) and np.array_equal(d_meta[5], expected["meta"])
    finally:
        for obj in (decode, prefill, bootstrap):
            obj.close()
    del garbage
