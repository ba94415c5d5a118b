import json
import subprocess
import sys

import kvbridge


def kvb(*args):
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", *args], capture_output=True, text=True, timeout=120)


def test_version():
    out = kvb("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvbridge {kvbridge.__version__}"


def test_plugins_json_rows_have_the_documented_fields():
    out = kvb("plugins", "--json")
    assert out.returncode == 0, out.stderr
    for row in json.loads(out.stdout):
        assert {"name", "kind", "distribution", "version", "capabilities"} <= set(row)
        assert row["kind"] in ("backend", "state_handler")


def test_no_command_prints_help_and_fails():
    out = kvb()
    assert out.returncode == 2 and "plugins" in out.stdout


def test_bench_plan_reports_every_case(monkeypatch, capsys):
    from kvbridge.bench import plan

    small = (plan.Case(3, 64, 128, True), plan.Case(3, 64, 128, False))
    monkeypatch.setattr(plan, "CASES", small)
    results = plan.run(reps=5, cases=small)
    assert [r["descriptors"] for r in results][1] == 3  # contiguous: one per entry
    assert all(r["kvbridge_ms"] > 0 and r["python_loop_ms"] > 0 for r in results)
    assert "speedup" in plan.format_table(results)
