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
    # Head slices too: one prefill rank writing to two decode ranks (1 -> 2), two prefill ranks in one process
    # writing to one (2 -> 1); a window is named by its decode slot's address, threads by their ident.
    for tp in ("1->2", "2->1"):
        sliced = next(r for r in rows if r["tp"] == tp and r["staging"] == "on")
        assert sliced["trace"]["windows"] == sliced["trace"]["staged"] == sliced["windows"]["both"] > 0, tp
        # Every step of the chain; those of every window in its order (Staged may leave from the worker's thread
        # or the I/O thread: a step each, in part of the windows, whose medians need not keep the order).
        steps = sliced["trace"]["steps"]
        assert {s["step"] for s in steps} == set(CHAIN), tp
        everywhere = [s["step"] for s in steps if s["windows"] == sliced["trace"]["windows"]]
        assert everywhere == [c for c in CHAIN if c in everywhere], tp
    # The tables go to stderr beside the JSON: the chain and each thread's time per window.
    assert "4 KiB scattered, staging on: a staged window's cycle" in out.stderr
    assert "each thread's time per window" in out.stderr and "scattering (incl. sync)" in out.stderr


def test_two_workers_of_one_name_gathering_at_once_keep_their_own_windows():
    # Two prefill ranks in one process (TP 2 -> 1): both workers are named after the peer; recorded with their
    # ident, each one's gather while it waited stays with the window it then took the slot for.
    prefill = [(0, "kvbridge-xfer-d@1", "gather >"), (1, "kvbridge-xfer-d@2", "slot wait >"),
               (2, "kvbridge-xfer-d@1", "gather <"), (3, "kvbridge-xfer-d@1", "slot wait >"),
               (4, "kvbridge-xfer-d@2", "slot taken", 200), (5, "kvbridge-xfer-d@1", "slot taken", 100),
               (6, "kvbridge-xfer-d@2", "gather >"), (7, "kvbridge-xfer-d@2", "gather <"),
               (8, "kvbridge-prefill@3", "slot freed >", 100), (9, "kvbridge-prefill@4", "slot freed >", 200)]
    decode = [(5.5, "kvbridge-decode@9", "received Staged", 100), (6.5, "kvbridge-decode@9", "received Staged", 200)]
    found = {c[-1][4]: [(e[2], e[3]) for e in c] for c in windows.cycles({"prefill": prefill, "decode": decode}, [(0, 9)])}
    assert found[100][:4] == [("transfer worker", "gather while waiting >"), ("transfer worker", "gather while waiting <"),
                              ("transfer worker", "slot wait >"), ("transfer worker", "slot taken")]
    assert [s for _, s in found[200]] == ["slot wait >", "slot taken", "gather >", "received Staged", "gather <",
                                          "slot freed >"]


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
