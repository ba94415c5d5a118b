"""A full-attention + Mamba2 hybrid: the request's Mamba state moves with its KV, byte-exact, at equal and
heterogeneous TP.

vLLM's hybrid KV cache manager gives the Mamba layers (1 and 3) a KV cache
group of their own over the same block pool; a request holds one state block
in it. The oracle unpacks each state block into conv state (x | B | C
channels) and SSM state by the spec's shapes (the packing
``MambaBase.bind_kv_cache`` reads), assembles prefill's whole-model state
from its ranks (x and SSM heads concatenated in rank order; the one B/C group
is on every rank) and cuts out what each decode rank holds: written from
vLLM's sharding, independently of the connector's regions and core's shards.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm_harness import (BLOCK, LAYERS, MAMBA_HEAD_DIM, MAMBA_HEADS, block_ids, layer_name, make_request,
                          make_server, model_config, prefill_request, status, step_until)
from vllm.v1.request import RequestStatus

from kvbridge.integrations.vllm.layout import mamba_groups

ATTENTION, MAMBA = (0, 2), (1, 3)


def states(rank, layer: int, block: int, spec: MambaSpec) -> list[torch.Tensor]:
    """One block's (conv, SSM) state of a Mamba layer, unpacked from the raw page by the spec's shapes."""
    page = rank.caches[layer_name(layer)][block].reshape(-1)  # int8 [state bytes]
    out, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(page[offset:offset + nbytes].view(dtype).view(*shape))
        offset += nbytes
    return out


def rows_first(conv: torch.Tensor) -> torch.Tensor:
    """A conv state as (rows, channels), whichever of vLLM's conv layouts (SD or DS) stores it."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return conv.t() if is_conv_state_dim_first() else conv


def split_conv(conv: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's x | B | C conv state as (x channels, B|C channels), each (rows, channels)."""
    conv = rows_first(conv)
    x = MAMBA_HEADS * MAMBA_HEAD_DIM // tp
    return conv[:, :x], conv[:, x:]


def expected(prefill, layer: int, block: int, spec: MambaSpec, d_rank: int, d_tp: int) -> list[torch.Tensor]:
    """What decode rank ``d_rank`` of ``d_tp`` must hold: prefill's whole state, cut as vLLM shards it."""
    tp = len(prefill.ranks)
    parts = [states(r, layer, block, spec) for r in prefill.ranks]
    x = torch.cat([split_conv(conv, tp)[0] for conv, _ in parts], dim=1)  # x channels: rank order
    bc = split_conv(parts[0][0], tp)[1]  # the one group: the same on every rank (the test makes it so)
    ssm = torch.cat([s for _, s in parts], dim=0)  # heads: rank order
    xs, hs = x.shape[1] // d_tp, ssm.shape[0] // d_tp
    return [torch.cat([x[:, d_rank * xs:(d_rank + 1) * xs], bc], dim=1), ssm[d_rank * hs:(d_rank + 1) * hs]]


@pytest.mark.parametrize("backend,p_tp,d_tp,variant", [
    ("memory", 1, 1, ""), ("memory", 2, 2, ""), ("nixl", 1, 1, ""), ("memory", 1, 2, ""), ("memory", 2, 1, ""),
    ("nixl", 1, 2, ""), ("nixl", 2, 1, ""),
    ("memory", 2, 1, "DS"),  # vLLM's other conv layout: (channels, rows)
    ("memory", 2, 2, "whole"),  # no n_groups in the config: the state moves as one item, rank to rank
])
def test_mamba_hybrid_state_moves_byte_exact(request, monkeypatch, model, bootstrap, backend, p_tp, d_tp, variant,
                                            tmp_path):
    if variant == "DS":  # vLLM fixes the layout per process (an lru_cache): set it for this test, then back
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        get_conv_state_layout.cache_clear()
        request.addfinalizer(get_conv_state_layout.cache_clear)  # the next read, environment restored, is SD again
    if variant == "whole":
        model = model_config(tmp_path / "model", n_groups=0)
    prefill = make_server(model, "kv_producer", {"backend": backend, "bootstrap": bootstrap}, tp=p_tp, mamba=True,
                          fill=True, seed=3)
    decode = make_server(model, "kv_consumer", {"backend": backend}, tp=d_tp, mamba=True)
    try:
        groups = prefill.sched.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec) for g in groups] == [FullAttentionSpec, MambaSpec]
        p_spec = groups[1].kv_cache_spec
        conv_rows, conv_channels = p_spec.shapes[0][::-1] if variant == "DS" else p_spec.shapes[0]
        assert conv_rows == 3 and conv_channels == (64 // p_tp + 32), p_spec.shapes  # the layout asked for
        assert (mamba_groups(model.hf_text_config) is None) == (variant == "whole")
        d_spec = decode.sched.kv_cache_config.kv_cache_groups[1].kv_cache_spec
        prompt = [random.randrange(10, 900) for _ in range(4 * BLOCK + 5)]
        prefill_request(prefill, "held", prompt[:BLOCK])  # holds prefill's first blocks: m1 gets others than decode
        params = prefill_request(prefill, "m1", prompt)
        src = block_ids(prefill.sched, "m1")
        assert len(src[1]) >= 1 and len(src[0]) == 5  # a state block next to the 5 attention blocks
        for layer in MAMBA:  # the one B/C group is replicated on prefill's ranks: the same bytes, as in vLLM
            for s in src[1]:
                first = split_conv(states(prefill.ranks[0], layer, s, p_spec)[0], p_tp)[1]
                for r in prefill.ranks[1:]:
                    split_conv(states(r, layer, s, p_spec)[0], p_tp)[1].copy_(first)

        decode.sched.add_request(make_request("m1", prompt, 4, params))
        decode.step()
        assert status(decode.sched, "m1") == RequestStatus.WAITING_FOR_REMOTE_KVS
        dst = block_ids(decode.sched, "m1")
        state_blocks = [(s, d) for s, d in zip(src[1], dst[1]) if s and d]  # 0: vLLM's null block
        assert state_blocks and src != dst, (src, dst)
        s0, d0 = state_blocks[0]
        for layer in MAMBA:  # not there yet: decode's blocks hold zeros, prefill's random bytes
            assert not torch.equal(states(decode.ranks[0], layer, d0, d_spec)[1],
                                   expected(prefill, layer, s0, p_spec, 0, d_tp)[1])

        step_until([prefill, decode], lambda: status(decode.sched, "m1") == RequestStatus.RUNNING)
        assert decode.sched.requests["m1"].num_computed_tokens == len(prompt)
        for r, d in enumerate(decode.ranks):
            for layer in MAMBA:
                for s, t in state_blocks:
                    got_conv, got_ssm = states(d, layer, t, d_spec)
                    for want, got in zip(expected(prefill, layer, s, p_spec, r, d_tp), (rows_first(got_conv), got_ssm)):
                        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), \
                            (r, layer, s, t)
            if p_tp == d_tp:  # equal TP: rank r's attention pages come from prefill's rank r (heads: test_e2e)
                for layer in ATTENTION:
                    for s, t in zip(src[0], dst[0]):
                        want = prefill.ranks[r].caches[layer_name(layer)][s].view(torch.uint8)
                        assert torch.equal(d.caches[layer_name(layer)][t].view(torch.uint8), want), (r, layer, s, t)
        step_until([prefill], lambda: "m1" not in prefill.sched.requests)  # freed once sent
        step_until([decode], lambda: "m1" not in decode.sched.requests)
    finally:
        decode.close()
        prefill.close()


