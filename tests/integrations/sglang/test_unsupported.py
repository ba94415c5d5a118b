"""SGLang pools kvbridge does not describe yet are refused by name, never moved half-described."""

import forked
import pytest


def describe_deepseek_v4() -> str:
    """Build SGLang's DeepSeekV4TokenToKVPool on CPU (it reads published ServerArgs) and ask kvbridge to describe it."""
    import json
    import os
    import tempfile

    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    from kvbridge.core import describe
    from kvbridge.core.state import UnknownPoolTypeError

    model = tempfile.mkdtemp()
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 128,
                   "max_position_embeddings": 256, "rms_norm_eps": 1e-6}, f)
    publish(ServerArgs(model_path=model, device="cpu", skip_tokenizer_init=True), role="scheduler",
            ranks=SpawnRanks(world_rank=0))
    with get_parallel().override(attn_dcp_size=1, attn_tp_size=1, attn_tp_rank=0):
        pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=256, c4_size=256, c128_size=256, c4_state_pool_size=8, c128_state_pool_size=8,
            page_size=256, swa_page_size=256, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=3,
            device="cpu", enable_memory_saver=False, compression_ratios=[0, 4, 128], sliding_window=128)
    try:
        describe([pool], dtype="fp8_e4m3", page_size=256)
    except UnknownPoolTypeError as exc:
        return str(exc)
    return "described"


def test_deepseek_v4_pool_is_refused_naming_its_class():
    text = forked.run(describe_deepseek_v4, {"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert "DeepSeekV4TokenToKVPool" in text and "sglang.srt.mem_cache.swa_memory_pool:SWAKVPool" in text, text


def test_manager_refuses_an_sglang_state_type_it_does_not_move(monkeypatch):
    import sglang_pd as pd
    import sglang_rig as rig
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode

    monkeypatch.setenv("KVBRIDGE_SGLANG_BACKEND", "memory")
    rank = rig.make_rank("mha", 0, 1, draft=False, fill=None)
    rank.kv_args.state_types = [StateType.DSV4_REQUEST_STATE]
    with pytest.raises(ValueError, match=r"SGLang state type 'c128_state' is not supported .* \(supported: dsa, mamba, swa\)"):
        pd.manager(rank, DisaggregationMode.DECODE, 1)
