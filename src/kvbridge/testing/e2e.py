"""End-to-end driver: a prefill process and a decode process moving real requests.

Both processes build the same request schedule from a seed; prefill fills its
pools with a pattern that encodes (region, page, word), decode verifies every
destination byte against the pattern computed with plain numpy indexing of the
source pages (never through the planner) and checks that pages no request
wrote still hold the sentinel.

Run as ``python -m kvbridge.testing.e2e ROLE --scenario JSON``.
Prefill prints ``BOOTSTRAP host:port`` first; decode prints one JSON result line.
``hold`` is a prefill rank for fault tests: it prints ``BOOTSTRAP host:port``,
creates a sender for every room of the schedule and never sends, then prints
one JSON line with each room's final state once every room has finished
(aborted, timed out) or the deadline has passed. ``prefill-close`` and
``decode-close`` put the first wave's rooms in flight (prefill sends each its
first chunk, never the last) and then close their manager; they print one JSON
line with each room's state before and after the close and how long it took.
``engine`` is a bare destination engine (no session) for tests of the backend
contract: it prints ``ENGINE <metadata hex> <KVArgs JSON>`` and waits to be killed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import msgspec
import numpy as np

from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region
from kvbridge.core.sessions.session import (
    KV_PAGE_SPACE,
    METADATA_SPACE,
    DecodeManager,
    Poll,
    PrefillManager,
    Receiver,
    Sender,
    SessionConfig,
)
from kvbridge.core.transfer.transport import open_transport

SENTINEL = np.uint32(0xEEEEEEEE)
META_WORDS = 16  # 64-byte metadata rows


class Scenario(msgspec.Struct, kw_only=True):
    backend: str
    layers: int = 2
    page_nbytes: int = 64
    prefill_pages: int = 16384
    decode_pages: int = 64 * 4096 + 1024
    requests: int = 200
    max_pages: int = 4096
    concurrency: int = 64
    max_chunks: int = 4
    seed: int = 0
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 120.0
    transfer_timeout: float = 30.0
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 2.0
    deadline: float = 300.0  # whole run, seconds
    backend_options: dict[str, str] = {}  # SessionConfig.backend_options
    layerwise: bool = False  # prefill sends every chunk layer-wise, one layer_ready() per layer
    checksum: bool = False  # SessionConfig.checksum (both sides)
    inline_row_bytes: int = 4096  # SessionConfig.inline_row_bytes (0: the metadata row is an engine write)
    staging: str = "gather"  # SessionConfig.staging: gather (the default), auto, on, off

    def session_config(self) -> SessionConfig:
        return SessionConfig.from_fields(self)


# -- memory -----------------------------------------------------------------------------
class Pools:
    """Numpy-backed KV regions (K and V per layer) plus a metadata region."""

    def __init__(self, sc: Scenario, pages: int, meta_rows: int) -> None:
        words = sc.page_nbytes // 4
        self.kv = [np.full((pages, words), SENTINEL, np.uint32) for _ in range(2 * sc.layers)]
        self.meta = np.full((meta_rows, META_WORDS), SENTINEL, np.uint32)
        regions = [
            Region(
                name=f"{role}{layer}",
                addr=arr.ctypes.data,
                nbytes=arr.nbytes,
                stride=sc.page_nbytes,
                role=role,
                index_space=KV_PAGE_SPACE,
                layer=layer,
            )
            for (layer, role), arr in zip([(l, r) for r in ("k", "v") for l in range(sc.layers)], self.kv)
        ]
        regions.append(
            Region(name="meta", addr=self.meta.ctypes.data, nbytes=self.meta.nbytes, stride=META_WORDS * 4,
                   role="metadata", index_space=METADATA_SPACE)
        )
        self.kvargs = KVArgs(
            regions=tuple(regions),
            index_spaces=(IndexSpace(KV_PAGE_SPACE, pages, 16), IndexSpace(METADATA_SPACE, meta_rows)),
            dtype="bfloat16",
            page_size=16,
        )

    def fill_source(self) -> None:
        for e, arr in enumerate(self.kv):
            arr[:] = pattern(e, np.arange(arr.shape[0]), arr.shape[1])

    def reset(self) -> None:
        for arr in self.kv:
            arr.fill(SENTINEL)
        self.meta.fill(SENTINEL)


def pattern(region: int, pages: np.ndarray, words: int) -> np.ndarray:
    """Word ``w`` of page ``p`` in region ``e``: unique per (e, p, w), never the sentinel."""
    return ((np.uint32(region + 1) << np.uint32(27)) + (pages.astype(np.uint32)[:, None] << np.uint32(8))
            + np.arange(words, dtype=np.uint32)[None, :])


def meta_row_for(room: int) -> np.ndarray:
    return (np.uint32(room & 0xFFFFFF) * np.uint32(64) + np.arange(META_WORDS, dtype=np.uint32)).astype(np.uint32)


# -- the shared schedule --------------------------------------------------------------------
class Request(msgspec.Struct):
    room: int
    src_pages: list[int]
    chunks: list[int]  # chunk sizes in pages
    dst_contiguous: bool


def schedule(sc: Scenario) -> list[Request]:
    rng = np.random.default_rng(sc.seed)
    out = []
    for i in range(sc.requests):
        n = int(rng.integers(1, sc.max_pages + 1))
        if rng.random() < 0.5:
            start = int(rng.integers(0, sc.prefill_pages - n + 1))
            src = np.arange(start, start + n)
        else:
            src = np.sort(rng.choice(sc.prefill_pages, n, replace=False))
        k = int(rng.integers(1, min(sc.max_chunks, n) + 1))
        cuts = np.sort(rng.choice(np.arange(1, n), k - 1, replace=False)) if k > 1 else np.array([], int)
        chunks = np.diff(np.concatenate(([0], cuts, [n]))).tolist()
        out.append(Request(room=sc.seed * 1_000_000 + i + 1, src_pages=src.tolist(), chunks=chunks,
                           dst_contiguous=bool(rng.random() < 0.5)))
    return out


def waves(reqs: list[Request], size: int) -> list[list[Request]]:
    return [reqs[i:i + size] for i in range(0, len(reqs), size)]


def wait_all(rooms: list[Any], deadline: float, what: str) -> None:
    while time.monotonic() < deadline:
        states = [r.poll() for r in rooms]
        if all(s in (Poll.SUCCESS, Poll.FAILED) for s in states):
            return
        time.sleep(0.002)
    raise TimeoutError(f"{what}: rooms not finished by the deadline")


# -- prefill ----------------------------------------------------------------------------------
def decode_is_up(mgr: PrefillManager, room: int, known: set[str], until: float) -> None:
    """Wait until ``room`` was asked for or a decode peer not in ``known`` handshook (or ``until``).

    A host creates a room's senders when its router hands it the request, often before decode's
    request arrives; the drivers do so once decode is up. A decode process's start-up on a loaded
    machine can outlast ``bootstrap_timeout``, which a sender counts from its creation (tests of that
    timeout create their senders first on purpose). A decode that gave up before asking has handshaken:
    its Abort then fails the sender as it is created."""
    while not mgr.requested(room) and not {p.peer_id for p in mgr.peers()} - known and time.monotonic() < until:
        time.sleep(0.002)


def serve(mgr: PrefillManager, pools: Pools, sc: Scenario) -> int:
    """Serve ``sc``'s schedule from an existing prefill manager; return the number of failed rooms."""
    deadline = time.monotonic() + sc.deadline
    failed = 0
    known = {p.peer_id for p in mgr.peers()}
    for wave in waves(schedule(sc), sc.concurrency):
        decode_is_up(mgr, wave[0].room, known, min(deadline, time.monotonic() + sc.bootstrap_timeout))
        senders = []
        for slot, req in enumerate(wave):
            pools.meta[slot] = meta_row_for(req.room)
            senders.append((Sender(mgr, req.room, metadata_row=slot), req))
        pending = list(senders)
        while pending and time.monotonic() < deadline:
            still = []
            for sender, req in pending:
                st = sender.poll()
                if st == Poll.WAITING_FOR_INPUT:
                    pages = np.asarray(req.src_pages)
                    bounds = np.cumsum([0, *req.chunks])
                    for c in range(len(req.chunks)):
                        sender.send(pages[bounds[c]:bounds[c + 1]], last=c == len(req.chunks) - 1, layerwise=sc.layerwise)
                        if sc.layerwise:
                            for layer, draft in sender.layers:
                                sender.layer_ready(layer, draft=draft)
                elif st == Poll.BOOTSTRAPPING:
                    still.append((sender, req))
            pending = still
            time.sleep(0.001)
        wait_all([s for s, _ in senders], deadline, "prefill wave")
        for s, _ in senders:
            if s.poll() != Poll.SUCCESS:
                failed += 1
                print(f"room {s.room} FAILED: {s.failure()}", file=sys.stderr)
    return failed


