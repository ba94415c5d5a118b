"""The bootstrap endpoint: prefill ranks register, decode ranks look them up.

One :class:`BootstrapServer` runs per prefill server (typically in its rank 0
process, or stand-alone). It is a zmq ROUTER on ``tcp://HOST:PORT``; messages
are the typed structs of :mod:`kvbridge.core.control.protocol`, authenticated like
every control message (:mod:`kvbridge.core.control.auth`).

The table holds one entry per (TP rank, PP stage). A registration is checked
(:func:`check_rank`) and must agree with the live entries (TP and PP sizes,
backend); it is a *lease*: the prefill manager renews it every
:data:`RENEW` seconds, and one not renewed for ``lease`` seconds is gone. A
second manager registering a rank another manager holds is refused, saying
who holds it, until that lease ends: a restarted prefill rank gets its place
back within ``lease`` seconds, and nobody can take a live rank's place.

Incarnations (:mod:`kvbridge.core.control.auth`): each registration names its
manager's incarnation, and a restarted prefill process is a new one. It
takes its rank's place at once, without waiting out the lease, when the
holder is provably gone: the new registration comes from the holder's own
control address (only one process listens on an address), or nobody listens
at the holder's address any more (a TCP probe is refused,
:mod:`kvbridge.core.control.liveness`; a frozen or unreachable holder keeps its
place). A gone holder is left out of lookups from then on, and its
incarnation is *retired*: its registrations, captured or late, are refused.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq

from . import protocol as P
from .auth import PREDATES, Auth, auth_for, check_host, new_incarnation
from .channel import Channel
from .ioloop import IOLoop
from .liveness import Probes

__all__ = ["BootstrapServer", "LEASE", "MAX_RANKS", "RENEW", "check_rank", "register_rank"]

log = logging.getLogger(__name__)

#: Seconds a registration lasts without renewal.
LEASE = 5.0
#: Seconds between a prefill manager's renewals.
RENEW = 1.0
#: Most TP ranks, PP stages, and ranks in all, one prefill server may register.
MAX_RANKS = 4096
#: Largest registration or lookup the endpoint reads (bytes).
MAX_REQUEST_BYTES = 64 << 10
#: Reasons that begin so are worth retrying: the rank's holder may be gone soon.
HELD = "rank held:"
#: Incarnations of replaced ranks remembered (their registrations are refused).
MAX_RETIRED = 4096

_ADDRESS = re.compile(r"[^\s/]{1,253}:\d{1,5}")
_BACKEND = re.compile(r"[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64}){0,15}")  # a backend, or lanes: names separated by commas


def check_rank(rank: P.RankInfo, known_backends: frozenset[str] | None = None) -> str | None:
    """What is wrong with a registered rank's fields, or None (for both the endpoint and decode ranks)."""
    if not 1 <= rank.tp_size <= MAX_RANKS or not 1 <= rank.pp_size <= MAX_RANKS:
        return f"tp_size {rank.tp_size} and pp_size {rank.pp_size} must lie in 1 .. {MAX_RANKS}"
    if rank.tp_size * rank.pp_size > MAX_RANKS:
        return f"tp_size x pp_size = {rank.tp_size * rank.pp_size} exceeds {MAX_RANKS} ranks"
    if not 0 <= rank.tp_rank < rank.tp_size:
        return f"tp_rank {rank.tp_rank} is outside 0 .. tp_size-1 = {rank.tp_size - 1}"
    if not 0 <= rank.pp_rank < rank.pp_size:
        return f"pp_rank {rank.pp_rank} is outside 0 .. pp_size-1 = {rank.pp_size - 1}"
    if not _ADDRESS.fullmatch(rank.control_addr) or not 0 < int(rank.control_addr.rpartition(":")[2]) < 65536:
        return f"control address {rank.control_addr[:80]!r} is not HOST:PORT"
    if not _BACKEND.fullmatch(rank.backend):
        return f"backend name {rank.backend[:80]!r} is not a backend name"
    unknown = [n for n in rank.backend.split(",") if known_backends is not None and n not in known_backends]
    if unknown:
        assert known_backends is not None
        return f"backend {unknown[0]!r} is not installed here (installed: {', '.join(sorted(known_backends))})"
    return None


