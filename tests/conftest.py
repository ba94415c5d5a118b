import os
import re
import secrets

import pytest

# Engine environment for CPU-only loopback machines (docs/engines.md):
# keep UCX on loopback, avoid NIXL's SIGSEGV at exit, quiet Mooncake's per-call logs.
for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
    os.environ.setdefault(key, value)

# Tests run with authenticated control messages, as a deployment should: every
# process (this one and the drivers it starts, which inherit the environment)
# holds the same secret. Tests of what happens without one remove it for a child.
os.environ.setdefault("KVBRIDGE_SECRET", secrets.token_hex(32))


# The suite runs on every core (pytest-xdist, `-n auto --dist loadgroup` in pyproject.toml). Tests that
# kill, freeze or signal processes and bound how fast the survivor reacts go to one worker, one after
# another (xdist_group "faults"), so no two of them compete for the cores; the rest are independent
# (ephemeral loopback ports, their own temporary folders and processes).
SERIAL = re.compile(r"frozen|freeze|kill|signal|ctrl_c|fault")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name == "test_faults.py" or SERIAL.search(item.name):
            item.add_marker(pytest.mark.xdist_group("faults"))
