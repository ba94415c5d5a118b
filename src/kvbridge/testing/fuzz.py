"""A control-plane fuzzer: hostile messages at a live prefill rank, its bootstrap endpoint and a live decode rank.

``python -m kvbridge.testing.fuzz --messages 100000 [--backend memory] [--seed 0]``

In this process: a prefill rank and its bootstrap endpoint (the targets on
prefill's side) and a decode rank whose receivers point at a fake prefill
server run here (the target on decode's side: the fake answers its lookups
and handshakes and sends it the hostile messages). The messages, in turn:
random bytes, mutated valid messages, valid messages of types the endpoint
does not handle, lengths that claim gigabytes, frames over the size limit,
wrong frame counts, unsealed (unauthenticated) messages, tampered seals and
replayed frames; sealed or not, from peers that completed a handshake or
not. Afterwards both ranks must still serve a normal transfer, checked byte
by byte against the source pattern by another process, and this process's
threads, file descriptors and RSS must not have grown with the message count.

Prints a table and one JSON line; exits 1 if anything failed. The default
test run uses a small sample (``tests/test_fuzz.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import zmq

from kvbridge.core.control import protocol as P
from kvbridge.core.control.auth import NO_INCARNATION, Sealer, auth_for, incarnation_name
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.control.channel import Channel
from kvbridge.core.control.metrics import metrics
from kvbridge.core.sessions.session import DecodeManager, PrefillManager, Receiver
from kvbridge.testing.e2e import Pools, Scenario, decode_schedule, prefill_pools, serve

__all__ = ["run", "main"]

MAX_BYTES = 1 << 20  # the targets' max_message_bytes: small, so oversize frames are cheap to send
SCENARIO = Scenario(backend="memory", layers=2, page_nbytes=64, prefill_pages=1024, decode_pages=1024, requests=16,
                    max_pages=32, concurrency=8, max_chunks=3, bootstrap_timeout=10.0, waiting_timeout=60.0,
                    transfer_timeout=10.0, heartbeat_interval=0.2, heartbeat_timeout=120.0, deadline=60.0)


def usage() -> dict[str, int]:
    """This process's threads, open file descriptors and resident bytes."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")), "rss": rss}


class Mutator:
    """Hostile payloads from valid ones (seeded, so a run can be repeated)."""

    def __init__(self, rng: random.Random, valid: list[bytes]) -> None:
        self.rng = rng
        self.valid = valid

    def random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.randrange(0, 300))

    def mutated(self) -> bytes:
        data = bytearray(self.rng.choice(self.valid))
        for _ in range(self.rng.randrange(1, 6)):
            op = self.rng.randrange(3)
            pos = self.rng.randrange(len(data) + 1)
            if op == 0 and data:
                data[min(pos, len(data) - 1)] ^= 1 << self.rng.randrange(8)
            elif op == 1:
                data[pos:pos] = self.rng.randbytes(self.rng.randrange(1, 9))
            elif data:
                del data[pos:pos + self.rng.randrange(1, 9)]
        return bytes(data)

    def huge_claim(self) -> bytes:
        """msgpack whose length prefixes claim gigabytes the frame does not hold."""
        kind = self.rng.randrange(3)
        if kind == 0:  # bin32 of 4 GiB inside a transfer request's index map
            return (b"\x84\xa4type\xb0transfer_request\xa4room\x01\xacmetadata_row\x00\xa7indices\x81\xa7kv_page"
                    + b"\xc6\xff\xff\xff\xff" + self.rng.randbytes(64))
        if kind == 1:  # a map claiming 2**32-1 entries
            return b"\xdf\xff\xff\xff\xff" + self.rng.randbytes(32)
        return b"\xdd\x7f\xff\xff\xff" + b"\x00" * 16  # an array claiming 2**31 items


