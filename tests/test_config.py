"""Host-server integration: argparse arguments, TransferConfig, declared backend options, hook tracing."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvbridge.core.description.plugins import get_registry
from kvbridge.cli import TransferConfig, add_transfer_args
from kvbridge.config import BACKEND_PREFERENCE, ConfigError, available_backends
from kvbridge.core.description.layout import KV_PAGE_SPACE, IndexSpace, KVArgs, Region
from kvbridge.core.description.plugins import Provider, Registered, Registry
from kvbridge.core.description.records import BackendSpec, OptionError, OptionSpec
from kvbridge.core.sessions.session import DecodeManager, SessionConfig

# Built-in backends and the engine module each needs (what "available" means).
ENGINES = {"nixl": "nixl_cu12", "ucx": "ucxx", "mooncake": "mooncake"}
AVAILABLE = [n for n in ("nixl", "ucx", "mooncake") if importlib.util.find_spec(ENGINES[n])]


def parser():
    p = argparse.ArgumentParser(prog="server")
    p.add_argument("--model", default="m")  # the host's own argument
    add_transfer_args(p)
    return p


def run_server(*args, env=None):
    """A host server that uses add_transfer_args, in its own process (argparse exits on errors)."""
    code = textwrap.dedent("""
        import argparse, json, sys
        from kvbridge.cli import add_transfer_args, TransferConfig
        p = argparse.ArgumentParser(prog="server")
        add_transfer_args(p)
        cfg = TransferConfig.from_args(p.parse_args(sys.argv[1:]), p)
        print(json.dumps(cfg.to_dict()))
    """)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


# -- argparse -----------------------------------------------------------------------------------
def test_backend_flag_lists_the_available_backends_and_takes_a_list_of_lanes():
    action = next(a for a in parser()._actions if a.dest == "transfer_backend")
    # Every available built-in is offered, and nothing that is not installed (third-party
    # backends such as the zmq example may be installed too).
    offered = set(action.metavar.strip("{}").split(","))
    assert set(AVAILABLE) <= offered <= set(get_registry().backends)
    assert parser().parse_args(["--transfer-backend", "memory,nixl"]).transfer_backend == "memory,nixl"


@pytest.mark.parametrize("value, why", [("memory,nope", "unknown transfer backend 'nope'"),
                                        ("memory,,nixl", "empty name"), ("nixl,nixl", "more than once")])
def test_a_bad_list_of_lanes_is_a_usage_error_naming_the_problem(value, why, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--transfer-backend", value])
    assert exc.value.code == 2 and why in capsys.readouterr().err


def test_default_backend_is_the_first_available_in_the_preference_order():
    assert BACKEND_PREFERENCE[:3] == ("nixl", "ucx", "mooncake")
    assert parser().parse_args([]).transfer_backend == AVAILABLE[0]


def make_registry(*specs):
    reg = Registry()
    for spec in specs:
        reg.backends[spec.name] = Registered("backend", spec, Provider("p", "dist", "1", "m"))
    return reg


def test_preference_skips_backends_whose_engine_is_missing_and_ranks_others_by_name():
    missing = ("kvbridge_engine_that_is_not_installed",)
    reg = make_registry(
        BackendSpec(name="nixl", factory="m:f", requires=missing),
        BackendSpec(name="zeta", factory="m:f"),
        BackendSpec(name="alpha", factory="m:f"),
        BackendSpec(name="mooncake", factory="m:f"),
    )
    assert available_backends(reg) == ["mooncake", "alpha", "zeta"]


def test_transfer_option_is_repeatable_and_a_later_key_wins():
    args = parser().parse_args([
        "--transfer-backend", "nixl", "--transfer-option", "xfer_mode=prepped",
        "--transfer-option", "progress_delay_us=0", "--transfer-option", "xfer_mode=descs",
    ])
    cfg = TransferConfig.from_args(args)
    assert cfg.backend == "nixl"
    assert cfg.backend_options == {"xfer_mode": "descs", "progress_delay_us": "0"}


def test_options_may_come_before_the_backend_they_belong_to():
    if "ucx" not in AVAILABLE or AVAILABLE[0] == "ucx":
        pytest.skip("needs ucx and a different default backend")
    args = parser().parse_args(["--transfer-option", "UCX_TLS=tcp", "--transfer-backend", "ucx"])
    assert TransferConfig.from_args(args).backend_options == {"UCX_TLS": "tcp"}


def test_parsed_arguments_build_the_session_config():
    args = parser().parse_args([
        "--transfer-backend", "mooncake", "--transfer-option", "protocol=tcp", "--transfer-bootstrap", "10.0.0.5:8998",
        "--transfer-host", "10.0.0.7", "--transfer-timeout", "12.5", "--transfer-heartbeat-interval", "0.5",
        "--transfer-heartbeat-timeout", "3", "--transfer-sender-grace", "2", "--transfer-fence-timeout", "9",
        "--transfer-warm-timeout", "0", "--transfer-strict-index-lengths", "--model", "x",
    ])
    cfg = TransferConfig.from_args(args)
    assert cfg.bootstrap == "10.0.0.5:8998" and args.model == "x"
    assert cfg.session_config() == SessionConfig(
        transfer_timeout=12.5, heartbeat_interval=0.5, heartbeat_timeout=3.0, host="10.0.0.7",
        backend_options={"protocol": "tcp"}, strict_index_lengths=True, sender_grace=2.0, fence_timeout=9.0,
        warm_timeout=0.0,
    )


def test_fence_timeout_defaults_to_none_and_a_mapping_may_say_none():
    cfg = TransferConfig.from_args(parser().parse_args(["--transfer-backend", "mooncake"]))
    assert cfg.fence_timeout is None and cfg.session_config().fence_wait == cfg.transfer_timeout + cfg.heartbeat_timeout
    assert TransferConfig.from_dict({"backend": "mooncake", "fence_timeout": "none"}).fence_timeout is None
    with pytest.raises(ConfigError, match="fence_timeout must be a number of seconds or none, got 'soon'"):
        TransferConfig.from_dict({"backend": "mooncake", "fence_timeout": "soon"})


def test_unknown_backend_exits_2_listing_installed_backends_and_a_missing_plugin():
    out = run_server("--transfer-backend", "rdma9")
    assert out.returncode == 2
    assert "unknown transfer backend 'rdma9'" in out.stderr
    # Whatever else is installed (third-party plugins), every installed backend is listed.
    assert f"installed backends: {', '.join(sorted(get_registry().backends))}." in out.stderr
    assert "plugin may not be installed" in out.stderr


def test_unknown_option_exits_2_listing_the_backends_options():
    out = run_server("--transfer-backend", "nixl", "--transfer-option", "progress_delay=10")
    assert out.returncode == 2
    assert "argument --transfer-option: backend 'nixl' has no option 'progress_delay'" in out.stderr
    assert "progress_delay_us, ucx_error_handling_mode, num_workers, ucx_engine_config, xfer_mode" in out.stderr


def test_bad_option_value_exits_2_naming_key_value_and_what_is_allowed():
    out = run_server("--transfer-backend", "nixl", "--transfer-option", "xfer_mode=fast")
    assert out.returncode == 2
    assert "option xfer_mode='fast' is not allowed; expected one of descs, prepped" in out.stderr
    out = run_server("--transfer-backend", "nixl", "--transfer-option", "num_workers=0")
    assert out.returncode == 2 and "num_workers='0' is not allowed; expected an integer >= 1" in out.stderr


def test_option_without_equals_sign_exits_2():
    out = run_server("--transfer-option", "xfer_mode")
    assert out.returncode == 2 and "expected KEY=VALUE, got 'xfer_mode'" in out.stderr


def test_bad_addresses_and_timeouts_exit_2():
    out = run_server("--transfer-bootstrap", "10.0.0.5")
    assert out.returncode == 2 and "argument --transfer-bootstrap: '10.0.0.5' is not HOST:PORT" in out.stderr
    out = run_server("--transfer-timeout", "0")
    assert out.returncode == 2 and "argument --transfer-timeout: must be > 0 seconds" in out.stderr
    out = run_server("--transfer-heartbeat-interval", "10")
    assert out.returncode == 2 and "heartbeat_timeout (5.0) must exceed heartbeat_interval (10.0)" in out.stderr


def test_a_good_command_line_parses_in_a_server_process():
    out = run_server("--transfer-backend", "ucx", "--transfer-option", "error_handling=off")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["backend_options"] == {"error_handling": "off"}


def test_from_args_needs_add_transfer_args():
    with pytest.raises(ConfigError, match="call add_transfer_args"):
        TransferConfig.from_args(argparse.Namespace(model="m"))


# -- from_dict ----------------------------------------------------------------------------------
def test_from_dict_builds_the_same_config_as_the_command_line():
    cfg = TransferConfig.from_dict({
        "backend": "nixl", "backend_options": {"xfer_mode": "prepped", "num_workers": 2},
        "bootstrap": "127.0.0.1:8998", "transfer_timeout": "20", "strict_index_lengths": True,
    })
    args = parser().parse_args([
        "--transfer-backend", "nixl", "--transfer-option", "xfer_mode=prepped", "--transfer-option", "num_workers=2",
        "--transfer-bootstrap", "127.0.0.1:8998", "--transfer-timeout", "20", "--transfer-strict-index-lengths",
    ])
    assert cfg == TransferConfig.from_args(args)
    assert cfg.backend_options == {"xfer_mode": "prepped", "num_workers": "2"}  # values reach backends as strings


def test_from_dict_round_trips_through_to_dict():
    cfg = TransferConfig.from_dict({"backend": "ucx", "backend_options": ["UCX_TLS=tcp"], "host": "10.1.1.1"})
    assert TransferConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_from_dict_without_backend_takes_the_best_available():
    assert TransferConfig.from_dict({}).backend == AVAILABLE[0]


def test_from_dict_rejects_unknown_keys_listing_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown transfer config key\(s\) 'timeout'; known keys: backend, backend_options, bootstrap"):
        TransferConfig.from_dict({"backend": "nixl", "timeout": 3})


def test_from_dict_rejects_an_unknown_backend_like_the_command_line():
    with pytest.raises(ConfigError, match="unknown transfer backend 'rdma9'; installed backends: .*plugin may not be installed"):
        TransferConfig.from_dict({"backend": "rdma9"})


@pytest.mark.parametrize("mapping, message", [
    ({"backend": "mooncake", "backend_options": {"protocol": "udp"}}, "option protocol='udp' is not allowed; expected one of tcp, rdma"),
    ({"backend": "ucx", "backend_options": {"TLS": "tcp"}}, "backend 'ucx' has no option 'TLS'; its options are: error_handling, UCX_*"),
    ({"waiting_timeout": "soon"}, "waiting_timeout must be a number of seconds, got 'soon'"),
    ({"bootstrap_timeout": -1}, "bootstrap_timeout must be > 0"),
    ({"bootstrap": "host:port"}, "bootstrap address 'host:port' is not HOST:PORT"),
    ({"strict_index_lengths": "maybe"}, "strict_index_lengths must be true or false"),
])
def test_from_dict_errors_name_the_setting_and_value(mapping, message):
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_dict(mapping)
    assert message in str(info.value)


# -- instance_name ------------------------------------------------------------------------------
def test_instance_name_defaults_to_unnamed_on_the_command_line_and_in_a_mapping():
    assert TransferConfig.from_args(parser().parse_args([])).session_config().instance_name == ""
    assert TransferConfig.from_dict({}).instance_name == ""
    assert TransferConfig.from_dict({"instance_name": None}).instance_name == ""  # JSON null: the default


def test_instance_name_from_the_flag_and_the_key_reaches_the_session_config():
    args = parser().parse_args(["--transfer-instance-name", "decode-3.pool:8200"])
    cfg = TransferConfig.from_args(args)
    assert cfg == TransferConfig.from_dict({"instance_name": "decode-3.pool:8200"})
    assert cfg.session_config().instance_name == "decode-3.pool:8200"
    assert TransferConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("value", ["two words", "x" * 129, "tab\there", "caf\u00e9", 7, ["a"]])
def test_a_bad_instance_name_is_refused_naming_the_value_and_what_is_allowed(value):
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_dict({"instance_name": value})
    assert info.value.field == "instance_name"
    assert "instance_name must be a short printable name, 1 to 128 of letters, digits" in str(info.value)
    assert repr(value)[:40] in str(info.value)


def test_a_bad_instance_name_flag_exits_2_naming_the_flag_and_value():
    out = run_server("--transfer-instance-name", "decode one")
    assert out.returncode == 2
    assert "argument --transfer-instance-name: instance_name must be a short printable name" in out.stderr
    assert "'decode one'" in out.stderr


def test_help_shows_the_instance_name_flag_and_its_default():
    text = " ".join(parser().format_help().split())
    assert "--transfer-instance-name NAME" in text
    assert "fail each other's rooms (default: none, unnamed)" in text


# -- option declarations and core's validation ------------------------------------------------------
def test_option_spec_prefix_matches_keys_under_it():
    spec = BackendSpec(name="u", factory="m:f", options=(OptionSpec(name="mode", choices=("a", "b")), OptionSpec(name="UCX_*")))
    assert spec.check_options({"UCX_TLS": "tcp", "mode": "a"}) == {"UCX_TLS": "tcp", "mode": "a"}
    with pytest.raises(OptionError, match="has no option 'UCX_'"):
        spec.check_options({"UCX_": "x"})


def test_option_spec_with_a_parse_function_reports_its_message():
    def even(text):
        """an even integer"""
        if int(text) % 2:
            raise ValueError(f"{text} is odd")
        return int(text)

    spec = BackendSpec(name="e", factory="m:f", options=(OptionSpec(name="n", type=even),))
    with pytest.raises(OptionError, match=r"backend 'e': option n='3' is not allowed; expected an even integer \(3 is odd\)"):
        spec.check_options({"n": "3"})
    assert spec.check_options({"n": 4}) == {"n": "4"}


def test_a_backend_that_declares_no_options_accepts_none():
    spec = BackendSpec(name="plain", factory="m:f")
    assert spec.check_options({}) == {}
    with pytest.raises(OptionError, match="backend 'plain' has no option 'x'; it declares no options"):
        spec.check_options({"x": "1"})


def test_option_declarations_are_checked_when_registered():
    with pytest.raises(ValueError, match="type 'integer' must be one of str, int, float, bool"):
        OptionSpec(name="n", type="integer")
    with pytest.raises(ValueError, match="declared more than once"):
        BackendSpec(name="b", factory="m:f", options=(OptionSpec(name="n"), OptionSpec(name="n")))


def test_plugins_json_lists_every_builtin_backends_options():
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "plugins", "--json"], capture_output=True, text=True, timeout=60)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    names = {n: [o["name"] for o in rows[n]["options"]] for n in ("mooncake", "nixl", "ucx")}
    assert names == {
        "mooncake": ["protocol", "device_name"],
        "nixl": ["progress_delay_us", "ucx_error_handling_mode", "num_workers", "ucx_engine_config", "xfer_mode"],
        "ucx": ["error_handling", "UCX_*"],
    }
    xfer = next(o for o in rows["nixl"]["options"] if o["name"] == "xfer_mode")
    assert xfer["default"] == "descs" and xfer["choices"] == ["descs", "prepped"]
    table = subprocess.run([sys.executable, "-m", "kvbridge", "plugins"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "160"}).stdout
    assert "Backend options (--transfer-option KEY=VALUE)" in table
    assert any(l.split()[:3] == ["nixl", "xfer_mode", "descs"] for l in table.splitlines())


def kvargs():
    k = np.zeros((4, 64), np.uint8)
    region = Region(name="k0", addr=k.ctypes.data, nbytes=k.nbytes, stride=64, role="k", index_space=KV_PAGE_SPACE, layer=0)
    return KVArgs(regions=(region,), index_spaces=(IndexSpace(KV_PAGE_SPACE, 4, 16),), dtype="bfloat16", page_size=16), k


def test_core_rejects_bad_options_of_every_builtin_backend_before_importing_its_engine():
    code = textwrap.dedent("""
        import json, sys
        import numpy as np
        from kvbridge.core.description.layout import KV_PAGE_SPACE, IndexSpace, KVArgs, Region
        from kvbridge.core.sessions.session import DecodeManager, SessionConfig
        k = np.zeros((4, 64), np.uint8)
        kv = KVArgs(regions=(Region(name="k0", addr=k.ctypes.data, nbytes=k.nbytes, stride=64, role="k",
                    index_space=KV_PAGE_SPACE, layer=0),), index_spaces=(IndexSpace(KV_PAGE_SPACE, 4, 16),),
                    dtype="bfloat16", page_size=16)
        engines = {"nixl": "nixl_cu12", "ucx": "ucxx", "mooncake": "mooncake"}
        out = {}
        for backend, options in [("nixl", {"bogus": "1"}), ("ucx", {"error_handling": "maybe"}),
                                 ("mooncake", {"protocol": "carrier-pigeon"})]:
            try:
                DecodeManager(kv, backend, config=SessionConfig(backend_options=options)).close()
                out[backend] = "created"
            except ValueError as exc:
                out[backend] = [type(exc).__name__, str(exc)]
        out["imported"] = sorted(m for m in engines.values() if m in sys.modules)
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # Where Triton is installed the same-host GPU lane goes before nixl (cuda_ipc,nixl): the message names both lanes.
    kind, why = out["nixl"]
    assert kind == "OptionError" and "'bogus'" in why, why
    assert "nixl" in why and "progress_delay_us, ucx_error_handling_mode, num_workers, ucx_engine_config, xfer_mode" in why
    assert out["ucx"] == ["OptionError", "backend 'ucx': option error_handling='maybe' is not allowed; expected one of on, off"]
    assert out["mooncake"][1].startswith("backend 'mooncake': option protocol='carrier-pigeon' is not allowed")
    assert out["imported"] == []


