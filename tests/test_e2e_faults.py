"""Faults and policy of the session layer, with real processes and real engines on 127.0.0.1.

Prefill and decode always run in different processes: one side is often this
pytest process (a PrefillManager with its BootstrapServer, or a DecodeManager)
and the other a driver from :mod:`kvbridge.testing.e2e` (``prefill``,
``decode``, or ``hold``: a prefill rank that opens a sender per room and never
sends). Hostile peers are bare zmq DEALER sockets speaking the control
protocol by hand. Every wait is bounded and every child process is killed at
teardown.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.core import protocol as P
from kvbridge.core.backend import BackendConfig
from kvbridge.core.bootstrap import BootstrapServer
from kvbridge.core.layout import KVArgs
from kvbridge.core.plugins import PluginError, get_registry
from kvbridge.core.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from kvbridge.testing import available_backends
from kvbridge.testing.e2e import SENTINEL, Pools, Scenario, meta_row_for, pattern, prefill_pools, schedule, serve

BACKENDS = available_backends()

SLACK = 1.0  # seconds allowed past a configured deadline (tick granularity, a loaded 2-core box)
START_WAIT = 30.0  # a driver process printing its bootstrap address
EXIT_WAIT = 30.0  # a driver process finishing its schedule and closing its engine
REPLY_WAIT = 3.0  # one control-message round trip
HOSTILE_META = b"127.0.0.1:1"  # engine metadata in Hellos that are refused before the backend sees them

BASE = Scenario(
    backend="?",
    layers=2,
    page_nbytes=64,
    prefill_pages=1024,
    decode_pages=1024,
    requests=8,
    max_pages=32,
    concurrency=8,
    max_chunks=3,
    bootstrap_timeout=5.0,
    waiting_timeout=30.0,
    transfer_timeout=5.0,
    heartbeat_interval=0.2,
    heartbeat_timeout=1.5,
    deadline=30.0,
)


def scenario(backend: str, **changes: Any) -> Scenario:
    return msgspec.structs.replace(BASE, backend=backend, **changes)


# -- fixtures and helpers -------------------------------------------------------------------
@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name = request.param
    try:
        available = get_registry().backend_available(name)
    except PluginError as exc:
        pytest.skip(str(exc))
    if not available:
        pytest.skip(f"backend {name!r} is registered but its engine package is not installed")
    return name


class Child:
    """An e2e driver process; its output goes to files so a full pipe never blocks it."""

    def __init__(self, role: str, sc: Scenario, stem: Path, bootstrap: str | None) -> None:
        self.role = role
        self.out_path, self.err_path = stem.with_suffix(".out"), stem.with_suffix(".err")
        cmd = [sys.executable, "-m", "kvbridge.testing.e2e", role, "--scenario", msgspec.json.encode(sc).decode()]
        if bootstrap is not None:
            cmd += ["--bootstrap", bootstrap]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @cached_property
    def bootstrap(self) -> str:
        """The ``host:port`` a prefill-side driver prints first."""
        deadline = time.monotonic() + START_WAIT
        while time.monotonic() < deadline:
            line, newline, _ = self.stdout().partition("\n")
            if newline:
                assert line.startswith("BOOTSTRAP "), f"{self.role} printed {line!r} first"
                return line.split()[1]
            if self.proc.poll() is not None:
                pytest.fail(f"{self.role} exited with {self.proc.returncode} before printing BOOTSTRAP:\n{self.stderr()[-3000:]}")
            time.sleep(0.02)
        pytest.fail(f"{self.role} printed no BOOTSTRAP line within {START_WAIT}s")

    def finish(self, timeout: float = EXIT_WAIT) -> tuple[int, dict[str, Any] | None]:
        """Wait for the exit; return the exit code and the last JSON line printed."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.role} did not exit within {timeout}s; stderr tail:\n{self.stderr()[-3000:]}")
        lines = [line for line in self.stdout().splitlines() if line.startswith("{")]
        return rc, json.loads(lines[-1]) if lines else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(role: str, sc: Scenario, bootstrap: str | None = None) -> Child:
        child = Child(role, sc, tmp_path / f"{len(started)}-{role}", bootstrap)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()


