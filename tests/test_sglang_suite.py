"""The SGLang integration's sub-suite (tests/integrations/sglang), run in .venv-sglang where SGLang 0.5.23 is installed.

SGLang cannot share .venv (scripts/setup-sglang.sh says why), so its tests run
there as one subprocess; this test fails with their output if any failed or
was skipped. scripts/setup.sh creates .venv-sglang.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = "tests/integrations/sglang"


def test_sglang_integration_suite_passes_in_its_own_environment():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("SGLang needs torch; this environment was set up with KVBRIDGE_TORCH=none")
    python = ROOT / ".venv-sglang" / "bin" / "python"
    assert python.exists(), f"{python} is missing: run `bash scripts/setup.sh` (it runs scripts/setup-sglang.sh)"
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-rfEsx", "-p", "no:cacheprovider", SUITE],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout[-12000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"the SGLang sub-suite failed (exit {proc.returncode}):\n{out}"
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, f"the SGLang sub-suite ran nothing:\n{out}"
    assert not re.search(r"skipped|xfail|deselected", summary), f"the SGLang sub-suite left tests out: {summary}"
    sys.stdout.write(summary + "\n")
