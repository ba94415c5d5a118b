"""Abort this process's TCP connections to a peer's engine, so nothing queued in them lands later.

For backends whose engine talks TCP (Mooncake's TCP transport, UCX's tcp
transport under NIXL and UCXX): :class:`TcpFence` is what such a backend
keeps, and how it implements ``Backend.abort_peer``, which core calls when a
write to a peer failed or ran past its deadline (core's fence policy is the
same for every backend; this is the engine-specific half).

When prefill gives up on a write to a decode peer (it failed, timed out, or
ran past its deadline), bytes the engine already handed to the kernel sit in
the connection's send queue; over a cut link they are retransmitted once it
is back, into pages decode may already have reported ``FAILED`` (late
writes, ``docs/failures.md``). No engine's API drops them, but Linux does:
``connect()`` with an ``AF_UNSPEC`` address on a TCP socket runs
``tcp_disconnect``, which discards the send queue and sends a reset. It is
unprivileged and works on any descriptor of the socket in our own process,
whichever engine opened it.

The peer's engine connections are told apart by their remote end: each side
lists the TCP ports its engine listens on (:func:`listening`, taken before
and after the engine starts: kvbridge's own control sockets and the host's
are not among them) and sends them with its backend metadata (:meth:`TcpFence.seal`). :func:`abort`
then resets exactly this process's connections to those ``(ip, port)``
endpoints, not another decode rank's on the same host, nor a zmq socket.

Connections are reset only when the peer's host no longer answers: a TCP
handshake to its engine's port (:func:`answers`) gets neither a SYN-ACK nor a
refusal within :data:`PROBE_TIMEOUT`, as over a cut link or to a host that is
gone. That is decided per address this process is connected to (an engine
may advertise a second NIC's address that does not answer from here), and
then every connection to that address is reset, idle ones too: UCX's TCP
transport holds further puts in user space until the peer acknowledges the
one before, so an idle connection may still have bytes to send. A host that
answers (a live process, or a stopped one: its kernel still answers and
acknowledges) is left alone: its kernel has taken or will take what was
sent, whatever prefill does, and a reset there only hurts it (a stopped
UCXX decode aborted on resume with "Endpoint timeout" when its connection
had been reset).

Linux only (``/proc``); elsewhere :func:`listening` finds nothing and
:func:`abort` aborts nothing. Transports without a socket (CMA between
processes of one host, RDMA) have nothing to abort.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Collection, Iterator

import msgspec

from kvbridge.core import TransferError

__all__ = ["Endpoint", "TcpFence", "abort", "answers", "checked", "engine_endpoints", "listening", "seal", "unseal"]

log = logging.getLogger(__name__)

#: A TCP endpoint: (IP address as text, port). IPv4-mapped IPv6 addresses are written as IPv4.
Endpoint = tuple[str, int]

_LISTEN = 0x0A
#: States with no connection to abort: TIME_WAIT, CLOSE, LISTEN.
_UNCONNECTED = {0x06, 0x07, _LISTEN}
_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")


def _address(hexaddr: str) -> Endpoint:
    """``0100007F:1F90`` (``/proc/net/tcp``: 32-bit words in host byte order) -> ``("127.0.0.1", 8080)``."""
    host, port = hexaddr.split(":")
    raw = b"".join(int(host[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(host), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _sockets() -> Iterator[tuple[Endpoint, Endpoint, int, int]]:
    """(local, remote, state, inode) of every TCP socket in this network namespace."""
    for table in _TABLES:
        try:
            with open(table) as file:
                lines = file.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9:
                yield _address(f[1]), _address(f[2]), int(f[3], 16), int(f[9])


def _own_sockets(pid: int | str = "self") -> dict[int, int]:
    """Socket inode -> one of the process's file descriptors for it (this process's by default)."""
    own: dict[int, int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return own
    for name in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            own.setdefault(int(link[8:-1]), int(name))
    return own


def listening(pid: int | str = "self") -> set[Endpoint]:
    """The TCP endpoints this process (or process ``pid`` of this network namespace, if this one
    may read its ``/proc`` entries) listens on; wildcard addresses as ``0.0.0.0`` / ``::``."""
    own = _own_sockets(pid)
    return {local for local, _, state, inode in _sockets() if state == _LISTEN and inode in own}


def engine_endpoints(before: Collection[Endpoint], host: str, pid: int | str = "self") -> tuple[Endpoint, ...]:
    """What the process listens on now and did not in ``before``, a wildcard written as ``host``
    (the address the engine advertises): what a peer's engine connects to. Sorted."""
    out = set()
    for ip, port in listening(pid) - set(before):
        if ipaddress.ip_address(ip).is_unspecified:
            ip = host
        out.add((ip, port))
    return tuple(sorted(out))


def checked(endpoints: Collection[Endpoint], whose: str) -> tuple[Endpoint, ...]:
    """``endpoints`` as :func:`abort` matches them; :class:`ValueError` names one that is not an IP and port."""
    out = []
    for ip, port in endpoints:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            raise ValueError(f"{whose} lists engine endpoint {str(ip)[:64]!r}, which is not an IP address") from None
        if not 0 < port < 65536:
            raise ValueError(f"{whose} lists engine endpoint port {port}, not in 1..65535")
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        out.append((str(addr), int(port)))
    return tuple(out)


def _disconnect(fd: int) -> bool:
    """``connect(fd, AF_UNSPEC)``: Linux's tcp_disconnect drops the send queue and sends a reset."""
    unspec = ctypes.create_string_buffer(16)  # a sockaddr whose sa_family is 0 (AF_UNSPEC)
    if _libc.connect(fd, unspec, len(unspec)) == 0:
        return True
    log.debug("tcpfence: connect(AF_UNSPEC) on fd %d failed: %s", fd, os.strerror(ctypes.get_errno()))
    return False


