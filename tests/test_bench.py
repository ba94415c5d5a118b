"""`kvbridge bench`: one command group, every part with --json and --plot; the request benchmark end to end."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cli import build_parser, main

PARTS = ("plan", "transfer", "tp", "request", "scale", "layerwise", "checksum")


def bench_parts():
    parser = build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices


def test_bench_has_exactly_the_documented_parts_each_with_json_and_plot():
    parts = bench_parts()
    assert tuple(parts) == PARTS
    for name, sub in parts.items():
        flags = {f for a in sub._actions for f in a.option_strings}
        assert {"--json", "--plot"} <= flags, name


def test_docs_cli_lists_every_bench_part():
    text = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    for name in bench_parts():
        assert f"`kvbridge bench {name}" in text, name


def test_plot_without_matplotlib_still_prints_results_and_says_why(monkeypatch, capsys, tmp_path):
    from kvbridge.bench import common, tp

    monkeypatch.setattr(common, "can_plot", lambda: False)
    monkeypatch.setattr(tp, "PAIRS", [(1, 2)])
    out_png = tmp_path / "tp.png"
    assert main(["bench", "tp", "--json", "--plot", str(out_png)]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["decode_tp"] == 2  # the results came anyway
    assert "--plot" in out.err and "kvbridge[plot]" in out.err and not out_png.exists()


@pytest.mark.skipif(not __import__("kvbridge.bench.common", fromlist=["x"]).can_plot(), reason="needs kvbridge[plot]")
def test_plot_writes_a_png(tmp_path, monkeypatch, capsys):
    from kvbridge.bench import tp

    monkeypatch.setattr(tp, "PAIRS", [(1, 2)])
    assert main(["bench", "tp", "--plot", str(tmp_path / "tp.png")]) == 0
    assert (tmp_path / "tp.png").read_bytes()[:4] == b"\x89PNG"


def test_request_bench_moves_checked_requests_and_reports_latency_and_references():
    # Real processes over the memory backend: decode checks every sequential request's
    # bytes and every slot of the concurrent cell; the zmq round trip is measured alongside.
    from kvbridge.bench import request

    res = request.run_backend("memory", [request.Cell(1, 1, 10), request.Cell(4, 8, 40)])
    assert res["result"] == "PASS", res["problems"]
    assert [c["requests"] for c in res["cells"]] == [10, 40]
    for c in res["cells"]:
        assert 0 < c["p50_us"] <= c["p99_us"] and c["requests_per_s"] > 0
    assert res["zmq_rtt_p50_us"] > 0 and res["raw_write_p50_us"] is None  # memory has no raw engine
    assert res["first_us"] > 0 and res["second_us"] > 0  # the cold-start pair of the first cell


def test_request_trace_puts_both_processes_steps_on_one_timeline_in_causal_order():
    # In a child process: tracing wraps core's classes for the rest of the process.
    out = subprocess.run([sys.executable, "-m", "kvbridge.bench.request", "--trace", "--backends", "memory",
                          "--requests", "320", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (res,) = json.loads(out.stdout)
    rows = res["trace"]
    assert res["result"] == "PASS" and res["traced_requests"] == 299, res
    assert rows[0]["side"] == "decode" and rows[0]["step"] == "Receiver.init >" and rows[0]["at_us"] == 0
    assert [r["at_us"] for r in rows] == sorted(r["at_us"] for r in rows)
    order = [(r["side"], r["step"]) for r in rows]
    causal = [("prefill", "received TransferRequest"), ("prefill", "Sender.send >"), ("prefill", "MemoryBackend.write <"),
              ("prefill", "Done handed to I/O >"), ("decode", "received Done"), ("decode", "Room.wait <")]
    assert all(step in order for step in causal), order
    assert [order.index(step) for step in causal] == sorted(order.index(step) for step in causal), order


def test_request_bench_rejects_an_unknown_backend_naming_the_installed_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "request", "--backends", "nope"])
    assert exc.value.code == 2
    assert re.search(r"argument --backends: unknown backend\(s\) nope; installed: .*memory", capsys.readouterr().err)


def test_checksum_bench_times_checked_rooms_off_and_on_and_every_hash(capsys):
    # Real processes over nixl, host memory: decode checks the last room's bytes of each size
    # against the source pattern; every hash's two halves agree. (--device cuda: tests/test_wmix.py
    # and scripts/gpu_check.sh's "checksum" step, where a GPU is.)
    from kvbridge.core.sessions import checksum as C

    assert main(["bench", "checksum", "--device", "cpu", "--total-mib", "1", "2", "--hash-mib", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    # Every hash over one region, then wmix64 over the same pages cut into regions (16 here: one a page).
    assert [(r["algorithm"], r["regions"]) for r in res["hash"]] == [
        (C.default_algorithm(), 1), *[(a, 1) for a in C.ALGORITHMS if a != C.default_algorithm()], ("wmix64", 16)]
    assert all(r["match"] and r["prefill_GBps"] > 0 and r["decode_GBps"] > 0 for r in res["hash"])
    assert [r["bytes"] for r in res["rooms"]] == [1 << 20, 2 << 20]
    assert all(r["verified"] and r["off_ms"] > 0 and r["on_ms"] > 0 and r["algorithm"] == C.default_algorithm()
               for r in res["rooms"])
