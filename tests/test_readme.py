"""The README's Python snippets run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippets_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python snippets"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    assert "4 descriptors" in capsys.readouterr().out  # the plan_pages snippet printed its plan


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh && python3 -m pytest -q" in README.read_text()
    assert "bash scripts/setup.sh" in ci and ci.rstrip().endswith("python3 -m pytest -q")
