"""A bounded chaos soak: rooms flow while a prefill process is killed, frozen, its bootstrap restarted, flooded.

The soak (this process) holds the bootstrap server and a decode rank, and
keeps ``concurrency`` rooms in flight to a prefill *process*
(:mod:`kvbridge.testing.restart`'s, which serves every room decode asks for),
each room on its own destination pages. Every ``every`` seconds it injects
the next fault, in turn, once the previous one is over (its prefill served a
room again, or :data:`RECOVERY` seconds passed):

- ``prefill-freeze``: SIGSTOP it for ``freeze`` seconds, then SIGCONT;
- ``bootstrap-restart``: close the bootstrap server and start a new one on
  its address (the prefill re-registers; no room needs it meanwhile);
- ``hostile``: 200 hostile frames (random bytes, bare and sealed garbage,
  another decode's claimed id) at the prefill's control endpoint and the
  bootstrap endpoint;
- ``prefill-kill``: SIGKILL the prefill process and start a new one at once
  (a new port; the bootstrap server survives);
- ``prefill-restart-same-address``: SIGKILL it and start a new one bound to
  the same control address (``SessionConfig.control_port``): decode must see a
  new peer (its incarnation), fail the old rooms and be served by the new one;
- ``prefill-restart-changed-layout``: the same, but the replacement has another
  page size: decode must refuse it at the handshake, naming the mismatch, and
  not a byte may land (the rooms' pages stay zero); after :data:`HOLD` seconds
  it is replaced in turn by a prefill with decode's layout, on the same address.

Besides, ``room_faults`` of the rooms (1% by default) get a fault of their own, a third each:

- ``room-abort-decode``: decode's host aborts the room right after ``init``
  (its ``Abort`` mostly reaches prefill before prefill's host created the
  ``Sender``, which must fail as it is created);
- ``room-abort-decode-late``: decode's host aborts it 0-10 ms later, wherever
  it is then (it may have ended already);
- ``room-abort-prefill``: prefill's host aborts its ``Sender`` instead of
  sending (:func:`kvbridge.testing.restart.host_aborts` picks the rooms).

Those rooms are counted in their own kind's row, not in the process fault's.

After ``seconds`` no fault starts, and the soak goes on until the last one
is over (at most :data:`RECOVERY` seconds more), then lets every room end.

It reports, per fault kind: the faults injected, the rooms that ended while
that kind was the latest fault and their outcomes, *wrong successes* (a
SUCCESS whose pages differ from the source pattern, computed with plain numpy
indexing), *late writes* (pages of a FAILED room that changed after it was
fenced, watched for ``settle`` seconds before the pages are used again), the
time from the fault to FAILED of the rooms in flight (on decode, the other
side), the time from a restarted/resumed prefill's readiness, and from the
fault itself, to the first SUCCESS after it, the failure reasons seen (first
words, counted); and for the run: rooms per second (overall, and before the
first fault, which waits for a first SUCCESS), the soak process's threads,
file descriptors and RSS at start, when the 10,000th room ended and at end,
and the CPU time per room of the soak process and of its prefill processes.

``net-cut`` (not in the default order: it needs root and ``ip``) runs the
whole soak in network namespaces (:mod:`kvbridge.testing.soaknet`: this
process re-run inside decode's namespace, its prefill processes in another,
a veth pair between them) and takes the link down for ``cut`` seconds, then
up; the other kinds, asked for with it, run there too. Where namespaces
cannot be created the report's ``skipped`` says why.

``python -m kvbridge.testing.soak --backend nixl --seconds 60`` prints the
table; ``tests/test_soak.py`` runs it briefly on two backends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zmq

from kvbridge.core.control import protocol as P
from kvbridge.core.control.auth import Sealer
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.sessions.session import DecodeManager, Poll, Receiver
from kvbridge.testing.e2e import Pools, pattern
from kvbridge.testing.restart import PAGES, RESTART, PrefillProcess, host_aborts, source_pages
from kvbridge.testing.soakreport import CHECKPOINT, KindStats, Report, process_cpu, resources, table

__all__ = ["KINDS", "NET_KINDS", "ROOM_KINDS", "Report", "soak", "table"]

if TYPE_CHECKING:
    from kvbridge.testing.soaknet import Net

#: In this order (the kill last: a new process takes longest to come back on a loaded box).
KINDS = ("prefill-freeze", "bootstrap-restart", "hostile", "prefill-restart-changed-layout",
         "prefill-restart-same-address", "prefill-kill")
#: Faults that need the soak in network namespaces (kvbridge.testing.soaknet): never in the default order.
NET_KINDS = ("net-cut",)
#: Faults of single rooms, given to ``room_faults`` of the rooms (see the module's docstring).
ROOM_KINDS = ("room-abort-decode", "room-abort-decode-late", "room-abort-prefill")
#: The faults that kill the prefill process and start another.
RESTARTS = ("prefill-kill", "prefill-restart-same-address", "prefill-restart-changed-layout")
#: Seconds the replacement with another layout serves (and is refused) before the right one replaces it.
HOLD = 1.5
#: Seconds the soak goes on after its time, for the last fault's prefill to serve again.
RECOVERY = 30.0
#: Short timeouts so a fault ends every room it touches within seconds (heartbeat_timeout 2 s: on a loaded
#: 2-core box a live prefill process can be starved of the CPU for a second).
SOAK = msgspec.structs.replace(RESTART, bootstrap_timeout=5.0, transfer_timeout=2.0, heartbeat_interval=0.2,
                               heartbeat_timeout=2.0)


class _Slot:
    """Destination pages for one room at a time; quarantined after a FAILED room until no late write can come."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.pages = np.arange(index * PAGES, (index + 1) * PAGES)
        self.span = slice(index * PAGES, (index + 1) * PAGES)  # the same pages: a view of a region, not a copy
        self.recv: Receiver | None = None
        self.snapshot: list[np.ndarray] | None = None  # its pages when the FAILED room was fenced
        self.free_at = 0.0  # when the pages are compared with the snapshot and used again
        self.accounted = False
        self.failed_at = 0.0
        self.fault: str | None = None  # its room's own fault (ROOM_KINDS)
        self.abort_at = 0.0  # room-abort-decode-late: when decode's host aborts it
        self.fault_at = 0.0  # when its room's fault came (decode's abort; prefill's: when the room opened)


