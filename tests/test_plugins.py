"""Plugin discovery through the real entry-point mechanism.

Each test writes small distributions (``*.dist-info`` with ``entry_points.txt``
plus their module) into a temporary directory placed on ``sys.path`` of a
fresh ``kvbridge`` process, the way pip would install a third-party plugin.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GOOD = '''
from kvbridge import hookimpl, BackendSpec, BackendCapabilities, HandlerCapabilities, StateHandlerSpec

@hookimpl
def kvbridge_register_backends():
    return [
        BackendSpec(
            name="carrier",
            factory="goodplug_engine:CarrierBackend",
            capabilities=BackendCapabilities(max_descriptors_per_batch=512, native_notifications=True),
            description="test transport",
        ),
        BackendSpec(
            name="needs-engine",
            factory="goodplug_engine:CarrierBackend",
            requires=("kvbridge_test_engine_that_is_not_installed",),
            extra="nixl",
        ),
    ]

@hookimpl
def kvbridge_register_state_handlers():
    return [StateHandlerSpec(name="ring", factory="goodplug_engine:RingHandler",
                             pool_types=("goodplug_pools:RingPool",),
                             capabilities=HandlerCapabilities(index_spaces=("slot",), draft=True))]
'''

GOOD_ENGINE = '''
import os
if os.environ.get("KVB_TEST_MARK"):
    open(os.environ["KVB_TEST_MARK"], "w").write("imported")
class CarrierBackend:
    pass
class RingHandler:
    pass
'''

GOOD_POOLS = '''
class RingPool:
    pass
class FancyRingPool(RingPool):
    pass
'''


def write_dist(root: Path, dist: str, version: str, entry_points: dict, modules: dict) -> None:
    info = root / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    eps = "[kvbridge]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(eps)
    for name, src in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(src))


@pytest.fixture
def site(tmp_path):
    return tmp_path


def run_kvbridge(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **env}
    full_env.pop("KVBRIDGE_DISABLE_PLUGIN_AUTOLOAD", None)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "kvbridge", *args], capture_output=True, text=True, env=full_env, timeout=60
    )


def good_dist(site: Path) -> None:
    write_dist(site, "goodplug", "1.2.3", {"good": "goodplug_mod"},
               {"goodplug_mod": GOOD, "goodplug_engine": GOOD_ENGINE, "goodplug_pools": GOOD_POOLS})


def test_third_party_plugin_is_listed_with_its_distribution_and_capabilities(site):
    good_dist(site)
    out = run_kvbridge(site, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    carrier = rows["carrier"]
    assert carrier["kind"] == "backend"
    assert carrier["distribution"] == "goodplug" and carrier["version"] == "1.2.3"
    assert carrier["capabilities"]["max_descriptors_per_batch"] == 512
    assert carrier["capabilities"]["native_notifications"] is True
    assert carrier["available"] is True
    assert rows["needs-engine"]["available"] is False
    ring = rows["ring"]
    assert ring["kind"] == "state_handler" and ring["capabilities"] == {
        "index_spaces": ["slot"], "hetero_tp": "", "layouts": [], "draft": True, "host_destination": False, "roles": []}
    assert ring["distribution"] == "goodplug"


def test_listing_does_not_import_the_backend_engine(site, tmp_path_factory):
    good_dist(site)
    mark = tmp_path_factory.mktemp("mark") / "imported"
    out = run_kvbridge(site, "plugins", KVB_TEST_MARK=str(mark))
    assert out.returncode == 0, out.stderr
    assert "carrier" in out.stdout and "goodplug" in out.stdout
    assert not mark.exists()


def test_table_shows_missing_extra(site):
    good_dist(site)
    out = run_kvbridge(site, "plugins", COLUMNS="400")  # wide enough for one line per row
    line = next(l for l in out.stdout.splitlines() if l.startswith("needs-engine"))
    assert "needs kvbridge[nixl]" in line


def test_broken_plugin_is_reported_by_name_and_does_not_hide_the_good_one(site):
    good_dist(site)
    write_dist(site, "brokenplug", "0.1", {"broken": "brokenplug_mod"},
               {"brokenplug_mod": "raise ImportError('libfoo.so: cannot open shared object file')\n"})
    out = run_kvbridge(site, "plugins", "--json")
    assert out.returncode == 0, out.stderr  # the listing of the others does not fail
    names = {r["name"] for r in json.loads(out.stdout)}
    assert {"carrier", "ring"} <= names
    assert "kvbridge plugins: warning: plugin 'broken' from brokenplug" in out.stderr
    assert "libfoo.so" in out.stderr
    strict = run_kvbridge(site, "plugins", "--json", "--strict")
    assert strict.returncode == 1 and "kvbridge plugins: error: plugin 'broken' from brokenplug" in strict.stderr
    assert {"carrier", "ring"} <= {r["name"] for r in json.loads(strict.stdout)}


def test_a_state_handler_declaring_capabilities_as_a_dict_loads_with_a_deprecation_naming_the_new_form(site):
    # A plugin written for contract 1.0, as the guide allowed then.
    write_dist(site, "ringstate", "0.3", {"ringstate": "ringstate_mod"}, {"ringstate_mod": """
        from kvbridge import hookimpl, StateHandlerSpec
        @hookimpl
        def kvbridge_register_state_handlers():
            return [StateHandlerSpec(name="ringstate", factory="ringstate_mod:Handler", pool_types=("ringstate_mod:Pool",),
                                     capabilities={"index_spaces": ["ring_slot"], "hetero_tp": "replicated"})]
    """})
    good_dist(site)
    out = run_kvbridge(site, "plugins", "--json", "--strict")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["ringstate"]["capabilities"]["index_spaces"] == ["ring_slot"] and "carrier" in rows
    assert ("kvbridge plugins: warning: plugin 'ringstate' from ringstate: state handler 'ringstate': capabilities given "
            "as a dict are deprecated since kvbridge's plugin contract 1.1 and will stop loading in 2.0; pass "
            "capabilities=HandlerCapabilities(index_spaces=['ring_slot'], hetero_tp='replicated')") in out.stderr, out.stderr


def test_capabilities_given_as_a_dict_warn_with_deprecation_warning_and_make_the_record():
    from kvbridge import BackendCapabilities, BackendSpec

    with pytest.warns(DeprecationWarning, match=r"pass capabilities=BackendCapabilities\(max_descriptors_per_batch=64\)"):
        spec = BackendSpec(name="legacy", factory="legacy_mod:Backend", capabilities={"max_descriptors_per_batch": 64})
    assert spec.capabilities == BackendCapabilities(max_descriptors_per_batch=64)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="unknown field `max_descriptor`"):
        BackendSpec(name="legacy", factory="legacy_mod:Backend", capabilities={"max_descriptor": 64})


def test_plugin_whose_hook_returns_garbage_is_reported(site):
    write_dist(site, "oddplug", "0.2", {"odd": "oddplug_mod"}, {"oddplug_mod": """
        from kvbridge import hookimpl
        @hookimpl
        def kvbridge_register_backends():
            return ["not a record"]
    """})
    good_dist(site)
    out = run_kvbridge(site, "plugins", "--json")
    assert out.returncode == 0
    assert "plugin 'odd' from oddplug" in out.stderr and "expected BackendSpec" in out.stderr
    assert "carrier" in out.stdout


def test_plugin_with_a_misspelt_hook_is_reported_naming_it_and_the_others_load(site):
    write_dist(site, "typoplug", "0.1", {"typo": "typoplug_mod"}, {"typoplug_mod": """
        from kvbridge import hookimpl, BackendSpec
        @hookimpl
        def kvbridge_register_backend():
            return [BackendSpec(name="typo", factory="typoplug_mod:X")]
    """})
    good_dist(site)
    out = run_kvbridge(site, "plugins", "--json")
    assert out.returncode == 0
    assert ("plugin 'typo' from typoplug: PluginError: implements 'kvbridge_register_backend' that kvbridge does not "
            "define (known hooks: kvbridge_register_backends, kvbridge_register_state_handlers); check the spelling") \
        in out.stderr, out.stderr
    names = {r["name"] for r in json.loads(out.stdout)}
    assert "carrier" in names and "typo" not in names


def test_autoload_can_be_switched_off(site):
    good_dist(site)
    out = run_kvbridge(site, "plugins", "--json", KVBRIDGE_DISABLE_PLUGIN_AUTOLOAD="1")
    assert out.returncode == 0, out.stderr
    names = {r["name"] for r in json.loads(out.stdout)}
    assert "carrier" not in names and "ring" not in names
    assert all(r["distribution"] == "kvbridge" for r in json.loads(out.stdout))


def test_duplicate_backend_name_is_an_error_listing_both_providers(site):
    good_dist(site)
    write_dist(site, "copycat", "9.9", {"copy": "copycat_mod"}, {"copycat_mod": """
        from kvbridge import hookimpl, BackendSpec
        @hookimpl
        def kvbridge_register_backends():
            return [BackendSpec(name="carrier", factory="copycat_mod:X")]
    """})
    out = run_kvbridge(site, "plugins", "--json", "--strict")
    assert out.returncode == 1
    assert "'carrier' is registered by more than one plugin" in out.stderr
    assert "goodplug 1.2.3" in out.stderr and "copycat 9.9" in out.stderr
    assert "carrier" not in {r["name"] for r in json.loads(out.stdout)}


# -- in-process: selection, lazy import, missing extras, state resolution ----------

@pytest.fixture
def registry(site, monkeypatch):
    from kvbridge.core.description.plugins import build_registry

    good_dist(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("KVBRIDGE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    yield build_registry()
    for mod in ("goodplug_mod", "goodplug_engine", "goodplug_pools"):
        sys.modules.pop(mod, None)


def test_selecting_a_backend_imports_its_factory(registry):
    assert "goodplug_engine" not in sys.modules
    factory = registry.load_backend("carrier")
    assert factory.__name__ == "CarrierBackend"
    assert "goodplug_engine" in sys.modules


def test_missing_engine_names_the_pip_extra(registry):
    from kvbridge.core.description.plugins import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"backend 'needs-engine' needs `pip install kvbridge\[nixl\]`"):
        registry.load_backend("needs-engine")


def test_unknown_backend_lists_installed_ones(registry):
    from kvbridge.core.description.plugins import UnknownBackendError

    with pytest.raises(UnknownBackendError, match="unknown transfer backend 'rdma9'; installed backends: .*carrier.*plugin may not be installed"):
        registry.backend_spec("rdma9")


def test_pool_subclass_resolves_to_the_registered_base_handler(registry):
    import goodplug_pools

    resolver = registry.state_resolver()
    assert resolver.resolve(goodplug_pools.FancyRingPool()).name == "ring"
    assert resolver.resolve(goodplug_pools.RingPool()).name == "ring"
