"""Control-plane behaviour of the session layer, with real processes on 127.0.0.1.

What is checked here does not depend on the transport (the conformance suite,
``kvbridge.testing.conformance``, covers what does, for every backend): hostile
and malformed control messages, requests and aborts from a decode that does
not own the room, incompatible layouts at handshake, and a bootstrap endpoint
nobody listens on. It runs against the memory backend (no engine), through the same
fixtures as the conformance suite (``kvbridge.testing.harness``).
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.core.control import protocol as P
from kvbridge.core.description.layout import KVArgs
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.sessions.session import Poll, PrefillManager, Receiver, Sender
from kvbridge.testing.e2e import SENTINEL, Pools, meta_row_for, prefill_pools, schedule
from kvbridge.testing.harness import START_WAIT, BackendHarness, finished, send_all, wait_until

HOSTILE_META = b"127.0.0.1:1"  # engine metadata in Hellos that are refused before the backend sees them


# -- malformed and wrong-version control messages ------------------------------------------------
KNOWN_TAGS = ["register", "register_ack", "lookup", "lookup_reply", "hello", "hello_ack", "transfer_request",
              "chunk_done", "done", "failed", "abort", "fenced", "heartbeat", "reject"]
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
        lambda tag, fields: Probe(msgspec.msgpack.encode({"type": tag, "v": P.PROTOCOL_VERSION, **fields}), False, _reject(), "wrong fields"),
        st.sampled_from(KNOWN_TAGS),
        st.dictionaries(st.text(max_size=12).filter(lambda k: k not in ("type", "v")), MSGPACK_VALUES, min_size=1, max_size=4),
    )

    def versioned(v: int, room: int) -> st.SearchStrategy[P.Message]:
        return st.sampled_from([
            P.Heartbeat(v=v),
            P.Lookup(v=v),
            P.Abort(v=v, room=room, reason="x"),
            P.TransferRequest(v=v, room=room, indices={"kv_page": P.pack_indices([0, 1])}, metadata_row=0),
            P.Hello(v=v, peer_id="x", lanes={backend: HOSTILE_META}, kvargs=kvargs),
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
            msgspec.msgpack.encode({"type": tag, "v": P.PROTOCOL_VERSION, **fields}), False,
            lambda r, ident: isinstance(r, P.Reject) and r.reason.startswith(f"malformed {tag!r} message: "),
            f"unknown tag {tag!r}",
        ),
        st.text(min_size=1, max_size=20).filter(lambda t: t not in KNOWN_TAGS),
        st.dictionaries(st.text(max_size=12).filter(lambda k: k not in ("type", "v")), MSGPACK_VALUES, max_size=3),
    )
    before_hello = st.builds(
        lambda msg: Probe(
            P.encode(msg), False,
            _reject(f"{type(msg).__name__} from {{ident!r}} before a handshake; send Hello first", None),  # of the connection
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


# -- incompatible layouts at handshake -------------------------------------------------------------
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


# -- a metadata row carried in Done that does not fit decode ----------------------------------------
def _elsewhere(row: P.MetadataRow, decode: Any) -> P.MetadataRow:
    """The row's bytes aimed at the last page of a KV region (registered, but not a metadata row)."""
    kv = decode.pools.kv[0]
    return P.MetadataRow(row=row.row, pieces=((kv[-1].ctypes.data, row.pieces[0][1]),))


BAD_ROWS: dict[str, tuple[Callable[[P.MetadataRow, Any], P.MetadataRow], str]] = {
    # case: (how prefill's row is changed, the reason decode must give)
    "elsewhere": (_elsewhere, r"Done carries 64 metadata bytes for address 0x[0-9a-f]+, which is not where row 0 of "
                              r"one of this rank's 1 metadata regions starts"),
    "oversize": (lambda r, d: P.MetadataRow(row=r.row, pieces=((r.pieces[0][0], r.pieces[0][1] + b"\xff" * 8),)),
                 r"Done carries 72 bytes for row 0 of metadata region 'meta', whose rows are 64 bytes"),
    "short": (lambda r, d: P.MetadataRow(row=r.row, pieces=((r.pieces[0][0], r.pieces[0][1][:8]),)),
              r"Done carries 8 bytes for row 0 of metadata region 'meta', whose rows are 64 bytes"),
    "another_row": (lambda r, d: P.MetadataRow(row=1, pieces=((r.pieces[0][0] + 64, r.pieces[0][1]),)),
                    r"Done carries metadata row 1 but this room asked for row 0"),
    "twice": (lambda r, d: P.MetadataRow(row=r.row, pieces=r.pieces * 2),
              r"Done carries row 0 of metadata region 'meta' twice"),
}