class Target:
    """One endpoint under fire: clients that send it hostile frames."""

    def __init__(self, name: str, address: str, handshake: P.Message | None) -> None:
        self.name = name
        self.address = address
        self.auth = auth_for()
        self._handshake = handshake
        self.sent: Counter[str] = Counter()
        self.replayable: list[bytes] = []
        self.clients = [self._client(i) for i in range(4)]

    def _client(self, i: int) -> Channel:
        chan = Channel(zmq.Context.instance(), zmq.DEALER, self.auth, endpoint="fuzz", max_bytes=1 << 30,
                       to=self.address.encode(), identity=f"fuzz-{self.name}-{i}-{os.urandom(4).hex()}".encode())
        chan.sock.setsockopt(zmq.SNDTIMEO, 2000)
        chan.sock.setsockopt(zmq.RCVHWM, 100)
        chan.connect(self.address)
        if self._handshake is not None and i % 2 == 0:  # half the clients handshake first
            hello = msgspec.structs.replace(self._handshake, peer_id=chan.sock.getsockopt(zmq.IDENTITY).decode())
            chan.send_msg(hello)
        return chan

    def fire(self, rng: random.Random, mut: Mutator, what: str) -> None:
        i = rng.randrange(len(self.clients))
        chan = self.clients[i]
        sock = chan.sock
        frames: list[bytes]
        if what == "random":
            frames = [mut.random_bytes()]
        elif what == "random-sealed":
            frames = [chan.seal(mut.random_bytes(), chan.to)]
        elif what == "mutated-sealed":
            frames = [chan.seal(mut.mutated(), chan.to)]
        elif what == "mutated-unsealed":
            frames = [mut.mutated()]
        elif what == "valid-unsealed":
            frames = [rng.choice(mut.valid)]
        elif what == "wrong-type":
            frames = [chan.seal(rng.choice(mut.valid), chan.to)]
        elif what == "huge-claim":
            frames = [chan.seal(mut.huge_claim(), chan.to)]
        elif what == "tampered":
            sealed = bytearray(self.auth.seal(rng.choice(mut.valid), chan.to, Sealer()))
            sealed[rng.randrange(len(sealed))] ^= 1 << rng.randrange(8)
            frames = [bytes(sealed)]
        elif what == "replayed" and self.replayable:
            frames = [rng.choice(self.replayable)]
        elif what == "frames":
            frames = [chan.seal(rng.choice(mut.valid), chan.to)] * rng.choice([2, 3])
        elif what == "oversize":
            frames = [bytes(MAX_BYTES + 1024)]
        else:
            return
        if what == "wrong-type" and len(self.replayable) < 256:
            self.replayable.append(frames[0])
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            pass
        self.sent[what] += 1
        if what == "oversize":  # zmq drops the connection: carry on from a fresh socket
            chan.close()
            self.clients[i] = self._client(i)
        self.drain()

    def drain(self) -> None:
        for chan in self.clients:
            while chan.sock.poll(0):
                chan.sock.recv_multipart()

    def close(self) -> None:
        for chan in self.clients:
            chan.close()


