"""The SGLang sub-suite runs in .venv-sglang (scripts/setup-sglang.sh), where SGLang 0.5.23 is installed.

From the main suite, tests/test_sglang_suite.py runs it there as a subprocess and
fails with its output if anything failed; in an environment without SGLang (the
main .venv) these files are not collected here, so nothing runs twice or skips.
"""

import importlib.util
import os
import sys

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else ["test_*.py"]
sys.path.insert(0, os.path.dirname(__file__))  # the rig (sglang_rig.py) is a plain module next to the tests
