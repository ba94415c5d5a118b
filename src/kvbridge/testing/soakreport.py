"""The chaos soak's report (:mod:`kvbridge.testing.soak`): per fault kind, and the run's resources and CPU."""

from __future__ import annotations

import os
import statistics
import threading

import msgspec

#: The room count at which the soak takes its middle reading of threads, fds and RSS (issue 28: flat over 10,000).
CHECKPOINT = 10_000


class KindStats(msgspec.Struct, kw_only=True):
    """One fault kind's results (``none``: rooms without a fault of their own before the first fault)."""

    faults: int = 0
    rooms: int = 0
    succeeded: int = 0
    failed: int = 0
    wrong_successes: int = 0
    late_writes: int = 0
    #: For each late write: the room, its failure reason, and the pages (of its own) that changed.
    late_rooms: list[str] = []
    #: Seconds from the fault to FAILED on decode of each room in flight at it (max over rooms, per fault); for
    #: a room's own fault (ROOM_KINDS), per FAILED room: from decode's abort, or prefill's room from its init.
    to_failed_s: list[float] = []
    #: Seconds from the prefill (restarted or resumed) being ready, or the fault, to the next SUCCESS.
    to_success_s: list[float] = []
    #: Seconds from the fault itself to that SUCCESS: how long the fault kept the soak from being served.
    down_s: list[float] = []
    #: FAILED rooms whose reason names a layout mismatch, and those of them with any byte landed.
    refused_layout: int = 0
    landed_in_refused: int = 0
    #: FAILED rooms counted by their reason's first words.
    reasons: dict[str, int] = {}
    #: Outcomes (SUCCESS/FAILED) of the rooms that were in flight when a fault of this kind began.
    inflight: dict[str, int] = {}


class Report(msgspec.Struct, kw_only=True):
    """One backend's soak: per fault kind (:class:`KindStats`), and the run's rate, resources and CPU."""

    backend: str
    seconds: float
    rooms: int = 0
    rooms_per_s: float = 0.0
    #: Rooms per second before the first fault (the soak's rate with nothing injected, in the same run).
    fault_free_rooms_per_s: float = 0.0
    unfinished: int = 0
    kinds: dict[str, KindStats] = {}
    resources_start: dict[str, int] = {}
    #: When the :data:`CHECKPOINT`-th room ended (empty if fewer ended).
    resources_checkpoint: dict[str, int] = {}
    resources_end: dict[str, int] = {}
    #: CPU microseconds per room, of the soak process (decode, the bootstrap server, the soak's own checks)
    #: and of its prefill processes (replacements' start-up included): load-independent, unlike rooms/s.
    cpu_us_per_room: dict[str, int] = {}
    error: str | None = None
    #: Why the soak did not run (network namespaces unavailable for a net-cut).
    skipped: str | None = None


def resources() -> dict[str, int]:
    """This process's threads, open file descriptors and resident memory (bytes)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")), "rss": rss}


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def table(reports: list[Report], details: bool = False) -> str:
    """The reports as a markdown table; ``details``: under it, each late write, the outcomes of the rooms in
    flight at each kind's faults and the failure reasons counted."""
    def span(v: list[float]) -> str:
        return "-" if not v else (f"{v[0]:.2f} s" if len(v) == 1 else f"{min(v):.2f}-{max(v):.2f} s "
                                  f"(median {statistics.median(v):.2f})")
    def res(d: dict[str, int]) -> str:
        return f"{d['threads']}/{d['fds']}/{d['rss'] >> 20}" if d else "-"
    rows = ["| backend | fault | faults | rooms | SUCCESS / FAILED | wrong SUCCESS | late writes | fault -> FAILED "
            "on decode | ready -> first SUCCESS | fault -> first SUCCESS | refused for layout (bytes landed) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        for kind, k in r.kinds.items():
            rows.append(f"| {r.backend} | {kind} | {k.faults} | {k.rooms} | {k.succeeded} / {k.failed} | "
                        f"{k.wrong_successes} | {k.late_writes} | {span(k.to_failed_s)} | {span(k.to_success_s)} | "
                        f"{span(k.down_s)} | {k.refused_layout} ({k.landed_in_refused}) |")
        rows.append(f"| {r.backend} | all | | {r.rooms} in {r.seconds:.0f} s: {r.rooms_per_s:.0f}/s "
                    f"({r.fault_free_rooms_per_s:.0f}/s before the first fault), {r.unfinished} unfinished; CPU per "
                    f"room: decode {r.cpu_us_per_room.get('decode', '-')} us, prefill {r.cpu_us_per_room.get('prefill', '-')} us "
                    "| | | | "
                    f"threads/fds/RSS MB at start, room {CHECKPOINT:,}, end: {res(r.resources_start)}, "
                    f"{res(r.resources_checkpoint)}, {res(r.resources_end)} | | | |"
                    + (f" error: {r.error}" if r.error else "") + (f" skipped: {r.skipped}" if r.skipped else ""))
    for r in reports if details else ():
        for kind, k in r.kinds.items():
            rows += [f"late write ({r.backend}, {kind}): {late}" for late in k.late_rooms]
            if k.inflight:
                rows.append(f"in flight at the fault ({r.backend}, {kind}): {k.inflight}")
            rows += [f"FAILED ({r.backend}, {kind}) x{n}: {reason}"
                     for reason, n in sorted(k.reasons.items(), key=lambda x: -x[1])]
    return "\n".join(rows)