class FakePrefill:
    """A bootstrap endpoint and a prefill rank that a decode rank connects to; sends it hostile frames."""

    def __init__(self, auth_backend: str) -> None:
        ctx = zmq.Context.instance()
        self.auth = auth_for()
        self.boot = Channel(ctx, zmq.ROUTER, self.auth, endpoint="fuzz", max_bytes=1 << 30)
        self.address = self.boot.bind("127.0.0.1")
        self.rank = Channel(ctx, zmq.ROUTER, self.auth, endpoint="fuzz", max_bytes=1 << 30)
        self.rank.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # count only frames the decode rank can receive
        self.rank.sock.setsockopt(zmq.SNDTIMEO, 2000)  # and wait while its queue is full
        self.control = self.rank.bind("127.0.0.1")
        self.backend = auth_backend
        self.decode_ident: bytes | None = None
        self.decode_incarnation = b""  # what the decode rank's Hello came from: sealed frames are addressed to it
        self.sent: Counter[str] = Counter()
        self.replayable: list[bytes] = []

    def serve(self) -> None:
        """Answer lookups with this rank and remember who says Hello (non-blocking)."""
        while self.boot.sock.poll(0):
            got = self.boot.receive(self.boot.sock.recv_multipart())
            if got is not None and isinstance(got[1], P.Lookup) and got[0] is not None:
                info = P.RankInfo(0, 1, 0, 1, self.control, self.backend)
                self.boot.send_msg(P.LookupReply(ranks=(info,)), got[0])
        while self.rank.sock.poll(0):
            frames = self.rank.sock.recv_multipart()
            got = self.rank.receive(frames)
            if got is not None and isinstance(got[1], P.Hello) and got[0] is not None:
                self.decode_ident = got[0]
                self.decode_incarnation = self.rank.sender_incarnation
                # Accept, so the decode rank keeps this connection (a handshake left pending would time out).
                self.rank.send_msg(P.HelloAck(kvargs=got[1].kvargs), got[0])

    def fire(self, rng: random.Random, mut: Mutator, what: str) -> bool:
        self.serve()
        ident = self.decode_ident
        if ident is None:
            return False
        inc = self.decode_incarnation
        to = incarnation_name(inc) if inc else ident
        seal = lambda payload: self.rank.seal(payload, to, inc or NO_INCARNATION)  # noqa: E731
        if what == "random":
            frame = mut.random_bytes()
        elif what == "random-sealed":
            frame = seal(mut.random_bytes())
        elif what in ("mutated-sealed", "huge-claim"):
            frame = seal(mut.mutated() if what == "mutated-sealed" else mut.huge_claim())
        elif what == "mutated-unsealed":
            frame = mut.mutated()
        elif what == "valid-unsealed":
            frame = rng.choice(mut.valid)
        elif what == "wrong-type":
            # Types decode does not take from a prefill rank, and room messages for rooms it does not
            # have; a sealed Reject or HelloAck would only end the handshake this fuzzer needs.
            frame = seal(rng.choice(mut.valid[:5] + mut.valid[6:12]))
            if len(self.replayable) < 256:
                self.replayable.append(frame)
        elif what == "tampered":
            sealed = bytearray(self.auth.seal(rng.choice(mut.valid), to, Sealer(), inc or NO_INCARNATION))
            sealed[rng.randrange(len(sealed))] ^= 1 << rng.randrange(8)
            frame = bytes(sealed)
        elif what == "replayed" and self.replayable:
            frame = rng.choice(self.replayable)
        else:
            return False
        try:
            self.rank.sock.send_multipart([ident, frame])
        except zmq.ZMQError:  # not connected (reconnecting after a hostile frame ended the handshake) or full
            return False
        self.sent[what] += 1
        return True

    def close(self) -> None:
        self.boot.close()
        self.rank.close()


KINDS = ["random", "random-sealed", "mutated-sealed", "mutated-unsealed", "valid-unsealed", "wrong-type",
         "huge-claim", "tampered", "replayed", "frames", "oversize"]
WEIGHTS = [12, 12, 20, 10, 8, 12, 6, 8, 8, 3, 1]


def _valid_messages(kvargs: Any, backend: str) -> list[bytes]:
    """Valid encodings of every message type, the mutator's seeds (wrong types for most endpoints)."""
    idx = P.pack_indices(np.arange(8))
    msgs: list[P.Message] = [
        P.Register(rank=P.RankInfo(0, 1, 0, 1, "127.0.0.1:9", backend)), P.RegisterAck(), P.Lookup(),
        P.LookupReply(ranks=(P.RankInfo(0, 1, 0, 1, "127.0.0.1:9", backend),)),
        P.Hello(peer_id="x", lanes={backend: b"127.0.0.1:1"}, kvargs=kvargs), P.HelloAck(kvargs=kvargs),
        P.TransferRequest(room=2**40, indices={"kv_page": idx}, metadata_row=0),
        P.ChunkDone(room=2**40, chunk=0, last=True), P.Done(room=2**40), P.Failed(room=2**40, reason="x"),
        P.Abort(room=2**40, reason="x"), P.Heartbeat(), P.Reject(reason="x", room=2**40),
    ]
    return [P.encode(m) for m in msgs]


