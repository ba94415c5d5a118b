"""The bootstrap endpoint: prefill ranks register, decode ranks look them up.

One :class:`BootstrapServer` runs per prefill server (typically in its rank 0
process, or stand-alone). It is a zmq ROUTER on ``tcp://HOST:PORT``; messages
are the typed structs of :mod:`kvbridge.core.protocol`.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from . import protocol as P
from .channel import IOLoop, routed_message

__all__ = ["BootstrapServer", "register_rank"]

log = logging.getLogger(__name__)


class BootstrapServer:
    """Keeps the table of registered prefill ranks; answers lookups."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._ranks: dict[tuple[int, int], P.RankInfo] = {}
        self._lock = threading.Lock()
        self._loop = IOLoop("kvbridge-bootstrap")
        sock = self._loop.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        self._loop.add_socket(sock, self._on_message)
        self._loop.start()

    @property
    def ranks(self) -> list[P.RankInfo]:
        with self._lock:
            return list(self._ranks.values())

    def _on_message(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        got = routed_message(sock, frames, "bootstrap")
        if got is None:
            return
        ident, msg = got
        if isinstance(msg, P.Register):
            with self._lock:
                self._ranks[(msg.rank.tp_rank, msg.rank.pp_rank)] = msg.rank
            reply: P.Message = P.RegisterAck()
        elif isinstance(msg, P.Lookup):
            reply = P.LookupReply(ranks=tuple(self.ranks))
        else:
            reply = P.Reject(reason=f"the bootstrap endpoint does not handle {type(msg).__name__} messages")
        sock.send_multipart([ident, P.encode(reply)])

    def close(self) -> None:
        self._loop.stop()


def request(address: str, msg: P.Message, timeout: float) -> P.Message:
    """One request/reply with the bootstrap endpoint, bounded by ``timeout`` seconds."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send(P.encode(msg))
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"bootstrap endpoint {address} did not answer within {timeout:.1f}s")
        return P.decode(sock.recv())
    finally:
        sock.close()


def register_rank(address: str, rank: P.RankInfo, timeout: float) -> None:
    """Register a prefill rank, retrying until ``timeout`` (the endpoint may start later)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            reply = request(address, P.Register(rank=rank), min(1.0, max(0.05, deadline - time.monotonic())))
        except TimeoutError as exc:
            last = exc
            continue
        if isinstance(reply, P.RegisterAck):
            return
        raise ConnectionError(f"bootstrap endpoint {address} refused registration: {reply}")
    raise TimeoutError(f"could not register with bootstrap endpoint {address} within {timeout:.1f}s: {last}")
