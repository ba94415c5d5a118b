"""SGLang's own load_plugins() makes get_kv_class yield kvbridge's classes, as reached from every module that uses it."""

import importlib

import forked

MODULES = ("sglang.srt.disaggregation.utils", "sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
           "sglang.srt.managers.disagg_service")
# Imported here, before any plugin is loaded (load_plugins runs only in the forked children): the
# children share them instead of importing them each, and the patch must rebind what they took by name.
for _name in (*MODULES, "sglang.srt.disaggregation.nixl", "sglang.srt.disaggregation.mooncake", "sglang.srt.disaggregation.fake"):
    importlib.import_module(_name)


def classes_after_load_plugins(backend: str) -> dict:
    """In a fresh process state: import the modules that took get_kv_class by name, load_plugins(), resolve from each."""
    mods = [importlib.import_module(m) for m in MODULES]  # imported before the patch: their bindings must be rebound
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.plugins import load_plugins

    load_plugins()
    out = {}
    for name, mod in zip(MODULES, mods):
        for kind in (KVClassType.MANAGER, KVClassType.SENDER, KVClassType.RECEIVER, KVClassType.BOOTSTRAP_SERVER):
            cls = mod.get_kv_class(TransferBackend(backend), kind)
            out[f"{name.rsplit('.', 1)[1]}:{kind.value}"] = f"{cls.__module__}.{cls.__qualname__}"
        fake = mod.get_kv_class(TransferBackend.FAKE, KVClassType.SENDER)
        out[f"{name.rsplit('.', 1)[1]}:fake"] = fake.__qualname__
        args = mod.get_kv_class(TransferBackend(backend), KVClassType.KVARGS)
        out[f"{name.rsplit('.', 1)[1]}:kvargs"] = f"{args.__module__}.{args.__qualname__}"
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    out["init_kv_manager_hooked"] = [hasattr(q._init_kv_manager, "__wrapped__") for q in (PrefillBootstrapQueue, DecodePreallocQueue)]
    return out


OURS = {"manager": "KVBridgeKVManager", "sender": "KVBridgeKVSender", "receiver": "KVBridgeKVReceiver",
        "bootstrap_server": "KVBridgeKVBootstrapServer"}


def test_every_module_that_imported_get_kv_class_yields_kvbridge_classes():
    got = forked.run(classes_after_load_plugins, {"KVBRIDGE_SGLANG_BACKEND": "memory", "SGLANG_PLUGINS": None}, "nixl")
    for mod in MODULES:
        short = mod.rsplit(".", 1)[1]
        for kind, cls in OURS.items():
            assert got[f"{short}:{kind}"] == f"kvbridge.integrations.sglang.conn.{cls}", (short, kind)
        assert got[f"{short}:fake"] == "FakeKVSender"  # SGLang's warm-up / health-check requests stay fake
        assert got[f"{short}:kvargs"] == "sglang.srt.disaggregation.base.conn.KVArgs"
    assert got["init_kv_manager_hooked"] == [True, True]


def test_selected_by_name_in_sglang_plugins():
    got = forked.run(classes_after_load_plugins, {"KVBRIDGE_SGLANG_BACKEND": "memory", "SGLANG_PLUGINS": "kvbridge"}, "mooncake")
    assert got["utils:sender"] == "kvbridge.integrations.sglang.conn.KVBridgeKVSender"


def test_filtered_out_by_sglang_plugins_sglang_is_untouched():
    got = forked.run(classes_after_load_plugins, {"KVBRIDGE_SGLANG_BACKEND": "memory", "SGLANG_PLUGINS": "another_plugin"}, "nixl")
    for mod in MODULES:
        short = mod.rsplit(".", 1)[1]
        assert got[f"{short}:sender"] == "sglang.srt.disaggregation.nixl.conn.NixlKVSender", short
        assert got[f"{short}:manager"] == "sglang.srt.disaggregation.nixl.conn.NixlKVManager", short
    assert got["init_kv_manager_hooked"] == [False, False]


def test_switched_off_the_installed_plugin_changes_nothing():
    got = forked.run(classes_after_load_plugins, {"KVBRIDGE_SGLANG_BACKEND": None, "KVBRIDGE_SGLANG_CONFIG": None,
                                                   "SGLANG_PLUGINS": None}, "mooncake")
    assert got["decode:receiver"] == "sglang.srt.disaggregation.mooncake.conn.MooncakeKVReceiver"
    assert got["init_kv_manager_hooked"] == [False, False]


