"""Authentication of control messages: a shared secret, a keyed MAC, replay protection.

Every control message kvbridge sends is *sealed* when a secret is set::

    b"KVB\\x02" | nonce (16) | counter (8) | time_ms (8) | from (8) | to_inc (8) | len(to) (2) | to | mac (16) | payload

and otherwise travels with the same incarnations in a plain header::

    b"KVP\\x02" | from (8) | to_inc (8) | payload

- ``from`` is the sending endpoint's *incarnation*: 8 random bytes a manager
  or bootstrap server draws when it starts, so a restarted process is a new
  peer whatever address it has; ``to_inc`` the incarnation of the endpoint
  the sender believes it talks to (zeros before it heard from it). An
  endpoint refuses a message addressed to another incarnation of itself
  (``stale``): a message sealed for the process it replaced.

- ``mac`` is keyed BLAKE2b (16 bytes) over everything before it and the
  payload, with a key derived from the secret: a message without the secret,
  or with any byte changed, is refused (``unauthenticated``, ``forged``).
- ``to`` names the endpoint the message is for (a prefill rank's control
  address, a bootstrap address, a decode rank's identity); an endpoint
  refuses a message meant for another one (``misaddressed``), so a message
  captured on its way to one endpoint cannot be played to another.
- ``nonce`` is random per sending socket and ``counter`` increases with every
  message it sends; a receiver refuses a counter it has already passed
  (``replayed``) and a ``time_ms`` more than :data:`REPLAY_WINDOW` seconds
  from its own clock (``stale``), so an old message cannot be played again.
  A process refuses every message sealed before its :class:`Auth` existed
  (``replayed``, :data:`PREDATES`): what was captured before a restart is
  refused by the restarted process, whichever side restarted.

The secret comes from ``SessionConfig.secret_file`` or the environment
(:data:`ENV_SECRET_FILE`, then :data:`ENV_SECRET`); never from a command-line
value. Without one, messages travel as they are and kvbridge listens on
loopback addresses only (:func:`check_host`). ``docs/security.md`` gives the
threat model.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "MIN_SECRET_BYTES",
    "NO_INCARNATION",
    "PREDATES",
    "REPLAY_WINDOW",
    "Auth",
    "AuthError",
    "Opened",
    "Sealer",
    "incarnation_name",
    "new_incarnation",
    "auth_for",
    "check_host",
    "load_secret",
]

log = logging.getLogger(__name__)

ENV_SECRET = "KVBRIDGE_SECRET"
ENV_SECRET_FILE = "KVBRIDGE_SECRET_FILE"
MIN_SECRET_BYTES = 16
#: Seconds a sealed message stays acceptable (both ways: clocks of two hosts may differ this much).
REPLAY_WINDOW = 30.0

MAGIC = b"KVB\x02"
#: Sealed by kvbridge whose protocol had no incarnations (version 2).
OLD_MAGIC = b"KVB\x01"
#: The plain header of an unsealed message (no secret): incarnations only.
PLAIN = b"KVP\x02"
_HEAD = struct.Struct(">16sQq8s8sH")  # nonce, counter, time_ms, from incarnation, to incarnation, len(to)
_PLAIN_HEAD = struct.Struct(">8s8s")  # from incarnation, to incarnation
#: The recipient's incarnation when the sender has not heard from it yet.
NO_INCARNATION = bytes(8)
#: Begins the reason of a refusal of a message sealed before the receiving process started (retry with a new one).
PREDATES = "sealed before this endpoint started"
_MAC = 16
_MAX_TO = 512
#: Sending sockets remembered per process (beyond, the oldest is forgotten and
#: nothing older than its last message is accepted from an unknown socket).
MAX_SENDERS = 65536


class AuthError(ValueError):
    """A control message was refused before decoding. ``kind`` is the metrics reason."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def load_secret(secret_file: str | os.PathLike[str] | None = None) -> bytes | None:
    """The shared secret: ``secret_file``, else ``$KVBRIDGE_SECRET_FILE``, else ``$KVBRIDGE_SECRET``; None if unset.

    A file's trailing newline is not part of the secret. A secret shorter than
    :data:`MIN_SECRET_BYTES` or an unreadable file is a ``ValueError`` naming where it came from.
    """
    source, path = None, secret_file or os.environ.get(ENV_SECRET_FILE) or None
    if path:
        source = f"secret file {str(path)!r}" + ("" if secret_file else f" (from ${ENV_SECRET_FILE})")
        try:
            p = Path(path)
            secret = p.read_bytes().rstrip(b"\r\n")
            if os.name == "posix" and p.stat().st_mode & 0o004:
                log.warning("kvbridge: %s is readable by every user; make it readable by the service only (chmod 600)", source)
        except OSError as exc:
            raise ValueError(f"cannot read the kvbridge {source}: {exc.strerror or exc}") from None
    else:
        text = os.environ.get(ENV_SECRET)
        if text is None:
            return None
        source, secret = f"${ENV_SECRET}", text.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the kvbridge secret from {source} has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            f"random bytes (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return secret