def prefill_pools(sc: Scenario) -> Pools:
    pools = Pools(sc, sc.prefill_pages, meta_rows=sc.concurrency)
    pools.fill_source()
    return pools


def run_prefill(sc: Scenario) -> int:
    pools = prefill_pools(sc)
    server = BootstrapServer("127.0.0.1")
    print(f"BOOTSTRAP {server.address}", flush=True)
    mgr = PrefillManager(pools.kvargs, sc.backend, bootstrap=server.address, config=sc.session_config())
    try:
        failed = serve(mgr, pools, sc)
        print(json.dumps({"role": "prefill", "failed": failed, "active_rooms": mgr.active_rooms()}), flush=True)
    finally:
        mgr.close()
        server.close()
    return 1 if failed else 0


def hold(mgr: PrefillManager, sc: Scenario) -> dict[str, Any]:
    """Create a sender for every room of ``sc``'s schedule, never send, and report how each ended."""
    deadline = time.monotonic() + sc.deadline
    senders = [Sender(mgr, req.room) for req in schedule(sc)]
    while time.monotonic() < deadline and any(s.poll() not in (Poll.SUCCESS, Poll.FAILED) for s in senders):
        time.sleep(0.01)
    rooms = {str(s.room): {"state": s.poll().name, "reason": s.failure()} for s in senders}
    return {"role": "hold", "rooms": rooms, "active_rooms": mgr.active_rooms()}


