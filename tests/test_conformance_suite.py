"""The conformance suite's own contract: what a plugin author sees when something is missing, and the CLI.

Each test runs pytest (or ``kvbridge conformance``) in a fresh process on a
small test file, the way a plugin author would; the suite's tests selected
here are the cheap ones. A broken contract stops every test at setup (pytest
reports an error per test) with a message saying what to set or install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvbridge.core.description.plugins import get_registry
from kvbridge.core.description.records import BackendCapabilities
from kvbridge.testing.requirements import requires, unmet

CHEAP = "registration or lands_byte_exact"  # two tests of the suite, a second or so
INSTALLED = ", ".join(sorted(get_registry().backends))  # whatever is installed here, third-party plugins included


def run(cmd: list[str], cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def pytest_on(tmp_path: Path, body: str, *args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_mine.py").write_text(
        "from kvbridge.testing.conformance import BackendConformance\n\n" + textwrap.dedent(body))
    return run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-k", CHEAP, *args], tmp_path, pythonpath)


def kvbridge_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "kvbridge", *args], tmp_path)


# -- the fixture contract -----------------------------------------------------------------------
def test_a_class_that_names_no_backend_fails_every_test_saying_what_to_set(tmp_path):
    out = pytest_on(tmp_path, "class TestMine(BackendConformance):\n    pass\n")
    assert out.returncode == 1 and "2 errors" in out.stdout and "passed" not in out.stdout, out.stdout
    assert "test_mine.TestMine: set the class attribute `backend = \"<name>\"` to the name your plugin's " \
        f"BackendSpec registers (installed backends: {INSTALLED};" in out.stdout


def test_a_class_that_names_an_unknown_backend_fails_listing_the_installed_ones(tmp_path):
    out = pytest_on(tmp_path, "class TestMine(BackendConformance):\n    backend = 'nosuch'\n")
    assert out.returncode == 1 and "2 errors" in out.stdout and "passed" not in out.stdout, out.stdout
    assert f"backend = 'nosuch' cannot be used: unknown transfer backend 'nosuch'; installed backends: {INSTALLED}." \
        in out.stdout


GHOST = '''
from kvbridge import hookimpl, BackendSpec

@hookimpl
def kvbridge_register_backends():
    return [BackendSpec(name="ghost", factory="ghost_engine:Backend", requires=("kvbridge_ghost_engine_not_installed",))]
'''


def test_a_backend_whose_engine_is_missing_fails_every_test_naming_the_module_to_install(tmp_path):
    site = tmp_path / "site"
    info = site / "ghostplug-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ghostplug\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvbridge]\nghost = ghostplug\n")
    (site / "ghostplug.py").write_text(GHOST)
    out = pytest_on(tmp_path, "class TestGhost(BackendConformance):\n    backend = 'ghost'\n", pythonpath=site)
    assert out.returncode == 1 and "2 errors" in out.stdout and "passed" not in out.stdout, out.stdout
    assert "backend = 'ghost' cannot be used: backend 'ghost' needs the module(s) kvbridge_ghost_engine_not_installed" \
        in out.stdout


def test_bad_backend_options_fail_saying_what_they_must_be(tmp_path):
    out = pytest_on(tmp_path, "class TestMine(BackendConformance):\n    backend = 'memory'\n    backend_options = {'a': 1}\n")
    assert out.returncode == 1 and "backend_options must be a dict of str to str" in out.stdout, out.stdout


def test_a_test_needing_an_undeclared_capability_is_skipped_naming_it(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_mine.py").write_text(
        "from kvbridge.testing.conformance import BackendConformance\n\n"
        "class TestMine(BackendConformance):\n    backend = 'memory'\n")
    out = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-k", "gpu_memory"], tmp_path)
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout
    assert "needs capability memory_kinds containing 'vram'; backend 'memory' declares memory_kinds=('dram',)" in out.stdout


# -- requirements -----------------------------------------------------------------------------------
def test_unmet_names_the_first_missing_declared_capability_before_machine_properties():
    @requires("cuda_device", "vram")
    def needs_gpu() -> None: ...

    dram = BackendCapabilities(memory_kinds=("dram",))
    assert unmet(needs_gpu, "x", dram) == (
        "needs capability memory_kinds containing 'vram'; backend 'x' declares memory_kinds=('dram',) in its BackendCapabilities")
    assert unmet(lambda: None, "x", dram) is None


def test_a_declared_capability_is_not_a_reason_to_skip():
    @requires("vram", "one_sided")
    def needs() -> None: ...

    assert unmet(needs, "x", BackendCapabilities(memory_kinds=("dram", "vram"), one_sided=True)) is None


def test_requires_rejects_an_unknown_requirement_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown requirement\(s\) \['rdma'\]; known: cuda_device, "):
        requires("rdma")


# -- kvbridge conformance ----------------------------------------------------------------------------
def test_kvbridge_conformance_runs_the_suite_against_an_installed_backend(tmp_path):
    # memory ships with kvbridge: the test does not depend on what else is installed.
    out = kvbridge_cli(tmp_path, "conformance", "memory", "-x", "-q", "-k", f"{CHEAP} or success_follows")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout, out.stdout


def test_kvbridge_conformance_exit_code_is_pytests(tmp_path):
    out = kvbridge_cli(tmp_path, "conformance", "memory", "-q", "-k", "no_test_has_this_name")
    assert out.returncode == 5, out.stdout + out.stderr  # pytest: no tests collected


@pytest.mark.parametrize("where", ["before NAME", "after NAME"])
def test_kvbridge_conformance_checks_its_transfer_options_before_running_anything(tmp_path, where):
    # memory declares no options: refused up front (usage error), not after some tests ran, nor passed to pytest.
    own = ["--transfer-option", "bogus=1", "--timeout-scale", "2"]
    pytest_args = ["-q", "-k", "success_follows"]
    args = [*own, "memory", *pytest_args] if where == "before NAME" else ["memory", *pytest_args, *own]
    out = kvbridge_cli(tmp_path, "conformance", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    assert out.stderr.startswith("usage: kvbridge conformance ")
    assert ("kvbridge conformance: error: argument --transfer-option: backend 'memory' has no option 'bogus'; "
            "it declares no options") in out.stderr


def test_kvbridge_conformance_takes_its_options_after_name_and_gives_the_rest_to_pytest(tmp_path):
    out = kvbridge_cli(tmp_path, "conformance", "memory", "-q", "--timeout-scale", "2", "-k", "registration")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
    out = kvbridge_cli(tmp_path, "conformance", "memory", "-k", "registration", "--", "--timeout-scale", "2")
    assert out.returncode == 4, out.stdout + out.stderr  # after --, everything is pytest's (which rejects it)


def test_kvbridge_conformance_gives_its_transfer_options_to_every_manager(tmp_path):
    # A well-formed value the engine then refuses: it can only fail if it reached the managers' engine.
    out = kvbridge_cli(tmp_path, "conformance", "--transfer-option", "ucx_engine_config=TLS=no_such_transport", "nixl",
                       "-q", "-k", "success_follows")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "'ucx_engine_config': 'TLS=no_such_transport'" in out.stdout and "1 failed" in out.stdout


def test_kvbridge_conformance_of_an_unknown_backend_is_a_usage_error_listing_the_installed_ones(tmp_path):
    out = kvbridge_cli(tmp_path, "conformance", "nosuch")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: kvbridge conformance ")
    assert out.stderr.strip().endswith(
        f"kvbridge conformance: error: argument NAME: unknown transfer backend 'nosuch'; installed backends: {INSTALLED}. "
        "If it comes from a separate package, that plugin may not be installed"
    )
