"""Authentication of control messages: a shared secret, a keyed MAC, replay protection.

Every control message kvbridge sends is *sealed* when a secret is set::

    b"KVB\\x01" | nonce (16) | counter (8) | time_ms (8) | len(to) (2) | to | mac (16) | payload

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
  from its own clock (``stale``), so an old message cannot be played again,
  not even to a restarted process.

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

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "MIN_SECRET_BYTES",
    "REPLAY_WINDOW",
    "Auth",
    "AuthError",
    "Sealer",
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

MAGIC = b"KVB\x01"
_HEAD = struct.Struct(">16sQqH")  # nonce, counter, time_ms, len(to)
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


class Sealer:
    """What one sending socket needs: a random nonce and a counter (used on its I/O thread only)."""

    def __init__(self) -> None:
        self.nonce = os.urandom(16)
        self.counter = 0


class Auth:
    """Seals and opens control messages with one key; one per key per process (:func:`auth_for`)."""

    def __init__(self, secret: bytes | None) -> None:
        self.key = None if secret is None else hashlib.blake2b(secret, digest_size=32, person=b"kvbridge-ctl").digest()
        self._lock = threading.Lock()
        #: (sender nonce, recipient) -> (last counter, last time_ms), least recently used first.
        #: One sending socket's messages to one recipient travel in order on one connection.
        self._senders: OrderedDict[tuple[bytes, bytes], tuple[int, int]] = OrderedDict()
        self._floor_ms = -(2**63)  # unknown senders' messages must be newer than this

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def seal(self, payload: bytes, to: bytes, sealer: Sealer) -> bytes:
        """``payload`` ready for the wire, addressed to ``to`` (unchanged without a secret)."""
        if self.key is None:
            return payload
        sealer.counter += 1
        head = MAGIC + _HEAD.pack(sealer.nonce, sealer.counter, int(time.time() * 1000), len(to)) + to
        mac = hashlib.blake2b(head, key=self.key, digest_size=_MAC)
        mac.update(payload)
        return b"".join((head, mac.digest(), payload))

    def open(self, frame: bytes, me: Collection[bytes]) -> bytes:
        """The payload of a sealed ``frame`` addressed to one of ``me``; :class:`AuthError` says why not."""
        sealed = frame[:4] == MAGIC
        if self.key is None:
            if sealed:
                raise AuthError("unauthenticated", "the message is authenticated but this endpoint has no kvbridge "
                                f"secret; set the same ${ENV_SECRET} or ${ENV_SECRET_FILE} on every process")
            return frame
        if not sealed:
            raise AuthError("unauthenticated", f"unauthenticated control message ({len(frame)} bytes): this endpoint "
                            f"requires the kvbridge secret (${ENV_SECRET} or ${ENV_SECRET_FILE})")
        start = 4 + _HEAD.size
        if len(frame) < start + _MAC:
            raise AuthError("forged", f"truncated authenticated message ({len(frame)} bytes)")
        nonce, counter, time_ms, to_len = _HEAD.unpack_from(frame, 4)
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
        now_ms = int(time.time() * 1000)
        if abs(now_ms - time_ms) > REPLAY_WINDOW * 1000:
            raise AuthError("stale", f"the message was sealed {(now_ms - time_ms) / 1000:+.1f}s from now, outside "
                            f"the {REPLAY_WINDOW:.0f}s window: replayed, or the hosts' clocks differ (run NTP)")
        stream = (nonce, to)
        with self._lock:
            self._prune(now_ms)
            last = self._senders.get(stream)
            if last is None and time_ms <= self._floor_ms:
                raise AuthError("replayed", "the message predates what this endpoint still remembers: replayed")
            if last is not None and counter <= last[0]:
                raise AuthError("replayed", f"message {counter} of its connection arrived after message "
                                f"{last[0]}: replayed")
            self._senders[stream] = (counter, time_ms)
            self._senders.move_to_end(stream)
            while len(self._senders) > MAX_SENDERS:
                _, (_, evicted_ms) = self._senders.popitem(last=False)
                self._floor_ms = max(self._floor_ms, evicted_ms)
        return frame[end + _MAC:]

    def _prune(self, now_ms: int) -> None:
        """Forget senders whose last message is outside the window: their replays are stale anyway."""
        horizon = now_ms - int(REPLAY_WINDOW * 1000)
        while self._senders:
            stream, (_, last_ms) = next(iter(self._senders.items()))
            if last_ms >= horizon:
                return
            del self._senders[stream]


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
