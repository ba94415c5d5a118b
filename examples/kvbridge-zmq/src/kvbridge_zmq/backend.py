"""The ``zmq`` transport: a kvbridge backend that needs no native engine.

``write`` sends the plan's bytes in messages of at most ``MAX_MESSAGE`` bytes
to the peer's receiver thread, which checks every destination range against
the memory it registered (the same check kvbridge's planner uses) and copies
the bytes into place, then acknowledges. A few messages are kept in flight;
``write`` returns when all are acknowledged, or raises at the deadline.
"""

from __future__ import annotations

import ctypes
import threading
import time

import msgspec
import numpy as np
import zmq

from kvbridge.core.backend import Backend, BackendConfig, TransferError, TransferTimeout
from kvbridge.core.plan import PlanError, TransferPlan

from . import CAPABILITIES

MAX_MESSAGE = 4 << 20  # bytes of payload per message
WINDOW = 4  # messages in flight per write


class _Header(msgspec.Struct, array_like=True):
    seq: int
    dst: list[int]
    nbytes: list[int]


class ZmqBackend(Backend):
    capabilities = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._ctx = zmq.Context.instance()
        self._regions: list = []
        self._peers: dict[str, str] = {}
        self._socks: dict[str, zmq.Socket] = {}
        self._stop = threading.Event()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        port = self._router.bind_to_random_port(f"tcp://{config.host}")
        self._endpoint = f"tcp://{config.host}:{port}"
        self._thread = threading.Thread(target=self._serve, name="kvbridge-zmq-recv", daemon=True)
        self._thread.start()

    # -- contract ------------------------------------------------------------------------
    def register(self, regions) -> None:
        self._regions = list(regions)

    def metadata(self) -> bytes:
        return self._endpoint.encode()

    def add_peer(self, peer, metadata, regions) -> None:
        endpoint = bytes(metadata).decode()
        if not endpoint.startswith("tcp://"):
            raise TransferError(f"zmq: peer {peer!r} sent metadata {endpoint!r}; expected a tcp:// endpoint")
        self._peers[peer] = endpoint

    def remove_peer(self, peer) -> None:
        self._peers.pop(peer, None)
        # The socket belongs to the peer's writer thread; it is dropped on next use or at close.

    def write(self, peer, plan: TransferPlan, deadline: float) -> None:
        endpoint = self._peers.get(peer)
        if endpoint is None:
            raise TransferError(f"zmq: unknown peer {peer!r}; call add_peer first")
        # Core runs one write per peer at a time, so this socket is used by one thread at a time.
        sock = self._socks.get(peer)
        if sock is None:
            sock = self._socks[peer] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        batches = list(plan.batches(max_bytes=MAX_MESSAGE))
        pending: set[int] = set()
        sent = 0
        while sent < len(batches) or pending:
            while sent < len(batches) and len(pending) < WINDOW:
                b = batches[sent]
                header = msgspec.msgpack.encode(_Header(sent, b.dst_addr.tolist(), b.nbytes.tolist()))
                frames = [header] + [(ctypes.c_char * n).from_address(a) for a, n in zip(b.src_addr.tolist(), b.nbytes.tolist())]
                sock.send_multipart(frames, copy=False)
                pending.add(sent)
                sent += 1
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                self._drop_socket(peer)  # late acks must not be read by the next write
                raise TransferTimeout(f"zmq: peer {peer!r} ({endpoint}) acknowledged {sent - len(pending)} of {len(batches)} messages by the deadline")
            seq, error = msgspec.msgpack.decode(sock.recv())
            if error:
                self._drop_socket(peer)
                raise TransferError(f"zmq: peer {peer!r} refused message {seq}: {error}")
            pending.discard(seq)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        for peer in list(self._socks):
            self._drop_socket(peer)
        self._peers.clear()

    # -- receiver ------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._router.poll(100):
                    continue
                ident, header, *payload = self._router.recv_multipart(copy=False)
                try:
                    self._place(bytes(header.buffer), payload)
                    seq, error = msgspec.msgpack.decode(bytes(header.buffer), type=_Header).seq, ""
                except (PlanError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                    seq, error = -1, str(exc)
                self._router.send_multipart([ident.bytes, msgspec.msgpack.encode((seq, error))])
        finally:
            self._router.close(linger=0)

    def _place(self, header: bytes, payload: list) -> None:
        h = msgspec.msgpack.decode(header, type=_Header)
        dst, nbytes = np.asarray(h.dst, np.int64), np.asarray(h.nbytes, np.int64)
        if not (dst.size == nbytes.size == len(payload)) or any(len(f.buffer) != n for f, n in zip(payload, h.nbytes)):
            raise ValueError("message frames do not match their header")
        # Nothing is written outside registered memory: the planner's own bounds check.
        TransferPlan(dst, dst, nbytes).validate(self._regions, self._regions)
        for frame, addr, n in zip(payload, h.dst, h.nbytes):
            ctypes.memmove(addr, np.frombuffer(frame.buffer, np.uint8).ctypes.data, n)

    def _drop_socket(self, peer: str) -> None:
        sock = self._socks.pop(peer, None)
        if sock is not None:
            sock.close(linger=0)
