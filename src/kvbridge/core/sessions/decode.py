"""The decode manager: finds prefill ranks through bootstrap, handshakes, heartbeats, routes replies."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

import zmq

from ..control import protocol as P
from ..control.auth import PREDATES
from ..control.bootstrap import MAX_RANKS, check_rank
from ..control.channel import Channel
from .checksum import verify
from ..description.layout import METADATA_SPACE, KVArgs
from ..transfer.landing import ScatterError
from .manager import SessionConfig, TransferManager
from .receiver import Receiver
from .room import Poll, Room
from .row import RowError, check_row, place_row
from .servers import PrefillRank, PrefillServer
from .watch import RankWatch
from ..transfer.transport import BackendChoice

__all__ = ["DecodeManager"]

log = logging.getLogger(__name__)

LOOKUP_RETRY = 0.2  # seconds between bootstrap lookups while prefill ranks are still registering
MAX_QUEUED = 1024  # messages kept for a server until its handshake completes
#: Seconds a room waits, after a prefill rank's ``Failed``, for that rank's ``Fenced`` before it reports
#: FAILED anyway (``Receiver.fenced`` False until it comes): a failure reaches decode's host within this (and a tick).
FAILURE_NOTICE = 0.5


class DecodeManager(TransferManager[Receiver], RankWatch):
    """One per decode rank: finds prefill ranks, handshakes, tracks receivers."""

    role = "decode"

    def __init__(self, kvargs: KVArgs, backend: BackendChoice = None, *, config: SessionConfig | None = None) -> None:
        super().__init__(kvargs, backend, config)
        self.peer_id = f"decode-tp{kvargs.tp_rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._meta = self.transport.metadata()
        #: The metadata regions, a row carried in ``Done`` is checked against (not every region, per request: #27).
        self._row_regions = [r for r in kvargs.regions if r.index_space == METADATA_SPACE]
        self._servers: dict[str, PrefillServer] = {}
        #: Servers given up on whose sockets stay open while their rooms wait for ``Fenced``.
        self._retired: list[PrefillServer] = []
        #: Rooms reported FAILED without every prefill rank's ``Fenced`` (``Receiver.fenced`` False), by id.
        self._unconfirmed: dict[int, Receiver] = {}
        #: Incarnations (hex) of prefill processes seen gone or replaced: a lookup still listing one is retried.
        self._dead: OrderedDict[str, str] = OrderedDict()
        self.loop.start()

    # -- for receivers -----------------------------------------------------------------------
    def server(self, address: str) -> PrefillServer:
        """The prefill server behind bootstrap ``address``; starts connecting on first use. Caller holds the lock."""
        server = self._servers.get(address)
        silent = self._silent(server, time.monotonic()) if server is not None and server.ready else None
        if server is not None and silent is not None:
            # Its tick has not failed it yet (this process was stopped, say): a new room joins a new one.
            self._fail_server(server, silent, "peer_dead")
            server = None
        if server is None:
            server = self._servers[address] = PrefillServer(address)
            self.loop.call(lambda: self._start(server))
        return server

    def _silent(self, server: PrefillServer, now: float) -> str | None:
        """Why ``server`` counts as dead: a rank that sent nothing for ``heartbeat_timeout``; or None."""
        for rank in server.ranks.values():
            if now - rank.last_seen > self.config.heartbeat_timeout:
                return f"{rank.label} sent nothing for {now - rank.last_seen:.1f}s (heartbeat_timeout={self.config.heartbeat_timeout}s)"
        return None

    def unconfirmed(self, recv: Receiver) -> None:
        """``recv`` failed without every rank's ``Fenced``: keep listening for them. Caller holds the lock."""
        if not self.closed:
            self._unconfirmed[recv.room] = recv

    def confirmed(self, recv: Receiver) -> None:
        """The last missing confirmation of a FAILED room came. Caller holds the lock."""
        if self._unconfirmed.get(recv.room) is recv:
            del self._unconfirmed[recv.room]
        log.info("decode: room %d: every prefill rank has now stopped writing it (%.1fs after FAILED)", recv.room,
                 time.monotonic() - (recv.ended or 0.0))

    def _start(self, server: PrefillServer) -> None:
        """Connect to a new server (I/O thread).

        A retired server at the same address keeps its connections while its rooms wait for
        ``Fenced`` (the tick closes them after): every connection has its own route on prefill, and
        a prefill rank sends a room's ``Fenced`` on the connection of the peer's latest handshake,
        which may still be the old one. Either way it is matched by address.
        """
        self._lookup(server)

    def send_to_ranks(self, server: PrefillServer, msg: P.Message) -> None:
        """Send ``msg`` to every prefill rank of ``server`` (any thread)."""
        payload = P.encode(msg)
        for rank in server.ranks.values():
            self.loop.send(rank.socket, payload)

    def tell(self, server: PrefillServer, msg: P.Message) -> None:
        """Send ``msg`` to every rank of ``server`` now, or once its handshake completes (any thread)."""
        with self.lock:
            if server.ready:
                self.send_to_ranks(server, msg)
            elif server.failed is None and len(server.queued) < MAX_QUEUED:
                server.queued.append(msg)

    def abort_room(self, room: Room, reason: str) -> None:
        assert isinstance(room, Receiver)
        room.abort(reason)

    # -- bootstrap and handshake (I/O thread) ------------------------------------------
    def _channel(self, to: str) -> Channel:
        # No zmq identity: the prefill ROUTER gives each connection its own, which no one can claim.
        chan = Channel(self.loop.ctx, zmq.DEALER, self.auth, endpoint="decode",
                       max_bytes=self.config.max_message_bytes, to=to.encode(), incarnation=self.incarnation)
        chan.connect(to)
        return chan

    def _lookup(self, server: PrefillServer) -> None:
        if server.lookup is None:
            server.lookup = self._channel(server.address)
            self.loop.add_socket(server.lookup.sock, lambda s, f: self._on_lookup(server, f))
        server.next_lookup = time.monotonic() + LOOKUP_RETRY
        server.lookup.send_msg(P.Lookup())

    def _on_lookup(self, server: PrefillServer, frames: list[bytes]) -> None:
        if server.failed is not None:
            return
        assert server.lookup is not None
        got = server.lookup.receive(frames)
        if got is None:
            return  # refused (counted, logged); the lookup is retried until bootstrap_timeout
        msg = got[1]
        if isinstance(msg, P.Reject) and PREDATES in msg.reason:
            return  # sent while the endpoint was (re)starting: the lookup is retried on tick
        if not isinstance(msg, P.LookupReply):
            self._fail_server(server, f"bootstrap endpoint {server.address} answered {msg}", "bootstrap")
            return
        if server.ranks or not msg.ranks:
            return  # already handshaking, or nobody registered yet (retry on tick)
        if any(r.incarnation in self._dead for r in msg.ranks if r.incarnation):
            return  # a rank whose process is gone is still listed (its replacement registers soon): retry
        # Every prefill rank (all TP ranks of all stages): each one tells this
        # rank Done for every room, even the ones it has nothing to send to.
        tp_size, pp_size = msg.ranks[0].tp_size, msg.ranks[0].pp_size
        problems = [p for p in map(check_rank, msg.ranks[:MAX_RANKS + 1]) if p is not None]
        if len(msg.ranks) > MAX_RANKS or problems or any((r.tp_size, r.pp_size) != (tp_size, pp_size) for r in msg.ranks):
            why = problems[0] if problems else f"{len(msg.ranks)} ranks that disagree on tp_size/pp_size or exceed {MAX_RANKS}"
            self._fail_server(server, f"bootstrap endpoint {server.address} listed a bad rank: {why}", "bootstrap")
            return
        wanted = {(r.tp_rank, r.pp_rank): r for r in msg.ranks}
        if len(wanted) < tp_size * pp_size:
            return  # not every rank registered yet
        ours = set(self.backend_name.split(","))
        bad = [r for r in wanted.values() if not ours & set(r.backend.split(","))]
        if bad:
            self._fail_server(
                server,
                f"prefill at {server.address} uses backend {bad[0].backend!r}, this decode rank {self.backend_name!r}: "
                "they share none",
                "layout",
            )
            return
        self.loop.remove_socket(server.lookup.sock)
        server.lookup = None
        landing = self.transport.landing
        for key, info in sorted(wanted.items()):
            offer = landing.offer((server.address, key)) if landing is not None else None
            hello = P.encode(P.Hello(peer_id=self.peer_id, lanes=self._meta, kvargs=self.kvargs, host=self.transport.host,
                                     staging=offer, instance=self.config.instance_name))
            rank = server.ranks[key] = PrefillRank(info)
            rank.chan = self._channel(info.control_addr)
            self.loop.add_socket(rank.chan.sock, self._rank_handler(server, rank))
            rank.monitor = self._monitor(rank.chan)
            self.loop.add_socket(rank.monitor, self._monitor_handler(rank))
            rank.chan.send(hello)

    def _rank_handler(self, server: PrefillServer, rank: PrefillRank) -> Callable[[zmq.Socket, list[bytes]], None]:
        return lambda _sock, frames: self._on_prefill(server, rank, frames)

    def _on_prefill(self, server: PrefillServer, rank: PrefillRank, frames: list[bytes]) -> None:
        assert rank.chan is not None
        got = rank.chan.receive(frames)
        if got is None:
            return  # refused (counted, logged)
        msg = got[1]
        incarnation = rank.chan.sender_incarnation
        if isinstance(msg, P.HelloAck) and incarnation:
            rank.incarnation = incarnation
            self._note_successor(rank)
        elif rank.incarnation and incarnation and incarnation != rank.incarnation and not rank.gone:
            # Another process answers at the rank's address: the one this server handshook with is gone.
            self._gone(server, rank, f"it restarted: a new process (incarnation {incarnation.hex()}) replaced "
                                     f"incarnation {rank.incarnation.hex()}, whose rooms are lost")
            return
        rank.last_seen = time.monotonic()
        if isinstance(msg, P.Staged):
            self._on_staged(server, rank, msg)
            return
        bad_row = self._place_row(server, msg.room, msg.row) if isinstance(msg, P.Done) and msg.row is not None else None
        bad_sum = None
        if isinstance(msg, P.Done) and (msg.checksum is not None or self.config.checksum):
            # Hashed off the lock (it reads every byte of the room); the room is checked under it below.
            bad_sum = (verify(msg.checksum, self.kvargs.regions) if msg.checksum is not None
                       else "checksum not verified: this decode rank asked for it but the prefill rank sent none")
        with self.lock:
            if isinstance(msg, P.HelloAck):
                # The prefill rank paired the two layouts before accepting.
                rank.acked = True
                if all(r.acked for r in server.ranks.values()) and not server.ready:
                    server.ready = True
                    for queued in server.queued:
                        self.send_to_ranks(server, queued)
                    server.queued.clear()
                    for recv in list(self.rooms.values()):
                        if recv.server is server:
                            recv.on_ready()
            elif isinstance(msg, P.Reject):
                rejected = self.rooms.get(msg.room) if msg.room is not None else None
                if rejected is not None and rejected.server is server:
                    rejected.fail(f"{rank.label} rejected the request: {msg.reason}", "rejected")
                elif not rank.acked:
                    self._fail_server(server, f"{rank.label} rejected the handshake: {msg.reason}", "layout")
                else:
                    # An acked rank refusing a room-less message (a heartbeat) has dropped
                    # this decode rank: fail its rooms now; the next receiver reconnects.
                    self._fail_server(server, f"{rank.label} no longer knows this decode rank: {msg.reason}", "peer_dead")
            elif isinstance(msg, (P.ChunkDone, P.Done, P.Failed, P.Abort, P.Fenced)):
                target = self.rooms.get(msg.room)
                if target is None and isinstance(msg, P.Fenced):
                    target = self._unconfirmed.get(msg.room)  # FAILED here before it came (a rank resumed)
                # The same rank through a newer connection (this decode reconnected) counts too.
                if target is None or target.server.address != server.address:
                    return  # finished or aborted here already
                if isinstance(msg, P.Fenced):
                    target.on_fenced(rank.key)
                elif target.fencing:
                    return  # given up here: neither progress nor success counts any more
                elif isinstance(msg, P.ChunkDone):
                    target.advance(Poll.TRANSFERRING)
                elif isinstance(msg, P.Done):
                    if bad_row is not None:
                        target.fail(f"{rank.label}: {bad_row}", "bad_request")
                    elif bad_sum is not None:
                        target.fail(f"{rank.label}: {bad_sum}", "checksum")
                    elif target.rank_done(rank.key, len(server.ranks)):
                        self.finish(target, Poll.SUCCESS)
                else:
                    # Prefill gave up itself: it has stopped starting writes, and its Fenced follows once
                    # its running write returned. Reported FAILED by FAILURE_NOTICE at the latest.
                    kind = "aborted" if isinstance(msg, P.Abort) else "remote"
                    target.fail(f"{rank.label}: {msg.reason}", kind, FAILURE_NOTICE)
            elif isinstance(msg, P.Heartbeat) and msg.clock is not None:
                rank.clock = msg.clock if rank.clock is None else max(rank.clock, msg.clock)

    def _on_staged(self, server: PrefillServer, rank: PrefillRank, msg: P.Staged) -> None:
        """Scatter a window that landed in this rank's staging slot (core/transfer/landing.py), under the lock and only
        while every room it holds bytes of is live here; a room given up (fenced or not) gets nothing, and
        the live rooms sharing the window fail (they would miss its bytes). The slot is given back either way."""
        landing = self.transport.landing
        assert rank.chan is not None
        with self.lock:
            targets = [self.rooms.get(room) for room in msg.rooms]
            live = [t for t in targets if t is not None and t.server.address == server.address and not t.fencing]
            problem, kind = None, "bad_request"
            if landing is None:
                problem = "a staged window came, but this decode rank lent no staging slots (staging off)"
            elif len(live) < len(targets):
                problem, kind = "a room sharing its staged window was given up here, so the window was dropped", "transfer_error"
            else:
                try:
                    landing.scatter((server.address, rank.key), msg)
                except ScatterError as exc:
                    problem = str(exc)
            if problem is not None:
                if landing is not None:
                    landing.dropped += 1
                for target in live:
                    target.fail(f"{rank.label}: {problem}", kind)
        rank.chan.send(P.encode(P.Unstaged(slot=msg.slot)))

    def _place_row(self, server: PrefillServer, room: int, row: P.MetadataRow) -> str | None:
        """Copy the metadata row a ``Done`` carries into place, if the room is live here and the row is exactly
        the one it asked for in its own host metadata regions; why not, else (nothing is written then)."""
        with self.lock:  # the room cannot fail (and its pages be reused) while the row is copied
            target = self.rooms.get(room)
            if target is None or target.server.address != server.address or target.fencing or target.asked is None:
                return None  # finished or given up here already: Done is ignored below
            try:
                place_row(check_row(row, self._row_regions, target.asked.metadata_row))
            except RowError as exc:
                return str(exc)
        return None

    def _fail_server(self, server: PrefillServer, reason: str, kind: str) -> None:
        """Fail every receiver of ``server`` and forget it, so a later receiver reconnects.

        ``kind`` is the failure's metrics label."""
        log.warning("decode: %s", reason)
        with self.lock:
            server.failed = reason
            server.queued.clear()
            if self._servers.get(server.address) is server:
                del self._servers[server.address]
            rooms = [recv for recv in self.rooms.values() if recv.server is server]
            if not server.ready and server.ranks:
                # Ranks that accepted the handshake (one rejected it, or the rest never answered) hold
                # senders waiting for a request that will not come: tell them now, with the reason,
                # rather than leave them to their bootstrap_timeout. (A rank that never got the Hello
                # ignores an Abort from a stranger; one that accepts the Hello later reads it next.)
                server.linger_until = time.monotonic() + self.config.heartbeat_interval
                for recv in rooms:
                    self.send_to_ranks(server, P.Abort(room=recv.room, reason=reason, requested=False))
            for recv in rooms:
                recv.fail(reason, kind)
            # Its sockets stay open while its rooms wait for Fenced (see _tick).
            if server not in self._retired:
                self._retired.append(server)

    # -- timeouts, heartbeats (I/O thread) ---------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        with self.lock:
            watched = [*self._servers.values(), *self._retired]
        for server in watched:  # servers in use, and those given up on whose rooms still wait for Fenced
            gone = next((r for r in server.ranks.values() if not r.gone and r.is_gone(now)), None)
            if gone is not None:
                self._gone(server, gone)
        with self.lock:
            servers = list(self._servers.values())
        for server in servers:
            if not server.ready:
                if now - server.created > cfg.bootstrap_timeout:
                    refusals = [c.last_refusal for c in (server.lookup, *(r.chan for r in server.ranks.values()))
                                if c is not None and c.last_refusal]
                    why = f" (last refusal: {refusals[-1]})" if refusals else ""
                    self._fail_server(server, f"could not reach every prefill rank through {server.address} within bootstrap_timeout={cfg.bootstrap_timeout}s{why}", "timeout")
                elif server.lookup is not None and now >= server.next_lookup:
                    self._lookup(server)
                continue
            silent = self._silent(server, now)
            if silent is not None:
                self._fail_server(server, silent, "peer_dead")
                continue
            for rank in server.ranks.values():
                if now - rank.last_ping >= cfg.heartbeat_interval and rank.chan is not None:
                    rank.last_ping = now
                    rank.chan.send_msg(P.Heartbeat(clock=rank.clock))
        with self.lock:
            for recv in list(self.rooms.values()):
                if recv.fencing:
                    recv.fence_overdue(now)
                    continue
                overdue = recv.overdue(now, cfg)
                if overdue is not None:
                    recv.fail(overdue, "timeout")
            keep = {id(r.server) for r in self.rooms.values() if r.fencing}
            keep.update(id(r.server) for r in self._unconfirmed.values())
            keep.update(id(s) for s in self._retired if now < s.linger_until)
            retired, self._retired = self._retired, [s for s in self._retired if id(s) in keep]
        for server in retired:
            if id(server) not in keep:
                self._close_server(server)

    def _shutdown(self) -> None:
        # close() gave up on every room: wait briefly for prefill to confirm it stopped
        # writing them (a live prefill answers within a round trip and its running batch).
        # Not the whole fence_timeout: closing must not hang on a dead prefill.
        deadline = time.monotonic() + min(self.config.fence_wait, self.config.heartbeat_timeout)
        while time.monotonic() < deadline:
            with self.lock:
                if not any(r.fencing for r in self.rooms.values()):
                    break
            time.sleep(0.005)
        with self.lock:
            for recv in list(self.rooms.values()):
                recv.fence_overdue(float("inf"))
            servers = [*self._servers.values(), *self._retired]
            self._servers.clear()
        ranks = [r for s in servers for r in s.ranks.values()]

        def stop_monitors() -> None:  # before the loop closes the sockets (it runs what is queued first)
            for r in ranks:
                self._stop_monitor(r)

        self.loop.call(stop_monitors)
