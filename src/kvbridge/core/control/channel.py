"""Control sockets: :class:`Channel` seals what it sends and opens what it receives.

Every control socket is a :class:`Channel`: it seals what it sends and opens
what it receives with the process's :class:`~kvbridge.core.control.auth.Auth` (the
one place control messages are authenticated), caps the size of a frame
(zmq drops a longer one before allocating it) and turns anything refused
into a counted, logged, and where possible answered rejection. The thread
that owns the sockets is :class:`~kvbridge.core.control.ioloop.IOLoop`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import zmq

from . import protocol as P
from .auth import NO_INCARNATION, Auth, AuthError, Sealer, incarnation_name, new_incarnation
from .ioloop import _io
from .metrics import metrics

log = logging.getLogger(__name__)


class _Quiet:
    """Logs a repeated refusal at most once per ``interval`` seconds (hostile traffic must not flood the log)."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get(key, (-1e9, 0))
            if now - last < self.interval:
                self._last[key] = (last, skipped + 1)
                return
            self._last[key] = (now, 0)
        if skipped:
            msg += f" ({skipped} more like it not logged)"
        log.warning(msg, *args)


quiet = _Quiet()
#: Refusals answered without a seal: the sender may not hold our secret, and the text reveals nothing.
_ANSWER_PLAIN = ("unauthenticated", "forged")
#: Connections whose sender incarnation a ROUTER remembers (to address its replies), least recent dropped first.
MAX_ROUTES = 4096


