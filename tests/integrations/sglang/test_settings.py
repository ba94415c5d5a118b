"""A decode's instance_name (docs/failures.md, "Decode restarted") from kvbridge's SGLang settings to its DecodeManager."""

import json

import forked
import pytest

from kvbridge.config import ConfigError
from kvbridge.integrations.sglang.settings import INSTANCE_ENV, for_dp_rank, transfer_config


def test_a_decode_is_unnamed_unless_the_settings_name_it():
    assert transfer_config({"KVBRIDGE_SGLANG_BACKEND": "memory"}).instance_name == ""


def test_the_settings_file_key_names_the_instance_and_the_variable_overrides_it(tmp_path):
    path = tmp_path / "kvbridge.json"
    path.write_text(json.dumps({"backend": "memory", "instance_name": "from-file"}))
    assert transfer_config({"KVBRIDGE_SGLANG_CONFIG": str(path)}).instance_name == "from-file"
    both = {"KVBRIDGE_SGLANG_CONFIG": str(path), INSTANCE_ENV: "decode-b:30001"}
    assert transfer_config(both).instance_name == "decode-b:30001"


def test_a_bad_name_in_the_variable_is_refused_naming_the_variable_and_value():
    with pytest.raises(ConfigError, match=rf"\(from {INSTANCE_ENV}\): instance_name must be a short printable name.*"
                                          r"got 'decode b'"):
        transfer_config({"KVBRIDGE_SGLANG_BACKEND": "memory", INSTANCE_ENV: "decode b"})


def test_each_dp_ranks_scheduler_gets_its_own_name_and_an_unnamed_one_stays_unnamed():
    named = transfer_config({"KVBRIDGE_SGLANG_BACKEND": "memory", INSTANCE_ENV: "decode-b"})
    assert for_dp_rank(named, 0, 1).instance_name == "decode-b"
    assert [for_dp_rank(named, r, 2).instance_name for r in (0, 1)] == ["decode-b-dp0", "decode-b-dp1"]
    assert for_dp_rank(transfer_config({"KVBRIDGE_SGLANG_BACKEND": "memory"}), 1, 2).instance_name == ""
    with pytest.raises(ConfigError, match="with dp_size 2: SGLang gave this scheduler no DP rank"):
        for_dp_rank(named, None, 2)


def decode_manager_name(dp_size: int, dp_rank: int | None) -> str:
    """SGLang's own decode ``_init_kv_manager`` after ``load_plugins()``, its ServerArgs published for
    ``dp_rank`` of ``dp_size`` as SGLang's launcher does: the instance name kvbridge's DecodeManager got."""
    import os
    import tempfile
    import types

    import sglang_rig as rig
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import TransferBackend, is_mla_backend
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    model = tempfile.mkdtemp()  # a model's config only: resolving ServerArgs reads it, nothing loads weights
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
                   "intermediate_size": 64, "num_attention_heads": rig.HEADS, "num_key_value_heads": rig.HEADS,
                   "num_hidden_layers": rig.LAYERS, "vocab_size": 128, "max_position_embeddings": 256,
                   "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}, f)
    args = ServerArgs(model_path=model, device="cpu", tp_size=1, dp_size=dp_size, skip_tokenizer_init=True,
                      host="127.0.0.1", disaggregation_mode="decode", disaggregation_transfer_backend="nixl")
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=dp_rank))
    rank = rig.make_rank("mha", 0, 1, draft=False, fill=None)
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)  # the attributes its scheduler would set
    queue.token_to_kv_pool, queue.draft_token_to_kv_pool = rank.target, None
    queue.metadata_buffers = rank.metadata
    queue.scheduler = types.SimpleNamespace(
        rust_server=None, server_args=args, enable_hisparse=False, req_to_token_pool=None,
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_cache_dtype_str="bfloat16")),
        model_config=types.SimpleNamespace(hf_text_config=None, num_hidden_layers=rig.LAYERS,
                                           get_total_num_kv_heads=lambda: rig.HEADS))
    queue.tp_rank, queue.pp_rank, queue.pp_size, queue.gpu_id = 0, 0, 1, 0
    queue.transfer_backend = TransferBackend.NIXL
    queue.is_mla_backend = is_mla_backend(queue.token_to_kv_pool)
    queue.enable_staging = False
    manager = queue._init_kv_manager()  # SGLang's own code, through kvbridge's hooks
    try:
        return f"{type(manager).__name__}:{manager.transfer.config.instance_name}"
    finally:
        manager.close()