@dataclass
class LocalPrefill:
    pools: Pools
    server: BootstrapServer
    mgr: PrefillManager

    @property
    def address(self) -> str:
        return self.server.address


@pytest.fixture
def local_prefill() -> Iterator[Callable[..., LocalPrefill]]:
    """Prefill in this process: source pools filled with the e2e pattern, a bootstrap server, a manager."""
    made: list[LocalPrefill] = []

    def make(sc: Scenario, config: SessionConfig | None = None) -> LocalPrefill:
        pools = prefill_pools(sc)
        server = BootstrapServer("127.0.0.1")
        try:
            mgr = PrefillManager(pools.kvargs, sc.backend, bootstrap=server.address, config=config or sc.session_config())
        except BaseException:
            server.close()
            raise
        made.append(LocalPrefill(pools, server, mgr))
        return made[-1]

    yield make
    for p in made:
        p.mgr.close()
        p.server.close()


@dataclass
class LocalDecode:
    pools: Pools
    mgr: DecodeManager


@pytest.fixture
def local_decode() -> Iterator[Callable[..., LocalDecode]]:
    """Decode in this process: sentinel-filled pools and a manager (``kvargs`` overrides the description)."""
    made: list[LocalDecode] = []

    def make(sc: Scenario, config: SessionConfig | None = None, kvargs: KVArgs | None = None) -> LocalDecode:
        pools = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
        mgr = DecodeManager(kvargs or pools.kvargs, sc.backend, config=config or sc.session_config())
        made.append(LocalDecode(pools, mgr))
        return made[-1]

    yield make
    for d in made:
        d.mgr.close()


class RawClient:
    """A bare zmq DEALER speaking the control protocol by hand: no kvbridge session code."""

    def __init__(self, address: str, name: str) -> None:
        self.identity = f"{name}-{uuid.uuid4().hex[:8]}"
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        self.sock.connect(f"tcp://{address}")

    def ask_raw(self, payload: bytes) -> P.Message:
        self.sock.send(payload)
        if not self.sock.poll(int(REPLY_WAIT * 1000), zmq.POLLIN):
            pytest.fail(f"no reply within {REPLY_WAIT}s to {payload[:60]!r}")
        return P.decode(self.sock.recv())

    def ask(self, msg: P.Message) -> P.Message:
        return self.ask_raw(P.encode(msg))

    def send(self, msg: P.Message) -> None:
        self.sock.send(P.encode(msg))

    def handshake(self, pools: Pools, backend: str) -> None:
        # Real engine metadata for the memory it describes (kept alive with the
        # client), so the prefill's backend accepts the peer: the hostility is in
        # what this client sends afterwards. Nothing is ever written to it.
        self.pools = pools
        self.engine = get_registry().load_backend(backend)(BackendConfig(name=self.identity))
        self.engine.register(pools.kvargs.regions)
        reply = self.ask(P.Hello(peer_id=self.identity, backend=backend, backend_meta=self.engine.metadata(), kvargs=pools.kvargs))
        assert isinstance(reply, P.HelloAck), reply

    def close(self) -> None:
        self.sock.close(linger=0)
        if getattr(self, "engine", None) is not None:
            self.engine.close()