def run_hold(sc: Scenario) -> int:
    pools = prefill_pools(sc)
    server = BootstrapServer("127.0.0.1")
    print(f"BOOTSTRAP {server.address}", flush=True)
    mgr = PrefillManager(pools.kvargs, sc.backend, bootstrap=server.address, config=sc.session_config())
    try:
        print(json.dumps(hold(mgr, sc)), flush=True)
    finally:
        mgr.close()
        server.close()
    return 0


# -- decode ----------------------------------------------------------------------------------
def run_decode(sc: Scenario, bootstrap: str) -> int:
    pools = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
    mgr = DecodeManager(pools.kvargs, sc.backend, config=sc.session_config())
    try:
        result = decode_schedule(mgr, pools, sc, bootstrap)
    finally:
        mgr.close()
    print(json.dumps(result), flush=True)
    return 0 if not result["failed"] and not result["mismatched_regions"] else 1


def decode_schedule(mgr: DecodeManager, pools: Pools, sc: Scenario, bootstrap: str) -> dict[str, Any]:
    """Receive ``sc``'s schedule from the prefill server at ``bootstrap`` with an existing manager; check every byte."""
    rng = np.random.default_rng(sc.seed + 1)
    words = sc.page_nbytes // 4
    result: dict[str, Any] = {"role": "decode", "requests": 0, "bytes": 0, "failed": [], "mismatched_regions": 0}
    deadline = time.monotonic() + sc.deadline
    t0 = time.monotonic()
    for wave in waves(schedule(sc), sc.concurrency):
        pools.reset()
        # Disjoint destinations: contiguous requests from the front, fragmented
        # ones as sorted random subsets of a shuffled remainder.
        cursor = 0
        shuffled = rng.permutation(np.arange(sum(len(r.src_pages) for r in wave if r.dst_contiguous), sc.decode_pages))
        frag_cursor = 0
        receivers = []
        dsts = []
        for slot, req in enumerate(wave):
            n = len(req.src_pages)
            if req.dst_contiguous:
                dst = np.arange(cursor, cursor + n)
                cursor += n
            else:
                dst = np.sort(shuffled[frag_cursor:frag_cursor + n])
                frag_cursor += n
            recv = Receiver(mgr, req.room, bootstrap=bootstrap)
            recv.init(dst, metadata_row=slot)
            receivers.append(recv)
            dsts.append(dst)
        wait_all(receivers, deadline, "decode wave")
        # Independent oracle: expected pools from the source pattern by plain indexing.
        expected = [np.full_like(a, SENTINEL) for a in pools.kv]
        expected_meta = np.full_like(pools.meta, SENTINEL)
        for slot, (req, recv, dst) in enumerate(zip(wave, receivers, dsts)):
            if recv.poll() != Poll.SUCCESS:
                result["failed"].append({"room": req.room, "reason": recv.failure()})
                continue
            for e, exp in enumerate(expected):
                exp[dst] = pattern(e, np.asarray(req.src_pages), words)
            expected_meta[slot] = meta_row_for(req.room)
            result["requests"] += 1
            result["bytes"] += len(req.src_pages) * sc.page_nbytes * len(pools.kv) + META_WORDS * 4
        for got, exp in zip([*pools.kv, pools.meta], [*expected, expected_meta]):
            result["mismatched_regions"] += int(not np.array_equal(got, exp))
    result["seconds"] = time.monotonic() - t0
    result["active_rooms"] = mgr.active_rooms()
    return result


