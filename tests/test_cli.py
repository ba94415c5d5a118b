"""The `kvbridge` command's conventions (docs/cli.md), command by command."""

import io
import json
import math
import os
import re
import subprocess
import sys

import pytest

import kvbridge
from kvbridge import ui


def kvb(*args, columns=None):
    env = {**os.environ}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "kvbridge", *args], capture_output=True, text=True, timeout=120, env=env)


def test_python_dash_m_kvbridge_is_the_kvbridge_command():
    out = kvb("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvbridge {kvbridge.__version__}"


def test_plugins_json_rows_have_the_documented_fields():
    out = kvb("plugins", "--json")
    assert out.returncode == 0, out.stderr
    for row in json.loads(out.stdout):
        assert {"name", "kind", "distribution", "version", "capabilities"} <= set(row)
        assert row["kind"] in ("backend", "state_handler")


def test_plugins_tables_fit_80_columns_and_read_as_words():
    out = kvb("plugins", columns=80)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    words = out.stdout.split()
    assert not {"True", "False", "None"} & set(words)
    for title in ("Transfer backends", "State handlers", "Backend options"):
        assert any(line.startswith(title) for line in lines)
    assert any(line.startswith("memory ") and " ok " in line for line in lines)


def test_no_command_prints_help_and_fails():
    out = kvb()
    assert out.returncode == 2 and "plugins" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["bench", "plan", "--reps", "0"], "argument --reps: must be >= 5, got 0"),
    (["bench", "tp", "--reps", "x"], "argument --reps: expected a whole number, got 'x'"),
    (["bench", "layerwise", "--compute-ms", "1,-2"], "argument --compute-ms: milliseconds must be >= 0, got '1,-2'"),
    (["conformance", "--timeout-scale", "0", "memory"], "argument --timeout-scale: must be > 0, got '0'"),
    (["demo", "--transfer-backend", "nope"], "unknown transfer backend 'nope'; installed backends:"),
])
def test_a_usage_error_exits_2_with_the_usage_line_and_says_what_is_allowed(args, message):
    out = kvb(*args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"usage: kvbridge {args[0]}")
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("command, default", [
    (["bench", "plan"], "(default: 5)"),
    (["conformance"], "(default: 1.0)"),
    (["demo"], "(default: 16)"),
])
def test_help_shows_defaults(command, default):
    out = kvb(*command, "--help", columns=200)
    assert out.returncode == 0 and default in out.stdout


def test_help_shows_the_choices_of_transfer_backend():
    from kvbridge.config import available_backends

    out = kvb("demo", "--help", columns=200)
    assert "--transfer-backend {" + ",".join(available_backends()) + "}" in out.stdout


def test_bench_plan_reports_every_case_with_units_in_its_keys(monkeypatch):
    from kvbridge.bench import plan

    monkeypatch.setenv("COLUMNS", "160")

    small = (plan.Case(3, 64, 128, True), plan.Case(3, 64, 128, False))
    results = plan.run(reps=5, cases=small)
    assert [r["descriptors"] for r in results][1] == 3  # contiguous: one per entry
    assert all(r["kvbridge_ms"] > 0 and r["sglang_ms"] > 0 and r["identical"] for r in results)
    text = io.StringIO()
    ui.print_table(plan.format_table(results), text)
    assert "speedup" in text.getvalue() and "3 x 64 pages x 128 B, contiguous" in text.getvalue()


def test_bench_plan_shows_progress_on_stderr_while_it_runs(monkeypatch, capsys):
    from kvbridge.bench import plan
    from kvbridge.cli import main

    monkeypatch.setattr(plan, "CASES", (plan.Case(3, 64, 128, True), plan.Case(3, 64, 128, False)))
    assert main(["bench", "plan", "--json"]) == 0
    out = capsys.readouterr()
    assert len(json.loads(out.out)) == 2  # stdout: the JSON document only
    lines = out.err.splitlines()  # a line a quarter, counting the Python loop's descriptors (what takes the time)
    assert len(lines) == 4 and all(line.startswith("bench plan: ") for line in lines)
    done, total = re.match(r"bench plan: ([\d,]+)/([\d,]+) descriptors \(SGLang loop\)", lines[-1]).groups()
    assert done == total and "ETA" in lines[0]