def bad_setting_stops_load_plugins() -> str:
    import logging

    from sglang.srt.plugins import load_plugins

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("sglang.srt.plugins").addHandler(handler)
    load_plugins()
    return "\n".join(str(r.exc_info[1]) for r in records if r.exc_info)


def test_an_unknown_kvbridge_backend_is_reported_by_name_at_plugin_load():
    text = forked.run(bad_setting_stops_load_plugins, {"KVBRIDGE_SGLANG_BACKEND": "no_such_backend", "SGLANG_PLUGINS": None})
    assert "no_such_backend" in text and "kvbridge's SGLang settings" in text


def sglang_init_kv_manager_then_transfer() -> dict:
    """SGLang's own _init_kv_manager (prefill and decode queues) after load_plugins(), then one request through them.

    The queues are SGLang's classes with the attributes their scheduler would set (a whole
    Scheduler needs a model and a GPU); the ServerArgs is real and published as SGLang does.
    """
    import json
    import os
    import tempfile
    import types

    import sglang_pd as pd
    import sglang_rig as rig
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import TransferBackend, is_mla_backend
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from kvbridge.integrations.sglang.conn import KVBridgeKVBootstrapServer

    load_plugins()
    boot = KVBridgeKVBootstrapServer("127.0.0.1", 0)
    port = int(boot.address.rsplit(":", 1)[1])
    model = tempfile.mkdtemp()  # a model's config only: resolving ServerArgs reads it, nothing loads weights
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
                   "intermediate_size": 64, "num_attention_heads": rig.HEADS, "num_key_value_heads": rig.HEADS,
                   "num_hidden_layers": rig.LAYERS, "vocab_size": 128, "max_position_embeddings": 256,
                   "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}, f)
    args = ServerArgs(model_path=model, device="cpu", tp_size=1, skip_tokenizer_init=True,
                      host="127.0.0.1", disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                      disaggregation_bootstrap_port=port)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    g = rig.global_tensors("mha", False, seed=9)
    ranks = {"prefill": rig.make_rank("mha", 0, 1, draft=False, fill=g), "decode": rig.make_rank("mha", 0, 1, draft=False, fill=None)}
    scheduler = types.SimpleNamespace(
        rust_server=None, server_args=args, enable_hisparse=False, req_to_token_pool=None,
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_cache_dtype_str="bfloat16")),
        model_config=types.SimpleNamespace(hf_text_config=None, num_hidden_layers=rig.LAYERS,
                                           get_total_num_kv_heads=lambda: rig.HEADS))
    managers = {}
    for role, cls in (("prefill", PrefillBootstrapQueue), ("decode", DecodePreallocQueue)):
        queue = cls.__new__(cls)
        queue.token_to_kv_pool, queue.draft_token_to_kv_pool = ranks[role].target, None
        queue.metadata_buffers, queue.scheduler = ranks[role].metadata, scheduler
        queue.tp_rank, queue.pp_rank, queue.pp_size, queue.gpu_id = 0, 0, 1, 0
        queue.transfer_backend = TransferBackend.NIXL
        queue.is_mla_backend = is_mla_backend(queue.token_to_kv_pool)  # as the queues' __init__ set it
        queue.enable_staging = False  # SGLANG_DISAGG_STAGING_BUFFER off (decode reads it)
        managers[role] = queue._init_kv_manager()  # SGLang's own code, through kvbridge's hooks
    out = {role: type(m).__name__ for role, m in managers.items()}
    try:
        senders = pd.prefill_senders([managers["prefill"]], port, 4242)
        recvs = pd.decode_receivers([managers["decode"]], [ranks["decode"]], port, 4242)
        out.update(pd.ready_then_sent(senders, recvs, [ranks["prefill"]]))
        out["problems"] = pd.check_decode(ranks["decode"], g)
    finally:
        for m in managers.values():
            m.close()
        boot.close()
    return out


def test_sglang_init_kv_manager_builds_kvbridge_managers_that_move_a_request():
    got = forked.run(sglang_init_kv_manager_then_transfer, {"KVBRIDGE_SGLANG_BACKEND": "memory", "SGLANG_PLUGINS": None,
                                                                       "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert got == {"prefill": "KVBridgeKVManager", "decode": "KVBridgeKVManager", "ready": [2], "polls": [4, 4],
                   "problems": []}