def test_mamba_state_not_sliceable_between_different_tp_fails_the_load_clearly(tmp_path, bootstrap, caplog):
    """Without n_groups in the model config the state moves whole: between different TP sizes it is refused."""
    model = model_config(tmp_path / "model", n_groups=0)
    prefill = make_server(model, "kv_producer", {"backend": "memory", "bootstrap": bootstrap}, tp=1, mamba=True,
                          fill=True)
    decode = make_server(model, "kv_consumer", {"backend": "memory"}, tp=2, mamba=True, policy="fail")
    try:
        prompt = list(range(100, 100 + 2 * BLOCK + 3))
        params = prefill_request(prefill, "m2", prompt)
        decode.sched.add_request(make_request("m2", prompt, 4, params))
        step_until([prefill, decode], lambda: status(decode.sched, "m2") in (None, RequestStatus.FINISHED_ERROR))
        assert "between equal TP sizes only" in caplog.text
    finally:
        decode.close()
        prefill.close()


assert LAYERS == 4  # ATTENTION / MAMBA above name the harness's layers


def test_pure_mamba_model_is_refused_at_registration(model):
    """Mamba pages no attention layer shares: refused with an error saying so (not moved half-described)."""
    from vllm.v1.core import kv_cache_planning
    from vllm.v1.worker.utils import allocate_kv_cache
    from vllm_harness import kv_cache_config, mamba_shapes, vllm_config

    from kvbridge.integrations.vllm.layout import describe_vllm_caches

    cfg = vllm_config(model, "kv_consumer", {"backend": "memory"}, hybrid=True, mamba=True)
    hybrid = kv_cache_config(cfg, 1, False, 64, mamba=True)  # the spec the hybrid's Mamba layers use
    spec = hybrid.kv_cache_groups[1].kv_cache_spec
    assert spec.shapes == mamba_shapes(1)
    specs = {layer_name(i): spec for i in range(LAYERS)}
    groups = kv_cache_planning.get_global_kv_cache_groups(cfg, [specs])
    kcc = kv_cache_planning.get_kv_cache_configs(cfg, [specs], [64 * spec.page_size_bytes * LAYERS], groups)[0]
    caches = allocate_kv_cache(kcc, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout())
    with pytest.raises(ValueError, match="share no attention layer's memory"):
        describe_vllm_caches(caches, kcc, total_kv_heads=4, tp_rank=0, tp_size=1)
