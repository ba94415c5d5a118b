"""Memory after hostile floods: does a live prefill/decode pair keep what floods of hostile messages cost?

``python -m kvbridge.testing.floodmem --floods 5 --messages 20000 --large 20 [--tracemalloc]``

A *target* process holds a prefill rank, its bootstrap endpoint and a decode rank (pointed at the
fuzzer's fake prefill server, :mod:`kvbridge.testing.fuzz`) for the whole run, with the default
``max_message_bytes`` (32 MiB) unless ``--max-bytes``. This process attacks it: ``--floods`` times,
``--messages`` hostile messages of the fuzzer's kinds and weights, plus ``--large`` unauthenticated
frames just under ``max_message_bytes`` at each endpoint (a frame under the limit is received whole
before it is refused); then it waits until the prefill rank has handled its queue (a fresh client's
question is answered) and ``--settle`` seconds more, and reads the target's threads, file descriptors
and RSS (the attackers' own buffers are not in them). Growth that stops after the first flood is a
one-time cost (allocator arenas, bounded tables filling up); growth per flood is a leak.
``--tracemalloc``: the target also lists the Python allocation sites that grew most between the end of
the first and of the last flood (Python allocations only, not zmq's). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import subprocess
import sys
import threading
import time
import tracemalloc
from typing import Any

import msgspec
import zmq

from kvbridge.core.control import protocol as P
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.sessions.manager import SessionConfig
from kvbridge.core.sessions.session import DecodeManager, PrefillManager, Receiver
from kvbridge.testing.e2e import Pools, prefill_pools
from kvbridge.testing.fuzz import KINDS, SCENARIO, WEIGHTS, FakePrefill, Mutator, RawProbe, Target, \
    _valid_messages, usage

MB = 1 << 20


def run_target(backend: str, fake: str, max_bytes: int, trace: bool) -> int:
    """The target process: serve until stdin closes; ``usage`` on stdin prints a JSON line of usage."""
    if trace:
        tracemalloc.start(8)
    sc = msgspec.structs.replace(SCENARIO, backend=backend)
    cfg = dataclasses.replace(sc.session_config(), max_message_bytes=max_bytes, max_index_list=1 << 16)
    ppools, dpools = prefill_pools(sc), Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
    server = BootstrapServer("127.0.0.1")
    prefill = PrefillManager(ppools.kvargs, backend, bootstrap=server.address, config=cfg)
    decode = DecodeManager(dpools.kvargs, backend, config=cfg)
    stop = threading.Event()

    def receivers() -> None:  # a hostile frame may end decode's handshake: a new receiver reconnects
        rooms = iter(range(1 << 50, 1 << 51))
        while not stop.is_set():
            recv = Receiver(decode, next(rooms), bootstrap=fake)
            while not recv.final and not stop.is_set():
                time.sleep(0.01)
            if not recv.final:
                recv.abort("flood over")

    thread = threading.Thread(target=receivers, daemon=True)
    thread.start()
    print(f"READY {prefill.control_address} {server.address}", flush=True)
    first = None
    for line in sys.stdin:
        gc.collect()
        got: dict[str, Any] = usage() | {"peers": len(prefill.peers())}
        if trace:
            got["traced"] = tracemalloc.get_traced_memory()[0]  # Python's allocations now (bytes)
            snap = tracemalloc.take_snapshot()
            if first is None:
                first = snap
            else:
                got["grew_most"] = [str(s) for s in snap.compare_to(first, "lineno")[:8]]
        print(json.dumps(got), flush=True)
    stop.set()
    thread.join(5)
    decode.close()
    prefill.close()
    server.close()
    return 0


def measure(floods: int, messages: int, large: int, settle: float = 2.0, trace: bool = False, seed: int = 0,
            backend: str = "memory", max_bytes: int = SessionConfig.max_message_bytes) -> dict[str, Any]:
    """Run the floods at a target process (see the module's docstring); its usage after each, as plain data."""
    rng = random.Random(seed)
    sc = msgspec.structs.replace(SCENARIO, backend=backend)
    kvargs = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency).kvargs
    fake = FakePrefill(backend)
    cmd = [sys.executable, "-m", "kvbridge.testing.floodmem", "target", "--backend", backend, "--fake", fake.address,
           "--max-bytes", str(max_bytes), *(["--tracemalloc"] if trace else [])]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert child.stdin is not None and child.stdout is not None
    out: dict[str, Any] = {"floods": floods, "messages": messages, "large": large, "max_bytes": max_bytes,
                           "settle_s": settle, "backend": backend, "after": []}
    targets: list[Target] = []
    try:
        _, control, bootstrap = child.stdout.readline().split()

        def ask() -> dict[str, Any]:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write("usage\n")
            child.stdin.flush()
            return json.loads(child.stdout.readline())

        out["baseline"] = ask()
        mut = Mutator(rng, _valid_messages(kvargs, backend))
        hello = P.Hello(peer_id="", lanes={backend: b"127.0.0.1:1"}, kvargs=kvargs)
        targets = [Target("prefill", control, hello), Target("bootstrap", bootstrap, None)]
        big = bytes(max_bytes - 4096)  # unauthenticated, under the limit: received whole, then refused
        t0 = time.monotonic()
        for _ in range(floods):
            for n in range(messages):
                what = rng.choices(KINDS, WEIGHTS)[0]
                if n % 3 == 2:
                    fake.serve()  # answer the target's lookups and handshakes
                    if not fake.fire(rng, mut, what):
                        targets[0].fire(rng, mut, what)
                else:
                    targets[n % 3].fire(rng, mut, what)
            for i in range(large):
                try:
                    if i % 3 == 2 and fake.decode_ident is not None:
                        fake.rank.sock.send_multipart([fake.decode_ident, big])
                    else:
                        targets[i % 2].clients[1].sock.send_multipart([big])  # a client that did not handshake
                except zmq.ZMQError:  # decode is reconnecting, or the queue is full: the next one
                    pass
                for t in targets:
                    t.drain()
            probe = RawProbe(control)  # answered once the prefill rank handled its queue
            probe.ask(P.Heartbeat())
            probe.close()
            for t in targets:
                t.drain()
            time.sleep(settle)
            out["after"].append(ask())
        out["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        for t in targets:
            t.close()
        fake.close()
        if child.stdin is not None:
            child.stdin.close()
        child.wait(30)
    base = out["baseline"]["rss"]
    rss = [u["rss"] for u in out["after"]]
    out["rss_mb_over_baseline"] = [round((r - base) / MB, 1) for r in rss]
    out["rss_mb_per_flood_after_first"] = round((rss[-1] - rss[0]) / MB / max(1, floods - 1), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.floodmem", description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", choices=["measure", "target"], default="measure")
    parser.add_argument("--floods", type=int, default=5)
    parser.add_argument("--messages", type=int, default=20000, help="hostile messages per flood")
    parser.add_argument("--large", type=int, default=20, help="frames just under max_message_bytes per flood")
    parser.add_argument("--max-bytes", type=int, default=SessionConfig.max_message_bytes,
                        help="the target's max_message_bytes")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds waited after each flood")
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="memory")
    parser.add_argument("--fake", help="target role: the fake prefill server's bootstrap address")
    args = parser.parse_args(argv)
    if args.role == "target":
        return run_target(args.backend, args.fake, args.max_bytes, args.tracemalloc)
    if args.floods < 1 or args.messages < 0 or args.large < 0:
        parser.error(f"--floods must be >= 1 and --messages, --large >= 0, got {args.floods}, {args.messages}, {args.large}")
    print(json.dumps(measure(args.floods, args.messages, args.large, args.settle, args.tracemalloc, args.seed,
                             args.backend, args.max_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