class _Recorder:
    created = []

    def __init__(self, config):
        _Recorder.created.append(dict(config.options))
        raise RuntimeError("stop here: the test only needs to see the options")


def test_core_passes_declared_options_to_the_backend_parsed_and_defaulted():
    # A manager takes a BackendSpec as well as a name: no registry involved.
    spec = BackendSpec(name="rec", factory=f"{__name__}:_Recorder",
                       options=(OptionSpec(name="depth", type="int", minimum=1, default="2"),
                                OptionSpec(name="mode", choices=("a", "b"), default="a"),
                                OptionSpec(name="ratio", type="float"), OptionSpec(name="X_*")))
    _Recorder.created.clear()
    kv, _ = kvargs()
    with pytest.raises(OptionError, match="option depth='0' is not allowed; expected an integer >= 1"):
        DecodeManager(kv, spec, config=SessionConfig(backend_options={"depth": "0"}))
    assert _Recorder.created == []  # rejected before the backend was constructed
    with pytest.raises(RuntimeError, match="stop here"):
        DecodeManager(kv, spec, config=SessionConfig(backend_options={"depth": "3", "X_Y": "z"}))
    with pytest.raises(RuntimeError, match="stop here"):
        DecodeManager(kv, spec)
    assert _Recorder.created == [{"depth": 3, "mode": "a", "ratio": None, "X_Y": "z"},
                                 {"depth": 2, "mode": "a", "ratio": None}]