class Soak:
    def __init__(self, backend: str, workdir: Path, concurrency: int, every: float, freeze: float,
                 settle: float, seed: int, kinds: tuple[str, ...] = KINDS, net: Net | None = None,
                 cut: float = 3.0, room_faults: float = 0.0) -> None:
        self.order = kinds
        self.net, self.cut_s = net, cut
        host = net.decode_ip if net is not None else "127.0.0.1"
        self.backend = backend
        self.workdir = workdir
        self.sc = msgspec.structs.replace(SOAK, backend=backend, decode_pages=concurrency * PAGES)
        self.pools = Pools(self.sc, self.sc.decode_pages, meta_rows=concurrency)
        self.slots = [_Slot(i) for i in range(concurrency)]
        self.every, self.freeze_s, self.settle = every, freeze, settle
        self.rng = random.Random(seed)
        self.words = self.sc.page_nbytes // 4
        self.room_faults = room_faults
        self.kinds = {k: KindStats() for k in ("none", *KINDS, *(k for k in kinds if k not in KINDS),
                                               *(ROOM_KINDS if room_faults else ()))}
        self.current = "none"
        self.next_room = 1
        self.procs: list[PrefillProcess] = []
        self.server = BootstrapServer(host)
        self.mgr = DecodeManager(self.pools.kvargs, backend, config=replace(self.sc.session_config(), host=host))
        #: (kind, fault time, rooms in flight at it, when the prefill is ready again or None, first SUCCESS seen)
        self.pending: list[dict[str, object]] = []
        self.thread_errors: list[str] = []
        self.ended = 0
        self.checkpoint: dict[str, int] = {}
        self.t0 = time.monotonic()  # the run's start (run() sets it)

    # -- the prefill process --------------------------------------------------------------------------
    def start_prefill(self, control_port: int = 0, page_nbytes: int | None = None) -> PrefillProcess:
        proc = PrefillProcess(self.backend, self.server.address, self.workdir / f"prefill-{len(self.procs)}",
                              control_port=control_port, page_nbytes=page_nbytes,
                              host=self.net.prefill_ip if self.net else "127.0.0.1",
                              prefix=self.net.prefix() if self.net else (), env=self.net.env() if self.net else None,
                              abort_fraction=self.room_faults / 3)
        self.procs.append(proc)
        return proc

    # -- rooms ----------------------------------------------------------------------------------------
    def _right(self, room: int, slot: _Slot) -> bool:
        """Whether ``slot``'s pages hold exactly what ``room``'s source pages hold, in every region."""
        src = source_pages(room)
        return all(np.array_equal(a[slot.span], pattern(e, src, self.words)) for e, a in enumerate(self.pools.kv))

    def _open(self, slot: _Slot) -> None:
        room = self.next_room
        self.next_room += 1
        for a in self.pools.kv:
            a[slot.span] = 0
        slot.fault, slot.fault_at = None, time.monotonic()
        draw = self.rng.random() * 3 / self.room_faults if self.room_faults else 3.0
        if host_aborts(room, self.room_faults / 3):
            slot.fault = "room-abort-prefill"
        elif draw < 2:
            slot.fault = ROOM_KINDS[int(draw)]
            slot.abort_at = time.monotonic() + self.rng.uniform(0.0, 0.01)
        if slot.fault is not None:
            self.kinds[slot.fault].faults += 1
        slot.recv = Receiver(self.mgr, room, bootstrap=self.server.address)
        slot.recv.init(slot.pages, metadata_row=slot.index)
        if slot.fault == "room-abort-decode":
            slot.recv.abort("decode's host aborted the room (the soak's room fault)")

    def _account(self, slot: _Slot) -> None:
        """Count a room that just became final (once)."""
        recv = slot.recv
        assert recv is not None and recv.final
        slot.accounted = True
        self.ended += 1
        if self.ended == CHECKPOINT:
            self.checkpoint = resources()
        stats = self.kinds[slot.fault or self.current]
        stats.rooms += 1
        for ev in self.pending:
            if recv.room in ev["inflight"]:  # type: ignore[operator]
                seen = self.kinds[str(ev["kind"])].inflight
                seen[recv.poll().name] = seen.get(recv.poll().name, 0) + 1
        if recv.poll() == Poll.SUCCESS:
            stats.succeeded += 1
            if not self._right(recv.room, slot):
                stats.wrong_successes += 1
            for ev in self.pending:
                ready = ev["ready"]
                if ev["success"] is None and ready is not None and recv.ended is not None \
                        and recv.ended >= ready and recv.created >= ev["at"]:  # type: ignore[operator]
                    ev["success"] = recv.ended - ready  # type: ignore[operator]
                    ev["down"] = recv.ended - ev["at"]  # type: ignore[operator]
            return
        stats.failed += 1
        if slot.fault is not None and recv.ended is not None:
            stats.to_failed_s.append(round(recv.ended - slot.fault_at, 3))
        reason = recv.failure() or ""
        key = re.sub(r"\S+:\d+\b", "<addr>", " ".join(reason.split()[:12]))[:120]  # one line per cause, any port
        stats.reasons[key] = stats.reasons.get(key, 0) + 1
        if "layout" in reason.lower() or "mismatch" in reason.lower():
            stats.refused_layout += 1
            stats.landed_in_refused += int(any(a[slot.span].any() for a in self.pools.kv))
        for ev in self.pending:
            if recv.room in ev["inflight"] and recv.ended is not None:  # type: ignore[operator]
                ev["failed"] = max(ev["failed"] or 0.0, recv.ended - ev["at"])  # type: ignore[operator,arg-type]

    def _release(self, slot: _Slot) -> None:
        slot.recv, slot.snapshot, slot.free_at, slot.accounted = None, None, 0.0, False

    def step(self, now: float) -> None:
        """Count rooms that ended, watch FAILED rooms' pages for late writes, keep every slot busy."""
        for slot in self.slots:
            recv = slot.recv
            if recv is not None and slot.fault == "room-abort-decode-late" and now >= slot.abort_at and not recv.final:
                recv.abort("decode's host aborted the room late (the soak's room fault)")
                slot.fault_at = now
            if recv is not None and recv.final:
                if not slot.accounted:
                    self._account(slot)
                    slot.failed_at = now
                if recv.poll() == Poll.SUCCESS:
                    self._release(slot)
                elif slot.snapshot is None:
                    if recv.fenced:  # nothing lands from now on: what changes after this is a late write
                        slot.snapshot = [a[slot.span].copy() for a in self.pools.kv]
                        slot.free_at = now + self.settle
                    elif now - slot.failed_at > 30.0:
                        self.unfenced += 1
                        self._release(slot)
                elif now >= slot.free_at:
                    changed = sum(int((a[slot.span] != s).any(axis=1).sum()) for a, s in zip(self.pools.kv, slot.snapshot))
                    if changed:
                        self.kinds[slot.fault or self.current].late_writes += 1
                        self.kinds[slot.fault or self.current].late_rooms.append(f"room {recv.room}: {changed} pages; {recv.failure()}")
                    self._release(slot)
            if slot.recv is None:
                self._open(slot)

    # -- faults ---------------------------------------------------------------------------------------
    def inject(self, kind: str, now: float) -> None:
        self.current = kind
        self.kinds[kind].faults += 1
        inflight = {s.recv.room for s in self.slots if s.recv is not None and not s.recv.final}
        ev: dict[str, object] = {"kind": kind, "at": now, "inflight": inflight, "ready": None, "success": None,
                                 "failed": None}
        self.pending.append(ev)
        proc = self.procs[-1]
        if kind == "prefill-kill":
            proc.kill()
            fresh = self.start_prefill()
            threading.Thread(target=self._when_ready, args=(fresh, ev), daemon=True).start()
        elif kind in ("prefill-restart-same-address", "prefill-restart-changed-layout"):
            port = int(proc.control_address().rpartition(":")[2])
            proc.kill()
            threading.Thread(target=self._same_address, args=(port, kind.endswith("layout"), ev), daemon=True).start()
        elif kind == "net-cut":
            assert self.net is not None, "net-cut needs the soak in namespaces (kvbridge.testing.soaknet)"
            net = self.net
            net.set(up=False)

            def heal() -> None:
                time.sleep(self.cut_s)
                net.set(up=True)
                ev["ready"] = time.monotonic()

            threading.Thread(target=heal, daemon=True).start()
        elif kind == "prefill-freeze":
            proc.freeze()

            def thaw() -> None:
                time.sleep(self.freeze_s)
                proc.thaw()
                ev["ready"] = time.monotonic()

            threading.Thread(target=thaw, daemon=True).start()
        elif kind == "bootstrap-restart":
            host, _, port = self.server.address.rpartition(":")
            self.server.close()
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    self.server = BootstrapServer(host, int(port))
                    break
                except zmq.ZMQError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            ev["ready"] = time.monotonic()
        else:
            self._hostile()
            ev["ready"] = time.monotonic()

    def _recovered(self, now: float) -> bool:
        """Whether the last fault is over: its prefill served a room again (or RECOVERY s passed), so the
        next fault hits a serving prefill, not one still starting (a loaded box starts one slowly). Before
        the first fault: a room succeeded (a freeze during the first handshake fails nothing: decode waits
        for a handshake up to bootstrap_timeout, longer than the freeze)."""
        if not self.pending:
            return self.kinds["none"].succeeded > 0 or now - self.t0 > RECOVERY
        last = self.pending[-1]
        return last["success"] is not None or now - float(last["at"]) > RECOVERY  # type: ignore[arg-type]

    def _same_address(self, port: int, other_layout: bool, ev: dict[str, object]) -> None:
        """Start the replacement on ``port``; with ``other_layout``, one of another page size first, for HOLD s."""
        try:
            if other_layout:
                wrong = self.start_prefill(port, page_nbytes=2 * self.sc.page_nbytes)
                wrong.ready()
                time.sleep(HOLD)
                wrong.kill()
            self._when_ready(self.start_prefill(port), ev)
        except Exception as exc:  # the run reports it (a thread's exception would otherwise be lost)
            self.thread_errors.append(f"{type(exc).__name__}: {exc}")

    def _when_ready(self, proc: PrefillProcess, ev: dict[str, object]) -> None:
        ready = proc.ready()
        ev["ready"] = time.monotonic() - (time.time() - ready)

    def _hostile(self) -> None:
        ctx = zmq.Context.instance()
        prefill = self.server.ranks[0].control_addr if self.server.ranks else None
        for address in filter(None, (prefill, self.server.address)):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.mgr.peer_id.encode())  # another decode's plaintext id
            sock.connect(f"tcp://{address}")
            for i in range(100):
                choice = i % 4
                if choice == 0:
                    frame = os.urandom(self.rng.randrange(1, 300))
                elif choice == 1:
                    frame = self.mgr.auth.seal(os.urandom(64), address.encode(), Sealer())
                elif choice == 2:
                    frame = P.encode(P.Abort(room=self.rng.randrange(self.next_room + 1), reason="hostile"))
                else:
                    frame = P.encode(P.Hello(peer_id=self.mgr.peer_id, lanes={}, kvargs=self.pools.kvargs))
                sock.send(frame)
            sock.close(0)

    # -- the run --------------------------------------------------------------------------------------
    def run(self, seconds: float, rounds: int | None = None) -> Report:
        """Inject faults for ``seconds``; with ``rounds``, exactly ``rounds`` of each kind instead (the run
        lasts at least ``seconds``, and at most RECOVERY + ``every`` more per fault)."""
        report = Report(backend=self.backend, seconds=seconds)
        self.unfenced = 0
        cpu0: tuple[os.times_result, float] | None = None
        try:
            first = self.start_prefill()
            first.ready()
            report.resources_start = resources()
            t0 = self.t0 = time.monotonic()
            cpu0 = os.times(), process_cpu(first.proc.pid)  # the first prefill's start-up is not a room's
            next_fault = t0 + self.every
            turn = 0
            planned = None if rounds is None else rounds * len(self.order)
            limit = t0 + seconds + RECOVERY + (0.0 if planned is None else planned * (RECOVERY + self.every))

            def injecting(now: float) -> bool:
                return now < t0 + seconds if planned is None else turn < planned and now < limit

            while (now := time.monotonic()) < limit and (now < t0 + seconds or injecting(now)
                                                          or not self._recovered(now)):
                self.step(now)
                if now >= next_fault and injecting(now) and self._recovered(now):
                    self.inject(self.order[turn % len(self.order)], now)
                    turn += 1
                    next_fault = now + self.every
                # Only rooms in flight: a FAILED room kept for its late-write watch is final, and waiting on it
                # returned at once (the loop spun through every fault's settle time).
                self.mgr.wait_any([s.recv for s in self.slots if s.recv is not None and not s.recv.final], 0.01)
            # Drain: no new rooms; every room must end (bounded by the timeouts).
            end = time.monotonic() + 15.0
            while time.monotonic() < end and any(s.recv is not None and not s.recv.final for s in self.slots):
                time.sleep(0.01)
            for slot in self.slots:
                if slot.recv is not None and slot.recv.final and not slot.accounted:
                    self._account(slot)
            report.unfinished = sum(1 for s in self.slots if s.recv is not None and not s.recv.final) + self.unfenced
            for ev in self.pending:
                stats = self.kinds[str(ev["kind"])]
                if ev["failed"] is not None:
                    stats.to_failed_s.append(round(float(ev["failed"]), 3))  # type: ignore[arg-type]
                if ev["success"] is not None:
                    stats.to_success_s.append(round(float(ev["success"]), 3))  # type: ignore[arg-type]
                    stats.down_s.append(round(float(ev["down"]), 3))  # type: ignore[arg-type]
            report.kinds = self.kinds
            report.rooms = sum(k.rooms for k in self.kinds.values())
            report.seconds = round(time.monotonic() - t0, 1)
            report.rooms_per_s = report.rooms / report.seconds
            first = float(self.pending[0]["at"]) if self.pending else time.monotonic()  # type: ignore[arg-type]
            report.fault_free_rooms_per_s = round(self.kinds["none"].rooms / max(first - t0, 1e-3), 1)
            report.resources_checkpoint = self.checkpoint
            report.resources_end = resources()
            if self.thread_errors:
                report.error = "; ".join(self.thread_errors)
        except Exception as exc:
            report.error = f"{type(exc).__name__}: {exc}"
        finally:
            for p in self.procs:
                p.kill()  # and waited for: its CPU is counted in os.times()'s children
            if cpu0 is not None and report.rooms:
                (t, started), now = cpu0, os.times()
                report.cpu_us_per_room = {
                    "decode": round((now.user + now.system - t.user - t.system) / report.rooms * 1e6),
                    "prefill": round((now.children_user + now.children_system - t.children_user - t.children_system
                                      - started) / report.rooms * 1e6)}
            self.mgr.close()
            self.server.close()
        return report


