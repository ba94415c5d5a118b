"""The chaos soak in network namespaces, for its ``net-cut`` fault.

The soak process is the decode rank and hosts the bootstrap server, so for a
cut it runs whole in one namespace (decode, ``10.77.0.2``) and starts its
prefill processes in another (``10.77.0.1``), joined by a veth pair
(:class:`kvbridge.testing.netcut.Link`, which also says how UCX is kept on
the veth). ``net-cut`` takes prefill's end of the link down for ``cut``
seconds, then up; the other kinds run as on loopback. Control messages cross
a non-loopback link, so the shared secret is set (``KVBRIDGE_SECRET``, if
unset) and passed to every process through the environment.

:func:`soak_in_namespaces` (this process, outside) creates the namespaces,
runs ``python -m kvbridge.testing.soaknet`` under ``ip netns exec`` and
reads its JSON report; where namespaces cannot be created (not root, no
``ip``) the report's ``skipped`` says why and nothing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass

import msgspec

from kvbridge.testing.netcut import DECODE_IP, PREFILL_IP, Link, _ip, unavailable
from kvbridge.testing.soak import KINDS, Report

#: The child soak's wall-clock bound beyond its own limits (its drain and the processes' start).
MARGIN = 120.0


@dataclass(frozen=True)
class Net:
    """The two namespaces as the soak (inside the decode one) drives them."""

    prefill_ns: str
    prefill_dev: str
    decode_ip: str = DECODE_IP
    prefill_ip: str = PREFILL_IP

    def prefix(self) -> list[str]:
        """The command that runs a prefill process in its namespace."""
        return ["ip", "netns", "exec", self.prefill_ns]

    def env(self) -> dict[str, str]:
        """A prefill process's UCX on its veth, over TCP (as :meth:`kvbridge.testing.netcut.Link.env` says why)."""
        return {"UCX_NET_DEVICES": self.prefill_dev, "UCX_TLS": "tcp", "UCX_HANDLE_ERRORS": "bt"}

    def set(self, up: bool) -> None:
        """Take prefill's end of the link down (or up)."""
        _ip("-n", self.prefill_ns, "link", "set", self.prefill_dev, "up" if up else "down")


def soak_in_namespaces(backend: str, seconds: float, *, concurrency: int, every: float, freeze: float, settle: float,
                       seed: int, kinds: tuple[str, ...], rounds: int | None, cut: float, room_faults: float) -> Report:
    """Run the soak (see :func:`kvbridge.testing.soak.soak`) with decode and prefill in two namespaces."""
    why = unavailable()
    if why is not None:
        return Report(backend=backend, seconds=0.0, skipped=why)
    os.environ.setdefault("KVBRIDGE_SECRET", secrets.token_hex(32))  # non-loopback hosts need it; children inherit it
    link = Link()
    try:
        args = ["--backend", backend, "--seconds", str(seconds), "--concurrency", str(concurrency), "--every",
                str(every), "--freeze", str(freeze), "--settle", str(settle), "--seed", str(seed), "--cut", str(cut),
                "--room-faults", str(room_faults), "--kinds", ",".join(kinds), "--prefill-ns", link.ns["prefill"], "--prefill-dev", link.dev["prefill"],
                *([] if rounds is None else ["--rounds", str(rounds)])]
        per_fault = 30.0 + every  # kvbridge.testing.soak.RECOVERY + every
        bound = seconds + MARGIN + per_fault * (len(kinds) * rounds if rounds else 1)
        env = {**os.environ, "UCX_NET_DEVICES": link.dev["decode"], "UCX_TLS": "tcp", "UCX_HANDLE_ERRORS": "bt"}
        r = subprocess.run([*link.prefix("decode"), sys.executable, "-m", "kvbridge.testing.soaknet", *args],
                           capture_output=True, text=True, timeout=bound, env=env)
        lines = [s for s in r.stdout.splitlines() if s.startswith("{")]
        if r.returncode != 0 or not lines:
            return Report(backend=backend, seconds=seconds,
                          error=f"the soak in namespaces exited with {r.returncode}: {r.stderr[-2000:]}")
        return msgspec.json.decode(lines[-1], type=Report)
    except subprocess.TimeoutExpired as exc:
        return Report(backend=backend, seconds=seconds, error=f"the soak in namespaces ran past {exc.timeout:.0f} s")
    finally:
        link.close()


def main(argv: list[str] | None = None) -> int:
    """The child: the soak inside the decode namespace; prints its report as one JSON line."""
    from kvbridge.testing.soak import soak

    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.soaknet", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--every", type=float, required=True)
    parser.add_argument("--freeze", type=float, required=True)
    parser.add_argument("--settle", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--kinds", required=True, help=f"comma-separated (of {', '.join(KINDS)}, net-cut)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--cut", type=float, required=True)
    parser.add_argument("--room-faults", type=float, required=True)
    parser.add_argument("--prefill-ns", required=True)
    parser.add_argument("--prefill-dev", required=True)
    args = parser.parse_args(argv)
    report = soak(args.backend, args.seconds, concurrency=args.concurrency, every=args.every, freeze=args.freeze,
                  settle=args.settle, seed=args.seed, kinds=tuple(args.kinds.split(",")), rounds=args.rounds,
                  net=Net(args.prefill_ns, args.prefill_dev), cut=args.cut, room_faults=args.room_faults)
    print(json.dumps(msgspec.to_builtins(report)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
