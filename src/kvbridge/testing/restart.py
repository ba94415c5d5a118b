"""A replaced prefill: how soon a surviving decode is served by the new process.

The survivor (this process) holds the bootstrap server and a decode rank and
moves one room at a time from a prefill *process*; after a few rooms that
process is killed (SIGKILL) and, ``gap`` seconds later, a new one is started
with the same settings (it binds a new control port and registers the same
rank). The decode rank keeps creating rooms throughout, as a host would. It
reports:

- ``failed_s``: from the kill to FAILED of the room in flight (with its reason);
- ``ready_s``: from starting the new process to its manager being registered;
- ``first_success_s``: from that registration to the first SUCCESS of a room
  served by the new process (issue 28's target: within 2 s);
- ``rooms``/``wrong``: rooms that succeeded, and those whose bytes differ
  from the source pattern (computed with plain numpy indexing, never the planner).

``python -m kvbridge.testing.restart [--backend NAME ...]`` prints the table;
``tests/test_restart.py`` asserts a generous bound on every backend.
Run as ``python -m kvbridge.testing.restart prefill --backend NAME --bootstrap ADDR``
for the prefill process (it prints ``READY <unix time> <control host:port>`` once registered;
``--control-port`` binds a given port, ``--page-nbytes`` a layout other than decode's,
``--abort-fraction`` has its host abort that fraction of the rooms).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np

from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender
from kvbridge.testing.e2e import Pools, Scenario, pattern, prefill_pools

BACKENDS = ("memory", "nixl", "mooncake", "ucx")
PAGES = 64  # pages per room
#: Short heartbeats (a killed process is seen gone by its closed connection anyway); a bootstrap_timeout
#: as long as the default, so a room that waited it out would show.
RESTART = Scenario(backend="?", layers=2, page_nbytes=64, prefill_pages=1024, decode_pages=1024, concurrency=1,
                   bootstrap_timeout=30.0, transfer_timeout=5.0, heartbeat_interval=0.2, heartbeat_timeout=1.0)


def host_aborts(room: int, fraction: float) -> bool:
    """Whether prefill's host aborts ``room`` instead of sending it, for ``fraction`` of the rooms (a fixed
    rule on the room number, so the soak's decode knows which rooms without being told)."""
    return (room * 2654435761) % 2**32 < fraction * 2**32  # Knuth's multiplicative hash: spread evenly


def source_pages(room: int) -> np.ndarray:
    """The prefill pages room ``room`` sends (both sides compute them; nothing is exchanged)."""
    return (np.arange(PAGES) * 3 + room * 5) % RESTART.prefill_pages


class Result(msgspec.Struct, kw_only=True):
    backend: str
    rooms: int = 0
    wrong: int = 0
    failed_s: float | None = None
    failed_reason: str | None = None
    ready_s: float | None = None
    first_success_s: float | None = None
    timed_out_rooms: int = 0  # rooms that ended by bootstrap_timeout (issue 28's failure 1)
    error: str | None = None


def run_prefill(backend: str, bootstrap: str, hold_from: int | None = None, control_port: int = 0,
                page_nbytes: int | None = None, host: str = "127.0.0.1", abort_fraction: float = 0.0) -> int:
    """The prefill process: serve every room decode asks for, until killed.

    Rooms numbered ``hold_from`` or more get a sender that never sends (a room kept in flight); rooms
    :func:`host_aborts` picks for ``abort_fraction`` are aborted by the host when they could be sent.
    ``control_port``: bind the control endpoint there (0: an ephemeral port); ``page_nbytes``: a
    layout other than decode's (a replacement that decode must refuse at the handshake)."""
    sc = msgspec.structs.replace(RESTART, backend=backend, page_nbytes=page_nbytes or RESTART.page_nbytes)
    pools = prefill_pools(sc)
    config = replace(sc.session_config(), control_port=control_port, host=host)
    mgr = PrefillManager(pools.kvargs, backend, bootstrap=bootstrap, config=config)
    print(f"READY {time.time():.6f} {mgr.control_address}", flush=True)
    senders: dict[int, Sender] = {}
    while True:
        for room in mgr.pending_rooms():
            if room not in senders:
                senders[room] = Sender(mgr, room, metadata_row=0)
        for room, sender in list(senders.items()):
            state = sender.poll()
            if state == Poll.WAITING_FOR_INPUT and host_aborts(room, abort_fraction):
                sender.abort("prefill's host aborted the room (the soak's room fault)")
            elif state == Poll.WAITING_FOR_INPUT and (hold_from is None or room < hold_from):
                sender.send(source_pages(room), last=True)
            elif sender.final:
                del senders[room]
        time.sleep(0.001)


