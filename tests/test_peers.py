"""Issue 28: a peer that restarts is a new peer; failures reach the other side at once; no stranger
can take a rank's route; what is remembered for rooms whose sender does not exist yet.

Real managers throughout (in this process where a process boundary is not the point, in
driver processes where it is: a kill, a freeze), real zmq sockets for the attackers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvbridge.core.control import auth as A
from kvbridge.core.control import protocol as P
from kvbridge.core.transfer.backend import BackendConfig, TransferError
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.control.channel import Channel
from kvbridge.core.control.metrics import metrics
from kvbridge.core.planning.plan import TransferPlan
from kvbridge.core.description.plugins import get_registry
from kvbridge.core.sessions import servers
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from kvbridge.testing.e2e import Pools, Scenario, pattern, prefill_pools
from kvbridge.testing.memory import MemoryBackend
from kvbridge.testing import decode_restart as DR
from kvbridge.testing.restart import BACKENDS, RESTART, PAGES as RESTART_PAGES, PrefillProcess, measure, table

SC = Scenario(backend="memory", layers=1, page_nbytes=64, prefill_pages=256, decode_pages=256, concurrency=1,
              bootstrap_timeout=10.0, transfer_timeout=2.0, heartbeat_interval=0.2, heartbeat_timeout=1.0)
PAGES = 16
#: The documented bound (docs/failures.md) is 2 s from the new process's registration to its first
#: SUCCESS (measured 0.1-0.3 s); asserted generously, for a loaded 2-core CI box.
RESTART_BOUND = 5.0


def wait_for(cond: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not within {timeout}s")
        time.sleep(0.002)
    return time.monotonic() - t0


@dataclasses.dataclass
class Pair:
    src: Pools
    dst: Pools
    server: BootstrapServer
    pm: PrefillManager
    dm: DecodeManager

    def room(self, room: int, timeout: float = 10.0) -> Receiver:
        """One room through both managers, served by this process as prefill's host; its receiver, final."""
        self.dst.reset()
        recv = Receiver(self.dm, room, bootstrap=self.server.address)
        recv.init(np.arange(PAGES), metadata_row=0)
        wait_for(lambda: self.pm.requested(room) or recv.final, timeout, f"room {room}'s request")
        if not recv.final:
            sender = Sender(self.pm, room)
            sender.wait(Poll.WAITING_FOR_INPUT, timeout)
            sender.send(np.arange(PAGES) + room % 7, last=True)
        recv.wait(Poll.SUCCESS, timeout)
        return recv

    def exact(self, room: int) -> bool:
        """Decode holds room ``room``'s pages, by plain indexing of the source pattern (not the planner)."""
        words = SC.page_nbytes // 4
        return all(np.array_equal(a[:PAGES], pattern(e, np.arange(PAGES) + room % 7, words))
                   for e, a in enumerate(self.dst.kv))


@contextlib.contextmanager
def pair(prefill_backend: Any = "memory", prefill: SessionConfig | None = None) -> Iterator[Pair]:
    src, dst = prefill_pools(SC), Pools(SC, SC.decode_pages, meta_rows=1)
    server = BootstrapServer("127.0.0.1")
    pm = dm = None
    try:
        pm = PrefillManager(src.kvargs, prefill_backend, bootstrap=server.address, config=prefill or SC.session_config())
        dm = DecodeManager(dst.kvargs, "memory", config=SC.session_config())
        yield Pair(src, dst, server, pm, dm)
    finally:
        for m in (dm, pm):
            if m is not None:
                m.close()
        server.close()


