"""The ``zmq`` transport: a kvbridge backend that needs no native engine.

Every engine has two halves. Here the writing half (prefill) gathers a batch's
source bytes into one message and sends it over a zmq DEALER socket to the
peer; the receiving half (decode) runs one thread with a ROUTER socket that
checks every destination range against the memory it registered (kvbridge's
own bounds check) before copying the bytes into place, then acknowledges.
``write`` returns once the message is acknowledged, so the bytes have landed,
and raises at its deadline, so a dead or frozen peer costs at most the deadline.

What the backend does not do, because kvbridge does it for every backend from
its declared capabilities: refuse memory of other kinds, cut plans into
batches of at most ``max_bytes_per_batch`` (4 MiB: one message each) and check
the deadline before every batch.

Wire format, one message per batch::

    [dst_addr: int64 * n] [nbytes: int64 * n] [payload: the n ranges, concatenated]

and the acknowledgement ``[error: utf-8, empty when placed]``.
A portable backend pays one ``memmove`` per descriptor on each side, which a
NIC does in hardware; the planner's coalescing keeps descriptors few.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

import numpy as np
import zmq

from kvbridge.core.transfer.backend import Backend, BackendConfig, TransferError, TransferTimeout
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.plan import PlanError, TransferPlan

from . import CAPABILITIES

__all__ = ["ZmqBackend"]


class _Peer:
    """A peer's endpoint and the socket its writes use (core runs one write per peer at a time)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sock: zmq.Socket[bytes] | None = None
        self.busy = False  # a write is using the socket
        self.gone = False  # removed or replaced: the socket closes when no write uses it

    def close_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None


class ZmqBackend(Backend):
    capabilities = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._regions: list[Region] = []
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()  # guards _peers and every _Peer's fields
        self._closed = False
        self._stop = threading.Event()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        port = self._router.bind_to_random_port(f"tcp://{config.host}")
        self._endpoint = f"tcp://{config.host}:{port}"
        self._receiver = threading.Thread(target=self._receive, name=f"kvbridge-zmq-{config.name}", daemon=True)
        self._receiver.start()

    # -- the contract ----------------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> None:
        self._regions = list(regions)  # what peers may write into

    def metadata(self) -> bytes:
        return self._endpoint.encode()

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        endpoint = bytes(metadata).decode(errors="replace")
        if not endpoint.startswith("tcp://"):
            raise TransferError(f"zmq: peer {peer!r} sent metadata {endpoint[:80]!r}; expected a tcp:// endpoint")
        with self._lock:
            self._retire(self._peers.get(peer))  # a peer that handshakes again replaces its old entry
            self._peers[peer] = _Peer(endpoint)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._retire(self._peers.pop(peer, None))

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        with self._lock:
            target = self._peers.get(peer)
            if target is None or self._closed:
                why = "the backend is closed" if self._closed else f"known peers: {', '.join(sorted(self._peers)) or 'none'}"
                raise TransferError(f"zmq: unknown peer {peer!r} ({why}); call add_peer first")
            target.busy = True
        try:
            self._send(peer, target, batch, deadline)
        except BaseException:
            with self._lock:
                target.close_socket()  # late acknowledgements must not reach the next write
            raise
        finally:
            with self._lock:
                target.busy = False
                if target.gone:
                    target.close_socket()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in self._peers.values():
                self._retire(peer)
            self._peers.clear()
        self._stop.set()
        self._receiver.join(5)

    def describe(self) -> dict[str, object]:
        return {"endpoint": self._endpoint}

    # -- writing ---------------------------------------------------------------------------------
    def _retire(self, peer: _Peer | None) -> None:
        """Caller holds the lock."""
        if peer is not None:
            peer.gone = True
            if not peer.busy:
                peer.close_socket()

    def _send(self, peer: str, target: _Peer, batch: TransferPlan, deadline: float) -> None:
        if target.sock is None:
            target.sock = self._ctx.socket(zmq.DEALER)
            target.sock.setsockopt(zmq.LINGER, 0)
            target.sock.connect(target.endpoint)
        target.sock.send_multipart(_message(batch), copy=False)
        left = deadline - time.monotonic()
        if left <= 0 or not target.sock.poll(max(1, int(left * 1000))):
            raise TransferTimeout(f"zmq: peer {peer!r} ({target.endpoint}) did not acknowledge {len(batch)} "
                                  f"descriptors, {batch.total_bytes} B by the deadline")
        (error,) = target.sock.recv_multipart()
        if error:
            raise TransferError(f"zmq: peer {peer!r} refused the write: {error.decode(errors='replace')}")

    # -- receiving -------------------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._router.poll(100):
                    continue
                ident, *frames = self._router.recv_multipart(copy=False)
                error = ""
                try:
                    if len(frames) != 3:
                        raise ValueError(f"a message has {len(frames)} frames after the identity, expected 3")
                    self._place(frames[0].buffer, frames[1].buffer, frames[2].buffer)
                except (PlanError, ValueError, IndexError) as exc:
                    error = str(exc)
                self._router.send_multipart([ident.bytes, error.encode()])
        finally:
            self._router.close(linger=0)

    def _place(self, dst_frame: memoryview, nbytes_frame: memoryview, payload: memoryview) -> None:
        dst, nbytes = np.frombuffer(dst_frame, np.int64), np.frombuffer(nbytes_frame, np.int64)
        if dst.size != nbytes.size or int(nbytes.sum()) != len(payload):
            raise ValueError(f"payload of {len(payload)} bytes does not match its header "
                             f"({dst.size} addresses, {nbytes.size} sizes summing to {int(nbytes.sum())})")
        # Nothing lands outside registered memory: the planner's own bounds check.
        TransferPlan(dst, dst, nbytes).validate(self._regions, self._regions)
        src = np.frombuffer(payload, np.uint8).ctypes.data
        for addr, offset, n in zip(dst.tolist(), _offsets(nbytes).tolist(), nbytes.tolist()):
            ctypes.memmove(addr, src + offset, n)


def _offsets(nbytes: np.ndarray) -> np.ndarray:
    """Where each descriptor's bytes start in the concatenated payload."""
    return np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)


def _message(batch: TransferPlan) -> list[bytes | bytearray]:
    payload = bytearray(batch.total_bytes)
    base = ctypes.addressof((ctypes.c_char * len(payload)).from_buffer(payload))
    for addr, offset, n in zip(batch.src_addr.tolist(), _offsets(batch.nbytes).tolist(), batch.nbytes.tolist()):
        ctypes.memmove(base + offset, addr, n)
    return [batch.dst_addr.tobytes(), batch.nbytes.tobytes(), payload]