#: How long a peer's host has to answer a TCP handshake before :func:`abort` takes it as unreachable.
#: A kernel answers at once (in microseconds on a LAN), for a stopped process too; over a cut link nothing does.
PROBE_TIMEOUT = 0.5


def answers(endpoint: Endpoint, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether the host of ``endpoint`` answers a TCP handshake to it within ``timeout``, with a SYN-ACK
    or a refusal. An accepted probe is reset at once (``SO_LINGER`` 0), so its listener reads no data."""
    ip, port = endpoint
    try:
        probe = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:  # no descriptor left: cannot tell, and the fence comes first (reset)
        log.warning("tcpfence: cannot probe %s:%d (%s); taking it as not answering", ip, port, exc)
        return False
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        probe.settimeout(timeout)
        try:
            probe.connect((ip, port))
        except ConnectionRefusedError:
            return True
        except OSError:  # timed out, or no route to the host
            return False
    return True


def abort(remote: Collection[Endpoint], only_unreachable: bool = True) -> int:
    """Reset this process's TCP connections whose remote end is one of ``remote``; return how many.

    With ``only_unreachable`` (the default) only those to an address of
    ``remote`` that does not answer a TCP handshake within
    :data:`PROBE_TIMEOUT` (:func:`answers`; decided per address this process
    is connected to): a cut link, or a host that is gone. Then every
    connection to that address is reset, idle ones too: an engine may hold
    bytes back in user space, not in the socket (UCX's TCP transport waits for
    the peer's acknowledgement of one put before it sends the next), and would
    send them once the link is back.

    Each is aborted through a duplicate of its descriptor, checked to be the
    same socket first, so a descriptor closed and reused meanwhile is never
    touched. The engine that owns it sees a connection reset on its next call.
    """
    wanted = set(checked(remote, "abort()"))
    own = _own_sockets()
    victims = [(inode, peer, own[inode]) for _, peer, state, inode in _sockets()
               if state not in _UNCONNECTED and peer in wanted and inode in own]
    if only_unreachable:
        # Per address this process is connected to: another advertised address (a second NIC's
        # listener) that does not answer from here says nothing about the host behind this one.
        silent = {ip for ip in {peer[0] for _, peer, _ in victims}
                  if not answers(min(e for e in wanted if e[0] == ip))}
        victims = [v for v in victims if v[1][0] in silent]
    done = 0
    for inode, _, fd in victims:
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            done += os.fstat(dup).st_ino == inode and _disconnect(dup)
        finally:
            os.close(dup)
    return done


_libc = ctypes.CDLL(None, use_errno=True)
_libc.connect.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


class _Sealed(msgspec.Struct, array_like=True, tag="kvbridge-tcp/1"):
    engine: bytes
    endpoints: list[tuple[str, int]]


def seal(engine: bytes, endpoints: Collection[Endpoint] = ()) -> bytes:
    """An engine's metadata with the endpoints it listens on, as :meth:`TcpFence.seal` sends them."""
    return msgspec.msgpack.encode(_Sealed(bytes(engine), [tuple(e) for e in endpoints]))


def unseal(metadata: bytes) -> tuple[bytes, list[tuple[str, int]]]:
    """The engine metadata and endpoints inside what :func:`seal` made (``msgspec.DecodeError`` otherwise)."""
    sealed = msgspec.msgpack.decode(metadata, type=_Sealed)
    return sealed.engine, sealed.endpoints


class TcpFence:
    """A TCP engine's half of core's fence, kept by its backend.

    Create it before the engine starts listening (first thing in the backend's
    ``__init__``); :meth:`seal` the engine's metadata in ``metadata()`` (it adds
    where the engine listens) and :meth:`open` a peer's in ``add_peer``;
    :meth:`forget` in ``remove_peer``; ``abort_peer`` is :meth:`abort_peer`.
    """

    def __init__(self, host: str, name: str) -> None:
        self._host = host
        self._name = name
        self._before = listening()
        self._mine: tuple[Endpoint, ...] | None = None
        self._peers: dict[str, tuple[Endpoint, ...]] = {}

    def seal(self, engine: bytes) -> bytes:
        """``engine``'s metadata with the endpoints the engine opened since this fence was made."""
        if self._mine is None:  # after register(): an engine may open its listeners only then
            self._mine = engine_endpoints(self._before, self._host)
        return seal(engine, self._mine)

    def open(self, peer: str, metadata: bytes) -> bytes:
        """The engine metadata inside what a peer's :meth:`seal` made; remembers its endpoints.
        :class:`TransferError` naming the peer for anything else."""
        try:
            engine, listed = unseal(metadata)
            endpoints = checked(listed, f"peer {peer!r}")
        except (msgspec.DecodeError, ValueError) as exc:
            raise TransferError(
                f"{self._name}: peer {peer!r} sent metadata that is not a {self._name} backend's ({exc}); "
                "run the same backend and kvbridge version on both sides"
            ) from None
        self._peers[peer] = endpoints
        return engine

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def abort_peer(self, peer: str, stuck: bool = False) -> int:
        """Reset this process's connections to ``peer``'s engine if its host no longer answers (all of
        them when ``stuck``: a write is still inside the engine past its deadline); how many."""
        endpoints = self._peers.get(peer)
        return abort(endpoints, only_unreachable=not stuck) if endpoints else 0
