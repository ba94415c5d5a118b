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
