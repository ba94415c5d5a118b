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


TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest -q -n 2 --dist loadgroup"


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert f"\n{TEST_COMMAND} " in README.read_text()  # the quick start's second line
    assert ci.rstrip().splitlines()[-1] == TEST_COMMAND