# -- closing with rooms in flight ---------------------------------------------------------
def _closing(mgr: PrefillManager | DecodeManager, rooms: list[Any], role: str) -> dict[str, Any]:
    """Close ``mgr`` now; report how long it took and every room's state before and after."""
    before = {str(r.room): r.poll().name for r in rooms}
    t0 = time.monotonic()
    mgr.close()
    seconds = time.monotonic() - t0
    after = {str(r.room): {"state": r.poll().name, "reason": r.failure()} for r in rooms}
    return {"role": role, "before_close": before, "close_seconds": seconds, "rooms": after,
            "active_rooms": mgr.active_rooms()}


def run_prefill_close(sc: Scenario) -> int:
    pools = prefill_pools(sc)
    server = BootstrapServer("127.0.0.1")
    print(f"BOOTSTRAP {server.address}", flush=True)
    mgr = PrefillManager(pools.kvargs, sc.backend, bootstrap=server.address, config=sc.session_config())
    try:
        wave = schedule(sc)[:sc.concurrency]
        deadline = time.monotonic() + sc.deadline
        decode_is_up(mgr, wave[0].room, set(), min(deadline, time.monotonic() + sc.bootstrap_timeout))
        senders = [Sender(mgr, req.room, metadata_row=slot) for slot, req in enumerate(wave)]
        while time.monotonic() < deadline and any(s.poll() == Poll.BOOTSTRAPPING for s in senders):
            time.sleep(0.002)
        for sender, req in zip(senders, wave):
            sender.send(req.src_pages[:(len(req.src_pages) + 1) // 2])  # never the last chunk
        result = _closing(mgr, senders, "prefill-close")
    finally:
        mgr.close()
        server.close()
    print(json.dumps(result), flush=True)
    return 0


def run_decode_close(sc: Scenario, bootstrap: str) -> int:
    pools = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
    mgr = DecodeManager(pools.kvargs, sc.backend, config=sc.session_config())
    try:
        receivers, cursor = [], 0
        for slot, req in enumerate(schedule(sc)[:sc.concurrency]):
            recv = Receiver(mgr, req.room, bootstrap=bootstrap)
            recv.init(np.arange(cursor, cursor + len(req.src_pages)), metadata_row=slot)
            cursor += len(req.src_pages)
            receivers.append(recv)
        # In flight: prefill has written a chunk into every room (its host never sends the last).
        deadline = time.monotonic() + sc.deadline
        while time.monotonic() < deadline and any(r.poll() in (Poll.BOOTSTRAPPING, Poll.WAITING_FOR_INPUT) for r in receivers):
            time.sleep(0.002)
        result = _closing(mgr, receivers, "decode-close")
    finally:
        mgr.close()
    print(json.dumps(result), flush=True)
    return 0


# -- a bare engine ----------------------------------------------------------------------------
def run_engine(sc: Scenario) -> int:
    """A destination engine without a session: registers decode pools, prints how to reach them, waits."""
    pools = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
    backend = open_transport(sc.backend, host="127.0.0.1", name=f"engine-{os.getpid()}",
                             transfer_timeout=sc.transfer_timeout, options=dict(sc.backend_options))
    backend.register(pools.kvargs.regions)
    print(f"ENGINE {msgspec.msgpack.encode(backend.metadata()).hex()} {msgspec.json.encode(pools.kvargs).decode()}", flush=True)
    try:
        time.sleep(sc.deadline)  # until the test kills it
    finally:
        backend.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.e2e")
    parser.add_argument("role", choices=["prefill", "decode", "hold", "prefill-close", "decode-close", "engine"])
    parser.add_argument("--scenario", required=True, help="Scenario as JSON")
    parser.add_argument("--bootstrap", help="decode: the prefill bootstrap address")
    args = parser.parse_args(argv)
    sc = msgspec.json.decode(args.scenario, type=Scenario)
    if args.role == "prefill":
        return run_prefill(sc)
    if args.role == "hold":
        return run_hold(sc)
    if args.role == "prefill-close":
        return run_prefill_close(sc)
    if args.role == "engine":
        return run_engine(sc)
    if not args.bootstrap:
        parser.error(f"{args.role} needs --bootstrap")
    if args.role == "decode-close":
        return run_decode_close(sc, args.bootstrap)
    return run_decode(sc, args.bootstrap)


if __name__ == "__main__":
    sys.exit(main())
