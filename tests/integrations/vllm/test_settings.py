"""KVBridgeConnector refuses bad settings and KV layouts it cannot move, saying what to do."""

from __future__ import annotations

import pytest
from kvbridge.config import ConfigError
from vllm_harness import make_server


def test_producer_without_bootstrap_is_refused_naming_the_key(model):
    with pytest.raises(ConfigError, match=r"kv_role 'kv_producer' needs kv_connector_extra_config.bootstrap"):
        make_server(model, "kv_producer", {"backend": "memory"})


def test_unknown_extra_config_key_lists_the_known_ones(model):
    with pytest.raises(ConfigError, match=r"unknown transfer config key\(s\) 'bootstrapp'.*known keys: backend"):
        make_server(model, "kv_consumer", {"backend": "memory", "bootstrapp": "127.0.0.1:1"})


def test_unknown_backend_is_refused_by_name(model):
    with pytest.raises(ConfigError, match="no-such-engine"):
        make_server(model, "kv_consumer", {"backend": "no-such-engine"})


def test_layout_with_heads_outside_blocks_is_refused_with_the_layouts_that_work(model):
    with pytest.raises(ValueError, match=r"VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC"):
        make_server(model, "kv_consumer", {"backend": "memory"}, layout="LHBNC")


# -- instance_name: the decode's name reaches its DecodeManager (docs/failures.md, "Decode restarted") --------
def consumer_worker(model, extra, *, dp_rank: int = 0, dp_size: int = 1):
    """One decode worker's connector as vLLM's factory builds it, its caches registered (its DecodeManager made).

    ``dp_rank``/``dp_size``: the engine's data-parallel place, as vLLM's DP engine core sets it in its config.
    """
    import torch
    import vllm_harness as harness
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = harness.vllm_config(model, "kv_consumer", extra)
    cfg.parallel_config.data_parallel_size = dp_size
    cfg.parallel_config.data_parallel_rank = dp_rank
    kcc = harness.kv_cache_config(cfg, 1, False, 64)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    conn.register_kv_caches(allocate_kv_cache(kcc, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout()))
    return conn


def test_a_decode_is_unnamed_unless_the_extra_config_names_it(model):
    server = make_server(model, "kv_consumer", {"backend": "memory"}, tp=2)
    try:
        assert [r.connector._worker.decode.config.instance_name for r in server.ranks] == ["", ""]
    finally:
        server.close()


def test_instance_name_in_the_extra_config_reaches_every_tp_ranks_decode_manager(model):
    server = make_server(model, "kv_consumer", {"backend": "memory", "instance_name": "decode-a:8200"}, tp=2)
    try:
        # The same name on every TP rank: prefill's slot is (host, name, TP rank, PP rank).
        assert [r.connector._worker.decode.config.instance_name for r in server.ranks] == ["decode-a:8200"] * 2
    finally:
        server.close()


def test_with_data_parallelism_each_engines_name_gets_its_dp_rank(model):
    conns = [consumer_worker(model, {"backend": "memory", "instance_name": "decode-a"}, dp_rank=r, dp_size=2)
             for r in (0, 1)]
    try:
        assert [c._worker.decode.config.instance_name for c in conns] == ["decode-a-dp0", "decode-a-dp1"]
    finally:
        for c in conns:
            c.shutdown()


def test_a_bad_instance_name_stops_the_engine_naming_the_key_and_value(model):
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config: instance_name must be a short printable "
                                          r"name.*got 'decode a'"):
        make_server(model, "kv_consumer", {"backend": "memory", "instance_name": "decode a"})
