"""A restarted decode: how soon the surviving prefill fails the old process's rooms, and serves the new one.

The survivor (the calling process) holds the bootstrap server and a prefill rank whose host serves
every room a decode asks for, except rooms numbered ``HELD_FROM`` to ``NEW_FROM - 1``, which it keeps
in flight. A decode *process* (this module's ``decode`` role) of instance ``--instance`` moves a few
rooms, then opens ``HELD`` rooms that stay in flight; it is killed (SIGKILL) and a new process of the
same instance and TP rank starts and moves rooms from ``NEW_FROM`` on, checking each byte for byte
against the source pattern (plain numpy indexing, never the planner). ``heartbeat_timeout`` is
``HEARTBEAT_TIMEOUT`` (30 s) on both sides, so rooms failed by the old process's lease would show.

``tests/test_peers.py`` drives it (:class:`DecodeProcess` and :func:`serve`); the ``decode`` role:
``python -m kvbridge.testing.decode_restart decode --backend NAME --bootstrap ADDR --instance NAME
--first ROOM --rooms N [--hold N]``. It prints one JSON line per room it moved, ``INFLIGHT`` once its
held rooms wait for input, ``DONE`` after its last room.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np

from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from kvbridge.testing.e2e import Pools, pattern
from kvbridge.testing.restart import PAGES, RESTART, source_pages

HEARTBEAT_TIMEOUT = 30.0  # a room failed by a lapsed lease would take this long
HELD_FROM, NEW_FROM = 100, 200  # rooms the prefill host keeps in flight; rooms of the replacing process


def session_config(backend: str, instance: str = "") -> SessionConfig:
    """Both sides' settings: the restart scenario with a 30 s lease and the decode's instance name."""
    sc = msgspec.structs.replace(RESTART, backend=backend)
    return dataclasses.replace(sc.session_config(), heartbeat_timeout=HEARTBEAT_TIMEOUT, instance_name=instance)


def run_decode(backend: str, bootstrap: str, instance: str, first: int, rooms: int, hold: int) -> int:
    """The decode process: move ``rooms`` rooms from ``first`` one by one, then open ``hold`` rooms from
    ``HELD_FROM`` and keep them in flight until killed."""
    sc = msgspec.structs.replace(RESTART, backend=backend)
    pools = Pools(sc, sc.decode_pages, meta_rows=1)
    mgr = DecodeManager(pools.kvargs, backend, config=session_config(backend, instance))
    words = sc.page_nbytes // 4
    for room in range(first, first + rooms):
        pools.reset()
        recv = Receiver(mgr, room, bootstrap=bootstrap)
        recv.init(np.arange(PAGES), metadata_row=0)
        state = recv.wait(Poll.SUCCESS, 60.0)
        exact = state == Poll.SUCCESS and all(np.array_equal(a[:PAGES], pattern(e, source_pages(room), words))
                                              for e, a in enumerate(pools.kv))
        print(json.dumps({"room": room, "state": state.name, "exact": exact, "reason": recv.failure()}), flush=True)
    held = [Receiver(mgr, room, bootstrap=bootstrap) for room in range(HELD_FROM, HELD_FROM + hold)]
    for recv in held:
        recv.init(np.arange(PAGES), metadata_row=0)
    for recv in held:
        recv.wait(Poll.WAITING_FOR_INPUT, 60.0)
    print("INFLIGHT" if held and all(r.poll() == Poll.WAITING_FOR_INPUT for r in held) else "DONE", flush=True)
    while held:  # until killed
        time.sleep(1.0)
    mgr.close()
    return 0


class DecodeProcess:
    """A decode process of this module; its output goes to files."""

    def __init__(self, backend: str, bootstrap: str, stem: Path, instance: str, first: int, rooms: int,
                 hold: int = 0) -> None:
        self.out, self.err = stem.with_suffix(".out"), stem.with_suffix(".err")
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvbridge.testing.decode_restart", "decode", "--backend", backend,
                 "--bootstrap", bootstrap, "--instance", instance, "--first", str(first), "--rooms", str(rooms),
                 "--hold", str(hold)], stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_for(self, word: str, timeout: float = 90.0) -> list[dict[str, object]]:
        """Wait for the line ``word``; the rooms it reported before it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.out.read_text(errors="replace").splitlines()
            if word in lines:
                return [json.loads(line) for line in lines if line.startswith("{")]
            if self.proc.poll() is not None:
                raise RuntimeError(f"decode exited with {self.proc.returncode}: {self.err.read_text()[-2000:]}")
            time.sleep(0.01)
        raise TimeoutError(f"decode printed no {word} line within {timeout}s: {self.err.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def serve(mgr: PrefillManager, stop: threading.Event, senders: dict[int, Sender]) -> None:
    """Prefill's host: a sender for every room asked for; send all but the held rooms (until ``stop``)."""
    while not stop.is_set():
        for room in mgr.pending_rooms():
            if room not in senders:
                senders[room] = Sender(mgr, room, metadata_row=0)
        for room, sender in list(senders.items()):
            if sender.poll() == Poll.WAITING_FOR_INPUT and not HELD_FROM <= room < NEW_FROM and not sender.final:
                sender.send(source_pages(room), last=True)
        time.sleep(0.001)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.decode_restart",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=["decode"])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--instance", default="", help="SessionConfig.instance_name ('': unnamed)")
    parser.add_argument("--first", type=int, default=1, help="the first room moved")
    parser.add_argument("--rooms", type=int, default=3, help="rooms moved one by one")
    parser.add_argument("--hold", type=int, default=0, help=f"rooms opened from {HELD_FROM} and kept in flight")
    args = parser.parse_args(argv)
    return run_decode(args.backend, args.bootstrap, args.instance, args.first, args.rooms, args.hold)


if __name__ == "__main__":
    sys.exit(main())