def new_incarnation() -> bytes:
    """A fresh incarnation id: 8 random bytes, never all zeros."""
    while (inc := os.urandom(8)) == NO_INCARNATION:
        pass
    return inc


def incarnation_name(inc: bytes) -> bytes:
    """The name a DEALER channel answers to as incarnation ``inc`` (a ROUTER addresses its replies so)."""
    return b"inc:" + inc.hex().encode()


class Sealer:
    """What one sending socket needs: its endpoint's incarnation, a random nonce and a counter (I/O thread only)."""

    def __init__(self, incarnation: bytes | None = None) -> None:
        self.incarnation = incarnation if incarnation is not None else new_incarnation()
        self.nonce = os.urandom(16)
        self.counter = 0


class Opened(NamedTuple):
    """An opened control message: its payload, the sender's incarnation and the one it was addressed to.

    Both incarnations are ``b""`` when the frame carried none (a bare unsealed message: a tool, not kvbridge)."""

    #: A view of the frame, not a copy of it (a decode request's 262,144 pages are 1 MiB: #27).
    payload: bytes | memoryview
    sender: bytes
    recipient: bytes


class Auth:
    """Seals and opens control messages with one key; one per key per process (:func:`auth_for`)."""

    def __init__(self, secret: bytes | None) -> None:
        self.key = None if secret is None else hashlib.blake2b(secret, digest_size=32, person=b"kvbridge-ctl").digest()
        self._lock = threading.Lock()
        #: (sender nonce, recipient) -> (last counter, last time_ms), least recently used first.
        #: One sending socket's messages to one recipient travel in order on one connection.
        self._senders: OrderedDict[tuple[bytes, bytes], tuple[int, int]] = OrderedDict()
        #: Unknown senders' messages must not predate this process's use of the secret (an endpoint
        #: that restarted refuses what was sealed for, or captured before, the process it replaced).
        self._started_ms = int(time.time() * 1000)
        self._floor_ms = self._started_ms  # raised when a sender is forgotten (MAX_SENDERS)

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def seal(self, payload: bytes, to: bytes, sealer: Sealer, to_inc: bytes = NO_INCARNATION) -> bytes:
        """``payload`` ready for the wire, addressed to ``to`` (incarnation ``to_inc`` when known).

        Without a secret it gets the plain header: the incarnations, unauthenticated."""
        if self.key is None:
            return PLAIN + _PLAIN_HEAD.pack(sealer.incarnation, to_inc) + payload
        sealer.counter += 1
        head = MAGIC + _HEAD.pack(sealer.nonce, sealer.counter, int(time.time() * 1000), sealer.incarnation, to_inc,
                                  len(to)) + to
        mac = hashlib.blake2b(head, key=self.key, digest_size=_MAC)
        mac.update(payload)
        return b"".join((head, mac.digest(), payload))

    def open(self, frame: bytes, me: Collection[bytes], incarnation: bytes | None = None) -> bytes:
        """The payload of a sealed ``frame`` addressed to one of ``me``; :class:`AuthError` says why not."""
        return bytes(self.open_frame(frame, me, incarnation).payload)

    @staticmethod
    def sender_of(frame: bytes) -> bytes:
        """The sender's incarnation a frame's header states, unverified (to address a refusal), or ``b""``."""
        if frame[:4] == MAGIC and len(frame) >= 4 + _HEAD.size:
            return _HEAD.unpack_from(frame, 4)[3]
        if frame[:4] == PLAIN and len(frame) >= 4 + _PLAIN_HEAD.size:
            return _PLAIN_HEAD.unpack_from(frame, 4)[0]
        return b""

    def open_frame(self, frame: bytes, me: Collection[bytes], incarnation: bytes | None = None) -> Opened:
        """Open ``frame`` addressed to one of ``me`` (and to ``incarnation``, this endpoint's, when it names one).

        :class:`AuthError` says why not: unauthenticated, forged, misaddressed, stale (outside the
        window, or addressed to an earlier incarnation of this endpoint), replayed."""
        magic = frame[:4]
        if magic == OLD_MAGIC:
            raise AuthError("malformed", "the message was sealed by an older kvbridge (control protocol 2, without "
                            "incarnations); run the same kvbridge version on every process")
        sealed = magic == MAGIC
        if self.key is None:
            if sealed:
                raise AuthError("unauthenticated", "the message is authenticated but this endpoint has no kvbridge "
                                f"secret; set the same ${ENV_SECRET} or ${ENV_SECRET_FILE} on every process")
            if magic != PLAIN:
                return Opened(frame, b"", b"")  # a bare message (a tool speaking the protocol by hand)
            if len(frame) < 4 + _PLAIN_HEAD.size:
                raise AuthError("malformed", f"truncated control message ({len(frame)} bytes)")
            sender, to_inc = _PLAIN_HEAD.unpack_from(frame, 4)
            _check_recipient(to_inc, incarnation)
            return Opened(memoryview(frame)[4 + _PLAIN_HEAD.size:], sender, to_inc)
        if not sealed:
            raise AuthError("unauthenticated", f"unauthenticated control message ({len(frame)} bytes): this endpoint "
                            f"requires the kvbridge secret (${ENV_SECRET} or ${ENV_SECRET_FILE})")
        start = 4 + _HEAD.size
        if len(frame) < start + _MAC:
            raise AuthError("forged", f"truncated authenticated message ({len(frame)} bytes)")
        nonce, counter, time_ms, sender, to_inc, to_len = _HEAD.unpack_from(frame, 4)
        end = start + to_len
        if to_len > _MAX_TO or len(frame) < end + _MAC:
            raise AuthError("forged", f"truncated authenticated message ({len(frame)} bytes)")
        mac = hashlib.blake2b(memoryview(frame)[:end], key=self.key, digest_size=_MAC)
        mac.update(memoryview(frame)[end + _MAC:])
        if not hmac.compare_digest(mac.digest(), frame[end:end + _MAC]):
            raise AuthError("forged", "authentication failed: the message was altered or sealed with another secret "
                            f"(every process needs the same ${ENV_SECRET})")
        to = frame[start:end]
        if to not in me:
            names = ", ".join(repr(n.decode(errors="replace")) for n in me)
            raise AuthError("misaddressed", f"the message is addressed to {to.decode(errors='replace')!r}, "
                            f"this endpoint is {names}: connect with the address the endpoint was given")
        _check_recipient(to_inc, incarnation)
        now_ms = int(time.time() * 1000)
        if abs(now_ms - time_ms) > REPLAY_WINDOW * 1000:
            raise AuthError("stale", f"the message was sealed {(now_ms - time_ms) / 1000:+.1f}s from now, outside "
                            f"the {REPLAY_WINDOW:.0f}s window: replayed, or the hosts' clocks differ (run NTP)")
        stream = (nonce, to)
        with self._lock:
            self._prune(now_ms)
            last = self._senders.get(stream)
            if last is None and time_ms < self._started_ms:
                raise AuthError("replayed", f"the message was {PREDATES} ({(self._started_ms - time_ms) / 1000:.3f}s "
                                "earlier): replayed from before a restart, or sent just before it (send it again)")
            if last is None and self._floor_ms > self._started_ms and time_ms <= self._floor_ms:
                raise AuthError("replayed", "the message predates what this endpoint still remembers: replayed")
            if last is not None and counter <= last[0]:
                raise AuthError("replayed", f"message {counter} of its connection arrived after message "
                                f"{last[0]}: replayed")
            self._senders[stream] = (counter, time_ms)
            self._senders.move_to_end(stream)
            while len(self._senders) > MAX_SENDERS:
                _, (_, evicted_ms) = self._senders.popitem(last=False)
                self._floor_ms = max(self._floor_ms, evicted_ms)
        return Opened(memoryview(frame)[end + _MAC:], sender, to_inc)

    def _prune(self, now_ms: int) -> None:
        """Forget senders whose last message is outside the window: their replays are stale anyway."""
        horizon = now_ms - int(REPLAY_WINDOW * 1000)
        while self._senders:
            stream, (_, last_ms) = next(iter(self._senders.items()))
            if last_ms >= horizon:
                return
            del self._senders[stream]


