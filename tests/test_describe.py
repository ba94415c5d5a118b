"""Pools -> KVArgs through the real registry (built-in handlers loaded from entry points)."""

import numpy as np
import pytest

from kvbridge.core.describe import describe
from kvbridge.core.pools import KVPool, MetadataPool
from kvbridge.core.state import UnknownPoolTypeError
from kvbridge.state_handlers.dsv4_hisparse import DSV4HiSparsePool
from kvbridge.state_handlers.swa import SWAPool


class DeepSeekV4Pool(SWAPool):
    """A host's own pool class, never registered anywhere."""


def swa_buffers():
    return dict(k=[np.zeros((8, 4, 2, 2), np.uint16)], v=[np.zeros((8, 4, 2, 2), np.uint16)], layer_ids=[3],
                page_size=4, kv_heads=2)


def test_an_unregistered_subclass_of_a_registered_pool_is_described_by_its_base_handler():
    args = describe([DeepSeekV4Pool(**swa_buffers())], dtype="bf16", page_size=4)
    assert {r.state_type for r in args.regions} == {"swa"}
    assert [s.name for s in args.index_spaces] == ["swa_page"]


def test_a_more_specific_registered_subclass_wins():
    pool = DSV4HiSparsePool(**swa_buffers(), c128=[np.zeros((4, 8), np.uint8)], compressed_layer_ids=[3])
    args = describe([pool], dtype="bf16", page_size=4)
    assert {r.state_type for r in args.regions} == {"swa", "dsv4_c128"}


def test_draft_pools_are_appended_and_pair_apart_from_the_target():
    kv = lambda: KVPool(k=[np.zeros((8, 4, 2, 2), np.uint16)], v=[np.zeros((8, 4, 2, 2), np.uint16)], layer_ids=[0],
                        page_size=4, kv_heads=2)
    args = describe([kv(), MetadataPool([np.zeros((4, 16), np.uint8)])], draft_pools=[kv()], dtype="bf16", page_size=4)
    keys = [r.key for r in args.regions]
    assert ("kv", "k", 0, False) in keys and ("kv", "k", 0, True) in keys
    assert len(set(keys)) == len(keys)


def test_a_pool_no_handler_serves_is_a_clear_error():
    with pytest.raises(UnknownPoolTypeError, match="no state handler serves pool type .*object"):
        describe([object()], dtype="bf16", page_size=4)


def test_two_pools_disagreeing_about_an_index_space_is_a_clear_error():
    a = KVPool(k=[np.zeros((8, 4, 2, 2), np.uint16)], v=None, layer_ids=[0], page_size=4)
    from kvbridge.state_handlers.nsa import NSAPool
    b = NSAPool(index_k=[np.zeros((9, 16), np.uint8)], scales=None, layer_ids=[0], page_size=4)
    with pytest.raises(ValueError, match="index space 'kv_page' is described differently by two pools"):
        describe([a, b], dtype="bf16", page_size=4)
