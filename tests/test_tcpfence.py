"""kvbridge.plugins.tcpfence on real sockets: abort exactly one peer's connections, dropping what they queued.

On loopback: a receiver that does not read, a sender whose send queue is
full. Its host still answers (a stopped process, not a cut link), so the
connection is left alone; forced, aborting the sender's connection must
drop that queue (the receiver reads what it already held, then a reset), and
leave a second connection to another port of the same IP as it was. A cut
link (no acknowledgements) is the fault matrix's net-cut cell (tests/test_faults.py).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import termios
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvbridge.plugins import tcpfence
from kvbridge.core.transfer.backend import Backend, BackendConfig, TransferCancelled, TransferError
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.description.records import BackendCapabilities
from kvbridge.core.transfer.transport import Transport

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="tcpfence reads /proc and relies on Linux tcp_disconnect")

SIOCOUTQ = termios.TIOCOUTQ  # bytes a TCP socket has not had acknowledged (Linux)
SIOCINQ = termios.FIONREAD  # bytes waiting to be read
DEADLINE = 10.0


def _queued(sock: socket.socket, request: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))[0])


class Pair:
    """A listener on 127.0.0.1, a client connected to it and the accepted end."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # inherited by the accepted end
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.client = socket.create_connection(("127.0.0.1", self.port), timeout=DEADLINE)
        self.server, _ = self.listener.accept()

    def close(self) -> None:
        for s in (self.client, self.server, self.listener):
            s.close()


@pytest.fixture
def pairs() -> Iterator[tuple[Pair, Pair]]:
    a, b = Pair(), Pair()
    yield a, b
    a.close()
    b.close()


def _fill(sock: socket.socket) -> int:
    """Send until the kernel takes no more (the peer does not read); return the bytes sent."""
    sock.setblocking(False)
    sent, chunk = 0, b"x" * 65536
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        try:
            sent += sock.send(chunk)
        except BlockingIOError:
            return sent
    raise AssertionError("the send queue never filled")


def _drain(sock: socket.socket) -> tuple[int, str]:
    """Read until end of stream or an error; return the bytes read and how it ended."""
    sock.settimeout(DEADLINE)
    got = 0
    while True:
        try:
            data = sock.recv(1 << 20)
        except ConnectionResetError:
            return got, "reset"
        except TimeoutError:
            return got, "timeout"
        if not data:
            return got, "eof"
        got += len(data)


def test_listening_lists_this_process_listeners_only(pairs: tuple[Pair, Pair]) -> None:
    a, b = pairs
    found = tcpfence.listening()
    assert {("127.0.0.1", a.port), ("127.0.0.1", b.port)} <= found
    assert ("127.0.0.1", a.client.getsockname()[1]) not in found  # a connected socket is not a listener


def test_engine_endpoints_are_the_listeners_opened_since_and_name_the_host_for_a_wildcard() -> None:
    before = tcpfence.listening()
    wild = socket.socket()
    wild.bind(("0.0.0.0", 0))
    wild.listen(1)
    try:
        assert tcpfence.engine_endpoints(before, "10.1.2.3") == (("10.1.2.3", wild.getsockname()[1]),)
    finally:
        wild.close()


def test_abort_drops_the_queued_bytes_of_that_peer_and_leaves_the_other_connection(pairs: tuple[Pair, Pair]) -> None:
    a, b = pairs
    sent = _fill(a.client)
    held = _queued(a.server, SIOCINQ)  # what the receiver already has: it may read that
    unacked = _queued(a.client, SIOCOUTQ)
    assert held < sent and unacked > 0, (held, sent, unacked)

    assert tcpfence.answers(("127.0.0.1", a.port))  # a full window, but the host answers
    assert tcpfence.abort([("127.0.0.1", a.port)]) == 0  # so it is not reset
    assert tcpfence.abort([("127.0.0.1", a.port)], only_unreachable=False) == 1

    got, end = _drain(a.server)
    assert (got, end) == (held, "reset"), f"read {got} of {sent} B sent ({held} held at the abort), then {end}"
    # The other connection, to another port of the same IP, works as before.
    b.client.sendall(b"still here")
    b.server.settimeout(DEADLINE)
    assert b.server.recv(64) == b"still here"
    b.server.sendall(b"and back")
    b.client.settimeout(DEADLINE)
    assert b.client.recv(64) == b"and back"


