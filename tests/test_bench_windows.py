"""``kvbridge bench transfer --trace``: where a staged window's time goes (kvbridge.bench.windows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvbridge.bench import windows

#: The chain of one staged window, in causal order (one batch in flight: the memory backend's write).
CHAIN = ["slot wait >", "slot taken", "gather >", "gather <", "post and land >", "post and land <",
         "Staged handed to I/O >", "Staged sent", "received Staged", "on Staged >", "scatter >", "scatter <",
         "Unstaged sent", "received Unstaged", "slot freed >"]


def test_trace_gives_every_step_of_each_staged_window_in_both_processes_and_keeps_the_checked_rows():
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "transfer", "--transfer-backend", "memory",
                          "--page-kib", "4", "--total-mib", "1", "--staging", "off", "on", "--reps", "5", "--trace",
                          "--json"], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert rows and all(r["verified"] for r in rows), "every row's bytes checked, as without --trace"
    scattered = next(r for r in rows if r["case"] == "scattered" and r["staging"] == "on")
    summary = scattered["trace"]
    # Every timed room's staged windows were traced whole (5 rooms of 1 MiB, one 4 MiB slice each).
    assert summary["windows"] == summary["staged"] == scattered["windows"]["both"] == 5
    steps = [s["step"] for s in summary["steps"]]
    assert steps == CHAIN, steps
    assert [s["side"] for s in summary["steps"]].count("decode") == 5
    at = {s["step"]: s["at_us"] for s in summary["steps"]}
    assert list(at.values()) == sorted(at.values()) and at["slot taken"] == 0 and at["slot wait >"] <= 0
    assert all(s["windows"] == 5 for s in summary["steps"])
    assert all(s["gap_p90_us"] >= s["gap_us"] >= 0 for s in summary["steps"])
    spent = {s["activity"]: s["us_per_window"] for s in summary["spent"]}
    assert spent["gathering (incl. sync)"] > 0 and spent["scattering (incl. sync)"] > 0
    assert summary["windows_per_s"] > 0 and summary["GBps"] > 0
    assert next(r for r in rows if r["case"] == "scattered" and r["staging"] == "off")["trace"]["windows"] == 0
    assert "trace" not in next(r for r in rows if r["tp"] == "1->2"), "a slot names a window for one peer only"
    # The tables go to stderr beside the JSON: the chain and each thread's time per window.
    assert "4 KiB scattered, staging on: a staged window's cycle" in out.stderr
    assert "each thread's time per window" in out.stderr and "scattering (incl. sync)" in out.stderr


def test_a_decode_event_recorded_after_prefill_already_freed_the_slot_stays_with_its_window():
    # Decode records "Unstaged sent" after prefill received it and took the slot again for the next window.
    prefill = [(0, "w", "slot wait >"), (1, "w", "slot taken", 6), (3, "kvbridge-prefill", "received Unstaged", 6),
               (4, "kvbridge-prefill", "slot freed >", 6), (5, "w", "slot wait >"), (6, "w", "slot taken", 6),
               (12, "kvbridge-prefill", "slot freed >", 6)]
    decode = [(2, "kvbridge-decode", "received Staged", 6), (7, "kvbridge-decode", "Unstaged sent", 6),
              (8, "kvbridge-decode", "received Staged", 6), (10, "kvbridge-decode", "Unstaged sent", 6)]
    found = windows.cycles({"prefill": prefill, "decode": decode}, [(0, 12)])
    assert [[e[3] for e in c] for c in found] == [
        ["slot wait >", "slot taken", "received Staged", "received Unstaged", "slot freed >", "Unstaged sent"],
        ["slot wait >", "slot taken", "received Staged", "Unstaged sent", "slot freed >"]]
    assert windows.cycles({"prefill": prefill, "decode": decode}, [(5, 12)])[0][0][0] == 5, "only inside the spans"