def _check_recipient(to_inc: bytes, incarnation: bytes | None) -> None:
    """Refuse a message addressed to another incarnation of this endpoint (the process it replaced)."""
    if incarnation is not None and to_inc != NO_INCARNATION and to_inc != incarnation:
        raise AuthError("stale", f"the message is addressed to incarnation {to_inc.hex()} of this endpoint, which is "
                        f"now {incarnation.hex()}: it was sent to (or captured from) the process this one replaced")


_auths: dict[bytes | None, Auth] = {}
_auths_lock = threading.Lock()
_warned_open = False


def auth_for(secret_file: str | os.PathLike[str] | None = None) -> Auth:
    """The process's :class:`Auth` for the secret :func:`load_secret` finds (shared, so replays are caught across sockets)."""
    global _warned_open
    secret = load_secret(secret_file)
    with _auths_lock:
        auth = _auths.get(secret)
        if auth is None:
            auth = _auths[secret] = Auth(secret)
        if secret is None and not _warned_open:
            _warned_open = True
            log.warning("kvbridge: no secret set ($%s or $%s): control messages are not authenticated, so "
                        "kvbridge listens on loopback addresses only", ENV_SECRET, ENV_SECRET_FILE)
    return auth


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, auth: Auth, what: str) -> None:
    """Refuse to listen on a non-loopback ``host`` without a secret (``what`` names the endpoint)."""
    if not auth.enabled and not is_loopback(host):
        raise ValueError(
            f"{what}: host {host!r} is not a loopback address and no kvbridge secret is set; set "
            f"${ENV_SECRET} or ${ENV_SECRET_FILE} (or SessionConfig.secret_file) on every process to listen "
            "beyond this host, or use 127.0.0.1"
        )
