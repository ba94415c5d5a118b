import fcntl
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

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
# worker (xdist_group "faults"), one at a time; those of EXCLUSIVE's files also run alone, holding an exclusive
# lock that every other test shares, so no other test competes with them for the cores.
# (?<!de): "default" is no fault; the tests of --help's defaults and of default settings share the cores.
SERIAL = re.compile(r"frozen|freeze|kill|signal|ctrl_c|(?<!de)fault|closed|deadline|in_time|timeout|timed_out|dead")
# Named like the above but bound no time: settings and usage errors, a deadline that passed before the write
# started, and bad kv_transfer_params (refused at once). They share the cores.
UNTIMED = re.compile(r"deadline_has_passed|write_after_the_deadline|fence_timeout_defaults|bad_addresses_and_timeouts|from_dict_errors"
                     r"|a_usage_error|bad_params_fail")


# tryfirst: pytest-xdist's worker reads the xdist_group marks in its own collection hook, after this one.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name == "vllm":
            # vLLM's tests on one worker, one at a time (their fault tests bound nothing tighter than 30 s):
            # each worker running one imports vLLM and builds its model config, about 12 CPU-s.
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif UNTIMED.search(item.name):
            continue
        # test_faulty_backends.py: one inner run of the suite (a module fixture, with a frozen-peer test in
        # it) serves all its tests; split over two workers it ran twice.
        elif item.path.name in ("test_faults.py", "test_faulty_backends.py") or SERIAL.search(item.name):
            item.add_marker(pytest.mark.xdist_group("faults"))
    # Longest first: the serial chain (one worker, about 300 s: the tests that run alone first, back to back, so
    # they wait for the other worker's running test once, not once a module), vLLM's, then single tests of
    # 10-50 s. Started last, the SGLang sub-suite (45 s, collected late) ran while the other worker had nothing left.
    items.sort(key=lambda item: (0 if _alone(item) else 1 if _grouped(item) else 2 if _grouped(item, "vllm")
                                 else 3 if item.path.name in LONG else 4))


#: Files of long tests (a sub-suite, demos, pytest runs in a subprocess): started early, so none ends the run alone.
LONG = frozenset({"test_sglang_suite.py", "test_demo.py", "test_conformance_suite.py", "test_scaffold.py"})


def _grouped(item: pytest.Item, group: str = "faults") -> bool:
    return any(m.args == (group,) for m in item.iter_markers("xdist_group"))


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


class _LoadGroupIds:
    """--dist loadgroup groups by the "@group" suffix xdist's worker appends to each node id; on pytest >= 9.2
    (structured node ids) its assignment no longer takes effect (pytest-dev/pytest-xdist#1386), and the fault
    tests were spread over both workers, each waiting out the other's running test before it could start.
    Appends it where xdist could not; a no-op where it did."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not config.getvalue("loadgroup"):
            return
        for item in items:
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")})
            if names and "@" not in item.nodeid and hasattr(item, "_id"):
                try:  # pytest's private node id type (9.2): where it is gone, the groups are xdist's own again
                    from _pytest.nodeid import NodeId
                except ImportError:
                    return
                item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(_LoadGroupIds(), "kvbridge-loadgroup-ids")


# Of the serial tests, the fault cells with engine processes killed, frozen or cut off and bounds on how fast the
# survivors notice run alone, the other worker waiting: tests/test_faults.py, the chaos soak, and the backends'
# own fault tests (under a second worker's load UCX once reported a write to a killed destination as done, a test
# that had passed in every run alone). The rest of the serial tests (one frozen or closed peer, a timeout, the
# demo's signals, the faulty backends' inner suite) run one at a time on their worker while the other worker
# goes on: they wait more than they compute (all serial tests: 336 s, 255 CPU-s), and holding the second core
# idle for them cost CI about 150 s.
EXCLUSIVE = frozenset(f"tests/{name}.py" for name in ("test_faults", "test_soak", "test_ucx_backend", "test_nixl_backend",
                                                      "test_mooncake_backend"))


def _alone(item: pytest.Item | None) -> bool:
    return (item is not None and _grouped(item)
            and item.path.relative_to(item.config.rootpath).as_posix() in EXCLUSIVE)


# The lock this worker holds, kept from one test to the next while both run alone: released between them, the
# other worker starts a test, which this one then waits out with the second core idle (a second to 25 s, the
# other worker's test). A module fixture of the next module is then set up under the lock too.
_held: list[tuple[IO[str], bool]] = []  # [(the lock file, exclusive)] while held


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    try:
        return (yield)
    finally:
        _release_unless_kept(item, nextitem)


def _release_unless_kept(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _held and not (_held[0][1] and _alone(nextitem)):
        lock, _ = _held.pop()
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


@pytest.fixture(autouse=True)
def _serial_tests_run_alone(request: pytest.FixtureRequest):
    workerinput = getattr(request.config, "workerinput", None)
    if workerinput is None:  # not under xdist: one test at a time anyway
        yield
        return
    alone = _alone(request.node)
    if not _held:  # else: the exclusive lock, kept from the test before (pytest_runtest_protocol)
        lock = open(Path(tempfile.gettempdir()) / f"kvbridge-tests-{workerinput['testrunuid']}.lock", "a")
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        _held.append((lock, alone))
    yield
