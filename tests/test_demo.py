"""`kvbridge demo`, the README's first command, end to end on every installed backend."""

import json
import subprocess
import sys

import pytest

from kvbridge.demo import Spec, summarize
from kvbridge.testing import available_backends


def demo(*args):
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", "demo", *args], capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("backend", available_backends())
def test_demo_passes_with_prefill_tp2_to_decode_tp1(backend):
    out = demo("--transfer-backend", backend, "--prefill-tp", "2", "--decode-tp", "1", "--requests", "8", "--json")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    s = json.loads(out.stdout)
    assert s["result"] == "PASS" and s["succeeded"] == 8 and s["verified"]
    assert {"kv", "swa", "nsa", "mamba", "dsv4", "draft", "metadata"} <= set(s["bytes_by_state"])
    assert s["bytes"] == sum(s["bytes_by_state"].values()) > 0
    assert 0 < s["latency_ms_p50"] <= s["latency_ms_p99"]


def test_demo_table_shows_progress_and_the_result():
    out = demo("--requests", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4/4 requests" in out.stderr  # the progress bar (milestone lines when not a terminal)
    for label in ("requests", "bytes kv", "throughput", "latency p50 / p99", "every byte verified  yes", "result               PASS"):
        assert label in out.stdout


def test_unknown_backend_is_a_clear_error_without_a_traceback():
    out = demo("--transfer-backend", "carrier-pigeon")
    assert out.returncode == 2
    assert "unknown transfer backend 'carrier-pigeon'; installed backends:" in out.stderr
    assert "Traceback" not in out.stderr


def test_any_failed_room_makes_the_summary_fail():
    spec = Spec(backend="x", requests=2)
    decode = {"rooms": {"1": [["SUCCESS", None]], "2": [["FAILED", "peer gone"]]}, "mismatches": [],
              "latency_s": [0.1, 0.2], "bytes_by_state": {"kv": 10}, "seconds": 1.0}
    prefill = {"rooms": {"1": [["SUCCESS", None]], "2": [["FAILED", "peer gone"]]}}
    s = summarize(spec, prefill, decode, 0, 0, "")
    assert s["result"] == "FAIL" and s["succeeded"] == 1
    assert any("room 2: FAILED peer gone" in p for p in s["problems"])
