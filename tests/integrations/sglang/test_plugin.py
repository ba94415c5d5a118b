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
