"""The conformance suite fails a broken backend, naming what it broke.

Each backend of :mod:`kvbridge.testing.faulty` breaks one clause of the
backend contract. It is installed the way a third-party plugin is (an entry
point in a ``*.dist-info`` on ``sys.path`` of a fresh pytest process), and the
suite's contract tests run against it exactly as a plugin author would run
them. The correct ``memory`` backend they are built on passes the same tests.

One pytest process runs them all (one test class per backend, each with its
own selection): a process per backend cost a pytest start-up each, and the
classes share nothing but the process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
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
REFERENCE = ("memory", "write or registration or close")  # the correct backend, the same tests


def class_name(backend: str) -> str:
    return "Test" + "".join(part.title() for part in backend.split("-"))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str | None]]:
    """backend -> {test name: None if it passed, else what its failure (or error, or skip) said}, from one pytest run."""
    tmp_path = tmp_path_factory.mktemp("faulty")
    site = tmp_path / "site"
    info = site / "faulty_backends-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-backends\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvbridge]\nfaulty = kvbridge.testing.faulty\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    runs = {**{b: sel for b, (sel, _, _) in CASES.items()}, REFERENCE[0]: REFERENCE[1]}
    (tmp_path / "test_suite.py").write_text("from kvbridge.testing.conformance import BackendConformance\n" + "".join(
        f"\n\nclass {class_name(b)}(BackendConformance):\n    backend = {b!r}\n" for b in runs))
    # -k matches class names too: each class runs its own selection (no test name holds a class name).
    selection = " or ".join(f"({class_name(b)} and ({sel}))" for b, sel in runs.items())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-k", selection,
                          "--junitxml", str(tmp_path / "report.xml"), "test_suite.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1) and (tmp_path / "report.xml").exists(), out.stdout[-4000:] + out.stderr[-2000:]
    found: dict[str, dict[str, str | None]] = {b: {} for b in runs}
    by_class = {class_name(b): b for b in runs}
    for case in ET.parse(tmp_path / "report.xml").getroot().iter("testcase"):
        backend = by_class[case.get("classname", "").rsplit(".", 1)[-1]]
        failure = case.find("failure")
        other = case.find("error") if case.find("error") is not None else case.find("skipped")
        text = None if failure is None else failure.get("message", "") + "\n" + (failure.text or "")
        if failure is None and other is not None:  # an error or a skip: not the failure expected, nor a pass
            text = f"{other.tag}: {other.get('message')}\n{other.text or ''}"
        found[backend][case.get("name", "")] = text
    return found


@pytest.mark.parametrize("backend", sorted(CASES))
def test_the_suite_fails_a_backend_that_breaks_the_contract_naming_what(outcomes, backend):
    _, test, says = CASES[backend]
    ran = outcomes[backend]
    assert test in ran, f"{backend}: {test} did not run; ran {sorted(ran)}"
    assert ran[test] is not None and says in ran[test], f"{backend}: {test}: {ran[test]}"


def test_the_correct_backend_they_are_built_on_passes_the_same_tests(outcomes):
    ran = outcomes[REFERENCE[0]]
    assert len(ran) == 11 and all(v is None for v in ran.values()), ran  # the contract tests the selection names