@dataclass
class _Entry:
    rank: P.RankInfo
    renewed: float
    #: Nobody listens at its control address any more (a probe was refused): replaceable, not listed.
    gone: bool = False


class BootstrapServer:
    """Keeps the table of registered prefill ranks; answers lookups.

    ``secret_file`` as in :class:`~kvbridge.core.sessions.session.SessionConfig`; without
    a secret ``host`` must be a loopback address.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret_file: str | None = None,
                 lease: float = LEASE) -> None:
        if lease <= RENEW:
            raise ValueError(f"lease must exceed the renewal interval {RENEW}s, got {lease}")
        self.lease = lease
        auth = auth_for(secret_file)
        check_host(host, auth, "kvbridge bootstrap endpoint")
        from ..description.plugins import get_registry

        self._known = frozenset(get_registry().backends)
        self._ranks: dict[tuple[int, int], _Entry] = {}
        #: Incarnations whose rank a newer one took (hex -> the one that replaced it).
        self._retired: OrderedDict[str, str] = OrderedDict()
        self._probes = Probes()
        self._lock = threading.Lock()
        #: This endpoint's incarnation: a restarted bootstrap server is a new one (kvbridge.core.control.auth).
        self.incarnation = new_incarnation()
        self._loop = IOLoop("kvbridge-bootstrap")
        self._chan = Channel(self._loop.ctx, zmq.ROUTER, auth, endpoint="bootstrap", max_bytes=MAX_REQUEST_BYTES,
                             incarnation=self.incarnation)
        self.address = self._chan.bind_port(host, port) if port else self._chan.bind(host)
        self._loop.add_socket(self._chan.sock, self._on_message)
        self._loop.start()

    @property
    def ranks(self) -> list[P.RankInfo]:
        """The live registrations (renewed within the lease, holder not known gone)."""
        now = time.monotonic()
        with self._lock:
            return [e.rank for e in self._ranks.values() if now - e.renewed <= self.lease and not e.gone]

    def _on_message(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        got = self._chan.receive(frames)
        if got is None:
            return
        ident, msg = got
        assert ident is not None
        if isinstance(msg, P.Register):
            problem = self._register(msg.rank, self._chan.sender_incarnation.hex())
            if problem is not None:
                self._chan.reject(ident, f"registration of prefill tp{msg.rank.tp_rank}/pp{msg.rank.pp_rank} refused: {problem}")
                return
            reply: P.Message = P.RegisterAck()
        elif isinstance(msg, P.Lookup):
            reply = P.LookupReply(ranks=tuple(self.ranks))
        else:
            self._chan.reject(ident, f"the bootstrap endpoint does not handle {type(msg).__name__} messages",
                              getattr(msg, "room", None))
            return
        self._chan.send_msg(reply, ident)

    def _register(self, rank: P.RankInfo, sender: str = "") -> str | None:
        """Add or renew ``rank`` (sent by incarnation ``sender``, hex, if its header named one); why not, or None."""
        problem = check_rank(rank, self._known)
        if problem is not None:
            return problem
        if sender and rank.incarnation and rank.incarnation != sender:
            return (f"the registration names incarnation {rank.incarnation!r} but was sent by {sender!r}: "
                    "a manager registers its own rank")
        now = time.monotonic()
        with self._lock:
            if rank.incarnation and rank.incarnation in self._retired:
                return (f"incarnation {rank.incarnation} of prefill tp{rank.tp_rank}/pp{rank.pp_rank} was replaced by "
                        f"incarnation {self._retired[rank.incarnation]} (a restarted process): a replayed or "
                        "late registration of the old process")
            for key, entry in list(self._ranks.items()):
                if now - entry.renewed > self.lease:
                    del self._ranks[key]
            key = (rank.tp_rank, rank.pp_rank)
            held = self._ranks.get(key)
            if held is not None and held.rank.incarnation != rank.incarnation:
                same_address = held.rank.control_addr == rank.control_addr
                if not (same_address or held.gone):
                    self._probe(key, held)
                    return (f"{HELD} the rank is registered by the manager at {held.rank.control_addr} (renewed "
                            f"{now - held.renewed:.1f}s ago); a second manager gets it once that one has not renewed "
                            f"for {self.lease:.0f}s or nobody listens at its address: stop the other one, or give "
                            "this one another rank")
                # The holder is gone: a new process listens at its address, or nobody does.
                log.warning("bootstrap: prefill tp%d/pp%d restarted: incarnation %s at %s replaces %s at %s",
                            rank.tp_rank, rank.pp_rank, rank.incarnation or "?", rank.control_addr,
                            held.rank.incarnation or "?", held.rank.control_addr)
                if held.rank.incarnation:
                    self._retired[held.rank.incarnation] = rank.incarnation or "?"
                    while len(self._retired) > MAX_RETIRED:
                        self._retired.popitem(last=False)
                del self._ranks[key]
            elif held is not None and held.rank.control_addr != rank.control_addr:
                return (f"{HELD} the rank is registered by the manager at {held.rank.control_addr} (renewed "
                        f"{now - held.renewed:.1f}s ago); a second manager gets it once that one has not renewed "
                        f"for {self.lease:.0f}s: stop the other one, or give this one another rank")
            for entry in self._ranks.values():
                other = entry.rank
                if (other.tp_size, other.pp_size, other.backend) != (rank.tp_size, rank.pp_size, rank.backend):
                    return (f"the registered ranks use tp_size {other.tp_size}, pp_size {other.pp_size}, backend "
                            f"{other.backend!r}; this one tp_size {rank.tp_size}, pp_size {rank.pp_size}, backend "
                            f"{rank.backend!r}: every rank of a prefill server must agree")
            self._ranks[key] = _Entry(rank, now)
        return None

    def _probe(self, key: tuple[int, int], held: _Entry) -> None:
        """Find out off the I/O thread whether anybody still listens at ``held``'s address (caller holds the lock)."""
        def done(refused: bool) -> None:
            if refused:
                with self._lock:
                    if self._ranks.get(key) is held:
                        held.gone = True
                log.warning("bootstrap: nobody listens at %s any more: prefill tp%d/pp%d (incarnation %s) is gone",
                            held.rank.control_addr, key[0], key[1], held.rank.incarnation or "?")

        self._probes.start(held.rank.control_addr, done)

    def close(self) -> None:
        self._loop.stop()


