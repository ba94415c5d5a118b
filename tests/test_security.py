"""Control-plane security (docs/security.md): each attack of issue 13 fails, with real processes.

The test process holds the secret (tests/conftest.py), and so do the driver
processes it starts. An attacker without it is a :class:`RawClient` sending
unsealed bytes; an attacker with it (a buggy or hostile holder) seals what it
sends. Every test here failed on the code before authentication existed.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
import time

import msgspec
import numpy as np
import pytest

from kvbridge.core.transfer.backend import host_id
from kvbridge.core.control import auth as A
from kvbridge.core.control import protocol as P
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.control.metrics import metrics
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, SessionConfig
from kvbridge.testing.e2e import Pools, schedule
from kvbridge.testing.harness import BackendHarness, RawClient, wait_until

HOSTILE_META = b"127.0.0.1:1"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rejected(endpoint: str, reason: str) -> int:
    return int(metrics().snapshot()["control_rejected"].get(endpoint, {}).get(reason, 0))


class TestSecurity(BackendHarness):
    backend = "memory"  # what is checked is core's control plane, the same for every backend

    def decode_pools(self, sc):  # type: ignore[no-untyped-def]
        return Pools(sc, sc.decode_pages, meta_rows=sc.concurrency)

    # -- finding 1: who may register, handshake, claim -------------------------------------------
    def test_register_without_the_secret_is_refused_counted_and_the_real_rank_kept(self, local_prefill, children, raw_clients):
        sc = self.scenario(requests=2)
        prefill = local_prefill(sc)
        real = [(r.tp_rank, r.control_addr) for r in prefill.server.ranks]
        before = rejected("bootstrap", "unauthenticated")
        impostor = raw_clients(prefill.address, "impostor")
        reply = impostor.ask(P.Register(rank=P.RankInfo(0, 1, 0, 1, "127.0.0.1:9", self.backend)), seal=False)
        assert isinstance(reply, P.Reject) and "requires the kvbridge secret" in reply.reason, reply
        assert [(r.tp_rank, r.control_addr) for r in prefill.server.ranks] == real
        assert rejected("bootstrap", "unauthenticated") == before + 1
        self.serve_a_fresh_decode(prefill, children, sc)

    def test_a_second_manager_cannot_take_a_live_rank(self, local_prefill, children, raw_clients):
        sc = self.scenario(requests=2)
        prefill = local_prefill(sc)
        holder = prefill.mgr.control_address
        second = raw_clients(prefill.address, "second")  # holds the secret
        reply = second.ask(P.Register(rank=P.RankInfo(0, 1, 0, 1, "127.0.0.1:9", self.backend)))
        assert isinstance(reply, P.Reject), reply
        assert f"rank held: the rank is registered by the manager at {holder}" in reply.reason, reply.reason
        assert [r.control_addr for r in prefill.server.ranks] == [holder]
        self.serve_a_fresh_decode(prefill, children, sc)

    def test_a_rank_whose_manager_stopped_renewing_can_be_registered_again(self, raw_clients):
        server = BootstrapServer("127.0.0.1", lease=1.5)
        try:
            client = raw_clients(server.address, "prefill")
            assert isinstance(client.ask(P.Register(rank=P.RankInfo(0, 1, 0, 1, "127.0.0.1:9", self.backend))), P.RegisterAck)
            assert isinstance(client.ask(P.Register(rank=P.RankInfo(0, 1, 0, 1, "127.0.0.1:10", self.backend))), P.Reject)
            time.sleep(1.6)  # the first registration's lease runs out: nothing renews it
            assert server.ranks == []
            assert isinstance(client.ask(P.Register(rank=P.RankInfo(0, 1, 0, 1, "127.0.0.1:10", self.backend))), P.RegisterAck)
            assert [r.control_addr for r in server.ranks] == ["127.0.0.1:10"]
        finally:
            server.close()

    @pytest.mark.parametrize("fields, problem", [
        ({"tp_rank": 10**9, "tp_size": -5}, "tp_size -5 and pp_size 1 must lie in 1 .. 4096"),
        ({"tp_rank": 3, "tp_size": 2}, "tp_rank 3 is outside 0 .. tp_size-1 = 1"),
        ({"backend": "zz"}, "backend 'zz' is not installed here"),
        ({"control_addr": "no port"}, "control address 'no port' is not HOST:PORT"),
        ({"tp_rank": 1, "tp_size": 2}, "every rank of a prefill server must agree"),
    ])
    def test_a_hostile_register_is_refused_and_does_not_poison_the_table(self, local_prefill, children, raw_clients,
                                                                        fields, problem):
        sc = self.scenario(requests=2)
        prefill = local_prefill(sc)
        hostile = raw_clients(prefill.address, "hostile")  # holds the secret: only the fields are wrong
        rank = msgspec.structs.replace(P.RankInfo(0, 1, 0, 1, "127.0.0.1:9", self.backend), **fields)
        reply = hostile.ask(P.Register(rank=rank))
        assert isinstance(reply, P.Reject) and problem in reply.reason, reply
        assert [r.control_addr for r in prefill.server.ranks] == [prefill.mgr.control_address]
        self.serve_a_fresh_decode(prefill, children, sc)

    def test_a_decode_without_the_secret_cannot_claim_another_decodes_rooms(self, local_prefill, children, raw_clients):
        sc = self.scenario(requests=4)
        prefill = local_prefill(sc)
        thief = raw_clients(prefill.mgr.control_address, "thief")
        pools = self.decode_pools(sc)
        meta = thief.engine_metadata(pools, self.backend, self.backend_options)  # a working engine of its own
        hello = P.Hello(peer_id=thief.identity, lanes=meta, host=host_id(), kvargs=pools.kvargs)
        reply = thief.ask(hello, seal=False)
        assert isinstance(reply, P.Reject) and "requires the kvbridge secret" in reply.reason, reply
        for req in schedule(sc):  # the rooms the real decode will ask for
            claim = P.TransferRequest(room=req.room, indices={"kv_page": P.pack_indices(np.arange(len(req.src_pages)))},
                                      metadata_row=0)
            reply = thief.ask(claim, seal=False)
            assert isinstance(reply, P.Reject) and "requires the kvbridge secret" in reply.reason, reply
        assert prefill.mgr.active_rooms() == 0 and prefill.mgr.peers() == []
        self.serve_a_fresh_decode(prefill, children, sc)  # every room, byte-exact, to the real decode

    def test_a_hello_without_the_secret_learns_no_address_and_adds_no_peer(self, local_prefill, raw_clients):
        prefill = local_prefill(self.scenario())
        spy = raw_clients(prefill.mgr.control_address, "spy")
        pools = self.decode_pools(self.scenario())
        before = rejected("prefill", "unauthenticated")
        meta = spy.engine_metadata(pools, self.backend, self.backend_options)  # a victim's, or its own: both work without auth
        hello = P.Hello(peer_id=spy.identity, lanes=meta, host=host_id(), kvargs=pools.kvargs)
        reply = spy.ask(hello, seal=False)
        assert isinstance(reply, P.Reject) and "requires the kvbridge secret" in reply.reason, reply
        assert "0x" not in reply.reason and str(prefill.pools.kvargs.regions[0].addr) not in reply.reason
        assert prefill.mgr.peers() == []
        assert rejected("prefill", "unauthenticated") == before + 1

    def test_a_tampered_message_is_refused_and_counted(self, local_prefill, raw_clients):
        prefill = local_prefill(self.scenario())
        client = raw_clients(prefill.mgr.control_address, "client")
        sealer = A.Sealer()
        frame = bytearray(client.chan.auth.seal(P.encode(P.Heartbeat()), prefill.mgr.control_address.encode(), sealer))
        frame[-1] ^= 0x01
        before = rejected("prefill", "forged")
        reply = client.ask_raw(bytes(frame), seal=False)
        assert isinstance(reply, P.Reject) and reply.reason.startswith("authentication failed"), reply
        assert rejected("prefill", "forged") == before + 1

    def test_a_replayed_message_is_refused_even_from_another_connection(self, local_prefill, raw_clients):
        sc = self.scenario(heartbeat_timeout=60.0)
        prefill = local_prefill(sc, config=dataclasses.replace(sc.session_config(), heartbeat_timeout=60.0))
        victim = raw_clients(prefill.mgr.control_address, "victim")
        victim.handshake(self.decode_pools(sc), self.backend, self.backend_options)
        sealed = victim.chan.auth.seal(P.encode(P.Abort(room=7, reason="x")), prefill.mgr.control_address.encode(),
                                       victim.chan._sealer)
        victim.send_raw(sealed, seal=False)
        assert isinstance(victim.reply(), P.Fenced)  # the original was handled: every Abort is answered
        assert isinstance(victim.ask(P.Heartbeat()), P.Heartbeat)
        before = rejected("prefill", "replayed")
        replayer = raw_clients(prefill.mgr.control_address, "replayer")
        replayer.send_raw(sealed, seal=False)
        reply = replayer.reply()
        assert isinstance(reply, P.Reject) and "replayed" in reply.reason, reply
        assert rejected("prefill", "replayed") == before + 1

    def test_a_message_sealed_for_another_endpoint_is_refused(self, local_prefill, raw_clients):
        prefill = local_prefill(self.scenario())
        client = raw_clients(prefill.mgr.control_address, "client")
        other = b"127.0.0.1:1"  # another prefill rank's address: messages captured there do not work here
        frame = client.chan.auth.seal(P.encode(P.Heartbeat()), other, A.Sealer())
        reply = client.ask_raw(frame, seal=False)
        assert isinstance(reply, P.Reject) and "addressed to '127.0.0.1:1'" in reply.reason, reply

    def test_a_message_sealed_outside_the_window_is_refused(self, monkeypatch):
        auth = A.Auth(b"s" * 32)
        frame = auth.seal(b"payload", b"me", A.Sealer())
        assert auth.open(frame, {b"me"}) == b"payload"
        sealed_at = time.time()
        frame = auth.seal(b"payload", b"me", A.Sealer())
        monkeypatch.setattr(A.time, "time", lambda: sealed_at + A.REPLAY_WINDOW + 5)
        with pytest.raises(A.AuthError) as info:
            auth.open(frame, {b"me"})  # opened 35 s after it was sealed
        assert info.value.kind == "stale"

    # -- without a secret: loopback only, said once ----------------------------------------------
    def test_without_a_secret_a_non_loopback_host_is_refused_naming_the_variable(self, monkeypatch, caplog):
        monkeypatch.delenv(A.ENV_SECRET, raising=False)
        monkeypatch.delenv(A.ENV_SECRET_FILE, raising=False)
        monkeypatch.setattr(A, "_warned_open", False)
        caplog.set_level(logging.WARNING, logger="kvbridge.core.control.auth")
        sc = self.scenario()
        with pytest.raises(ValueError, match=r"host '0\.0\.0\.0' is not a loopback address and no kvbridge secret is set; set \$KVBRIDGE_SECRET"):
            BootstrapServer("0.0.0.0")
        with pytest.raises(ValueError, match=r"\$KVBRIDGE_SECRET"):
            DecodeManager(self.decode_pools(sc).kvargs, self.backend, config=dataclasses.replace(sc.session_config(), host="0.0.0.0"))
        server = BootstrapServer("127.0.0.1")  # loopback works without a secret
        server.close()
        said = [r.getMessage() for r in caplog.records if "no secret set" in r.getMessage()]
        assert len(said) == 1, said

    def test_a_short_or_unreadable_secret_is_an_error_naming_its_source(self, monkeypatch, tmp_path):
        monkeypatch.setenv(A.ENV_SECRET, "short")
        with pytest.raises(ValueError, match=r"the kvbridge secret from \$KVBRIDGE_SECRET has 5 bytes; use at least 16"):
            A.load_secret()
        with pytest.raises(ValueError, match="cannot read the kvbridge secret file"):
            A.load_secret(tmp_path / "missing")
        path = tmp_path / "secret"
        path.write_text("x" * 40 + "\n")
        assert A.load_secret(path) == b"x" * 40  # the file wins over the environment; its newline is not part of it

    # -- finding 3: bounds ------------------------------------------------------------------------
    def test_a_frame_over_max_message_bytes_is_dropped_before_it_is_allocated(self, local_prefill, raw_clients):
        sc = self.scenario()
        cfg = dataclasses.replace(sc.session_config(), max_message_bytes=1 << 20, max_index_list=1 << 16)
        prefill = local_prefill(sc, config=cfg)
        big = os.urandom(1) * (96 << 20)  # allocated here before measuring: only a received copy would add to RSS
        gc.collect()
        before = rss_bytes()
        hostile = raw_clients(prefill.mgr.control_address, "hostile")
        hostile.send_raw(big, seal=False)
        time.sleep(0.5)  # no reply is the expected outcome; give the I/O thread time to (not) read it
        assert not hostile.sock.poll(500)
        assert rss_bytes() - before < 32 << 20, f"RSS grew by {(rss_bytes() - before) >> 20} MiB"
        other = raw_clients(prefill.mgr.control_address, "other")
        assert isinstance(other.ask(P.Heartbeat()), P.Reject)  # still serving ("send Hello first")
        del big

    def test_an_index_list_longer_than_max_index_list_is_refused_before_decoding(self, local_prefill, raw_clients):
        sc = self.scenario()
        cfg = dataclasses.replace(sc.session_config(), heartbeat_timeout=60.0, max_index_list=512)
        prefill = local_prefill(sc, config=cfg)
        peer = raw_clients(prefill.mgr.control_address, "peer")
        peer.handshake(self.decode_pools(sc), self.backend, self.backend_options)
        reply = peer.ask(P.TransferRequest(room=1, indices={"kv_page": bytes(4 * 513)}, metadata_row=0))
        assert isinstance(reply, P.Failed), reply
        assert "index list 'kv_page' has 513 entries, more than max_index_list=512" in reply.reason

    def test_a_thousand_hellos_do_not_start_a_thousand_threads(self, local_prefill, raw_clients):
        sc = self.scenario()
        cfg = dataclasses.replace(sc.session_config(), heartbeat_timeout=120.0)
        prefill = local_prefill(sc, config=cfg)
        pools = self.decode_pools(sc)
        helper = raw_clients(prefill.mgr.control_address, "engine")
        helper.handshake(pools, self.backend, self.backend_options)  # real engine metadata every Hello can use
        meta = helper.engine.metadata()
        threads = threading.active_count()
        replies: dict[str, int] = {}
        for i in range(1000):
            client = RawClient(prefill.mgr.control_address, f"h{i}")
            try:
                reply = client.ask(P.Hello(peer_id=client.identity, lanes=meta, host=host_id(), kvargs=pools.kvargs))
            finally:
                client.close()
            kind = type(reply).__name__ if isinstance(reply, P.HelloAck) else reply.reason.split(":")[0]  # type: ignore[union-attr]
            replies[kind] = replies.get(kind, 0) + 1
        assert threading.active_count() <= threads + 1, (threading.active_count(), threads)
        assert set(replies) <= {"HelloAck", "too many handshakes"}, replies
        assert replies.get("HelloAck", 0) >= 2 * cfg.handshake_rate  # the burst is served
        assert len(prefill.mgr.peers()) <= cfg.max_peers

    def test_max_peers_refuses_the_next_decode_rank_with_a_reason(self, local_prefill, raw_clients):
        sc = self.scenario()
        prefill = local_prefill(sc, config=dataclasses.replace(sc.session_config(), heartbeat_timeout=60.0, max_peers=2))
        pools = self.decode_pools(sc)
        for name in ("a", "b"):
            raw_clients(prefill.mgr.control_address, name).handshake(pools, self.backend, self.backend_options)
        third = raw_clients(prefill.mgr.control_address, "c")
        reply = third.ask(P.Hello(peer_id=third.identity, lanes={self.backend: HOSTILE_META}, kvargs=pools.kvargs))
        assert isinstance(reply, P.Reject) and "already serves 2 decode ranks, its limit (SessionConfig.max_peers)" in reply.reason

    # -- finding 6 ----------------------------------------------------------------------------------
    def test_a_hello_with_addresses_near_2_64_gets_a_typed_rejection(self, local_prefill, raw_clients):
        sc = self.scenario()
        prefill = local_prefill(sc)
        client = raw_clients(prefill.mgr.control_address, "client")
        fields = msgspec.to_builtins(self.decode_pools(sc).kvargs)
        fields["regions"][0]["addr"] = 2**64 - 16
        hello = {"type": "hello", "v": P.PROTOCOL_VERSION, "peer_id": client.identity, "lanes": {self.backend: b""},
                 "kvargs": fields}
        reply = client.ask_raw(msgspec.msgpack.encode(hello))
        assert isinstance(reply, P.Reject) and reply.reason.startswith("malformed 'hello' message: "), reply
        assert "ends past 2**63-1" in reply.reason
        assert isinstance(client.ask(P.Heartbeat()), P.Reject)  # and the rank keeps serving

    def test_a_room_id_of_2_64_is_refused_at_creation_and_close_still_works(self, local_decode):
        sc = self.scenario()
        decode = local_decode(sc)
        threads = threading.active_count()
        with pytest.raises(ValueError, match=r"room must be an integer in 0 \.\. 2\*\*64-1"):
            Receiver(decode.mgr, 2**64, bootstrap="127.0.0.1:1")
        recv = Receiver(decode.mgr, 2**64 - 1, bootstrap="127.0.0.1:1")
        recv.init([0], metadata_row=2**70)  # a bad row fails the room; nothing is sent
        assert recv.poll() == Poll.FAILED
        decode.mgr.close()
        assert decode.mgr.active_rooms() == 0
        wait_until(lambda: threading.active_count() < threads, 5.0, "the decode manager's thread ending")

    def test_a_manager_whose_registration_is_refused_releases_everything(self, local_prefill):
        sc = self.scenario()
        first = local_prefill(sc)
        threads = threading.active_count()
        cfg = dataclasses.replace(sc.session_config(), bootstrap_timeout=1.0)
        with pytest.raises(TimeoutError, match="rank held"):
            PrefillManager(first.pools.kvargs, self.backend, bootstrap=first.address, config=cfg)
        wait_until(lambda: threading.active_count() <= threads, 5.0, "the refused manager's threads ending")
