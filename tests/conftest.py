import fcntl
import os
import re
import secrets
import tempfile
from pathlib import Path

import pytest

# Engine environment for CPU-only loopback machines (docs/engines.md):
# keep UCX on loopback, avoid NIXL's SIGSEGV at exit, quiet Mooncake's per-call logs.
for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
    os.environ.setdefault(key, value)

# Tests run with authenticated control messages, as a deployment should: every
# process (this one and the drivers it starts, which inherit the environment)
# holds the same secret. Tests of what happens without one remove it for a child.
os.environ.setdefault("KVBRIDGE_SECRET", secrets.token_hex(32))


# CI runs the suite on two workers (pytest-xdist, `-n 2 --dist loadgroup`: README, .ci/run); tests are
# independent (ephemeral loopback ports, their own temporary folders and processes). Tests that kill,
# freeze or signal processes, or bound how fast something fails, are kept serial: they all go to one
# worker (xdist_group "faults") and each runs alone, holding an exclusive lock that every other test
# shares, so no other test competes with it for the cores.
# (?<!de): "default" is no fault; the tests of --help's defaults and of default settings share the cores.
SERIAL = re.compile(r"frozen|freeze|kill|signal|ctrl_c|(?<!de)fault|closed|deadline|in_time|timeout|timed_out|dead")
# Named like the above but bound no time: settings and usage errors, a deadline that passed before the write
# started, and bad kv_transfer_params (refused at once). They share the cores.
UNTIMED = re.compile(r"deadline_has_passed|write_after_the_deadline|fence_timeout_defaults|bad_addresses_and_timeouts|from_dict_errors"
                     r"|a_usage_error|bad_params_fail")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if UNTIMED.search(item.name):
            continue
        # test_faulty_backends.py: one inner run of the suite (a module fixture, with a frozen-peer test in
        # it) serves all its tests; split over two workers it ran twice.
        if item.path.name in ("test_faults.py", "test_faulty_backends.py") or SERIAL.search(item.name):
            item.add_marker(pytest.mark.xdist_group("faults"))


@pytest.fixture(autouse=True)
def _serial_tests_run_alone(request: pytest.FixtureRequest):
    workerinput = getattr(request.config, "workerinput", None)
    if workerinput is None:  # not under xdist: one test at a time anyway
        yield
        return
    alone = any(m.args == ("faults",) for m in request.node.iter_markers("xdist_group"))
    path = Path(tempfile.gettempdir()) / f"kvbridge-tests-{workerinput['testrunuid']}.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