def request(address: str, msg: P.Message, timeout: float, auth: Auth | None = None,
            incarnation: bytes | None = None) -> P.Message:
    """One request/reply with the bootstrap endpoint, bounded by ``timeout`` seconds (sent as ``incarnation``)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    chan = Channel(ctx, zmq.DEALER, auth or auth_for(), endpoint="prefill", max_bytes=MAX_REQUEST_BYTES << 4,
                   to=address.encode(), incarnation=incarnation)
    try:
        chan.connect(address)
        chan.send_msg(msg)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not chan.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            got = chan.receive([chan.sock.recv()])
            if got is not None:
                return got[1]
        refusal = f" (last refusal: {chan.last_refusal})" if chan.last_refusal else ""
        raise TimeoutError(f"bootstrap endpoint {address} did not answer within {timeout:.1f}s{refusal}")
    finally:
        chan.close()


def register_rank(address: str, rank: P.RankInfo, timeout: float, auth: Auth | None = None,
                  incarnation: bytes | None = None) -> None:
    """Register a prefill rank, retrying until ``timeout`` (the endpoint may start later, a past holder may be going).

    ``incarnation``: the registering manager's (``rank.incarnation`` names it in hex)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            reply = request(address, P.Register(rank=rank), min(1.0, max(0.05, deadline - time.monotonic())), auth,
                            incarnation)
        except TimeoutError as exc:
            last = exc
            continue
        if isinstance(reply, P.RegisterAck):
            return
        if isinstance(reply, P.Reject) and (HELD in reply.reason or PREDATES in reply.reason):
            # Held: the holder may be gone soon. Predates: sent while the endpoint was (re)starting.
            last = ConnectionError(reply.reason)
            time.sleep(min(RENEW / 4, max(0.0, deadline - time.monotonic())))
            continue
        reason = reply.reason if isinstance(reply, P.Reject) else str(reply)
        raise ConnectionError(f"bootstrap endpoint {address} refused registration: {reason}")
    raise TimeoutError(f"could not register with bootstrap endpoint {address} within {timeout:.1f}s: {last}")