class Channel:
    """One control socket: its messages sealed and opened by ``auth``, its frames at most ``max_bytes``.

    ``endpoint`` (``"prefill"``, ``"decode"``, ``"bootstrap"``) labels logs
    and the rejection counter. ``incarnation`` is the endpoint's (its
    manager's or bootstrap server's; random if not given): it travels in
    every message's header, and a message addressed to another incarnation
    is refused. A ROUTER answers to the names in ``me`` and addresses each
    reply to the incarnation that connection's last accepted message came
    from; a DEALER sends to ``to`` (the incarnation it last heard from there)
    and answers to its incarnation. A DEALER sets no zmq identity unless
    ``identity`` is given: the ROUTER assigns one per connection, so no
    client can present another's. :attr:`sender_incarnation` is the
    incarnation of the last message :meth:`receive` accepted. Use it on one
    thread at a time.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        kind: int,
        auth: Auth,
        *,
        endpoint: str,
        max_bytes: int,
        me: tuple[bytes, ...] = (),
        to: bytes = b"",
        identity: bytes | None = None,
        incarnation: bytes | None = None,
    ) -> None:
        self.auth = auth
        self.endpoint = endpoint
        self.kind = kind
        self.to = to
        self.incarnation = incarnation or new_incarnation()
        self.sock: zmq.Socket[bytes] = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        if kind == zmq.DEALER:
            me = (*me, incarnation_name(self.incarnation))
            if identity:
                self.sock.setsockopt(zmq.IDENTITY, identity)
                me = (*me, identity)
        self.me = frozenset(me)
        self._sealer = Sealer(self.incarnation)
        #: The incarnation of the last message accepted here (``b""``: it carried none).
        self.sender_incarnation = b""
        #: DEALER: the incarnation last heard from at ``to`` (addressed in what it sends).
        self.peer_incarnation = b""
        #: ROUTER: each connection's last sender incarnation (replies are addressed to it).
        self._routes: OrderedDict[bytes, bytes] = OrderedDict()
        #: The last refusal of a message received here (for failure reasons of silent peers).
        self.last_refusal: str | None = None

    def bind(self, host: str) -> str:
        """Bind a random port on ``host``; return ``host:port``, which is also a name this channel answers to."""
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        address = f"{host}:{port}"
        self.me = self.me | {address.encode()}
        return address

    def bind_port(self, host: str, port: int) -> str:
        self.sock.bind(f"tcp://{host}:{port}")
        address = f"{host}:{port}"
        self.me = self.me | {address.encode()}
        return address

    def connect(self, address: str) -> None:
        self.sock.connect(f"tcp://{address}")

    def seal(self, payload: bytes, to: bytes, to_inc: bytes = NO_INCARNATION) -> bytes:
        """``payload`` sealed for ``to`` (incarnation ``to_inc``) as this channel seals what it sends (its replay
        counter)."""
        return self.auth.seal(payload, to, self._sealer, to_inc)

    def send(self, payload: bytes, ident: bytes | None = None) -> None:
        """Seal ``payload`` for ``ident`` (ROUTER) or this channel's peer (DEALER) and send it without blocking."""
        to, to_inc = self._address(ident)
        frame = self.seal(payload, to, to_inc)
        _send(self.sock, [ident, frame] if ident is not None else [frame])

    def _address(self, ident: bytes | None, sender: bytes = b"") -> tuple[bytes, bytes]:
        """``(to, to_inc)`` for a message to ``ident`` (ROUTER) or this channel's peer (DEALER)."""
        if ident is None:
            return self.to, self.peer_incarnation or NO_INCARNATION
        if sender and ident[:1] != b"\x00":
            # A refusal on a connection that named itself (zmq's own ids start with a zero byte): answer
            # the name, since the incarnation the refused frame claims may be another's (a replay).
            return ident, NO_INCARNATION
        inc = sender or self._routes.get(ident)
        return (incarnation_name(inc), inc) if inc else (ident, NO_INCARNATION)

    def send_msg(self, msg: P.Message, ident: bytes | None = None) -> None:
        self.send(P.encode(msg), ident)

    def receive(self, frames: list[bytes]) -> tuple[bytes | None, P.Message] | None:
        """``(identity or None, message)`` of a received message, or None if it was refused.

        Refusals are counted (``metrics().rejected``), logged at most every few
        seconds per kind, and on a ROUTER answered with a :class:`~kvbridge.core.control.protocol.Reject`
        saying why: sealed, or plain to a sender that may not hold the secret.
        """
        routed = self.kind == zmq.ROUTER
        if len(frames) != (2 if routed else 1):
            self._refused(None, "malformed", f"a control message with {len(frames)} frames")
            return None
        ident = frames[0] if routed else None
        try:
            opened = self.auth.open_frame(frames[-1], self.me, self.incarnation)
        except AuthError as exc:
            self._refused(ident, exc.kind, str(exc), plain=exc.kind in _ANSWER_PLAIN,
                          sender=Auth.sender_of(frames[-1]))
            if not routed and exc.kind == "unauthenticated":
                self._peek(frames[-1])
            return None
        try:
            msg = P.decode(opened.payload)
        except P.ProtocolError as exc:
            self._refused(ident, "malformed", str(exc), sender=opened.sender)
            return None
        self.sender_incarnation = opened.sender
        if opened.sender:
            if ident is None:
                self.peer_incarnation = opened.sender
            else:
                self._routes[ident] = opened.sender
                self._routes.move_to_end(ident)
                if len(self._routes) > MAX_ROUTES:
                    self._routes.popitem(last=False)
        return ident, msg

    def reject(self, ident: bytes, reason: str, room: int | None = None, kind: str = "refused") -> None:
        """Refuse a well-formed message: count it and answer ``ident`` with a Reject (ROUTER only)."""
        self._refused(ident, kind, reason, room=room)

    def _refused(self, ident: bytes | None, kind: str, reason: str, *, plain: bool = False,
                 room: int | None = None, sender: bytes = b"") -> None:
        metrics().rejected(self.endpoint, kind)
        who = "" if ident is None else f" from {ident[:64]!r}"
        self.last_refusal = reason
        quiet.warning(f"{self.endpoint}:{kind}", "%s: refused a control message%s: %s", self.endpoint, who, reason)
        if ident is not None:
            reply = P.encode(P.Reject(reason=reason, room=room))
            if not plain:
                to, to_inc = self._address(ident, sender)
                reply = self.auth.seal(reply, to, self._sealer, to_inc)
            _send(self.sock, [ident, reply])

    def _peek(self, frame: bytes) -> None:
        """Explain an unauthenticated answer (typically: the other side has another secret, or none)."""
        try:
            msg = P.decode(frame)
        except P.ProtocolError:
            return
        if isinstance(msg, P.Reject):
            self.last_refusal = f"the other side answered without authentication: {msg.reason[:300]}"
            quiet.warning(f"{self.endpoint}:peek", "%s: %s", self.endpoint, self.last_refusal)

    def close(self) -> None:
        self.sock.close(linger=0)


_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: zmq's are enum flags, and each | builds a member
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def _send(sock: zmq.Socket | None, frames: list[bytes]) -> None:
    if sock is None:
        return
    try:
        # Frame by frame, as send_multipart sends them, without its per-frame checks (each message of a
        # request's critical path: #27). A ROUTER's first frame routes: Again there drops the message whole.
        for frame in frames[:-1]:
            sock.send(frame, _MORE)
        sock.send(frames[-1], _NOBLOCK)
    except zmq.Again:
        quiet.warning("full", "kvbridge control socket is full; dropped a message")
    except zmq.ZMQError as exc:
        quiet.warning("send", "kvbridge control send failed: %s", exc)
    sent = _io.sent
    if sent is not None:  # a send may take the signal of a message that arrived: the loop asks the socket again
        sent.add(sock)
