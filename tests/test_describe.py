"""Pools -> KVArgs through the real registry (built-in handlers loaded from entry points)."""

import numpy as np
import pytest

from kvbridge.core.description.describe import describe
from kvbridge.core.description.pools import KVPool, MetadataPool
from kvbridge.core.description.state import UnknownPoolTypeError
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


# -- roles: an open vocabulary, declared by the handler that uses it ------------------------------
ROLES_PLUGIN = '''
from dataclasses import dataclass
from kvbridge import (DescribeContext, Description, HandlerCapabilities, IndexSpace, KV_PAGE_SPACE, StateHandlerSpec,
                      buffer_region, hookimpl, item_count)

@dataclass
class LatentPool:
    """Per layer three buffers indexed by KV page: two halves of a latent and a per-page scale."""
    wkv_a: list
    wkv_b: list
    scale: list
    page_size: int
    typo: bool = False

class LatentHandler:
    def describe(self, pool, ctx: DescribeContext) -> Description:
        desc = Description()
        roles = ("wkv_a", "wkv_bb" if pool.typo else "wkv_b", "scale")
        for role, bufs in zip(roles, (pool.wkv_a, pool.wkv_b, pool.scale)):
            for layer, buf in enumerate(bufs):
                desc.regions.append(buffer_region(buf, name=f"latent.{role}{layer}", role=role,
                                                  index_space=KV_PAGE_SPACE, layer=layer, state_type="latent"))
        desc.index_spaces.append(IndexSpace(KV_PAGE_SPACE, item_count(pool.wkv_a[0]), pool.page_size, "page"))
        return desc

@hookimpl
def kvbridge_register_state_handlers():
    return [StateHandlerSpec(name="latent", factory="kvb_roles_plugin:LatentHandler",
                             pool_types=("kvb_roles_plugin:LatentPool",),
                             capabilities=HandlerCapabilities(index_spaces=(KV_PAGE_SPACE,), roles=("wkv_a", "wkv_b")))]
'''


@pytest.fixture
def latent(tmp_path, monkeypatch):
    """A third-party state handler using roles of its own, loaded through an entry point."""
    import importlib.metadata as md
    import sys

    from kvbridge.core.description.plugins import build_registry

    (tmp_path / "kvb_roles_plugin.py").write_text(ROLES_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = build_registry([md.EntryPoint("latent", "kvb_roles_plugin", "kvbridge")])
    assert not registry.errors, registry.errors
    yield registry, sys.modules["kvb_roles_plugin"]
    sys.modules.pop("kvb_roles_plugin", None)


def latent_pool(module, rng=None, typo=False):
    def buf(width):
        return rng.integers(0, 255, (16, width), np.uint8) if rng is not None else np.zeros((16, width), np.uint8)
    return module.LatentPool(wkv_a=[buf(64), buf(64)], wkv_b=[buf(32), buf(32)], scale=[buf(8), buf(8)], page_size=4,
                             typo=typo)


def test_a_handler_names_several_buffers_per_layer_with_roles_it_declares_and_they_pair_and_move(latent):
    import ctypes

    from kvbridge.core.planning.pairing import pair_layouts

    registry, module = latent
    src_pool, dst_pool = latent_pool(module, np.random.default_rng(0)), latent_pool(module)
    src = describe([src_pool], dtype="bf16", page_size=4, registry=registry)
    dst = describe([dst_pool], dtype="bf16", page_size=4, registry=registry)
    assert sorted({r.role for r in src.regions}) == ["scale", "wkv_a", "wkv_b"]  # declared ones and a core one
    plan = pair_layouts(src, dst).plan({"kv_page": [1, 2, 9]}, {"kv_page": [0, 5, 6]})
    for s, d, n in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist()):
        ctypes.memmove(d, s, n)
    for field in ("wkv_a", "wkv_b", "scale"):
        for layer in range(2):
            src_buf, dst_buf = getattr(src_pool, field)[layer], getattr(dst_pool, field)[layer]
            assert (dst_buf[[0, 5, 6]] == src_buf[[1, 2, 9]]).all() and not dst_buf[[1, 2, 3, 4]].any()


def test_a_role_its_handler_did_not_declare_is_rejected_where_it_is_made(latent):
    registry, module = latent
    with pytest.raises(ValueError, match="state handler 'latent' described region 'latent.wkv_bb0' with role 'wkv_bb', "
                                         r"which it does not declare; add it to its HandlerCapabilities\(roles=...\) "
                                         r"\(declared: wkv_a, wkv_b;"):
        describe([latent_pool(module, typo=True)], dtype="bf16", page_size=4, registry=registry)


def test_declared_roles_must_be_lowercase_words():
    from kvbridge.core.description.records import HandlerCapabilities

    with pytest.raises(ValueError, match="HandlerCapabilities.roles: role 'WKV' is not a lowercase word"):
        HandlerCapabilities(index_spaces=("kv_page",), roles=("WKV",))