def restarted(host: str, port: int) -> BootstrapServer:
    """A bootstrap server on the port a closed one had (zmq releases it asynchronously: retried briefly)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return BootstrapServer(host, port)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- Build 1: a replaced prefill serves new rooms at once ------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_and_replaced_prefill_serves_new_rooms_within_the_bound(tmp_path: Path, backend: str) -> None:
    if not get_registry().backend_available(backend):
        pytest.fail(f"backend {backend!r} is not installed here (scripts/setup.sh installs it)")
    res = measure(backend, tmp_path)
    report = table([res])
    assert res.error is None, report
    assert res.wrong == 0 and res.rooms >= 6, report
    # The room in flight fails when the process is seen gone (about GONE_GRACE), naming it.
    assert res.failed_s is not None and res.failed_s <= 2.0 and "gone" in (res.failed_reason or ""), report
    # No room waits out bootstrap_timeout (30 s here) for the dead rank the lookup still listed.
    assert res.timed_out_rooms == 0, report
    assert res.first_success_s is not None and res.first_success_s <= RESTART_BOUND, report


@contextlib.contextmanager
def same_address_restart(tmp_path: Path) -> Iterator[tuple[Receiver, Any, Any]]:
    """A decode in this process with room 1 in flight (asked, never sent) to a prefill process bound to a fixed
    port; yields the room, ``kill()`` (that process) and ``start()`` (another on the same port, serving every
    room; returns once it registered). On the way out, the new process must serve a new room."""
    sc = msgspec.structs.replace(RESTART, backend="memory", heartbeat_timeout=30.0)  # no silence before the restart
    dst = Pools(sc, sc.decode_pages, meta_rows=2)
    server = BootstrapServer("127.0.0.1")
    dm = DecodeManager(dst.kvargs, "memory", config=sc.session_config())
    procs = [PrefillProcess("memory", server.address, tmp_path / "old", hold_from=1)]
    try:
        port = int(procs[0].control_address().rpartition(":")[2])
        recv = Receiver(dm, 1, bootstrap=server.address)
        recv.init(np.arange(RESTART_PAGES), metadata_row=0)
        assert recv.wait(Poll.WAITING_FOR_INPUT, 30.0) == Poll.WAITING_FOR_INPUT, recv.failure()

        def start() -> None:
            procs.append(PrefillProcess("memory", server.address, tmp_path / "new", control_port=port))
            procs[-1].ready()

        yield recv, procs[0].kill, start
        fresh = Receiver(dm, 2, bootstrap=server.address)  # the new process serves new rooms
        fresh.init(np.arange(RESTART_PAGES, 2 * RESTART_PAGES), metadata_row=1)
        assert fresh.wait(Poll.SUCCESS, 30.0) == Poll.SUCCESS, fresh.failure()
    finally:
        for proc in procs:
            proc.kill()
        dm.close()
        server.close()


def test_a_prefill_killed_and_replaced_on_its_address_before_decode_saw_it_gone_fails_the_rooms_naming_the_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A replacement that binds the port before decode's grace for a closed connection ends (a fast restart):
    # decode's connection reaches the new process, whose first answer comes from another incarnation.
    monkeypatch.setattr(servers, "GONE_GRACE", 60.0)
    with same_address_restart(tmp_path) as (recv, kill, start):
        kill()
        start()
        assert recv.wait(Poll.SUCCESS, 30.0) == Poll.FAILED  # waits until final
        assert "it restarted: a new process (incarnation" in (recv.failure() or ""), recv.failure()
        assert recv.fenced  # the old process is gone: nothing more of it lands


def test_a_prefill_killed_and_seen_gone_before_its_replacement_on_its_address_answered_is_named_in_the_log(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # On one host the old process dies before the new one can bind its port, and starting one takes longer than
    # GONE_GRACE: the rooms fail as the process gone, final then (docs/failures.md), and decode says which
    # process replaced it once the new one answers its handshake.
    caplog.set_level(logging.WARNING, logger="kvbridge")
    with same_address_restart(tmp_path) as (recv, kill, start):
        kill()
        assert recv.wait(Poll.SUCCESS, 30.0) == Poll.FAILED  # waits until final
        assert "the process is gone" in (recv.failure() or ""), recv.failure()
        start()
    named = [r.getMessage() for r in caplog.records if "restarted: a new process" in r.getMessage()]
    assert len(named) == 1 and "seen gone before" in named[0], named


def test_a_restarted_bootstrap_refuses_what_was_sealed_for_the_old_one_and_the_rank_registers_again() -> None:
    with pair() as p:
        assert p.room(1).poll() == Poll.SUCCESS
        host, _, port = p.server.address.rpartition(":")
        # What a renewal captured on the wire looks like: sealed for the old server's incarnation.
        chan = Channel(zmq.Context.instance(), zmq.DEALER, p.pm.auth, endpoint="test", max_bytes=1 << 20,
                       to=p.server.address.encode())
        chan.connect(p.server.address)
        try:
            chan.send_msg(P.Register(rank=P.RankInfo(0, 1, 0, 1, "127.0.0.1:9", "memory")))  # a Reject, answered
            assert chan.sock.poll(5000) and chan.receive([chan.sock.recv()]) is not None
            assert chan.peer_incarnation == p.server.incarnation
            old = p.server.incarnation
            p.server.close()
            p.server = restarted(host, int(port))  # the same address: zmq reconnects everyone
            assert p.server.incarnation != old
            # The prefill's renewal, addressed to the old incarnation, is refused; it registers again at once.
            waited = wait_for(lambda: [r.control_addr for r in p.server.ranks] == [p.pm.control_address], 5.0,
                              "the prefill rank registered with the restarted bootstrap server")
            assert waited <= 3.0
            before = int(metrics().snapshot()["control_rejected"].get("bootstrap", {}).get("stale", 0))
            chan.send_msg(P.Register(rank=P.RankInfo(0, 1, 0, 1, "127.0.0.1:9", "memory")))
            assert chan.sock.poll(5000)
            got = chan.receive([chan.sock.recv()])
            assert got is not None and isinstance(got[1], P.Reject) and "incarnation" in got[1].reason, got
            assert int(metrics().snapshot()["control_rejected"]["bootstrap"]["stale"]) == before + 1
            assert [r.control_addr for r in p.server.ranks] == [p.pm.control_address]
        finally:
            chan.close()
        assert p.room(2).poll() == Poll.SUCCESS and p.exact(2)


def test_a_process_refuses_what_was_sealed_before_it_started() -> None:
    secret = b"k" * 32
    frame = A.Auth(secret).seal(b"payload", b"me", A.Sealer())
    time.sleep(0.01)
    restarted = A.Auth(secret)  # a restarted process: its replay memory is empty
    with pytest.raises(A.AuthError) as info:
        restarted.open(frame, {b"me"})
    assert info.value.kind == "replayed" and A.PREDATES in str(info.value)
    fresh = restarted.seal(b"payload", b"me", A.Sealer())
    assert restarted.open(fresh, {b"me"}) == b"payload"


def test_a_message_for_another_incarnation_is_refused_with_and_without_a_secret() -> None:
    me, other = A.new_incarnation(), A.new_incarnation()
    for auth in (A.Auth(b"k" * 32), A.Auth(None)):
        frame = auth.seal(b"x", b"me", A.Sealer(), to_inc=other)
        with pytest.raises(A.AuthError) as info:
            auth.open_frame(frame, {b"me"}, me)
        assert info.value.kind == "stale" and other.hex() in str(info.value)
        opened = auth.open_frame(auth.seal(b"x", b"me", A.Sealer(me), to_inc=me), {b"me"}, me)
        assert opened == A.Opened(b"x", me, me)


# -- Build 2: no route without proof -------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [True, False], ids=["secret", "no-secret"])
def test_a_socket_presenting_a_decodes_id_cannot_take_its_route(monkeypatch: pytest.MonkeyPatch, secret: bool) -> None:
    if not secret:
        monkeypatch.delenv(A.ENV_SECRET, raising=False)
        monkeypatch.delenv(A.ENV_SECRET_FILE, raising=False)
    with pair() as p:
        assert p.room(1).poll() == Poll.SUCCESS
        peer = p.pm.peer(p.dm.peer_id)
        assert peer is not None
        route = peer.ident
        ctx = zmq.Context.instance()
        attackers: list[zmq.Socket] = []
        refusals: list[str] = []

        def attack() -> None:
            """Sockets naming themselves as the decode (its peer id, its connection's routing id), each
            sending a Hello that claims the decode's peer id, sealed (a holder of the secret) and bare."""
            for identity in (p.dm.peer_id.encode(), route):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                with contextlib.suppress(zmq.ZMQError):
                    sock.setsockopt(zmq.IDENTITY, identity)
                sock.connect(f"tcp://{p.pm.control_address}")
                hello = P.encode(P.Hello(peer_id=p.dm.peer_id, lanes=p.dm._meta, kvargs=p.dst.kvargs,
                                         host=p.dm.transport.host))
                sock.send(p.dm.auth.seal(hello, p.pm.control_address.encode(), A.Sealer()))
                sock.send(P.encode(P.Heartbeat(clock=time.monotonic())))
                if sock.poll(1000):
                    reply = P.decode(A.Auth(None).open(sock.recv(), ())) if not secret else None
                    if isinstance(reply, P.Reject):
                        refusals.append(reply.reason)
                attackers.append(sock)

        served = 0
        deadline = time.monotonic() + 3.0
        room = 1
        while time.monotonic() < deadline:
            attack()
            for _ in range(5):
                room += 1
                recv = p.room(room, timeout=5.0)
                assert recv.poll() == Poll.SUCCESS, recv.failure()
                assert p.exact(room)
                served += 1
        for sock in attackers:
            sock.close(0)
        # The decode's route never moved, and the rooms kept flowing (with the route taken: 9-24 in 10 s).
        assert p.pm.peer(p.dm.peer_id) is peer and peer.ident == route
        assert served >= 10
        if not secret:
            assert any("belongs to another process" in r for r in refusals), refusals


# -- Build 3: remembered aborts, failures both ways within a second, fencing, metrics --------------------
def test_an_abort_before_the_sender_exists_fails_the_sender_when_it_is_created() -> None:
    with pair() as p:
        recv = Receiver(p.dm, 5, bootstrap=p.server.address)
        recv.init(np.arange(PAGES), metadata_row=0)
        wait_for(lambda: p.pm.requested(5), 5.0, "decode's request")
        recv.abort("the host gave up")
        wait_for(lambda: not p.pm.requested(5), 5.0, "the abort")
        sender = Sender(p.pm, 5)
        assert sender.poll() == Poll.FAILED and "the host gave up" in (sender.failure() or "")
        recv.wait(Poll.SUCCESS, 5.0)
        assert recv.poll() == Poll.FAILED and recv.fenced


def test_a_sender_grace_expiry_before_the_sender_exists_fails_the_sender_when_it_is_created() -> None:
    with pair(prefill=dataclasses.replace(SC.session_config(), sender_grace=0.3)) as p:
        recv = Receiver(p.dm, 6, bootstrap=p.server.address)
        recv.init(np.arange(PAGES), metadata_row=0)
        wait_for(lambda: p.pm.requested(6), 5.0, "decode's request")
        wait_for(lambda: not p.pm.requested(6), 5.0, "sender_grace")
        sender = Sender(p.pm, 6)
        assert sender.poll() == Poll.FAILED and "sender_grace" in (sender.failure() or "")
        recv.wait(Poll.SUCCESS, 5.0)
        assert recv.poll() == Poll.FAILED and "sender_grace" in (recv.failure() or "")


def _write_fails(self: MemoryBackend, peer: str, batch: TransferPlan, deadline: float) -> None:
    raise TransferError("writeBody failed: Bad address")


#: The memory backend with an engine whose write fails as Mooncake's did (``writeBody ... Bad address``)
#: and which, like Mooncake, may still write for a while after a failed write (so ``Fenced`` is held back).
#: Named "memory" (its class name is what a ready instance registers as), so the decode pairs with it.
WriteFails = type("memory", (MemoryBackend,), {"drain_after_failure": 30.0, "write": _write_fails})


def test_a_failed_engine_write_on_prefill_reaches_decode_within_a_second_naming_it() -> None:
    with pair(prefill_backend=WriteFails(BackendConfig(name="failing"))) as p:
        recv = Receiver(p.dm, 7, bootstrap=p.server.address)
        recv.init(np.arange(PAGES), metadata_row=0)
        wait_for(lambda: p.pm.requested(7), 5.0, "decode's request")
        sender = Sender(p.pm, 7)
        sender.wait(Poll.WAITING_FOR_INPUT, 5.0)
        sender.send(np.arange(PAGES), last=True)
        sender.wait(Poll.SUCCESS, 5.0)
        assert sender.poll() == Poll.FAILED and sender.ended is not None
        recv.wait(Poll.SUCCESS, 5.0)
        assert recv.poll() == Poll.FAILED and recv.ended is not None
        assert recv.ended - sender.ended <= 1.0, recv.ended - sender.ended  # FAILURE_NOTICE (0.5 s) and a tick
        assert "Bad address" in (recv.failure() or "")
        assert not recv.fenced  # the engine may still drain: prefill's Fenced comes after drain_after_failure


def test_an_abort_on_decode_reaches_prefill_within_a_second() -> None:
    with pair() as p:
        recv = Receiver(p.dm, 8, bootstrap=p.server.address)
        recv.init(np.arange(PAGES), metadata_row=0)
        wait_for(lambda: p.pm.requested(8), 5.0, "decode's request")
        sender = Sender(p.pm, 8)
        sender.wait(Poll.WAITING_FOR_INPUT, 5.0)
        t0 = time.monotonic()
        recv.abort("decode's host gave up")
        sender.wait(Poll.SUCCESS, 5.0)
        assert sender.poll() == Poll.FAILED and time.monotonic() - t0 <= 1.0
        assert "decode's host gave up" in (sender.failure() or "")


def test_a_prefill_that_was_itself_held_up_does_not_drop_the_decode_it_could_not_hear(
        caplog: pytest.LogCaptureFixture) -> None:
    # Prefill's I/O thread held up for longer than the silence after which a decode is forgotten
    # (FORGET_AFTER x heartbeat_timeout = 3 s here), as a frozen or swapped-out process is: the decode
    # heartbeated all along, and its heartbeats wait in the socket. Before, the first tick after the
    # stall ran before they were read and dropped the decode, whose next request was then refused.
    with pair() as p:
        assert p.room(1).poll() == Poll.SUCCESS
        peer = p.pm.peer(p.dm.peer_id)
        assert peer is not None
        held = time.monotonic()
        p.pm.loop.call(lambda: time.sleep(3.5))
        wait_for(lambda: time.monotonic() - held > 3.8, 5.0, "the stall and the ticks after it")
        assert p.pm.peer(p.dm.peer_id) is peer
        assert not [r for r in caplog.records if "dropping it" in r.getMessage()]
        assert p.room(2).poll() == Poll.SUCCESS and p.exact(2)


def test_an_abort_on_a_dropped_decodes_old_connection_fails_the_room_it_asked_for_at_once() -> None:
    # A decode prefill dropped (here: by hand, as for silence) does not know it yet: its next request
    # is refused, it fails the room and aborts it on the connection prefill no longer routes by. That
    # connection's Hello was accepted once, so the abort counts as the decode's: the sender prefill's
    # host created for the room fails now, not at bootstrap_timeout (10 s here).
    with pair() as p:
        assert p.room(1).poll() == Poll.SUCCESS
        peer = p.pm.peer(p.dm.peer_id)
        assert peer is not None
        p.pm.loop.call(lambda: p.pm._drop_peer(peer, "dropped by the test"))
        wait_for(lambda: p.pm.peer(p.dm.peer_id) is None, 5.0, "the drop")
        sender = Sender(p.pm, 3)
        recv = Receiver(p.dm, 3, bootstrap=p.server.address)
        recv.init(np.arange(PAGES), metadata_row=0)
        recv.wait(Poll.SUCCESS, 5.0)
        assert recv.poll() == Poll.FAILED
        t = wait_for(lambda: sender.poll() == Poll.FAILED, 5.0, "prefill's sender")
        assert t < 2.0 and "aborted by decode" in (sender.failure() or ""), (t, sender.failure())
        assert p.room(4).poll() == Poll.SUCCESS and p.exact(4)  # the decode handshakes again


def test_metrics_count_a_room_before_its_success_is_visible() -> None:
    with pair() as p:
        def sent() -> int:
            return int(sum(metrics().snapshot()["backends"].get("memory", {}).get("bytes", {}).values()))
        per_room = PAGES * SC.page_nbytes * 2 * SC.layers
        for room in range(20, 40):
            before = sent()
            recv = Receiver(p.dm, room, bootstrap=p.server.address)
            recv.init(np.arange(PAGES), metadata_row=0)
            wait_for(lambda: p.pm.requested(room), 5.0, "decode's request")
            sender = Sender(p.pm, room)
            sender.wait(Poll.WAITING_FOR_INPUT, 5.0)
            sender.send(np.arange(PAGES), last=True)
            assert sender.wait(Poll.SUCCESS, 5.0) == Poll.SUCCESS
            assert sent() - before >= per_room  # read the moment SUCCESS is visible
            recv.wait(Poll.SUCCESS, 5.0)


def test_fencing_holds_while_decode_opens_rooms_to_a_frozen_prefill(tmp_path: Path) -> None:
    """Issue 28, failure 5: decode kept opening rooms to a frozen prefill, closed the connection the
    failed room was asked on, and the prefill's Fenced for it was lost (0 of 4 fenced after 63 s)."""
    sc = msgspec.structs.replace(RESTART, backend="memory", bootstrap_timeout=1.0, transfer_timeout=2.0)
    dst = Pools(sc, sc.decode_pages, meta_rows=1)
    server = BootstrapServer("127.0.0.1")
    dm = DecodeManager(dst.kvargs, "memory", config=sc.session_config())
    proc = PrefillProcess("memory", server.address, tmp_path / "prefill", hold_from=2)
    try:
        proc.ready()
        first = Receiver(dm, 1, bootstrap=server.address)
        first.init(np.arange(RESTART_PAGES), metadata_row=0)
        assert first.wait(Poll.SUCCESS, 10.0) == Poll.SUCCESS
        held = Receiver(dm, 2, bootstrap=server.address)  # its sender never sends
        held.init(np.arange(RESTART_PAGES), metadata_row=0)
        held.wait(Poll.WAITING_FOR_INPUT, 10.0)
        time.sleep(0.2)
        proc.freeze()
        rooms = [held]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:  # new rooms to the frozen prefill, each a new connection
            rooms.append(Receiver(dm, len(rooms) + 2, bootstrap=server.address))
            rooms[-1].init(np.arange(RESTART_PAGES), metadata_row=0)
            time.sleep(0.3)
        assert held.poll() == Poll.FAILED and not held.fenced  # fence_timeout passed without the prefill
        proc.thaw()
        # The last room may have handshaken with the resumed prefill (which holds it): given up on now.
        for r in rooms:
            if not r.final:
                r.abort("the test is over")
        # Every room asked on a connection decode gave up is confirmed once the prefill resumed.
        wait_for(lambda: all(r.final and r.fenced for r in rooms), 10.0, "every room's Fenced after the prefill resumed")
        assert all(r.poll() == Poll.FAILED for r in rooms)
    finally:
        proc.kill()
        dm.close()
        server.close()


# -- Build 1: a restarted decode is retired at once (leftover of issue 28) --------------------------------
def _decode_restart(tmp_path: Path, backend: str, instance: str
                    ) -> tuple[dict[int, tuple[Poll, str | None]], float, list[dict[str, Any]]]:
    """Kill a decode process with rooms in flight and start another of ``instance``, TP rank 0; prefill
    (this process) serves both with a 30 s lease. Returns the old rooms' states and reasons on prefill once the
    new process is done (before prefill closes), the seconds
    from the new handshake (seen here) to the last old room's FAILED (negative: failed before it was
    seen, in the same handler), and the new process's rooms."""
    if not get_registry().backend_available(backend):
        pytest.fail(f"backend {backend!r} is not installed here (scripts/setup.sh installs it)")
    src = prefill_pools(msgspec.structs.replace(RESTART, backend=backend))
    server = BootstrapServer("127.0.0.1")
    pm = PrefillManager(src.kvargs, backend, bootstrap=server.address, config=DR.session_config(backend))
    stop, senders = threading.Event(), {}  # type: ignore[var-annotated]
    host = threading.Thread(target=DR.serve, args=(pm, stop, senders), daemon=True)
    host.start()
    procs: list[DR.DecodeProcess] = []
    try:
        procs.append(DR.DecodeProcess(backend, server.address, tmp_path / "decode-0", instance, 1, 3, hold=3))
        before = procs[0].wait_for("INFLIGHT")
        assert [r["state"] for r in before] == ["SUCCESS"] * 3 and all(r["exact"] for r in before), before
        held = range(DR.HELD_FROM, DR.HELD_FROM + 3)
        # Decode's request is out; prefill's host creates each sender as it sees the request.
        wait_for(lambda: all(r in senders and senders[r].poll() == Poll.WAITING_FOR_INPUT for r in held), 10.0,
                 "prefill's senders of the rooms in flight")
        old = {room: senders[room] for room in held}
        (old_peer,) = [p.peer_id for p in pm.peers()]
        procs[0].kill()
        procs.append(DR.DecodeProcess(backend, server.address, tmp_path / "decode-1", instance, DR.NEW_FROM, 5))
        # The replacement's handshake, as this process sees it (polled every 2 ms).
        wait_for(lambda: any(p.peer_id != old_peer for p in pm.peers()), 90.0, "the new decode's handshake")
        seen = time.monotonic()
        after = procs[1].wait_for("DONE")
        states = {room: (s.poll(), s.failure()) for room, s in old.items()}
        failed = [s.ended or 0.0 for s in old.values() if s.poll() == Poll.FAILED]
        return states, (max(failed) - seen if len(failed) == len(old) else math.inf), after
    finally:
        stop.set()
        host.join(5)
        for p in procs:
            p.kill()
        pm.close()
        server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_decode_replaced_under_its_instance_name_fails_its_old_rooms_at_once_and_is_served(
        tmp_path: Path, backend: str) -> None:
    """Issue 28's leftover: a killed decode's rooms waited for its lease (heartbeat_timeout, 30 s here)
    though a new process of the same decode rank had handshaken. Now the handshake retires it."""
    old, after_handshake, rooms = _decode_restart(tmp_path, backend, instance="decode-a")
    assert after_handshake <= 1.0, f"old rooms FAILED {after_handshake:.2f}s after the new handshake (lease: 30 s)"
    for room, (state, reason) in old.items():
        assert state == Poll.FAILED and reason is not None
        assert "restarted" in reason and "'decode-a' TP rank 0" in reason and "incarnation" in reason, (room, reason)
    assert [r["state"] for r in rooms] == ["SUCCESS"] * 5 and all(r["exact"] for r in rooms), rooms


def test_a_killed_unnamed_decode_replaced_leaves_the_old_rooms_to_its_lease(tmp_path: Path) -> None:
    """Without ``instance_name`` a new process cannot be told from another decode instance's rank 0:
    the old rooms are not failed by the handshake (they wait for the 30 s lease), the new one is served."""
    old, after_handshake, rooms = _decode_restart(tmp_path, "memory", instance="")
    assert after_handshake == math.inf and all(state == Poll.WAITING_FOR_INPUT for state, _ in old.values()), old
    assert [r["state"] for r in rooms] == ["SUCCESS"] * 5 and all(r["exact"] for r in rooms), rooms
