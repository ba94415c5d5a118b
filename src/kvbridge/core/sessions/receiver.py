"""The decode side of one request: a :class:`Receiver`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..control import protocol as P
from ..description.layout import KV_PAGE_SPACE, METADATA_SPACE
from ..control.metrics import metrics
from ..planning.indices import Indices, PlanError, check_index
from .room import Poll, Room
from .servers import DecodeSide, PrefillServer

if TYPE_CHECKING:
    from .manager import SessionConfig

__all__ = ["Receiver"]

_INT32_MAX = 2**31 - 1  # indices travel as int32 (protocol.pack_indices)


class Receiver(Room):
    """Decode side of one request.

    The host creates it with the prefill server's bootstrap address, calls
    :meth:`init` with where the room's pages, state and metadata row go, and
    polls until SUCCESS (the metadata row, written last, has landed) or
    FAILED (no byte of the room lands after that: the host may reuse its
    pages). ``server`` and the other non-host methods are core's.

    Once the room has given up (an abort, a timeout, a dead peer, prefill's
    ``Failed``) it is *fencing*: ``poll()`` keeps its last state until every
    prefill rank confirmed it stopped writing (``Fenced``) or
    ``SessionConfig.fence_wait`` passed, and only then says FAILED. In the
    second case :attr:`fenced` stays False until the missing confirmations
    arrive (a frozen prefill that resumed) or those ranks' processes are gone.
    """

    def __init__(self, manager: DecodeSide, room: int, bootstrap: str) -> None:
        super().__init__(room)
        self.manager = manager
        self._request: P.TransferRequest | None = None
        self._init_at: float | None = None
        self._sent = False
        self._done: set[tuple[int, int]] = set()
        self._fenced: set[tuple[int, int]] = set()  # prefill ranks that confirmed they stopped
        self._fencing: tuple[str, str, float] | None = None  # (reason, metrics kind, give up waiting at)
        #: FAILED without every rank's confirmation: a rank that was asked may still be writing.
        self._unconfirmed = False
        with manager.lock:
            # The server first: finding it may fail a dead one's rooms, which must not include this one yet.
            self.server: PrefillServer = manager.server(bootstrap)
            manager.add_room(self)
            if self.server.ready:
                self.on_ready()

    def init(
        self,
        page_indices: npt.ArrayLike,
        state_indices: Mapping[str, npt.ArrayLike] | None = None,
        metadata_row: int = 0,
    ) -> None:
        """Tell prefill where this room's pages, state and metadata row go.

        Every list is checked here, once (in range of this rank's index space,
        no index twice); a bad one fails the room with the reason and sends nothing.
        """
        m = self.manager
        with m.lock:
            if self.poll() == Poll.FAILED:
                return
            if self._request is not None:
                raise RuntimeError(f"room {self.room}: init() called twice")
            try:
                counts = m.space_counts
                indices = {KV_PAGE_SPACE: page_indices, **(state_indices or {})}
                if KV_PAGE_SPACE not in counts and not np.size(page_indices):
                    del indices[KV_PAGE_SPACE]  # a rank with state only (no full-attention KV)
                packed: dict[str, bytes | memoryview] = {}  # msgspec encodes either as the same bytes
                for space, idx in indices.items():
                    count = counts[space] if space in counts else m.kvargs.index_space(space).count  # KeyError names it
                    checked = Indices.check(f"destination {space} index", idx, count, unique=True)
                    # Checked against an index space that fits int32: packed without pack_indices' range check,
                    # as the int32 array's own bytes (a copy of its own: msgspec encodes any buffer).
                    packed[space] = (memoryview(checked.array.astype("<i4")).cast("B") if count <= _INT32_MAX
                                     else P.pack_indices(checked.array))
                if METADATA_SPACE in counts:
                    check_index("metadata_row", metadata_row, counts[METADATA_SPACE])
            except (KeyError, PlanError, P.ProtocolError) as exc:
                reason = f"room {self.room}: {exc.args[0] if exc.args else exc}"
                m.finish(self, Poll.FAILED, reason, "bad_request")  # nothing was asked for: nothing can land
                # Prefill may have a sender waiting for this request: tell it now, not at its bootstrap_timeout.
                m.tell(self.server, P.Abort(room=self.room, reason=f"decode init failed: {reason}", requested=False))
                return
            self._request = P.TransferRequest(room=self.room, indices=packed,  # type: ignore[arg-type]
                                              metadata_row=int(metadata_row),
                                              strict=m.config.strict_index_lengths, checksum=m.config.checksum)
            self._init_at = time.monotonic()
            if self.server.ready:
                self._send_request()

    @property
    def asked(self) -> P.TransferRequest | None:
        """What this room asked prefill for (after :meth:`init`)."""
        return self._request

    def abort(self, reason: str = "abort() called by decode's host") -> None:
        """Give up on this room; prefill is told. Returns at once: ``poll()`` says FAILED once
        prefill confirmed it stopped writing (or the fence timeout passed); only then reuse the pages."""
        self.fail(reason, "aborted")

    # -- core's (the manager's I/O thread, under its lock) ---------------------------------
    def fail(self, reason: str, kind: str, wait: float | None = None) -> None:
        """Give up on the room: FAILED now if nothing was asked of prefill, else once it is fenced.

        ``kind`` is the failure's metrics label. The first reason wins. ``wait``: report FAILED
        (unfenced) after at most this many seconds instead of ``fence_wait`` (prefill failed the
        room itself: its failure must reach the host promptly).
        """
        m = self.manager
        with m.lock:
            if self.final or self._fencing is not None:
                return
            if not self._sent:
                m.finish(self, Poll.FAILED, reason, kind)
                return
            patience = m.config.fence_wait if wait is None else min(wait, m.config.fence_wait)
            self._fencing = (reason, kind, time.monotonic() + patience)
            self.manager.send_to_ranks(self.server, P.Abort(room=self.room, reason=reason))
            self._check_fenced()

    @property
    def fenced(self) -> bool:
        """Whether no byte of this room can land any more (read it after ``poll()`` says FAILED).

        True at SUCCESS, and at FAILED once every prefill rank that was asked
        confirmed it stopped writing, or nothing was asked. False while such a
        rank may still write: decode reported FAILED at ``fence_timeout``
        without its confirmation (a prefill frozen or cut off). It turns True
        when that rank's ``Fenced`` arrives after all (it resumed) or its
        process is gone (its control connection closed and reconnecting is
        refused). A host that must never have a page written after it reused
        it keeps the pages of a FAILED room until this is True (docs/failures.md;
        a decode process that was itself stopped is the one exception there).
        """
        return self.final and not self._unconfirmed

    def on_fenced(self, rank: tuple[int, int]) -> None:
        """Prefill ``rank`` confirmed it stopped writing the room (or its process is gone).

        Prefill sends ``Failed`` before it when it gives up itself, so a
        ``Fenced`` for a room that is neither fencing here nor FAILED without
        confirmations answers an earlier ``Abort`` of the same room id (a
        failed ``init``) and is ignored.
        """
        if self._fencing is not None:
            self._fenced.add(rank)
            if self._unconfirmed and len(self._fenced) >= len(self.server.ranks):
                self._unconfirmed = False
                self.manager.confirmed(self)
            else:
                self._check_fenced()

    def fence_overdue(self, now: float) -> bool:
        """Past the fence timeout: report FAILED without every rank's confirmation (not :attr:`fenced`)."""
        if self._fencing is not None and not self.final and now >= self._fencing[2]:
            self._unconfirmed = True
            self.manager.finish(self, Poll.FAILED, self._fencing[0], self._fencing[1])
            self.manager.unconfirmed(self)
            return True
        return False

    @property
    def fencing(self) -> bool:
        return self._fencing is not None and not self.final

    def _check_fenced(self) -> None:
        if self._fencing is not None and len(self._fenced) >= len(self.server.ranks) > 0:
            self.manager.finish(self, Poll.FAILED, self._fencing[0], self._fencing[1])

    def on_ready(self) -> None:
        """The handshake with every prefill rank is done: send the request if ``init`` came already."""
        if self.advance(Poll.WAITING_FOR_INPUT):
            metrics().bootstrap(self.manager.backend_name, "decode", time.monotonic() - self.created)
        if self._request is not None:
            self._send_request()

    def rank_done(self, rank: tuple[int, int], ranks: int) -> bool:
        """Record ``Done`` from prefill ``rank``; True once all ``ranks`` have sent it."""
        self._done.add(rank)
        return len(self._done) == ranks

    def overdue(self, now: float, cfg: SessionConfig) -> str | None:
        """Why a timeout of this room has expired, or None."""
        if self._fencing is not None:
            return None
        if self.poll() == Poll.BOOTSTRAPPING and now - self.created > cfg.bootstrap_timeout:
            return f"bootstrap did not complete within bootstrap_timeout={cfg.bootstrap_timeout}s"
        if self._init_at is not None and now - self._init_at > cfg.waiting_timeout:
            return f"transfer did not complete within waiting_timeout={cfg.waiting_timeout}s"
        return None

    def _send_request(self) -> None:
        if not self._sent and self._request is not None:
            self._sent = True
            self.manager.send_to_ranks(self.server, self._request)