def soak(backend: str, seconds: float, *, concurrency: int = 8, every: float = 3.0, freeze: float = 3.0,
         settle: float = 0.3, seed: int = 0, kinds: tuple[str, ...] = KINDS, rounds: int | None = None,
         net: Net | None = None, cut: float = 3.0, room_faults: float = 0.01) -> Report:
    """Run the soak on ``backend`` for ``seconds`` (plus a bounded drain); see the module docstring.

    ``kinds``: the faults to inject, in this order, in turn; ``rounds``: inject exactly this many of
    each (the run then lasts as long as they take, at least ``seconds``); ``room_faults``: the fraction
    of rooms given a fault of their own (:data:`ROOM_KINDS`). With a kind of
    :data:`NET_KINDS` the soak runs in network namespaces (:mod:`kvbridge.testing.soaknet`; ``net``
    is set there, in the soak's own namespace); where they cannot be created the report's
    ``skipped`` says why."""
    if net is None and any(k in NET_KINDS for k in kinds):
        from kvbridge.testing.soaknet import soak_in_namespaces

        return soak_in_namespaces(backend, seconds, concurrency=concurrency, every=every, freeze=freeze,
                                  settle=settle, seed=seed, kinds=kinds, rounds=rounds, cut=cut,
                                  room_faults=room_faults)
    with tempfile.TemporaryDirectory(prefix="kvbridge-soak-") as tmp:
        return Soak(backend, Path(tmp), concurrency, every, freeze, settle, seed, kinds, net, cut,
                    room_faults).run(seconds, rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", action="append", help="repeatable (default: memory)")
    parser.add_argument("--seconds", type=float, default=30.0, help="soak time per backend (plus a drain)")
    parser.add_argument("--concurrency", type=int, default=8, help="rooms in flight")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between faults")
    parser.add_argument("--fault", action="append", choices=KINDS + NET_KINDS,
                        help=f"repeatable (default: {', '.join(KINDS)}; net-cut runs the soak in network namespaces)")
    parser.add_argument("--cut", type=float, default=3.0, help="net-cut: seconds the link is down")
    parser.add_argument("--rounds", type=int, help="inject exactly this many faults of each kind (the run lasts "
                        "as long as they take, at least --seconds)")
    parser.add_argument("--room-faults", type=float, default=0.01, help="the fraction of rooms given a fault of "
                        f"their own ({', '.join(ROOM_KINDS)}, a third each; default 0.01)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    kinds = tuple(args.fault or KINDS)
    reports = [soak(b, args.seconds, concurrency=args.concurrency, every=args.every, kinds=kinds,
                    rounds=args.rounds, cut=args.cut, room_faults=args.room_faults)
               for b in args.backend or ["memory"]]
    print(json.dumps([msgspec.to_builtins(r) for r in reports]) if args.json else table(reports, details=True))
    bad = any(r.error or r.unfinished or any(k.wrong_successes or k.late_writes or k.landed_in_refused
                                             for k in r.kinds.values())
              for r in reports)
    if any(r.skipped for r in reports):  # did not run: not a pass
        print("skipped: " + "; ".join(f"{r.backend}: {r.skipped}" for r in reports if r.skipped), file=sys.stderr)
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
