"""Network-cut cells of the fault matrix: prefill and decode in two network namespaces joined by a veth pair.

Both sides are real processes (``ip netns exec``), prefill at ``10.77.0.1`` and
decode at ``10.77.0.2``; prefill runs the bootstrap server on its address, so
a cut link cuts the bootstrap path too. Control messages cross a non-loopback
link, so both need the shared secret (``KVBRIDGE_SECRET``, set here if unset and
passed through the environment), and each engine is kept on its veth
(``UCX_NET_DEVICES`` names it; Mooncake targets the peer's address). The
parent drives the processes through gate files in a shared directory and
takes the link down with ``ip link set <veth> down``:

- ``net-cut``: the link goes down and stays down until both sides reported the
  room; it comes back up after, and the decode then watches the FAILED room's
  pages for :data:`~kvbridge.testing.faults.SETTLE` seconds (bytes queued in a
  TCP connection would land now);
- ``net-flap``: the link is down for :data:`FLAP` seconds only; the room may
  succeed or fail, but both sides must agree and no byte lands after FAILED.

Phases: ``handshake`` (cut before decode asks the bootstrap server and
handshakes), ``mid-transfer`` (prefill has written all but the last page of a
room of 10,000+ pages), ``between`` (after one room succeeded, before the
next). Every cell then serves one more room over the restored link. Both sides
are survivors: the time to FAILED reported is the slower side's, measured from
the cut on the shared monotonic clock (namespaces do not change it).

Creating namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN: :func:`unavailable`
says why not where they cannot be created, and the cell is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender
from kvbridge.testing.e2e import SENTINEL, Pools, Scenario, prefill_pools, schedule

PREFILL_IP, DECODE_IP = "10.77.0.1", "10.77.0.2"
FLAP = 1.5  # seconds the link is down in a net-flap cell
GATE_WAIT = 120.0  # a driver waiting for the parent's next gate
IP_WAIT = 10.0  # one `ip` command
UP_WAIT = 10.0  # the veth pair's carrier, after both ends are set up


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_WAIT)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None if they can): tries ``ip netns add`` and removes it."""
    name = f"kvbprobe-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", name)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace ({exc}); needs root or CAP_SYS_ADMIN + CAP_NET_ADMIN"
    try:
        _ip("netns", "del", name)
    except (RuntimeError, subprocess.TimeoutExpired):
        pass
    return None


class Link:
    """Two namespaces and the veth pair between them; :meth:`close` removes them (also after a partial setup)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = {"prefill": f"kvb-p-{tag}", "decode": f"kvb-d-{tag}"}
        self.dev = {"prefill": f"kvbp{tag}", "decode": f"kvbd{tag}"}  # interface names: at most 15 characters
        self.made: list[str] = []
        try:
            for role, ns in self.ns.items():
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.ns["prefill"], "link", "add", self.dev["prefill"], "type", "veth", "peer", "name",
                self.dev["decode"], "netns", self.ns["decode"])
            for role, ip in (("prefill", PREFILL_IP), ("decode", DECODE_IP)):
                _ip("-n", self.ns[role], "addr", "add", f"{ip}/30", "dev", self.dev[role])
                _ip("-n", self.ns[role], "link", "set", self.dev[role], "up")
            self.wait_running()
        except BaseException:
            self.close()
            raise

    def wait_running(self, timeout: float = UP_WAIT) -> None:
        """Wait until both ends carry (operstate UP). The kernel reports a veth's carrier up to a second after
        ``link set up``; UCX started before that finds no active device there (CI saw NIXL fail to create its
        agent: NIXL_ERR_BACKEND)."""
        deadline = time.monotonic() + timeout
        while True:
            states = {role: subprocess.run(["ip", "-n", self.ns[role], "-o", "link", "show", "dev", self.dev[role]],
                                           capture_output=True, text=True, timeout=IP_WAIT).stdout
                      for role in self.ns}
            if all(" state UP " in out for out in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the veth pair did not come up within {timeout:.0f} s: {states}")
            time.sleep(0.02)

    def prefix(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[role]]

    def env(self, role: str) -> dict[str, str]:
        """UCX (nixl, ucx) on this side's veth only, and over TCP as between two hosts: UCX would otherwise
        put by CMA (``process_vm_writev``), which crosses namespaces of one host without the link. A crash
        inside UCX prints its backtrace (UCX_HANDLE_ERRORS)."""
        return {"UCX_NET_DEVICES": self.dev[role], "UCX_TLS": "tcp", "UCX_HANDLE_ERRORS": "bt"}

    def set(self, up: bool) -> float:
        """Take prefill's end of the link down (or up); returns the monotonic time it took effect."""
        _ip("-n", self.ns["prefill"], "link", "set", self.dev["prefill"], "up" if up else "down")
        return time.monotonic()

    def close(self) -> None:
        for ns in reversed(self.made):  # deleting a namespace deletes its end of the veth, and so the pair
            try:
                _ip("netns", "del", ns)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        self.made.clear()