ENV = {"KVBRIDGE_SGLANG_BACKEND": "memory", "SGLANG_PLUGINS": None, "HF_HUB_OFFLINE": "1"}


def test_sglangs_decode_init_kv_manager_passes_the_name_to_the_decode_manager():
    got = forked.run(decode_manager_name, {**ENV, INSTANCE_ENV: "decode-b:30001"}, 1, None, timeout=120)
    assert got == "KVBridgeKVManager:decode-b:30001"


def test_sglangs_decode_init_kv_manager_leaves_an_unnamed_decode_unnamed():
    assert forked.run(decode_manager_name, {**ENV, INSTANCE_ENV: None}, 1, None, timeout=120) == "KVBridgeKVManager:"


def test_sglangs_decode_of_dp_rank_1_of_2_appends_its_dp_rank():
    got = forked.run(decode_manager_name, {**ENV, INSTANCE_ENV: "decode-b"}, 2, 1, timeout=120)
    assert got == "KVBridgeKVManager:decode-b-dp1"


def test_a_restarted_named_decode_server_fails_its_old_room_on_prefill_at_once_and_is_served(monkeypatch, tmp_path):
    """Two decode managers of one name and rank in turn (the first abandoned, as if its server were replaced;
    lease 30 s): prefill fails the first one's room as soon as the second handshakes, naming the restart, and
    the second one's request is moved byte for byte (docs/failures.md, "Decode restarted")."""
    import time

    import sglang_pd as pd
    import sglang_rig as rig
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvbridge.integrations.sglang.conn import KVBridgeKVBootstrapServer

    config = tmp_path / "kvbridge.json"
    config.write_text(json.dumps({"backend": "memory", "heartbeat_timeout": 30}))
    monkeypatch.delenv("KVBRIDGE_SGLANG_BACKEND", raising=False)
    monkeypatch.setenv("KVBRIDGE_SGLANG_CONFIG", str(config))
    monkeypatch.setenv(INSTANCE_ENV, "decode-b:30001")
    boot = KVBridgeKVBootstrapServer("127.0.0.1", 0)
    port = int(boot.address.rsplit(":", 1)[1])
    managers = []
    try:
        g = rig.global_tensors("mha", False, seed=3)
        p_rank = rig.make_rank("mha", 0, 1, draft=False, fill=g)
        prefill = pd.manager(p_rank, DisaggregationMode.PREFILL, port)
        managers.append(prefill)
        old_rank = rig.make_rank("mha", 0, 1, draft=False, fill=None)
        managers.append(pd.manager(old_rank, DisaggregationMode.DECODE, port))
        s1 = pd.prefill_senders([prefill], port, 101)[0]
        pd.decode_receivers([managers[-1]], [old_rank], port, 101)
        assert pd.wait([s1], {KVPoll.WaitingForInput, KVPoll.Failed}, 30) == [KVPoll.WaitingForInput]
        new_rank = rig.make_rank("mha", 0, 1, draft=False, fill=None)
        new = pd.manager(new_rank, DisaggregationMode.DECODE, port)
        managers.append(new)
        assert new.transfer.config.instance_name == "decode-b:30001"
        s2 = pd.prefill_senders([prefill], port, 102)[0]
        start = time.monotonic()
        r2 = pd.decode_receivers([new], [new_rank], port, 102)
        assert pd.wait([s1], {KVPoll.Failed}, 10) == [KVPoll.Failed]
        elapsed = time.monotonic() - start
        print(f"old room FAILED on prefill {elapsed:.2f}s after the new server's request")
        assert elapsed < 5  # the handshake, not the 30 s lease
        reason = s1.sender.failure() or ""
        assert "decode 'decode-b:30001' TP rank 0" in reason and "restarted" in reason, reason
        assert pd.wait([s2], {KVPoll.WaitingForInput, KVPoll.Failed}, 30) == [KVPoll.WaitingForInput]
        assert pd.send_and_finish([s2], r2, [p_rank]) == []
        assert pd.check_decode(new_rank, g) == []
    finally:
        for m in reversed(managers):
            m.close()
        boot.close()