# -- hook tracing ---------------------------------------------------------------------------------
def test_trace_hooks_env_logs_every_registration_hook_call():
    env = {**os.environ, "KVBRIDGE_TRACE_HOOKS": "1"}
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "plugins"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.startswith("kvbridge.hooks: ")]
    for plugin in ("mooncake", "nixl", "ucx"):
        assert f"kvbridge.hooks: kvbridge_register_backends in kvbridge:{plugin} [plugin]" in lines
    assert any("finish kvbridge_register_backends --> [[BackendSpec(name='nixl'" in l for l in lines)
    assert any("finish kvbridge_register_state_handlers --> " in l for l in lines)


def test_no_trace_without_the_env_var():
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_TRACE_HOOKS"}
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "plugins"], capture_output=True, text=True, env=env, timeout=60)
    assert "kvbridge.hooks" not in out.stderr


def test_trace_goes_to_the_hosts_logging_configuration():
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(name)s|%(levelname)s|%(message)s")
        from kvbridge.core.description.plugins import get_registry
        get_registry()
    """)
    env = {**os.environ, "KVBRIDGE_TRACE_HOOKS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kvbridge.hooks|DEBUG|kvbridge_register_backends in kvbridge:mooncake [plugin]" in out.stdout
    assert "kvbridge.hooks" not in out.stderr  # no second handler of its own


@pytest.mark.parametrize("value, why", [(-1, "must be an int >= 0"), (True, "must be an int >= 0"), (2.5, "must be an int >= 0"),
                                        (17 << 20, "must be at most half of max_message_bytes")])
def test_inline_row_bytes_out_of_range_is_refused_naming_the_value(value: object, why: str) -> None:
    with pytest.raises(ValueError, match=f"inline_row_bytes.*{why}"):
        SessionConfig(inline_row_bytes=value)


@pytest.mark.parametrize("bad", [-1, 65536, True, "5555"])
def test_a_bad_control_port_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"control_port must be an int in 0\.\.65535"):
        SessionConfig(control_port=bad)


def test_warm_timeout_may_be_zero_but_not_negative_nor_text():
    assert TransferConfig.from_dict({"backend": "mooncake", "warm_timeout": 0}).session_config().warm_timeout == 0.0
    assert TransferConfig.from_dict({"backend": "mooncake", "warm_timeout": "2.5"}).warm_timeout == 2.5
    with pytest.raises(ConfigError, match="warm_timeout must be a number of seconds, got 'soon'"):
        TransferConfig.from_dict({"backend": "mooncake", "warm_timeout": "soon"})
    for bad in (-1, True):
        with pytest.raises(ConfigError, match="warm_timeout must be a number of seconds >= 0"):
            TransferConfig.from_dict({"backend": "mooncake", "warm_timeout": bad})
    with pytest.raises(SystemExit):
        parser().parse_args(["--transfer-backend", "mooncake", "--transfer-warm-timeout", "-1"])
