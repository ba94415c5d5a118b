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


# Tables a test hands to the run's summary (tests/test_soak.py's chaos soak: per backend and fault kind).
# The test's report carries it (a user property) to the controller, also from an xdist worker (whose
# stdout is hidden), and the summary prints it after the results, passed or failed.
SUMMARY = "summary_table"
_tables: list[tuple[str, str]] = []


@pytest.fixture
def summary_table(record_property):
    """``summary_table(text)``: print ``text`` in the run's terminal summary, under the test's id."""
    return lambda text: record_property(SUMMARY, text)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _tables.extend((report.nodeid, value) for name, value in report.user_properties if name == SUMMARY)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _tables:
        return
    terminalreporter.section("tables the tests measured")
    for nodeid, text in sorted(_tables):
        terminalreporter.write_line(nodeid)
        terminalreporter.write_line(text)


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
