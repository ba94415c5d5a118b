"""Opt-in pytest plugin: the CPU seconds each test costs, which a busy machine does not inflate.

Wall-clock durations (``--durations``) on a shared 2-core machine mostly measure the other
users' load; CPU time does not. For each test this writes one tab-separated line to the file
``$CPU_DURATIONS`` as the test ends: node id, wall seconds, CPU seconds of this process, CPU
seconds of the child processes it waited for, and the 1-minute load average::

    CPU_DURATIONS=/tmp/cpu.tsv PYTHONPATH=tests .venv/bin/python -m pytest -p cpu_durations
    sort -t$'\\t' -k4 -rn /tmp/cpu.tsv | head -20

Children count once they are reaped (every test here waits for its processes); under
pytest-xdist each worker appends its own tests to the same file.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator

import pytest


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = os.environ.get("CPU_DURATIONS")
    own0, children0 = _cpu()
    wall0 = time.monotonic()
    yield
    if path:
        own1, children1 = _cpu()
        with open(path, "a") as out:
            out.write(f"{item.nodeid}\t{time.monotonic() - wall0:.2f}\t{own1 - own0:.2f}\t{children1 - children0:.2f}"
                      f"\t{os.getloadavg()[0]:.2f}\n")
