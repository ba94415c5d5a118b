"""Review of the fence's reset rule and its retry (core/tcpfence.py, Transport._post).

- A retry after a reset is checked for liveness first; when that check stops it (the room failed
  meanwhile), the attempt that failed was still posted, so its peer's connections must be reset as
  after any failed write (post() skipped that: it took the TransferCancelled for "nothing posted").
- abort() decides per address: an advertised engine address this process has no connection to
  (a second NIC's listener that does not answer from here) must not get the connections to an
  address that answers reset.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Sequence

import numpy as np
import pytest

from kvbridge.core import tcpfence, transport as transport_mod
from kvbridge.core.backend import Backend, BackendConfig, TransferCancelled, TransferError
from kvbridge.core.layout import Region
from kvbridge.core.plan import TransferPlan
from kvbridge.core.records import BackendCapabilities
from kvbridge.core.transport import Transport


class _FailsFirst(Backend):
    """Fails its first write (as Mooncake fails a call on a pooled connection that was reset)."""

    capabilities = BackendCapabilities()

    def __init__(self) -> None:
        super().__init__(BackendConfig(host="127.0.0.1", name="fake", transfer_timeout=5.0))
        self.writes = 0

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


def test_a_retry_stopped_by_a_failed_room_still_resets_the_peers_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []

    def abort(remote: object, only_unreachable: bool = True) -> int:
        calls.append(only_unreachable)
        return 1

    monkeypatch.setattr(transport_mod.tcpfence, "abort", abort)
    backend = _FailsFirst()
    t = Transport(backend, "fake", fast_path=False)
    t.add_peer("p", b"", [], tcp=[("127.0.0.1", 9)])
    t.reset("p", "a stuck write", stuck=True)  # one connection reset: the next write may retry once
    calls.clear()
    plan = TransferPlan(np.array([4096], np.uint64), np.array([8192], np.uint64), np.array([64], np.uint64))

    def live() -> bool:  # the room fails while the first attempt is in the backend
        return backend.writes == 0

    with pytest.raises(TransferCancelled):
        t.write("p", plan, time.monotonic() + 5.0, live)
    assert backend.writes == 1  # no retry once the room is not live (the fence)
    assert calls == [True], "the failed attempt was posted: its connections must be reset as after any failed write"


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


def test_a_call_after_the_io_loop_stopped_writes_into_no_other_file() -> None:
    """A worker that outlived close() (its Fenced, its Done) calls loop.call: the wake-up byte must
    not go to the file that reused the closed wake pipe's descriptor number."""
    import os

    from kvbridge.core.channel import IOLoop

    loop = IOLoop("test-stopped-wake")
    loop.start()
    old = loop._wake_w
    loop.stop()
    fds = [os.pipe() for _ in range(4)]  # one of them takes the old number (lowest free first)
    try:
        loop.call(lambda: None)
        for r, w in fds:
            os.set_blocking(r, False)
            with pytest.raises(BlockingIOError):
                got = os.read(r, 8)
                pytest.fail(f"{got!r} written into an unrelated pipe (fds {r}, {w}; the loop's was {old})")
    finally:
        for r, w in fds:
            os.close(r)
            os.close(w)
