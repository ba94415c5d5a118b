"""The prefill side of one request: a :class:`Sender`, and how it plans and writes each chunk."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy.typing as npt

from . import protocol as P
from .backend import TransferCancelled, TransferTimeout
from .layout import KV_PAGE_SPACE, METADATA_SPACE
from .metrics import metrics
from .pairing import Route
from .plan import Indices, PlanError, TransferPlan
from .room import Poll, Room

if TYPE_CHECKING:
    from .manager import SessionConfig
    from .prefill import DecodePeer, PrefillManager

__all__ = ["DecodeRequest", "Sender"]

log = logging.getLogger(__name__)

Totals = dict[str, tuple[int, int]]  # state type -> (bytes, descriptors)


@dataclass
class DecodeRequest:
    """One decode rank's destination lists for a room, checked on arrival."""

    peer: str
    decode_rank: int
    decode_tp: int
    indices: dict[str, Indices]
    metadata_row: int
    received: float
    strict: bool = False  # decode asked for strict_index_lengths

    def conflict(self, others: Mapping[str, DecodeRequest]) -> str | None:
        """Why this request cannot join a room's ``others``, or None."""
        if self.peer in others:
            return f"decode {self.peer!r} already sent a request for it"
        for other in others.values():
            if other.decode_tp != self.decode_tp:
                return f"decode ranks disagree on the decode TP size ({other.decode_tp} vs {self.decode_tp})"
            if other.decode_rank == self.decode_rank:
                return f"decode TP rank {self.decode_rank} already sent a request for it (from {other.peer!r})"
        return None