def run(messages: int, backend: str = "memory", seed: int = 0, verbose: bool = True) -> dict[str, Any]:
    """Fire ``messages`` hostile messages, then check both ranks still serve; the result as plain data."""
    rng = random.Random(seed)
    sc = msgspec.structs.replace(SCENARIO, backend=backend)
    cfg = dataclasses.replace(sc.session_config(), max_message_bytes=MAX_BYTES, max_index_list=1 << 16)
    ppools = prefill_pools(sc)
    dpools = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
    server = BootstrapServer("127.0.0.1")
    prefill = PrefillManager(ppools.kvargs, backend, bootstrap=server.address, config=cfg)
    decode = DecodeManager(dpools.kvargs, backend, config=cfg)
    fake = FakePrefill(decode.backend_name)
    mut = Mutator(rng, _valid_messages(dpools.kvargs, backend))
    hello = P.Hello(peer_id="", lanes={backend: b"127.0.0.1:1"}, kvargs=dpools.kvargs)
    targets = [Target("prefill", prefill.control_address, hello), Target("bootstrap", server.address, None)]
    room = iter(range(1 << 50, 1 << 51))
    receiver = Receiver(decode, next(room), bootstrap=fake.address)
    before_rejected = json.dumps(metrics().snapshot()["control_rejected"])
    errors = _ErrorCount()
    logging.getLogger("kvbridge").addHandler(errors)
    result: dict[str, Any] = {"messages": messages, "seed": seed, "backend": backend}
    t0 = time.monotonic()
    warm = min(1000, messages // 10)
    base: dict[str, int] = {}
    try:
        for n in range(messages):
            if n == warm:
                base = usage()
            what = rng.choices(KINDS, WEIGHTS)[0]
            side = n % 3
            if side == 2:
                if receiver.final:  # a hostile frame ended the handshake: a new receiver reconnects
                    receiver = Receiver(decode, next(room), bootstrap=fake.address)
                if not fake.fire(rng, mut, what):
                    targets[0].fire(rng, mut, what)
            else:
                targets[side].fire(rng, mut, what)
            if verbose and n and n % 20000 == 0:
                print(f"  {n} messages, {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
        # Every target has handled its queue once a fresh client gets an answer.
        probe = RawProbe(prefill.control_address)
        caught_up = isinstance(probe.ask(P.Heartbeat()), P.Reject)
        probe.close()
        fuzz_s = time.monotonic() - t0
        for t in targets:
            t.drain()
        after = usage()
        receiver.abort("fuzz over")
        result.update(fuzz_seconds=round(fuzz_s, 2), rate=round(messages / fuzz_s), usage_before=base, usage_after=after,
                      sent={t.name: dict(t.sent) for t in targets} | {"decode": dict(fake.sent)})
        # Both ranks still serve a normal transfer, checked byte by byte.
        result["prefill_serves"] = _prefill_serves(prefill, ppools, sc, server.address)
        result["decode_serves"] = _decode_serves(decode, dpools, sc)
        result["rejected"] = metrics().snapshot()["control_rejected"]
        result["rejected_before"] = json.loads(before_rejected)
    finally:
        logging.getLogger("kvbridge").removeHandler(errors)
        for t in targets:
            t.close()
        fake.close()
        decode.close()
        prefill.close()
        server.close()
    grew = {k: result["usage_after"][k] - result["usage_before"].get(k, result["usage_after"][k]) for k in ("threads", "fds", "rss")}
    result["grew"] = grew
    result["errors_logged"] = errors.messages[:10]
    result["caught_up"] = caught_up
    result["ok"] = bool(caught_up and not errors.messages and result["prefill_serves"] and result["decode_serves"] and grew["threads"] <= 2
                        and grew["fds"] <= 16 and grew["rss"] < 64 << 20)
    return result


class _ErrorCount(logging.Handler):
    """Collects kvbridge's ERROR records: a handler that failed (an exception escaped) is a finding."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.messages) < 100:
            self.messages.append(record.getMessage() + (f" {record.exc_info[1]!r}" if record.exc_info else ""))


class RawProbe:
    """A sealed DEALER that asks one question (for 'has the target caught up')."""

    def __init__(self, address: str) -> None:
        self.chan = Channel(zmq.Context.instance(), zmq.DEALER, auth_for(), endpoint="fuzz", max_bytes=1 << 24,
                            to=address.encode())
        self.chan.connect(address)

    def ask(self, msg: P.Message, wait: float = 120.0) -> P.Message | None:
        self.chan.send_msg(msg)
        if not self.chan.sock.poll(int(wait * 1000)):
            return None
        got = self.chan.receive(self.chan.sock.recv_multipart())
        return None if got is None else got[1]

    def close(self) -> None:
        self.chan.close()


def _prefill_serves(prefill: PrefillManager, pools: Pools, sc: Scenario, bootstrap: str) -> bool:
    """A decode process receives ``sc`` from the fuzzed prefill rank and checks every byte."""
    cmd = [sys.executable, "-m", "kvbridge.testing.e2e", "decode", "--scenario", msgspec.json.encode(sc).decode(),
           "--bootstrap", bootstrap]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        failed = serve(prefill, pools, sc)
        out, err = child.communicate(timeout=sc.deadline + 30)
    except Exception:
        child.kill()
        raise
    lines = [line for line in out.splitlines() if line.startswith("{")]
    res = json.loads(lines[-1]) if lines else {}
    ok = failed == 0 and child.returncode == 0 and res.get("mismatched_regions") == 0 and res.get("requests") == sc.requests
    if not ok:
        print(f"prefill side: failed={failed} rc={child.returncode} {res}\n{err[-2000:]}", file=sys.stderr)
    return ok


def _decode_serves(decode: DecodeManager, pools: Pools, sc: Scenario) -> bool:
    """The fuzzed decode rank receives ``sc`` from a prefill process and checks every byte."""
    cmd = [sys.executable, "-m", "kvbridge.testing.e2e", "prefill", "--scenario", msgspec.json.encode(sc).decode()]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        bootstrap = line.split()[1]
        res = decode_schedule(decode, pools, sc, bootstrap)
        child.communicate(timeout=sc.deadline + 30)
    except Exception:
        child.kill()
        raise
    ok = child.returncode == 0 and not res["failed"] and res["mismatched_regions"] == 0 and res["requests"] == sc.requests
    if not ok:
        print(f"decode side: rc={child.returncode} {res}", file=sys.stderr)
    return ok


def _table(result: dict[str, Any]) -> str:
    rows = [f"{'target':<10} " + " ".join(f"{k:>9}" for k in KINDS)]
    for name, sent in result["sent"].items():
        rows.append(f"{name:<10} " + " ".join(f"{sent.get(k, 0):>9}" for k in KINDS))
    rows.append("")
    rows.append(f"{result['messages']} messages in {result['fuzz_seconds']}s ({result['rate']}/s)")
    b, a = result["usage_before"], result["usage_after"]
    rows.append(f"threads {b['threads']} -> {a['threads']}, fds {b['fds']} -> {a['fds']}, "
                f"RSS {b['rss'] / 2**20:.1f} -> {a['rss'] / 2**20:.1f} MiB")
    rows.append("refused: " + json.dumps(result["rejected"]))
    rows.append(f"errors logged (exceptions in handlers): {len(result['errors_logged'])}")
    rows.append(f"prefill still serves byte-exact: {result['prefill_serves']}; decode: {result['decode_serves']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--backend", default="memory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("KVBRIDGE_SECRET", os.urandom(32).hex())  # children inherit it
    result = run(args.messages, args.backend, args.seed)
    print(_table(result), file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
