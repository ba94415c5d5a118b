"""The conformance suite fails a broken backend, naming what it broke.

Each backend of :mod:`kvbridge.testing.faulty` breaks one clause of the
backend contract. It is installed the way a third-party plugin is (an entry
point in a ``*.dist-info`` on ``sys.path`` of a fresh pytest process), and the
suite's contract tests run against it exactly as a plugin author would run
them. The correct ``memory`` backend they are built on passes the same tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CONTRACT = "(write or registration or close) and not frozen"
BYTE_EXACT = "test_a_write_lands_byte_exact_and_touches_nothing_else"
FROZEN = "test_a_write_to_a_frozen_peer_returns_by_its_deadline_and_the_peer_recovers"
MOVED_OTHER_BYTES = "a write must move exactly the planned bytes, every batch of them, and return only once they have landed"

# backend -> (selection, the test that must fail, what its failure must say)
CASES = {
    "faulty-offbyone": (CONTRACT, BYTE_EXACT, MOVED_OTHER_BYTES),
    "faulty-dropbatch": (CONTRACT, BYTE_EXACT, MOVED_OTHER_BYTES),
    "faulty-early": (CONTRACT, BYTE_EXACT, MOVED_OTHER_BYTES),
    "faulty-flipbyte": (CONTRACT, BYTE_EXACT, MOVED_OTHER_BYTES),
    "faulty-deadline": ("frozen", FROZEN, "neither returned nor raised within"),
}


def run_suite(tmp_path: Path, backend: str, selection: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    info = site / "faulty_backends-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-backends\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvbridge]\nfaulty = kvbridge.testing.faulty\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_suite.py").write_text(
        "from kvbridge.testing.conformance import BackendConformance\n\n\n"
        f"class TestIt(BackendConformance):\n    backend = {backend!r}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rf", "-k", selection, "test_suite.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("backend", sorted(CASES))
def test_the_suite_fails_a_backend_that_breaks_the_contract_naming_what(tmp_path, backend):
    selection, test, says = CASES[backend]
    out = run_suite(tmp_path, backend, selection)
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-2000:]
    failed = re.findall(r"^FAILED test_suite\.py::TestIt::(\w+)", out.stdout, re.M)
    assert test in failed, out.stdout[-4000:]
    assert says in out.stdout, out.stdout[-4000:]


def test_the_correct_backend_they_are_built_on_passes_the_same_tests(tmp_path):
    out = run_suite(tmp_path, "memory", "write or registration or close")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"\b10 passed\b", out.stdout), out.stdout[-2000:]