class PrefillProcess:
    """A prefill process of this module; its output goes to files."""

    def __init__(self, backend: str, bootstrap: str, stem: Path, hold_from: int | None = None, control_port: int = 0,
                 page_nbytes: int | None = None, host: str = "127.0.0.1", prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, abort_fraction: float = 0.0) -> None:
        """``prefix`` runs it under another command (``ip netns exec NAME``); ``env`` adds to its environment."""
        self.out, self.err = stem.with_suffix(".out"), stem.with_suffix(".err")
        self.started = time.time()
        extra = [] if hold_from is None else ["--hold-from", str(hold_from)]
        extra += ["--host", host, "--control-port", str(control_port)] + ([] if page_nbytes is None else ["--page-nbytes", str(page_nbytes)])
        extra += ["--abort-fraction", str(abort_fraction)] if abort_fraction else []
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "kvbridge.testing.restart", "prefill", "--backend", backend,
                 "--bootstrap", bootstrap, *extra], stdout=out, stderr=err,
                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})

    def ready(self, timeout: float = 60.0) -> float:
        """The unix time its manager was registered (waiting for the line)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out.read_text(errors="replace").splitlines():
                if line.startswith("READY "):
                    return float(line.split()[1])
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefill exited with {self.proc.returncode}: {self.err.read_text()[-2000:]}")
            time.sleep(0.01)
        raise TimeoutError(f"prefill printed no READY line within {timeout}s: {self.err.read_text()[-2000:]}")

    def control_address(self, timeout: float = 60.0) -> str:
        """Its control endpoint's ``host:port`` (from its READY line)."""
        self.ready(timeout)
        return next(line.split()[2] for line in self.out.read_text(errors="replace").splitlines()
                    if line.startswith("READY "))

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def measure(backend: str, workdir: Path, before: int = 5, gap: float = 1.0, deadline: float = 90.0) -> Result:
    """Kill and replace the prefill process once; time the surviving decode (see the module's docstring)."""
    res = Result(backend=backend)
    sc = msgspec.structs.replace(RESTART, backend=backend)
    words = sc.page_nbytes // 4
    pools = Pools(sc, sc.decode_pages, meta_rows=1)
    server = BootstrapServer("127.0.0.1")
    mgr = DecodeManager(pools.kvargs, backend, config=sc.session_config())
    procs: list[PrefillProcess] = []
    end = time.monotonic() + deadline
    try:
        # The room in flight at the kill is held there (never sent): else a prefill quick enough could land it
        # between decode's WAITING_FOR_INPUT and the kill (seen once: 7 rooms ok, none failed).
        procs.append(PrefillProcess(backend, server.address, workdir / "prefill-0", hold_from=before + 1))
        procs[0].ready()
        room, killed_at, replaced = 0, None, False
        while time.monotonic() < end:
            room += 1
            pools.reset()
            recv = Receiver(mgr, room, bootstrap=server.address)
            recv.init(np.arange(PAGES), metadata_row=0)
            if room == before + 1:  # this room is in flight when the process dies
                recv.wait(Poll.WAITING_FOR_INPUT, 10.0)
                procs[0].kill()
                killed_at = time.time()
            recv.wait(Poll.SUCCESS, max(0.0, end - time.monotonic()))
            state = recv.poll()
            if state == Poll.SUCCESS:
                src = source_pages(room)
                res.rooms += 1
                res.wrong += int(any(not np.array_equal(a[:PAGES], pattern(e, src, words))
                                     for e, a in enumerate(pools.kv)))
                if replaced and res.first_success_s is None:
                    ready = procs[1].ready()
                    res.ready_s = ready - procs[1].started
                    # Room.ended is monotonic; READY is wall-clock: convert through now.
                    res.first_success_s = (time.time() - (time.monotonic() - (recv.ended or 0.0))) - ready
                    break
            elif state == Poll.FAILED:
                if "bootstrap_timeout" in (recv.failure() or ""):
                    res.timed_out_rooms += 1
                if killed_at is not None and res.failed_s is None:
                    res.failed_s = time.time() - (time.monotonic() - (recv.ended or 0.0)) - killed_at
                    res.failed_reason = recv.failure()
            if killed_at is not None and not replaced:
                time.sleep(max(0.0, killed_at + gap - time.time()))
                procs.append(PrefillProcess(backend, server.address, workdir / "prefill-1"))
                replaced = True
        else:
            res.error = f"no SUCCESS from the new prefill within {deadline}s"
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        for p in procs:
            p.kill()
        mgr.close()
        server.close()
    return res


def table(results: list[Result]) -> str:
    rows = ["| backend | kill -> FAILED on decode | new process ready | ready -> first SUCCESS | rooms ok / wrong | rooms timed out |",
            "|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
    for r in results:
        rows.append(f"| {r.backend} | {fmt(r.failed_s)} | {fmt(r.ready_s)} | {fmt(r.first_success_s)} | "
                    f"{r.rooms} / {r.wrong} | {r.timed_out_rooms} |" + (f" error: {r.error}" if r.error else ""))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.restart", description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", choices=["measure", "prefill"], default="measure")
    parser.add_argument("--backend", action="append", help="repeatable (default: every installed one of "
                        f"{', '.join(BACKENDS)})")
    parser.add_argument("--bootstrap", help="prefill role: the bootstrap address")
    parser.add_argument("--hold-from", type=int, help="prefill role: rooms from this number on are never sent")
    parser.add_argument("--control-port", type=int, default=0, help="prefill role: bind the control endpoint "
                        "on this port (0: ephemeral)")
    parser.add_argument("--host", default="127.0.0.1", help="prefill role: the control endpoint's address")
    parser.add_argument("--page-nbytes", type=int, help="prefill role: a page size other than decode's")
    parser.add_argument("--abort-fraction", type=float, default=0.0, help="prefill role: the host aborts this "
                        "fraction of the rooms instead of sending them")
    parser.add_argument("--repeat", type=int, default=1, help="episodes per backend")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    if args.role == "prefill":
        return run_prefill(args.backend[0], args.bootstrap, args.hold_from, args.control_port, args.page_nbytes, args.host,
                           args.abort_fraction)
    from kvbridge.core.description.plugins import get_registry

    backends = args.backend or [b for b in BACKENDS if get_registry().backend_available(b)]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-restart-") as tmp:
        for b in backends:
            for i in range(args.repeat):
                work = Path(tmp) / f"{b}-{i}"
                work.mkdir()
                results.append(measure(b, work))
    print(json.dumps([msgspec.to_builtins(r) for r in results]) if args.json else table(results))
    return 0 if all(r.error is None and r.wrong == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