class Sender(Room):
    """Prefill side of one request, towards every decode rank of the room.

    The host creates it, waits for WAITING_FOR_INPUT (every decode rank's
    request has arrived), calls :meth:`send` once per prefill chunk, and
    polls until SUCCESS or FAILED.
    """

    def __init__(self, manager: PrefillManager, room: int, metadata_row: int = 0) -> None:
        super().__init__(room)
        self.manager = manager
        self.metadata_row = int(metadata_row)
        self._requests: dict[str, DecodeRequest] = {}
        self._expected: int | None = None
        self._chunks = 0
        self._sent_pages = 0
        self._last_sent = False
        self._unfinished = 0  # peers whose last chunk has not landed yet
        self._busy: dict[str, float] = {}  # peer -> start of its running write
        with manager.lock:
            manager.add_room(self)
            for req in manager.take_pending(self.room):
                self.attach(req)
            aborted = manager.take_aborted(self.room)
            if aborted is not None:
                manager.fail_sender(self, aborted, "aborted")

    # -- used by the manager (I/O thread, under its lock) ---------------------------------
    def attach(self, req: DecodeRequest) -> str | None:
        """Add one decode rank's request; WAITING_FOR_INPUT once every decode rank's is in."""
        problem = req.conflict(self._requests)
        if problem is not None:
            return problem
        if self.poll() != Poll.BOOTSTRAPPING:
            return "the room is already being served"
        self._requests[req.peer] = req
        self._expected = req.decode_tp
        if len(self._requests) == self._expected and self.advance(Poll.WAITING_FOR_INPUT):
            metrics().bootstrap(self.manager.backend_name, "prefill", time.monotonic() - self.created)
        return None

    def asked_by(self, peer_id: str) -> bool:
        """Whether decode peer ``peer_id`` sent a request for this room."""
        return peer_id in self._requests

    def peer_ids(self) -> list[str]:
        return list(self._requests)

    def request(self, peer_id: str) -> DecodeRequest | None:
        """Decode peer ``peer_id``'s request for this room, if it sent one."""
        return self._requests.get(peer_id)

    def overdue(self, now: float, cfg: SessionConfig) -> tuple[str, str] | None:
        """``(reason, kind)`` if a timeout of this room has expired, else None."""
        if self.poll() == Poll.BOOTSTRAPPING and now - self.created > cfg.bootstrap_timeout:
            got = sorted(r.decode_rank for r in self._requests.values())
            return (f"requests from decode ranks {got} of {self._expected or '?'} arrived within "
                    f"bootstrap_timeout={cfg.bootstrap_timeout}s", "timeout")
        if self._busy and now - min(self._busy.values()) > cfg.transfer_timeout:
            return f"transfer did not complete within transfer_timeout={cfg.transfer_timeout}s", "timeout"
        return None

    # -- the host's calls ------------------------------------------------------------------
    def send(
        self,
        page_indices: npt.ArrayLike,
        state_indices: Mapping[str, npt.ArrayLike] | None = None,
        last: bool = False,
    ) -> None:
        """Queue one prefill chunk (its KV pages, plus state with the last chunk).

        Returns at once; progress shows in :meth:`poll`. Bad indices (out of
        range, more pages than decode allocated, a slot-list mismatch) fail
        the room with the reason, on both sides.
        """
        m = self.manager
        with m.lock:
            if self.poll() == Poll.FAILED:
                return
            if self.poll() == Poll.BOOTSTRAPPING:
                raise RuntimeError(f"room {self.room}: send() before every decode rank's request arrived; wait for WAITING_FOR_INPUT")
            if self._last_sent:
                raise RuntimeError(f"room {self.room}: send() after the last chunk")
            jobs = []
            try:
                pages = m.source_indices(KV_PAGE_SPACE, page_indices)
                state = {space: m.source_indices(space, idx) for space, idx in (state_indices or {}).items()}
                for peer_id, req in sorted(self._requests.items()):
                    peer = m.peer(peer_id)
                    if peer is None:
                        raise PlanError(f"decode peer {peer_id!r} is gone")
                    totals: Totals = {}
                    plan, meta_plan = self._plan_chunk(peer.route, req, pages, state, last, totals)
                    jobs.append((peer, plan, meta_plan, totals))
            except PlanError as exc:
                m.fail_sender(self, f"room {self.room} chunk {self._chunks}: {exc}", "bad_request")
                return
            chunk = self._chunks
            self._chunks += 1
            self._sent_pages += len(pages)
            self._last_sent = last
            if last:
                self._unfinished = len(jobs)
            self.advance(Poll.TRANSFERRING)
        for peer, plan, meta_plan, totals in jobs:
            peer.worker.submit(functools.partial(self._write_chunk, peer, plan, meta_plan, totals, chunk, last))

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Give up on this room; decode is told. No batch starts after this; decode reports
        FAILED once the batch running now (if any) has returned (``Fenced``)."""
        self.manager.fail_sender(self, reason, "aborted")

    # -- planning --------------------------------------------------------------------------
    def _plan_chunk(
        self,
        route: Route,
        req: DecodeRequest,
        pages: Indices,
        state: Mapping[str, Indices],
        last: bool,
        totals: Totals,
    ) -> tuple[TransferPlan, TransferPlan | None]:
        """This chunk's plan and (last chunk) metadata plan; adds their bytes per state type to ``totals``."""
        dst_pages = req.indices.get(KV_PAGE_SPACE)
        allocated = len(dst_pages) if dst_pages is not None else 0
        lo, hi = self._sent_pages, self._sent_pages + len(pages)
        if hi > allocated:
            raise PlanError(f"prefill sent {hi} pages in total but decode rank {req.decode_rank} allocated {allocated}")
        if last and hi != allocated:
            raise PlanError(f"the last chunk ends at page {hi} but decode rank {req.decode_rank} allocated {allocated} pages")
        src: dict[str, Indices] = {}
        dst: dict[str, Indices] = {}
        if len(pages) and dst_pages is not None and route.spaces.get(KV_PAGE_SPACE) is not None:
            src[KV_PAGE_SPACE], dst[KV_PAGE_SPACE] = pages, dst_pages[lo:hi]
        if state and not last:
            raise PlanError("state indices are sent with the last chunk")
        if last:
            own = {s.name for s in route.src.index_spaces}
            for space, idx in state.items():
                if space not in route.spaces:
                    if space not in own and any(s.name == space for s in route.dst.index_spaces):
                        continue  # another pipeline stage's state: that stage sends it
                    raise PlanError(f"no paired regions use index space {space!r} (paired: {sorted(route.spaces)})")
                if space not in req.indices:
                    raise PlanError(f"decode rank {req.decode_rank} sent no destination indices for {space!r}")
                src[space], dst[space] = self._align(route, space, req, idx)
            self._check_complete(route, req, state)
        plan = route.plan(src, dst, totals) if src else TransferPlan.empty()
        meta_plan = None
        kv = self.manager.kvargs
        meta = route.spaces.get(METADATA_SPACE)
        # The metadata row comes from the last pipeline stage, sent by one TP rank.
        if last and meta is not None and meta.sends and kv.pp_rank == kv.pp_size - 1:
            meta_plan = route.plan({METADATA_SPACE: [self.metadata_row]}, {METADATA_SPACE: [req.metadata_row]}, totals)
        return plan, meta_plan

    def _check_complete(self, route: Route, req: DecodeRequest, state: Mapping[str, Indices]) -> None:
        """Every state list decode allocated must come from prefill too, unless both sides declare the space optional."""
        for space, dst in req.indices.items():
            if space in (KV_PAGE_SPACE, METADATA_SPACE) or space in state or not len(dst) or space not in route.spaces:
                continue
            if route.src.index_space(space).optional and route.dst.index_space(space).optional:
                continue
            raise PlanError(
                f"decode rank {req.decode_rank} allocated {len(dst)} {space!r} indices but prefill passed no "
                f"{space!r} list with the last chunk; pass it in send(state_indices=...), or declare the index "
                "space optional on both sides (IndexSpace.optional)"
            )

    def _align(self, route: Route, space: str, req: DecodeRequest, src: Indices) -> tuple[Indices, Indices]:
        """The one index-length mismatch policy, for every backend and state type (strict if either side asks)."""
        dst = req.indices[space]
        if len(src) == len(dst):
            return src, dst
        kind = route.spaces[space].kind
        own = self.manager.config.strict_index_lengths
        if kind != "page" or own or req.strict:
            why = (("strict_index_lengths is set" if own else "strict_index_lengths is set on decode")
                   if kind == "page" else f"{space!r} is {kind}-indexed")
            raise PlanError(f"{space}: prefill has {len(src)} indices, decode {len(dst)} ({why}; they must match)")
        n = min(len(src), len(dst))
        log.warning(
            "room %d: %s index lists differ (prefill %d, decode %d); sending the first %d",
            self.room, space, len(src), len(dst), n,
        )
        return src[:n], dst[:n]  # views: the request's own lists stay as they are

    # -- on the peer's worker thread -------------------------------------------------------
    def _write_chunk(
        self,
        peer: DecodePeer,
        plan: TransferPlan,
        meta_plan: TransferPlan | None,
        totals: Mapping[str, tuple[int, int]],
        chunk: int,
        last: bool,
    ) -> None:
        """Write the chunk, then (last) the metadata row; then tell the decode rank.

        The room's liveness is checked before every batch (``PrefillManager.live``):
        once it failed, or decode's lease ran out, no further batch starts, and
        ``Fenced`` goes out when this write returns.
        """
        m = self.manager
        if not m.begin_write(self, peer):
            return
        start = time.monotonic()
        deadline = start + m.config.transfer_timeout
        self._busy[peer.peer_id] = start
        try:
            for p in (plan, meta_plan):
                if p is not None and len(p):
                    m.transport.write(peer.peer_id, p, deadline, lambda: m.live(self, peer, wait=True))
        except TransferCancelled:
            return  # the room failed (live() says why); end_write fences it
        except Exception as exc:
            kind = "timeout" if isinstance(exc, TransferTimeout) else "transfer_error"
            m.fail_sender(self, f"transfer of chunk {chunk} to {peer.peer_id!r} failed: {exc}", kind)
            return
        finally:
            self._busy.pop(peer.peer_id, None)
            m.end_write(self, peer)
        if totals:  # something was written
            metrics().transfer(m.backend_name, totals, time.monotonic() - start)
        with m.lock:  # failing the room takes the lock too: Done never follows Failed
            if not m.live(self, peer):
                return
            m.notify(peer, P.ChunkDone(room=self.room, chunk=chunk, last=last))
            if last:
                m.notify(peer, P.Done(room=self.room))
                self._unfinished -= 1
                if self._unfinished == 0:
                    m.finish(self, Poll.SUCCESS)