class TestControlPlane(BackendHarness):
    @pytest.mark.parametrize("case", sorted(BAD_ROWS))
    def test_a_metadata_row_in_done_that_does_not_fit_decode_fails_the_room_and_writes_nothing(
        self, local_prefill, local_decode, case
    ):
        # A prefill rank (holding the secret) sends a row in Done that is not exactly the row decode asked
        # for in its own metadata regions: decode fails the room naming the problem, before SUCCESS, and
        # writes none of it, into the metadata rows or anywhere else.
        change, reason = BAD_ROWS[case]
        sc = self.scenario(requests=1, max_pages=8, max_chunks=1, concurrency=2)
        (req,) = schedule(sc)
        prefill = local_prefill(sc)
        decode = local_decode(sc)
        prefill.pools.meta[0] = meta_row_for(req.room)
        notify = prefill.mgr.notify

        def tampering(peer, *msgs, **kwargs):
            notify(peer, *(msgspec.structs.replace(m, row=change(m.row, decode))
                           if isinstance(m, P.Done) and m.row is not None else m for m in msgs), **kwargs)

        prefill.mgr.notify = tampering
        sender = Sender(prefill.mgr, req.room, metadata_row=0)
        recv = Receiver(decode.mgr, req.room, bootstrap=prefill.address)
        recv.init(list(range(len(req.src_pages))), metadata_row=0)
        wait_until(lambda: sender.poll() >= Poll.WAITING_FOR_INPUT, START_WAIT, "decode's request")
        sender.send(req.src_pages, last=True)
        wait_until(finished(recv), START_WAIT, "receiver")
        assert recv.poll() == Poll.FAILED and re.search(reason, recv.failure() or ""), recv.failure()
        assert recv.failure().startswith("prefill tp0/pp0 at "), recv.failure()
        assert (decode.pools.meta == SENTINEL).all(), "a rejected row was written into decode's metadata rows"
        assert all((kv[len(req.src_pages):] == SENTINEL).all() for kv in decode.pools.kv), "a byte landed outside the room"

    def test_a_prefill_host_waiting_for_success_is_woken_once_done_left(self, local_prefill, local_decode):
        # The transfer worker moves the room to SUCCESS without waking hosts; the I/O thread wakes them
        # after it sent Done (so the host's thread does not hold the GIL before Done is out). A host
        # blocked in wait() must still wake then, not at its timeout (nothing else changes in this manager).
        sc = self.scenario(requests=1, max_pages=8, max_chunks=1, concurrency=2)
        (req,) = schedule(sc)
        prefill = local_prefill(sc)
        decode = local_decode(sc)
        sender = Sender(prefill.mgr, req.room, metadata_row=0)
        recv = Receiver(decode.mgr, req.room, bootstrap=prefill.address)
        recv.init(list(range(len(req.src_pages))), metadata_row=0)
        assert sender.wait(Poll.WAITING_FOR_INPUT, START_WAIT) == Poll.WAITING_FOR_INPUT
        sender.send(req.src_pages, last=True)
        t0 = time.monotonic()
        state = sender.wait(Poll.SUCCESS, 60)
        assert state == Poll.SUCCESS and time.monotonic() - t0 < 10, (state, time.monotonic() - t0)
        assert recv.wait(Poll.SUCCESS, START_WAIT) == Poll.SUCCESS, recv.failure()

    backend = "memory"  # nothing here depends on the transport: core's policy, tested once

    # -- a decode that does not own the room ---------------------------------------------------
    def test_bad_request_from_another_decode_does_not_fail_a_room_it_does_not_own(
        self, local_prefill, children, raw_clients
    ):
        sc = self.scenario(requests=1)
        prefill, decode, sender, req = self.waiting_room(local_prefill, children, requests=1)

        hostile = raw_clients(prefill.mgr.control_address, "hostile")
        hostile.handshake(Pools(sc, sc.decode_pages, meta_rows=sc.concurrency), self.backend, self.backend_options)
        reply = hostile.ask(P.TransferRequest(room=req.room, indices={"kv_page": b"\x01\x02\x03"}, metadata_row=0))
        assert isinstance(reply, P.Failed) and reply.room == req.room
        assert sender.poll() == Poll.WAITING_FOR_INPUT, f"the real decode's room was failed: {sender.failure()}"

        send_all(sender, req.src_pages, req.chunks)
        wait_until(finished(sender), 10.0, "sender")
        assert sender.poll() == Poll.SUCCESS, sender.failure()
        rc, result = decode.finish()
        assert rc == 0 and result is not None and result["failed"] == [] and result["mismatched_regions"] == 0

    def test_abort_from_another_decode_does_not_drop_a_pending_request_it_does_not_own(
        self, local_prefill, children, raw_clients
    ):
        sc = self.scenario(requests=1)
        (req,) = schedule(sc)
        prefill = local_prefill(sc)
        decode = children("decode", sc, bootstrap=prefill.address)
        # No sender yet: decode's request waits in the prefill manager for the host to create one.
        wait_until(lambda: prefill.mgr.active_rooms() == 1, self.scaled(START_WAIT), "decode's request pending")

        hostile = raw_clients(prefill.mgr.control_address, "hostile")
        hostile.handshake(Pools(sc, sc.decode_pages, meta_rows=sc.concurrency), self.backend, self.backend_options)
        # Answered (nothing of it is being written for this peer), and nothing else happens.
        assert hostile.ask(P.Abort(room=req.room, reason="not mine to abort")) == P.Fenced(room=req.room)

        prefill.pools.meta[0] = meta_row_for(req.room)
        sender = Sender(prefill.mgr, req.room, metadata_row=0)
        assert sender.poll() == Poll.WAITING_FOR_INPUT, "the real decode's pending request was dropped"
        send_all(sender, req.src_pages, req.chunks)
        wait_until(finished(sender), 10.0, "sender")
        assert sender.poll() == Poll.SUCCESS, sender.failure()
        rc, result = decode.finish()
        assert rc == 0 and result is not None and result["failed"] == []

    def test_a_late_abort_of_a_finished_room_does_not_fail_the_next_sender_of_that_id(
        self, local_prefill, raw_clients
    ):
        sc = self.scenario()
        prefill = local_prefill(sc)
        peer = raw_clients(prefill.mgr.control_address, "peer")
        peer.handshake(Pools(sc, sc.decode_pages, meta_rows=sc.concurrency), self.backend, self.backend_options)
        first = Sender(prefill.mgr, 9)
        peer.send(P.TransferRequest(room=9, indices={"kv_page": P.pack_indices([0, 1])}, metadata_row=0))
        wait_until(lambda: first.poll() >= Poll.WAITING_FOR_INPUT, self.scaled(START_WAIT), "the request")
        first.abort("the host gave up")
        # Decode's own Abort crosses prefill's Failed (the replies queued: Failed, Fenced, then its Fenced).
        assert P.Fenced(room=9) in (peer.ask(P.Abort(room=9, reason="decode gave up too")), peer.ask(P.Heartbeat()))
        again = Sender(prefill.mgr, 9)  # the same id later (a decode that restarted its counter)
        assert again.poll() == Poll.BOOTSTRAPPING, again.failure()

    # -- the lease: a slow decode is kept, a stale proof of life is not enough -----------------------
    def test_a_late_heartbeat_from_a_handshaken_decode_is_answered_and_renews_its_lease(
        self, local_prefill, raw_clients
    ):
        sc = self.scenario(heartbeat_interval=0.2, heartbeat_timeout=1.0)
        prefill = local_prefill(sc)
        peer = raw_clients(prefill.mgr.control_address, "slow")
        peer.handshake(Pools(sc, sc.decode_pages, meta_rows=sc.concurrency), self.backend, self.backend_options)
        first = peer.ask(P.Heartbeat())
        assert isinstance(first, P.Heartbeat) and first.clock is not None
        time.sleep(1.5 * sc.heartbeat_timeout)  # late: past heartbeat_timeout, a decode under load
        late = peer.ask(P.Heartbeat(clock=first.clock))
        assert isinstance(late, P.Heartbeat), f"a late heartbeat made prefill forget the decode: {late}"
        assert isinstance(peer.ask(P.Heartbeat(clock=late.clock)), P.Heartbeat)
        (known,) = prefill.mgr.peers()
        assert known.lease_until > time.monotonic(), "a heartbeat echoing a fresh clock did not renew the lease"

    def test_heartbeats_echoing_an_old_clock_do_not_keep_a_room_alive_but_the_decode_stays_known(
        self, local_prefill, raw_clients
    ):
        # What a prefill resumed after a freeze finds queued: pings decode sent long ago.
        sc = self.scenario(heartbeat_interval=0.2, heartbeat_timeout=1.0)
        prefill = local_prefill(sc)
        peer = raw_clients(prefill.mgr.control_address, "stale")
        peer.handshake(Pools(sc, sc.decode_pages, meta_rows=sc.concurrency), self.backend, self.backend_options)
        sender = Sender(prefill.mgr, 7)
        peer.send(P.TransferRequest(room=7, indices={"kv_page": P.pack_indices([0, 1, 2, 3])}, metadata_row=0))
        wait_until(lambda: sender.poll() >= Poll.WAITING_FOR_INPUT, self.scaled(START_WAIT), "the request")
        clock = None
        fresh_until = time.monotonic() + 2.5 * sc.heartbeat_timeout
        while time.monotonic() < fresh_until:  # fresh echoes: the room stays live
            reply = peer.ask(P.Heartbeat(clock=clock))
            assert isinstance(reply, P.Heartbeat)
            clock = reply.clock
            time.sleep(sc.heartbeat_interval)
        assert sender.poll() == Poll.WAITING_FOR_INPUT, sender.failure()
        t0 = time.monotonic()
        while sender.poll() != Poll.FAILED and time.monotonic() - t0 < 4 * sc.heartbeat_timeout + self.slack:
            reply = peer.ask(P.Heartbeat(clock=clock))  # the same old clock, again and again
            assert isinstance(reply, P.Heartbeat), f"the decode was forgotten: {reply}"
            time.sleep(sc.heartbeat_interval)
        assert sender.poll() == Poll.FAILED
        assert "gave no sign of life" in (sender.failure() or ""), sender.failure()
        assert time.monotonic() - t0 <= 2 * sc.heartbeat_timeout + self.slack

    # -- malformed and wrong-version control messages ---------------------------------------------
    def test_garbage_control_messages_are_refused_and_the_prefill_keeps_serving(
        self, local_prefill, children, raw_clients, caplog
    ):
        caplog.set_level(logging.WARNING)
        sc = self.scenario()
        # A long heartbeat timeout keeps the hand-made peer's handshake alive through shrinking.
        prefill = local_prefill(sc, config=msgspec.structs.replace(sc, heartbeat_timeout=120.0).session_config())
        claimed = Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)
        stranger = raw_clients(prefill.mgr.control_address, "stranger")  # never says Hello
        peer = raw_clients(prefill.mgr.control_address, "peer")
        peer.handshake(claimed, self.backend, self.backend_options)

        @settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(_probes(claimed.kvargs, self.backend))
        def refused(probe: Probe) -> None:
            client = peer if probe.handshaken else stranger
            reply = client.ask_raw(probe.payload)
            assert probe.expect(reply, client.identity), f"{probe.what}: {probe.payload[:80]!r} got {reply}"

        refused()
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("kvbridge")]
        assert not errors, [r.getMessage() for r in errors]
        assert prefill.mgr.active_rooms() == 0
        assert isinstance(peer.ask(P.Heartbeat()), P.Heartbeat)  # the fuzzing peer is still connected
        self.serve_a_fresh_decode(prefill, children, self.scenario(seed=1))

    def test_unknown_message_type_without_a_version_is_not_reported_as_a_version_mismatch(
        self, local_prefill, raw_clients
    ):
        # "v" is optional on the wire (it defaults to the current version), so a message
        # without it must be refused for what is wrong with it, not as "protocol version -1".
        prefill = local_prefill(self.scenario())
        client = raw_clients(prefill.mgr.control_address, "client")
        reply = client.ask_raw(msgspec.msgpack.encode({"type": "bogus"}))
        assert isinstance(reply, P.Reject)
        assert reply.reason.startswith("malformed 'bogus' message: "), reply.reason

    # -- incompatible layouts at handshake ---------------------------------------------------------
    @pytest.mark.parametrize("case", sorted(LAYOUT_CHANGES))
    def test_incompatible_layout_fails_the_handshake_and_both_sides_name_the_difference(self, local_decode, children, case):
        sc = self.scenario(requests=1, bootstrap_timeout=30.0)
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

    def test_a_handshake_one_prefill_rank_rejects_fails_the_room_on_the_other_ranks_at_once(self, local_decode):
        # Prefill TP 2 (replicated pages: tp0 sends), and tp1 runs another page size: tp1 rejects the
        # handshake, tp0 accepts it. tp0's sender must fail with the reason, not wait for bootstrap_timeout.
        sc = self.scenario(requests=1, bootstrap_timeout=30.0)
        server = BootstrapServer("127.0.0.1")
        managers: list[PrefillManager] = []
        try:
            for tp_rank, page_size in ((0, 16), (1, 32)):
                pools = prefill_pools(sc)
                kvargs = msgspec.structs.replace(pools.kvargs, tp_rank=tp_rank, tp_size=2, page_size=page_size)
                managers.append(PrefillManager(kvargs, sc.backend, bootstrap=server.address, config=sc.session_config()))
            room = schedule(sc)[0].room
            senders = [Sender(m, room, metadata_row=0) for m in managers]
            decode = local_decode(sc)
            recv = Receiver(decode.mgr, room, bootstrap=server.address)
            recv.init([0, 1], metadata_row=0)
            wait_until(finished(recv), 10.0, "receiver")
            assert recv.poll() == Poll.FAILED
            assert re.search(r"prefill tp1/pp0 at \S+ rejected the handshake: incompatible layouts: ", recv.failure() or "")
            assert 5.0 < sc.bootstrap_timeout  # so the wait below (which fails past 5 s) proves it came early
            wait_until(finished(senders[0]), 5.0, "tp0's sender")
            assert senders[0].poll() == Poll.FAILED
            assert "rejected the handshake" in (senders[0].failure() or ""), senders[0].failure()
            assert "page size differs" in (senders[0].failure() or ""), senders[0].failure()
        finally:
            for m in managers:
                m.close()
            server.close()

    # -- bootstrap timeout -----------------------------------------------------------------------------
    def test_receiver_fails_within_the_bootstrap_timeout_when_nothing_listens(self, local_decode):
        with socket.socket() as s:  # a port nothing listens on once closed
            s.bind(("127.0.0.1", 0))
            address = "127.0.0.1:%d" % s.getsockname()[1]
        sc = self.scenario(bootstrap_timeout=2.0)
        decode = local_decode(sc)
        t0 = time.monotonic()
        recv = Receiver(decode.mgr, 1, bootstrap=address)
        recv.init([0, 1], metadata_row=0)
        wait_until(finished(recv), sc.bootstrap_timeout + self.slack, "receiver")
        elapsed = time.monotonic() - t0
        assert recv.poll() == Poll.FAILED
        assert "bootstrap_timeout=2.0s" in (recv.failure() or ""), recv.failure()
        assert sc.bootstrap_timeout <= elapsed < sc.bootstrap_timeout + self.slack
        assert decode.mgr.active_rooms() == 0