def test_bench_layerwise_moves_verified_requests_both_ways_and_reports_ratios():
    # The smallest run: 2 layers of one 64 KiB page, one timed request per mode, on the memory backend.
    out = kvb("bench", "layerwise", "--transfer-backend", "memory", "--layers", "2", "--layer-mib", "0.0625",
              "--compute-ms", "0,20", "--reps", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["compute_ms"] for r in rows] == [0, 20] and all(r["verified"] for r in rows)
    for r in rows:
        assert r["exposed_ratio"] == r["exposed_layerwise_ms"] / r["exposed_chunk_ms"]
        assert r["ttft_chunk_ms"] >= r["exposed_chunk_ms"] > 0
    assert rows[1]["regime"] == "compute-bound" and rows[1]["ttft_chunk_ms"] >= 40  # two 20 ms layers
    for r in rows:  # the throughput comparison: the pairs' median ratio inside their interquartile range
        assert r["throughput_ratio_p25"] <= r["throughput_ratio"] <= r["throughput_ratio_p75"]
        assert r["target_met"] in ("yes", "no", "noise") and r["reps"] == 1
        # Per chunk: the chunk's write (the row travels in Done); layer-wise: at most one per layer. What a
        # write costs is measured once 3 writes of a size class were made (this short run may make fewer).
        assert r["writes_chunk"] == 1 and 1 <= r["writes_layerwise"] <= 2
        assert math.isnan(r["write_cost_ms"]) or r["write_cost_ms"] >= 0


def test_bench_layerwise_with_the_demos_tiny_model_decodes_the_first_tokens_from_what_arrived():
    pytest.importorskip("torch", reason="torch is not installed (KVBRIDGE_TORCH=none); the demo's model needs it")
    # One prompt of 40 tokens in chunks of 16 (three chunks, the last partial), one timed pair.
    out = kvb("bench", "layerwise", "--model", "tiny", "--transfer-backend", "memory", "--prompt-tokens", "40",
              "--chunk-size", "16", "--reps", "1", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["model"] == "tiny" and row["prompt_tokens"] == 40 and row["layers"] == 6  # 5 + the draft head's
    assert row["verified"] and row["ttft_chunk_ms"] >= row["exposed_chunk_ms"] > 0
    assert row["exposed_ratio"] == row["exposed_layerwise_ms"] / row["exposed_chunk_ms"]


@pytest.mark.parametrize("part", ["transfer", "layerwise"])
def test_bench_on_cuda_without_a_gpu_is_a_usage_error_naming_the_device(part):
    from kvbridge.bench.common import cuda_problem

    if cuda_problem() is None:
        pytest.skip("this machine has a CUDA device")
    out = kvb("bench", part, "--device", "cuda", "--transfer-backend", "memory")
    assert out.returncode == 2 and out.stderr.startswith(f"usage: kvbridge bench {part}"), out.stderr
    assert f"kvbridge bench {part}: error: argument --device: cuda" in out.stderr and "Traceback" not in out.stderr


def test_bench_transfer_has_one_parser_whatever_the_device():
    cpu, cuda = kvb("bench", "transfer", "--help", columns=200), kvb("bench", "transfer", "--device", "cuda", "--help",
                                                                     columns=200)
    assert cpu.returncode == cuda.returncode == 0 and cpu.stdout == cuda.stdout
    assert cpu.stdout.startswith("usage: kvbridge bench transfer")
    for text in ("--plot FILE.png", "--page-kib", "(default: 4 16 64 256 1024)", "(default: 5; cuda: 10)", "(default: cpu)"):
        assert text in cpu.stdout, text


@pytest.mark.parametrize("args, message", [
    (["--decode-gpu", "1"], "argument --decode-gpu: applies to --device cuda only (this run is --device cpu)"),
    (["--staging", "on"], "argument --staging: applies to the fragmentation axis only; give --page-kib too"),
    (["--trace"], "argument --trace: applies to the fragmentation axis only; give --page-kib too"),
    (["--slice-mib", "64"], "argument --slice-mib: applies to --device cuda only (this run is --device cpu)"),
    (["--device", "cuda", "--slice-mib", "64"], "argument --slice-mib: applies to staged paths; give --staging on or auto too"),
    (["--device", "cuda", "--regions", "2"], "argument --regions: applies to --device cpu only (this run is --device cuda)"),
    (["--total-mib", "1", "2"], "argument --total-mib: takes one value with --device cpu, got [1, 2]"),
])
def test_bench_transfer_refuses_the_other_devices_options(args, message):
    out = kvb("bench", "transfer", "--transfer-backend", "memory", *args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_conformance_without_a_name_asks_for_the_name_only():
    out = kvb("conformance")
    assert out.returncode == 2 and out.stderr.startswith("usage: kvbridge conformance"), out.stderr
    assert "the following argument is required: NAME (an installed backend; available here: " in out.stderr
    assert "PYTEST_ARGS" not in out.stderr.splitlines()[-1]  # optional: named only in the usage line