# -- drivers (run inside a namespace) ------------------------------------------------------------
def _gate(gates: Path, name: str) -> bool:
    """Wait (bounded) for the parent's gate file; False if it never came."""
    deadline = time.monotonic() + GATE_WAIT
    while not (gates / name).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _line(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def run_prefill(sc: Scenario, sizes: list[int], gates: Path, split: set[int]) -> int:
    """Room i starts at gate ``go<i>``; a room in ``split`` gets all pages but the last, then the last at gate ``up<i>``."""
    from kvbridge.testing.faults import source_pages

    pools = prefill_pools(sc)
    server = BootstrapServer(PREFILL_IP)
    print(f"BOOTSTRAP {server.address}", flush=True)
    config = replace(sc.session_config(), host=PREFILL_IP)
    mgr = PrefillManager(pools.kvargs, sc.backend, bootstrap=server.address, config=config)
    try:
        for i, (req, n) in enumerate(zip(schedule(sc), sizes)):
            if not _gate(gates, f"go{i}"):
                return 2
            sender = Sender(mgr, req.room, metadata_row=0)  # as a host does when its router hands it the request
            deadline = time.monotonic() + sc.deadline
            sender.wait(Poll.WAITING_FOR_INPUT, sc.deadline)
            pages = source_pages(n)
            if sender.poll() == Poll.WAITING_FOR_INPUT:
                if i in split:
                    sender.send(pages[:-1])
                    _line(event="sent", room=req.room)
                    while not (gates / f"up{i}").exists() and sender.poll() not in (Poll.SUCCESS, Poll.FAILED) \
                            and time.monotonic() < deadline:
                        time.sleep(0.001)
                    if sender.poll() not in (Poll.SUCCESS, Poll.FAILED):
                        sender.send(pages[-1:], last=True)
                else:
                    sender.send(pages, last=True)
            sender.wait(Poll.SUCCESS, max(0.0, deadline - time.monotonic()))  # or FAILED
            _line(room=req.room, state=sender.poll().name, reason=sender.failure(), t=time.monotonic())
    finally:
        mgr.close()
        server.close()
    return 0


def run_decode(sc: Scenario, sizes: list[int], gates: Path, bootstrap: str) -> int:
    """Room i starts at gate ``go<i>``; a FAILED room's pages are compared SETTLE s after gate ``up<i>``."""
    from kvbridge.testing.faults import SETTLE

    pools = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
    mgr = DecodeManager(pools.kvargs, sc.backend, config=replace(sc.session_config(), host=DECODE_IP))
    print(f"READY {os.getpid()}", flush=True)
    try:
        for i, (req, n) in enumerate(zip(schedule(sc), sizes)):
            if not _gate(gates, f"go{i}"):
                return 2
            pools.reset()
            recv = Receiver(mgr, req.room, bootstrap=bootstrap)
            recv.init(np.arange(n), metadata_row=0)
            recv.wait(Poll.SUCCESS, sc.deadline)  # or FAILED
            t = time.monotonic()
            written = int(sum((a[:n] != SENTINEL).any(axis=1).sum() for a in pools.kv))  # (page, region) pairs landed
            _line(room=req.room, state=recv.poll().name, reason=recv.failure(), t=t, written=written, of=n * len(pools.kv))
            if recv.poll() == Poll.FAILED:
                at_failed = [a.copy() for a in (*pools.kv, pools.meta)]
                if not _gate(gates, f"up{i}"):
                    return 2
                time.sleep(SETTLE)
                late = int(sum((a != b).any(axis=1).sum() for a, b in zip((*pools.kv, pools.meta), at_failed)))
                _line(room=req.room, late_pages=late)
    finally:
        mgr.close()
    return 0


# -- the parent's side of one cell ---------------------------------------------------------------
def run_cell(cell: Any, sc: Scenario, workdir: Path) -> None:
    """Fill ``cell`` (a :class:`kvbridge.testing.faults.Cell` with fault net-cut or net-flap)."""
    from kvbridge.testing.faults import room_lines, sizes, wait_for
    from kvbridge.testing.harness import Child

    why = unavailable()
    if why is not None:
        cell.skipped = why
        return
    os.environ.setdefault("KVBRIDGE_SECRET", secrets.token_hex(32))  # non-loopback hosts need it; children inherit it
    phase, flap = cell.phase, cell.fault == "net-flap"
    cell.failure_expected = not flap
    big = phase == "mid-transfer"
    n = sizes(sc, big)[:3]
    fault_room = 1 if phase == "between" else 0
    gates = workdir / f"gates-{uuid.uuid4().hex[:6]}"
    gates.mkdir(parents=True)
    spec = msgspec.json.encode(sc).decode()
    common = ["--scenario", spec, "--sizes", ",".join(map(str, n)), "--gates", str(gates)]
    link = Link()
    started: list[Child] = []
    try:
        pre = Child("prefill", sc, workdir / f"{gates.name}-prefill", None, 1.0, module="kvbridge.testing.netcut",
                    extra=common[2:] + ["--split", "0" if big else ""], prefix=link.prefix("prefill"),
                    env=link.env("prefill"))
        started.append(pre)
        dec = Child("decode", sc, workdir / f"{gates.name}-decode", pre.bootstrap, 1.0, module="kvbridge.testing.netcut",
                    extra=common[2:], prefix=link.prefix("decode"), env=link.env("decode"))
        started.append(dec)
        dec.first_line("READY")

        def go(i: int) -> None:
            (gates / f"go{i}").touch()

        def results(child: Child, room: int, timeout: float = 60.0) -> dict[str, Any]:
            want = schedule(sc)[room].room

            def found() -> list[dict[str, Any]]:
                return [x for x in (json.loads(s) for s in child.stdout().splitlines() if s.startswith("{"))
                        if x.get("room") == want and "state" in x]
            wait_for(lambda: bool(found()) or child.proc.poll() is not None, timeout, f"{child.role}'s room {room}")
            if not found():
                room_lines(child, 10**6, 0.0)  # raises with the exit code and stderr
            return found()[0]

        if phase == "between":
            go(0)
            first = [results(c, 0) for c in (pre, dec)]
            if any(r["state"] != "SUCCESS" for r in first):
                raise RuntimeError(f"room 0 before the cut: {first}")
        if big:
            go(0)
            wait_for(lambda: '"event": "sent"' in pre.stdout() or pre.proc.poll() is not None, 60.0, "prefill's chunk")
            time.sleep(0.02)  # the write is under way
        t0 = link.set(up=False)
        if not big:
            go(fault_room)
        if flap:
            time.sleep(FLAP)
            link.set(up=True)
            (gates / f"up{fault_room}").touch()
        got = {c.role: results(c, fault_room) for c in (pre, dec)}
        if not flap:
            link.set(up=True)
            (gates / f"up{fault_room}").touch()
        times = {role: r["t"] - t0 for role, r in got.items() if r["state"] == "FAILED"}
        states = {role: r["state"] for role, r in got.items()}
        cell.prefill_success_after_decode_failed = states == {"prefill": "SUCCESS", "decode": "FAILED"}
        if states["decode"] == "SUCCESS" and states["prefill"] != "SUCCESS":
            raise RuntimeError(f"decode SUCCESS but prefill {states['prefill']}")
        cell.survivor_failed_s = max(times.values()) if times else None
        cell.written = f"{got['decode']['written']}/{got['decode']['of']}"
        cell.reason = " | ".join(f"{role[0].upper()} {r['state']} {times[role]:.2f}s: {r['reason']}" if role in times
                                 else f"{role[0].upper()} {r['state']}" for role, r in got.items())
        if states["decode"] == "FAILED":
            want = schedule(sc)[fault_room].room
            wait_for(lambda: any(json.loads(s).get("late_pages") is not None for s in dec.stdout().splitlines()
                              if s.startswith("{") and json.loads(s).get("room") == want) or dec.proc.poll() is not None,
                  60.0, "decode's late-write count")
            late = [json.loads(s)["late_pages"] for s in dec.stdout().splitlines()
                    if s.startswith("{") and "late_pages" in s and json.loads(s).get("room") == want]
            if not late:
                room_lines(dec, 10**6, 0.0)
            cell.late_pages = late[0]
        # Over the restored link, both serve the next room.
        go(fault_room + 1)
        after = [results(c, fault_room + 1) for c in (pre, dec)]
        cell.resumed_peer_served = all(r["state"] == "SUCCESS" for r in after)
        if not cell.resumed_peer_served:
            cell.reason = f"{cell.reason} || after: {[(r['state'], r['reason']) for r in after]}"
    finally:
        for c in started:
            c.kill()
        link.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.netcut", description="network-cut cell drivers")
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--sizes", required=True, help="pages per room, comma-separated")
    parser.add_argument("--gates", required=True, type=Path)
    parser.add_argument("--split", default="", help="prefill: rooms whose last page waits for gate up<i>")
    parser.add_argument("--bootstrap")
    args = parser.parse_args(argv)
    sc = msgspec.json.decode(args.scenario, type=Scenario)
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.role == "prefill":
        return run_prefill(sc, sizes, args.gates, {int(x) for x in args.split.split(",") if x})
    return run_decode(sc, sizes, args.gates, args.bootstrap)


if __name__ == "__main__":
    import sys

    sys.exit(main())