def test_a_prefill_rank_counts_as_gone_only_when_its_connection_closed_and_reconnecting_is_refused() -> None:
    """A frozen process keeps its connections and a cut link closes none; a process that dropped the
    connection but takes it back (its ROUTER handed the identity to a newer connection, say) is not
    gone, although zmq schedules a retry as the connection closes; a dead one's port refuses the
    reconnects: gone, after GONE_GRACE for what its kernel still delivers."""
    import zmq

    from kvbridge.core.sessions.servers import GONE_GRACE, PrefillRank

    info = P.RankInfo(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, control_addr="127.0.0.1:1", backend="memory")
    rank = PrefillRank(info)
    rank.on_event(zmq.EVENT_CONNECTED)
    assert not rank.is_gone(time.monotonic() + 100)  # connected (or silent: frozen, cut off)
    rank.on_event(zmq.EVENT_DISCONNECTED)
    rank.on_event(zmq.EVENT_CONNECT_RETRIED)  # scheduled as it closed (measured: within 2 ms)
    assert not rank.is_gone(time.monotonic() + 100)  # no attempt has failed yet
    rank.on_event(zmq.EVENT_CONNECTED)  # reconnected: a process still listens
    rank.on_event(zmq.EVENT_CONNECT_RETRIED)
    rank.on_event(zmq.EVENT_CONNECT_RETRIED)
    assert not rank.is_gone(time.monotonic() + 100)  # retries while connected do not count
    rank.on_event(zmq.EVENT_DISCONNECTED)
    rank.on_event(zmq.EVENT_CONNECT_RETRIED)
    rank.on_event(zmq.EVENT_CONNECT_RETRIED)  # an attempt was refused: nobody listens there any more
    assert not rank.is_gone(time.monotonic())  # within the grace
    assert rank.is_gone(time.monotonic() + GONE_GRACE)