@pytest.fixture
def raw_clients() -> Iterator[Callable[[str, str], RawClient]]:
    made: list[RawClient] = []

    def make(address: str, name: str) -> RawClient:
        made.append(RawClient(address, name))
        return made[-1]

    yield make
    for c in made:
        c.close()


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` until true; return the seconds it took, fail after ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not within {timeout}s")
        time.sleep(0.005)
    return time.monotonic() - t0


def finished(room: Sender | Receiver) -> Callable[[], bool]:
    return lambda: room.poll() in (Poll.SUCCESS, Poll.FAILED)


def send_all(sender: Sender, src_pages: list[int], chunks: list[int]) -> None:
    bounds = np.cumsum([0, *chunks])
    for c in range(len(chunks)):
        sender.send(np.asarray(src_pages[bounds[c]:bounds[c + 1]]), last=c == len(chunks) - 1)


def serve_a_fresh_decode(prefill: LocalPrefill, children: Callable[..., Child], sc: Scenario) -> None:
    """The in-process prefill serves ``sc`` to a new decode process, which verifies every byte."""
    decode = children("decode", sc, bootstrap=prefill.address)
    assert serve(prefill.mgr, prefill.pools, sc) == 0
    rc, result = decode.finish()
    assert rc == 0, f"decode: {result}\n{decode.stderr()[-3000:]}"
    assert result is not None and result["requests"] == sc.requests and result["failed"] == []
    assert result["mismatched_regions"] == 0
    wait_until(lambda: prefill.mgr.active_rooms() == 0, SLACK, "prefill rooms released")


def snapshot(pools: Pools) -> list[np.ndarray]:
    return [a.copy() for a in (*pools.kv, pools.meta)]


def unchanged(pools: Pools, before: list[np.ndarray]) -> bool:
    return all(np.array_equal(a, b) for a, b in zip((*pools.kv, pools.meta), before))


def all_sentinel(pools: Pools) -> bool:
    return all((a == SENTINEL).all() for a in (*pools.kv, pools.meta))


# -- 1. a decode process dies mid-transfer -------------------------------------------------------
def test_decode_killed_mid_transfer_fails_the_sender_in_time_and_the_prefill_serves_the_next_decode(
    backend, local_prefill, children
):
    # One request of at least 10,000 pages; prefill sends every other source page,
    # so nothing coalesces: one descriptor per page and region, seconds of work.
    big = scenario(backend, prefill_pages=32768, decode_pages=16384, max_pages=16384, max_chunks=1, requests=1)
    big = next(s for s in (msgspec.structs.replace(big, seed=i) for i in range(100))
               if len(schedule(s)[0].src_pages) >= 10_000)
    (req,) = schedule(big)
    prefill = local_prefill(big)
    doomed = children("decode", big, bootstrap=prefill.address)
    sender = Sender(prefill.mgr, req.room)
    wait_until(lambda: sender.poll() >= Poll.WAITING_FOR_INPUT, START_WAIT, "decode's request")
    sender.send(np.arange(len(req.src_pages)) * 2, last=True)
    time.sleep(0.02)  # let the write start; the fastest backend here needs ~0.17 s for it all
    assert sender.poll() == Poll.TRANSFERRING, "the chunk finished before the kill; make it larger"

    doomed.kill()
    cfg = prefill.mgr.config
    bound = cfg.transfer_timeout + cfg.heartbeat_timeout + SLACK
    elapsed = wait_until(finished(sender), bound, "sender after the decode was killed")
    assert sender.poll() == Poll.FAILED
    assert elapsed < bound
    assert re.match(
        r"transfer of chunk 0 to '.+' failed: |transfer did not complete within transfer_timeout=|decode peer '.+' sent no heartbeat",
        sender.failure() or "",
    ), sender.failure()

    fresh = scenario(backend, prefill_pages=big.prefill_pages, concurrency=big.concurrency, seed=1)
    serve_a_fresh_decode(prefill, children, fresh)


# -- 2. a prefill process dies while decode waits ----------------------------------------------
def test_prefill_killed_fails_the_waiting_receiver_within_the_heartbeat_timeout(backend, local_decode, children):
    sc = scenario(backend, requests=1, bootstrap_timeout=30.0)  # the holder keeps its sender open
    holder = children("hold", sc)
    decode = local_decode(sc)
    (req,) = schedule(sc)
    recv = Receiver(decode.mgr, req.room, bootstrap=holder.bootstrap)
    recv.init(np.arange(len(req.src_pages)), metadata_row=0)
    wait_until(lambda: recv.poll() == Poll.WAITING_FOR_INPUT, START_WAIT, "handshake with the holder")
    time.sleep(3 * sc.heartbeat_interval)  # heartbeats are flowing

    holder.kill()
    elapsed = wait_until(finished(recv), sc.heartbeat_timeout + SLACK, "receiver after the prefill was killed")
    assert recv.poll() == Poll.FAILED
    assert re.fullmatch(
        r"prefill tp0/pp0 at 127\.0\.0\.1:\d+ sent nothing for \d+\.\ds \(heartbeat_timeout=1\.5s\)", recv.failure() or ""
    ), recv.failure()
    assert elapsed < sc.heartbeat_timeout + SLACK
    assert decode.mgr.active_rooms() == 0


# -- 3. destination indices outside the registered pool -----------------------------------------
@pytest.mark.parametrize("bad", ["past-the-end", "negative"])
def test_receiver_init_with_a_page_outside_the_pool_fails_at_once_and_sends_nothing(backend, local_decode, children, bad):
    sc = scenario(backend, requests=1)
    prefill = children("prefill", sc)
    decode = local_decode(sc)
    (req,) = schedule(sc)
    n = len(req.src_pages)
    recv = Receiver(decode.mgr, req.room, bootstrap=prefill.bootstrap)
    wait_until(lambda: recv.poll() == Poll.WAITING_FOR_INPUT, START_WAIT, "handshake")  # a request would go out at once
    dst = np.arange(n)
    dst[-1] = sc.decode_pages if bad == "past-the-end" else -1
    recv.init(dst, metadata_row=0)
    assert recv.poll() == Poll.FAILED
    assert recv.failure() == (
        f"room {req.room}: destination kv_page index[{n - 1}] = {dst[-1]} is out of range "
        f"(valid range is 0..{sc.decode_pages - 1})"
    )

    # Prefill takes one request per room (a bad one would have failed its sender), so this
    # retry can only succeed if nothing was sent for the failed receiver.
    retry = Receiver(decode.mgr, req.room, bootstrap=prefill.bootstrap)
    dst = np.arange(n) + 7
    retry.init(dst, metadata_row=0)
    wait_until(finished(retry), 10.0, "retry")
    assert retry.poll() == Poll.SUCCESS, retry.failure()
    words = sc.page_nbytes // 4
    for e, got in enumerate(decode.pools.kv):
        expected = np.full_like(got, SENTINEL)
        expected[dst] = pattern(e, np.asarray(req.src_pages), words)
        np.testing.assert_array_equal(got, expected, err_msg=f"region {e}")
    np.testing.assert_array_equal(decode.pools.meta[0], meta_row_for(req.room))
    assert (decode.pools.meta[1:] == SENTINEL).all()
    rc, result = prefill.finish()
    assert rc == 0 and result == {"role": "prefill", "failed": 0, "active_rooms": 0}, prefill.stderr()[-3000:]


@pytest.mark.parametrize("sender_first", [True, False], ids=["sender-created", "no-sender-yet"])
def test_hostile_request_for_a_page_outside_the_pool_gets_failed_and_moves_no_bytes(
    backend, local_prefill, children, raw_clients, sender_first
):
    sc = scenario(backend)
    prefill = local_prefill(sc)
    before = snapshot(prefill.pools)
    claimed = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)  # the memory the hostile client describes
    hostile = raw_clients(prefill.mgr.control_address, "hostile")
    hostile.handshake(claimed, backend)
    room, bad = 4242, sc.decode_pages + 5
    sender = Sender(prefill.mgr, room) if sender_first else None

    reply = hostile.ask(P.TransferRequest(room=room, indices={"kv_page": np.array([0, bad], "<i4").tobytes()}, metadata_row=0))
    reason = (
        f"bad transfer request from decode {hostile.identity!r}: destination kv_page index[1] = {bad} "
        f"is out of range (valid range is 0..{sc.decode_pages - 1})"
    )
    assert reply == P.Failed(room=room, reason=reason)
    if sender is not None:
        assert sender.poll() == Poll.FAILED and sender.failure() == reason
    assert prefill.mgr.active_rooms() == 0  # nothing pending, nothing held
    assert unchanged(prefill.pools, before)
    assert all_sentinel(claimed)

    serve_a_fresh_decode(prefill, children, scenario(backend, seed=1))
    assert all_sentinel(claimed)


def test_bad_request_from_another_decode_does_not_fail_a_room_it_does_not_own(
    backend, local_prefill, children, raw_clients
):
    sc = scenario(backend, requests=1)
    (req,) = schedule(sc)
    prefill = local_prefill(sc)
    decode = children("decode", sc, bootstrap=prefill.address)
    prefill.pools.meta[0] = meta_row_for(req.room)
    sender = Sender(prefill.mgr, req.room, metadata_row=0)
    wait_until(lambda: sender.poll() >= Poll.WAITING_FOR_INPUT, START_WAIT, "decode's request")

    hostile = raw_clients(prefill.mgr.control_address, "hostile")
    hostile.handshake(Pools(sc, sc.decode_pages, meta_rows=sc.concurrency), backend)
    reply = hostile.ask(P.TransferRequest(room=req.room, indices={"kv_page": b"\x01\x02\x03"}, metadata_row=0))
    assert isinstance(reply, P.Failed) and reply.room == req.room
    assert sender.poll() == Poll.WAITING_FOR_INPUT, f"the real decode's room was failed: {sender.failure()}"

    send_all(sender, req.src_pages, req.chunks)
    wait_until(finished(sender), 10.0, "sender")
    assert sender.poll() == Poll.SUCCESS, sender.failure()
    rc, result = decode.finish()
    assert rc == 0 and result is not None and result["failed"] == [] and result["mismatched_regions"] == 0


def test_abort_from_another_decode_does_not_drop_a_pending_request_it_does_not_own(
    backend, local_prefill, children, raw_clients
):
    sc = scenario(backend, requests=1)
    (req,) = schedule(sc)
    prefill = local_prefill(sc)
    decode = children("decode", sc, bootstrap=prefill.address)
    # No sender yet: decode's request waits in the prefill manager for the host to create one.
    wait_until(lambda: prefill.mgr.active_rooms() == 1, START_WAIT, "decode's request pending")

    hostile = raw_clients(prefill.mgr.control_address, "hostile")
    hostile.handshake(Pools(sc, sc.decode_pages, meta_rows=sc.concurrency), backend)
    hostile.send(P.Abort(room=req.room, reason="not mine to abort"))
    assert isinstance(hostile.ask(P.Heartbeat()), P.Heartbeat)  # the Abort has been handled

    prefill.pools.meta[0] = meta_row_for(req.room)
    sender = Sender(prefill.mgr, req.room, metadata_row=0)
    assert sender.poll() == Poll.WAITING_FOR_INPUT, "the real decode's pending request was dropped"
    send_all(sender, req.src_pages, req.chunks)
    wait_until(finished(sender), 10.0, "sender")
    assert sender.poll() == Poll.SUCCESS, sender.failure()
    rc, result = decode.finish()
    assert rc == 0 and result is not None and result["failed"] == []


# -- 4. malformed and wrong-version control messages -----------------------------------------
KNOWN_TAGS = ["register", "register_ack", "lookup", "lookup_reply", "hello", "hello_ack", "transfer_request",
              "chunk_done", "done", "failed", "abort", "heartbeat", "reject"]
ROOMS = st.integers(0, 2**40)
MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=16) | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@dataclass(frozen=True)
class Probe:
    """One fuzzed payload, who sends it, and the reply it must get."""

    payload: bytes
    handshaken: bool
    expect: Callable[[P.Message, str], bool]  # (reply, sender identity) -> ok
    what: str


_ANY: Any = object()


def _reject(text: str | None = None, room: int | None = _ANY) -> Callable[[P.Message, str], bool]:
    """A Reject with a reason; ``text`` (formatted with the sender's identity) and ``room`` when given."""
    return lambda r, ident: (
        isinstance(r, P.Reject)
        and bool(r.reason)
        and (room is _ANY or r.room == room)
        and (text is None or r.reason == text.format(ident=ident))
    )


def _probes(kvargs: KVArgs, backend: str) -> st.SearchStrategy[Probe]:
    random_bytes = st.binary(max_size=300).map(lambda b: Probe(b, False, _reject(), "random bytes"))
    wrong_shape = MSGPACK_VALUES.map(lambda v: Probe(msgspec.msgpack.encode(v), False, _reject(), "msgpack of a wrong shape"))
    known_tag_wrong_fields = st.builds(
        lambda tag, fields: Probe(msgspec.msgpack.encode({"type": tag, "v": 1, **fields}), False, _reject(), "wrong fields"),
        st.sampled_from(KNOWN_TAGS),
        st.dictionaries(st.text(max_size=12).filter(lambda k: k not in ("type", "v")), MSGPACK_VALUES, min_size=1, max_size=4),
    )

    def versioned(v: int, room: int) -> st.SearchStrategy[P.Message]:
        return st.sampled_from([
            P.Heartbeat(v=v),
            P.Lookup(v=v),
            P.Abort(v=v, room=room, reason="x"),
            P.TransferRequest(v=v, room=room, indices={"kv_page": P.pack_indices([0, 1])}, metadata_row=0),
            P.Hello(v=v, peer_id="x", backend=backend, backend_meta=HOSTILE_META, kvargs=kvargs),
        ])

    wrong_version = st.tuples(st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != P.PROTOCOL_VERSION), ROOMS, st.booleans()).flatmap(
        lambda t: versioned(t[0], t[1]).map(lambda msg: Probe(
            P.encode(msg), t[2],
            _reject(f"protocol version {t[0]} is not supported (this side speaks {P.PROTOCOL_VERSION}); "
                    "run the same kvbridge version on prefill and decode", room=None),
            f"version {t[0]}",
        ))
    )
    unknown_tag = st.builds(
        lambda tag, fields: Probe(
            msgspec.msgpack.encode({"type": tag, "v": 1, **fields}), False,
            lambda r, ident: isinstance(r, P.Reject) and r.reason.startswith(f"malformed {tag!r} message: "),
            f"unknown tag {tag!r}",
        ),
        st.text(min_size=1, max_size=20).filter(lambda t: t not in KNOWN_TAGS),
        st.dictionaries(st.text(max_size=12).filter(lambda k: k not in ("type", "v")), MSGPACK_VALUES, max_size=3),
    )
    before_hello = st.builds(
        lambda msg: Probe(
            P.encode(msg), False,
            _reject(f"{type(msg).__name__} from {{ident!r}} before a handshake; send Hello first", getattr(msg, "room", None)),
            f"{type(msg).__name__} before Hello",
        ),
        st.one_of(
            st.builds(P.TransferRequest, room=ROOMS, indices=st.just({"kv_page": P.pack_indices([3])}), metadata_row=st.integers(0, 7)),
            st.builds(P.ChunkDone, room=ROOMS, chunk=st.integers(0, 9), last=st.booleans()),
            st.builds(P.Done, room=ROOMS),
            st.just(P.Heartbeat()),
        ),
    )
    ragged_indices = st.builds(
        lambda room, space, data: Probe(
            P.encode(P.TransferRequest(room=room, indices={space: data}, metadata_row=0)), True,
            lambda r, ident: r == P.Failed(room=room, reason=(
                f"bad transfer request from decode {ident!r}: index list {space!r} has {len(data)} bytes, "
                "not a multiple of 4 (int32)"
            )),
            "ragged index bytes",
        ),
        ROOMS,
        st.sampled_from(["kv_page", "metadata_row", "no_such_space"]),
        st.binary(max_size=64).filter(lambda b: len(b) % 4 != 0),
    )
    return st.one_of(random_bytes, wrong_shape, known_tag_wrong_fields, wrong_version, unknown_tag, before_hello, ragged_indices)


def test_garbage_control_messages_are_refused_and_the_prefill_keeps_serving(
    backend, local_prefill, children, raw_clients, caplog
):
    caplog.set_level(logging.WARNING)
    sc = scenario(backend)
    # A long heartbeat timeout keeps the hand-made peer's handshake alive through shrinking.
    prefill = local_prefill(sc, config=msgspec.structs.replace(sc, heartbeat_timeout=120.0).session_config())
    claimed = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
    stranger = raw_clients(prefill.mgr.control_address, "stranger")  # never says Hello
    peer = raw_clients(prefill.mgr.control_address, "peer")
    peer.handshake(claimed, backend)

    @settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(_probes(claimed.kvargs, backend))
    def refused(probe: Probe) -> None:
        client = peer if probe.handshaken else stranger
        reply = client.ask_raw(probe.payload)
        assert probe.expect(reply, client.identity), f"{probe.what}: {probe.payload[:80]!r} got {reply}"

    refused()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("kvbridge")]
    assert not errors, [r.getMessage() for r in errors]
    assert prefill.mgr.active_rooms() == 0
    assert isinstance(peer.ask(P.Heartbeat()), P.Heartbeat)  # the fuzzing peer is still connected
    serve_a_fresh_decode(prefill, children, scenario(backend, seed=1))


def test_unknown_message_type_without_a_version_is_not_reported_as_a_version_mismatch(
    backend, local_prefill, raw_clients
):
    # "v" is optional on the wire (it defaults to the current version), so a message
    # without it must be refused for what is wrong with it, not as "protocol version -1".
    prefill = local_prefill(scenario(backend))
    client = raw_clients(prefill.mgr.control_address, "client")
    reply = client.ask_raw(msgspec.msgpack.encode({"type": "bogus"}))
    assert isinstance(reply, P.Reject)
    assert reply.reason.startswith("malformed 'bogus' message: "), reply.reason


# -- 5. incompatible layouts at handshake --------------------------------------------------------
LAYOUT_CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    # case: (scenario changes, KVArgs changes on decode, the difference both sides must name)
    "page_size": ({}, {"page_size": 32}, "page size differs: prefill 16 tokens, decode 32"),
    "dtype": ({}, {"dtype": "float16"}, "KV dtype differs: prefill 'bfloat16', decode 'float16'"),
    "missing_layer": (
        {"layers": 1}, {},
        "decode registered no region for 2 prefill region(s): kv/k layer 1 ('k1'), kv/v layer 1 ('v1'); "
        "both sides must run the same model config",
    ),
}


@pytest.mark.parametrize("case", sorted(LAYOUT_CHANGES))
def test_incompatible_layout_fails_the_handshake_and_both_sides_name_the_difference(backend, local_decode, children, case):
    sc = scenario(backend, requests=1, bootstrap_timeout=30.0)
    sc_changes, kv_changes, difference = LAYOUT_CHANGES[case]
    holder = children("hold", sc)
    decode_sc = msgspec.structs.replace(sc, **sc_changes)
    pools = Pools(decode_sc, decode_sc.decode_pages, meta_rows=decode_sc.concurrency)
    decode = local_decode(decode_sc, kvargs=msgspec.structs.replace(pools.kvargs, **kv_changes))
    recv = Receiver(decode.mgr, schedule(sc)[0].room, bootstrap=holder.bootstrap)
    wait_until(finished(recv), 10.0, "receiver")
    assert recv.poll() == Poll.FAILED

    logged = re.compile(rf"rejected handshake from {re.escape(repr(decode.mgr.peer_id))}: (.*)$", re.M)
    wait_until(lambda: logged.search(holder.stderr()) is not None, 5.0, "prefill logging the rejection")
    problem = logged.search(holder.stderr()).group(1)  # type: ignore[union-attr]
    assert problem == f"incompatible layouts: {difference}"
    assert re.fullmatch(r"prefill tp0/pp0 at 127\.0\.0\.1:\d+ rejected the handshake: (.*)", recv.failure() or "")
    assert recv.failure().endswith(f" rejected the handshake: {problem}")  # type: ignore[union-attr]
    assert decode.mgr.active_rooms() == 0


# -- 6. aborts ---------------------------------------------------------------------------------
def test_receiver_abort_fails_the_waiting_sender_with_aborted_by_decode(backend, local_decode, children):
    sc = scenario(backend, requests=1, bootstrap_timeout=30.0)
    holder = children("hold", sc)  # its sender waits and never sends
    decode = local_decode(sc)
    (req,) = schedule(sc)
    recv = Receiver(decode.mgr, req.room, bootstrap=holder.bootstrap)
    wait_until(lambda: recv.poll() == Poll.WAITING_FOR_INPUT, START_WAIT, "handshake")
    recv.init(np.arange(len(req.src_pages)), metadata_row=0)
    time.sleep(0.3)  # the request reaches the holder's sender, which then waits

    recv.abort("the user cancelled the request")
    assert recv.poll() == Poll.FAILED and recv.failure() == "the user cancelled the request"
    assert decode.mgr.active_rooms() == 0
    rc, result = holder.finish()
    assert rc == 0, holder.stderr()[-3000:]
    assert result == {
        "role": "hold",
        "rooms": {str(req.room): {"state": "FAILED", "reason": "aborted by decode: the user cancelled the request"}},
        "active_rooms": 0,
    }


def test_sender_abort_fails_the_receiver_with_the_prefill_reason(backend, local_prefill, children):
    sc = scenario(backend, requests=1)
    (req,) = schedule(sc)
    prefill = local_prefill(sc)
    decode = children("decode", sc, bootstrap=prefill.address)
    sender = Sender(prefill.mgr, req.room)
    wait_until(lambda: sender.poll() >= Poll.WAITING_FOR_INPUT, START_WAIT, "decode's request")

    sender.abort("prefill dropped the request: out of KV memory")
    assert sender.poll() == Poll.FAILED and sender.failure() == "prefill dropped the request: out of KV memory"
    assert prefill.mgr.active_rooms() == 0
    rc, result = decode.finish()
    assert rc == 1 and result is not None
    assert result["failed"] == [{
        "room": req.room,
        "reason": f"prefill tp0/pp0 at {prefill.mgr.control_address}: prefill dropped the request: out of KV memory",
    }]
    assert result["active_rooms"] == 0


# -- 7. bootstrap timeout -------------------------------------------------------------------------
def test_receiver_fails_within_the_bootstrap_timeout_when_nothing_listens(backend, local_decode):
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % s.getsockname()[1]
    sc = scenario(backend, bootstrap_timeout=2.0)
    decode = local_decode(sc)
    t0 = time.monotonic()
    recv = Receiver(decode.mgr, 1, bootstrap=address)
    recv.init([0, 1], metadata_row=0)
    wait_until(finished(recv), sc.bootstrap_timeout + SLACK, "receiver")
    elapsed = time.monotonic() - t0
    assert recv.poll() == Poll.FAILED
    assert "bootstrap_timeout=2.0s" in (recv.failure() or ""), recv.failure()
    assert sc.bootstrap_timeout <= elapsed < sc.bootstrap_timeout + SLACK
    assert decode.mgr.active_rooms() == 0


# -- 8. nothing leaks ------------------------------------------------------------------------------
def test_ten_thousand_one_page_requests_leave_no_rooms_behind(backend, children):
    sc = scenario(backend, requests=10_000, max_pages=1, max_chunks=1, concurrency=64, deadline=80.0)
    prefill = children("prefill", sc)
    decode = children("decode", sc, bootstrap=prefill.bootstrap)
    rc_d, d = decode.finish(sc.deadline + 10)
    rc_p, p = prefill.finish()
    assert rc_d == 0 and d is not None, decode.stderr()[-3000:]
    assert d["requests"] == 10_000 and d["failed"] == [] and d["mismatched_regions"] == 0
    assert d["active_rooms"] == 0
    assert rc_p == 0 and p == {"role": "prefill", "failed": 0, "active_rooms": 0}, prefill.stderr()[-3000:]