def test_abort_touches_nothing_for_endpoints_nobody_connected_to(pairs: tuple[Pair, Pair]) -> None:
    a, _ = pairs
    assert tcpfence.abort([]) == 0
    assert tcpfence.abort([("127.0.0.1", 1)]) == 0
    a.client.sendall(b"ok")
    a.server.settimeout(DEADLINE)
    assert a.server.recv(8) == b"ok"


def test_a_host_that_does_not_answer_has_every_connection_reset_idle_ones_too() -> None:
    """A listener whose accept queue is full drops handshakes, as a cut link does: the probe gets no
    answer, so the idle connection to it (an engine may hold bytes back in user space) is reset."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # Linux queues one connection; later SYNs are dropped, not refused
    port = listener.getsockname()[1]
    idle = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)  # queued, never accepted
    try:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
        closed.close()
        assert tcpfence.answers(("127.0.0.1", refused))  # a refusal is an answer: the host is there
        assert not tcpfence.answers(("127.0.0.1", port), timeout=0.2)
        assert tcpfence.abort([("127.0.0.1", port)]) == 1
        idle.settimeout(DEADLINE)
        with pytest.raises(OSError):  # reset: no longer connected
            idle.send(b"x")
    finally:
        idle.close()
        listener.close()


# -- the reset after a failed write (Transport) and its per-address rule ----------------------------
class _FailsFirst(Backend):
    """Fails its first write (as Mooncake fails a call on a pooled connection that was reset); its
    ``abort_peer`` records each call and says it reset one connection."""

    capabilities = BackendCapabilities()

    def __init__(self) -> None:
        super().__init__(BackendConfig(host="127.0.0.1", name="fake", transfer_timeout=5.0))
        self.writes = 0
        self.aborts: list[bool] = []

    def abort_peer(self, peer: str, stuck: bool = False) -> int:
        self.aborts.append(stuck)
        return 1

    def register(self, regions: Sequence[Region]) -> None:
        pass

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        pass

    def remove_peer(self, peer: str) -> None:
        pass

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        self.writes += 1
        if self.writes == 1:
            raise TransferError("fake: writeHeader: connection reset (some slices may have gone out)")

    def close(self) -> None:
        pass


def test_a_retry_stopped_by_a_failed_room_still_resets_the_peers_connections() -> None:
    backend = _FailsFirst()
    t = Transport.of(backend, "fake")
    t.add_peer("p", b"", [])
    t.reset("p", "a stuck write", stuck=True)  # one connection reset: the next write may retry once
    assert backend.aborts == [True]
    backend.aborts.clear()
    plan = TransferPlan(np.array([4096], np.uint64), np.array([8192], np.uint64), np.array([64], np.uint64))

    def live() -> bool:  # the room fails while the first attempt is in the backend
        return backend.writes == 0

    with pytest.raises(TransferCancelled):
        t.write("p", plan, time.monotonic() + 5.0, live)
    assert backend.writes == 1  # no retry once the room is not live (the fence)
    assert backend.aborts == [False], "the failed attempt was posted: its connections must be reset as after any failed write"


@pytest.mark.skipif(sys.platform != "linux", reason="tcpfence reads /proc")
def test_an_unanswering_address_without_connections_resets_nothing_to_an_address_that_answers() -> None:
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen(4)
    client = socket.create_connection(live.getsockname(), timeout=5.0)
    server, _ = live.accept()
    full = socket.socket()  # another advertised address of the peer's engine, not answering from here
    full.bind(("127.0.0.2", 0))
    full.listen(0)
    filler = socket.create_connection(full.getsockname(), timeout=5.0)  # fills the accept queue: SYNs dropped
    try:
        assert not tcpfence.answers(full.getsockname(), timeout=0.2)
        endpoints = [live.getsockname(), full.getsockname()]
        own = tcpfence.abort([live.getsockname()])
        assert own == 0  # the address answers: left alone
        # The connection to 127.0.0.2 (the filler) is this process's too; only ask about the live one's address.
        filler.close()
        filler = None
        assert tcpfence.abort(endpoints) == 0, "127.0.0.1 answers and nothing connects to 127.0.0.2: reset nothing"
        client.settimeout(5.0)
        client.sendall(b"ok")
        assert server.recv(8) == b"ok"
    finally:
        for s in (client, server, live, full, filler):
            if s is not None:
                s.close()
