"""Prefill and decode as separate processes moving real requests through each backend.

The decode process checks every destination byte against the source pattern
(computed with plain numpy indexing, not the planner) and that pages no
request wrote still hold the sentinel; see kvbridge.testing.e2e.
"""

import json
import os
import subprocess
import sys
import time

import msgspec
import pytest

from kvbridge.testing import available_backends
from kvbridge.testing.e2e import Scenario

BACKENDS = available_backends()


def run_pair(sc: Scenario, timeout: float = 240) -> tuple[dict, dict]:
    """Run the prefill and decode drivers as two processes; return their result lines."""
    spec = msgspec.json.encode(sc).decode()
    cmd = [sys.executable, "-m", "kvbridge.testing.e2e"]
    prefill = subprocess.Popen([*cmd, "prefill", "--scenario", spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    decode = None
    try:
        first = prefill.stdout.readline()  # "BOOTSTRAP host:port", printed before anything else
        assert first.startswith("BOOTSTRAP "), f"prefill did not start: {first!r} {prefill.stderr.read() if prefill.poll() is not None else ''}"
        decode = subprocess.Popen([*cmd, "decode", "--scenario", spec, "--bootstrap", first.split()[1]],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        d_out, d_err = decode.communicate(timeout=timeout)
        p_out, p_err = prefill.communicate(timeout=60)
    finally:
        for proc in (prefill, decode):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert decode.returncode == 0, f"decode failed:\n{d_out}\n{d_err[-4000:]}"
    assert prefill.returncode == 0, f"prefill failed:\n{p_out}\n{p_err[-4000:]}"
    return json.loads(p_out.strip().splitlines()[-1]), json.loads(d_out.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_200_requests_64_in_flight_arrive_byte_exact(backend):
    # Lengths 1..4096 pages, half fragmented and half contiguous on each side,
    # 1-4 chunks each, 64 requests initiated before any is waited on.
    sc = Scenario(backend=backend, requests=200, max_pages=4096, concurrency=64)
    prefill, decode = run_pair(sc)
    assert decode["requests"] == 200 and decode["failed"] == []
    assert decode["mismatched_regions"] == 0
    assert prefill["failed"] == 0
    assert prefill["active_rooms"] == 0 and decode["active_rooms"] == 0


def test_every_builtin_backend_is_installed_so_none_is_silently_skipped():
    # The end-to-end tests run over what is installed; CI installs every engine.
    assert {"mooncake", "nixl", "ucx"} <= set(BACKENDS), f"installed backends: {BACKENDS}"
