"""The prefill side of one request: a :class:`Sender`, and how it plans and writes each chunk."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from ..planning.layers import layer_list
from ..description.layout import KV_PAGE_SPACE, METADATA_SPACE
from ..control.metrics import metrics
from ..planning.pairing import Route
from ..planning.indices import Indices, PlanError
from ..planning.transferplan import TransferPlan
from .room import Poll, Room
from .peers import DecodeRequest, PrefillSide
from .inline import inline_write, write_inline
from .row import RowPlans
from .worker import Group
from .writes import ChunkWrite, Job, Totals, after_layers, write_chunks, write_layers

if TYPE_CHECKING:
    from .manager import SessionConfig

__all__ = ["DecodeRequest", "Sender"]

log = logging.getLogger(__name__)



@dataclass
class _LayeredChunk:
    """A chunk sent with ``layerwise=True`` whose layers are being announced."""

    chunk: int
    last: bool
    jobs: list[Job]
    announced: set[int] = field(default_factory=set)  # layer groups posted
    touched: float = field(default_factory=time.monotonic)  # send() or the latest layer_ready()


class Sender(Room):
    """Prefill side of one request, towards every decode rank of the room.

    The host creates it, waits for WAITING_FOR_INPUT (every decode rank's
    request has arrived), calls :meth:`send` once per prefill chunk, and
    polls until SUCCESS or FAILED.

    Layer-wise: ``send(pages, layerwise=True)`` plans the chunk but posts
    nothing; the host then calls :meth:`layer_ready` as each layer (or group
    of layers) of the chunk has been computed, and that layer's KV and state
    go out on the transfer threads while the host computes the next. Once
    every one of :attr:`layers` has been announced, the chunk's metadata row
    (last chunk) and its completion follow.
    """

    def __init__(self, manager: PrefillSide, room: int, metadata_row: int = 0) -> None:
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
        self._layered: _LayeredChunk | None = None
        # Per peer, the room's latest chunk sent layer-wise: later chunks to that peer are written after it.
        self._layer_jobs: dict[str, Job] = {}
        self._written: dict[str, list[TransferPlan | None]] = {}  # peer -> its plans, when checksummed
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
            self.manager.ready.add(self.room)
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
            if not got:  # the usual cause: decode never called init() for this room
                return (f"no request from decode for room {self.room} within bootstrap_timeout="
                        f"{cfg.bootstrap_timeout:g} s: did decode create a Receiver for room {self.room} and call "
                        f"init()? (a decode that failed before asking reports why on its side)", "timeout")
            missing = sorted(set(range(self._expected or 0)) - set(got))
            return (f"decode ranks {missing} of decode TP {self._expected} sent no request for room {self.room} "
                    f"within bootstrap_timeout={cfg.bootstrap_timeout:g} s (ranks {got} did): did every decode rank "
                    f"call init()?", "timeout")
        if self._busy and now - min(self._busy.values()) > cfg.transfer_timeout:
            return f"transfer did not complete within transfer_timeout={cfg.transfer_timeout}s", "timeout"
        lc = self._layered
        if lc is not None and now - lc.touched > cfg.transfer_timeout:
            return (f"{self._missing(lc)} of chunk {lc.chunk} (sent layerwise) were not announced with layer_ready() "
                    f"within transfer_timeout={cfg.transfer_timeout}s", "timeout")
        return None

    # -- the host's calls ------------------------------------------------------------------
    def send(
        self,
        page_indices: npt.ArrayLike,
        state_indices: Mapping[str, npt.ArrayLike] | None = None,
        last: bool = False,
        layerwise: bool = False,
    ) -> None:
        """Queue one prefill chunk (its KV pages, plus state with the last chunk).

        Returns at once; progress shows in :meth:`poll`. Except: a small chunk
        (:data:`.inline.INLINE_MAX_BYTES`) to a decode rank on this host whose worker
        is idle, while no other room is ready to send, is written on this
        thread before ``send`` returns (one thread hand-off less; the backend
        must declare ``inline_writes``, and on one host its write lands even in
        a frozen process). Bad indices (out of range, more pages than decode
        allocated, a slot-list mismatch) fail the room with the reason, on both
        sides. The lists are the host's again once it returns: a plan keeps copies of them, not them.

        With ``layerwise=True`` the chunk is planned now (and bad indices fail
        the room now) but nothing moves until :meth:`layer_ready` announces
        its layers; every layer in :attr:`layers` must be announced before
        the next ``send()``.
        """
        inline = self._queue_chunk(page_indices, state_indices, last, layerwise)
        for write in inline:  # claimed under the lock, written after it: the I/O thread is not held up meanwhile
            write_inline(write)

    def _queue_chunk(
        self,
        page_indices: npt.ArrayLike,
        state_indices: Mapping[str, npt.ArrayLike] | None,
        last: bool,
        layerwise: bool,
    ) -> list[ChunkWrite]:
        """:meth:`send` under the manager's lock: plan the chunk and queue its writes; return the writes
        this thread runs itself (their peers' workers claimed: :func:`.inline.inline_write`)."""
        m = self.manager
        with m.lock:
            if self.poll() == Poll.FAILED:
                return []
            if self.poll() == Poll.BOOTSTRAPPING:
                raise RuntimeError(f"room {self.room}: send() before every decode rank's request arrived; wait for WAITING_FOR_INPUT")
            if self._layered is not None:
                lc = self._layered
                reason = (f"room {self.room}: send() of chunk {self._chunks} before {self._missing(lc)} of chunk "
                          f"{lc.chunk} (sent layerwise) were announced with layer_ready()")
                m.fail_sender(self, reason, "bad_request")
                raise RuntimeError(reason)
            if self._last_sent:
                raise RuntimeError(f"room {self.room}: send() after the last chunk")
            jobs: list[Job] = []
            try:
                pages = m.source_indices(KV_PAGE_SPACE, page_indices)
                state = {space: m.source_indices(space, idx) for space, idx in state_indices.items()} if state_indices else {}
                for peer_id, req in sorted(self._requests.items()):
                    peer = m.peer(peer_id)
                    if peer is None:
                        raise PlanError(f"decode peer {peer_id!r} is gone")
                    totals: Totals = {}
                    plan, meta_plan = self._plan_chunk(peer.route, req, pages, state, last, totals, peer.row_plans)
                    jobs.append(Job(peer, plan, meta_plan, totals))
                    if req.checksum:
                        self._written.setdefault(peer_id, []).extend((plan, meta_plan))
            except PlanError as exc:
                m.fail_sender(self, f"room {self.room} chunk {self._chunks}: {exc}", "bad_request")
                return []
            chunk = self._chunks
            self._chunks += 1
            self._sent_pages += len(pages)
            self._last_sent = last
            if last:
                self._unfinished = len(jobs)
            self.advance(Poll.TRANSFERRING)
            m.ready.discard(self.room)
            if layerwise and m.layer_index.keys:  # a rank without layers has nothing to wait for
                self._layered = _LayeredChunk(chunk, last, jobs)
                for job in jobs:
                    # Held behind the previous layer-wise chunk still being written (after_layers), it counts as
                    # queued, so layer_ready() submits nothing; released, it takes every layer announced by then.
                    job.queued = after_layers(self._layer_jobs.get(job.peer.peer_id), functools.partial(
                        job.peer.worker.submit, functools.partial(write_layers, self, job, chunk, last)))
                    self._layer_jobs[job.peer.peer_id] = job
                return []
            inline: list[ChunkWrite] = []
            for job in jobs:
                write = ChunkWrite(self, job, chunk, last, job.plan)
                earlier = self._layer_jobs.get(job.peer.peer_id)
                if (earlier is None or not earlier.queued) and inline_write(self.manager, job):
                    inline.append(write)  # nothing held behind a layer-wise chunk (after_layers): this thread writes
                    continue
                # Grouped: chunks of other rooms queued for this peer meanwhile go out in the same writes.
                submit = functools.partial(job.peer.worker.submit, Group(write_chunks, write))
                if not after_layers(earlier, submit):
                    submit()
            return inline

    @property
    def layers(self) -> tuple[tuple[int, bool], ...]:
        """This rank's layers as ``(layer id, draft)``: what :meth:`layer_ready` must announce per layer-wise chunk."""
        return self.manager.layer_index.keys

    def layer_ready(self, layers: int | Iterable[int], draft: bool = False, ready: Any = None) -> None:
        """Post ``layers`` (one id, a range or several ids; draft-model layers with ``draft=True``) of the
        chunk sent with ``layerwise=True``: their KV and state move while the host computes on.

        Call it once the layers' source bytes are final. On GPU, instead of
        synchronising first, pass ``ready``: anything with a ``synchronize()``
        method (a ``torch.cuda.Event`` recorded after the layers' kernels),
        which each transfer thread waits on before writing. After the chunk's
        last layer the metadata row (with the last chunk) and the chunk's
        completion follow. Returns at once. Raises ``ValueError`` for a layer
        this rank does not hold or one already announced for this chunk
        (nothing is posted then), ``RuntimeError`` without a layer-wise chunk.
        """
        m = self.manager
        index = m.layer_index
        ids = layer_list(layers)
        with m.lock:
            if self.poll() == Poll.FAILED:
                return
            lc = self._layered
            if lc is None:
                raise RuntimeError(f"room {self.room}: layer_ready() without a chunk sent with send(..., layerwise=True)"
                                   + (" (the last chunk's layers were all announced)" if self._last_sent else ""))
            kind = "draft layer" if draft else "layer"
            groups: list[int] = []
            for layer in ids:
                g = index.group_of(layer, draft)
                if g is None:
                    raise ValueError(f"room {self.room}: {kind} {layer} is not a layer of this rank (it holds "
                                     f"{index.describe(draft)}; draft-model layers need draft=True)")
                if g in lc.announced or g in groups:
                    raise ValueError(f"room {self.room}: {kind} {layer} of chunk {lc.chunk} was already announced")
                groups.append(g)
            lc.announced.update(groups)
            now = time.monotonic()
            m.note_layer_gap(now - lc.touched)
            lc.touched = now
            complete = len(lc.announced) == len(index.keys)
            if complete:
                self._layered = None
            # Under the lock: a peer's layers keep the order they were announced in. One call per peer
            # is queued at a time; it takes every layer announced by then (see writes.write_layers).
            for job in lc.jobs:
                job.announced.append((groups, ready))
                job.complete = complete
                if complete:  # a lingering worker wakes for the last layer; the others it takes when its wait ends
                    job.arrived.set()
                if not job.queued:
                    job.queued = True
                    job.peer.worker.submit(functools.partial(write_layers, self, job, lc.chunk, lc.last))

    def _missing(self, lc: _LayeredChunk) -> str:
        return self.layer_names([g for g in range(len(self.manager.layer_index.keys)) if g not in lc.announced])

    def layer_names(self, groups: Sequence[int]) -> str:
        """Layer groups for messages: ``layers 0, 1; draft layer 100``."""
        keys = self.manager.layer_index.keys
        out = []
        for draft in (False, True):
            ids = sorted(keys[g][0] for g in groups if keys[g][1] == draft)
            if ids:
                shown = ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")
                out.append(f"{'draft ' if draft else ''}layer{'s' if len(ids) > 1 else ''} {shown}")
        return "; ".join(out)

    # -- for the writes (writes.py, on a peer's worker) --------------------------------------
    def write_started(self, peer_id: str, at: float) -> None:
        """A write to ``peer_id`` began at ``at``: :meth:`overdue` times it against transfer_timeout."""
        self._busy[peer_id] = at

    def write_ended(self, peer_id: str) -> None:
        """The write to ``peer_id`` returned (landed, failed or cancelled)."""
        self._busy.pop(peer_id, None)

    def take_written(self, peer_id: str) -> list[TransferPlan | None] | None:
        """The plans written to ``peer_id``, kept only when checksummed; handed over once."""
        return self._written.pop(peer_id, None)

    def peer_landed(self) -> bool:
        """One peer's last chunk landed (under the manager's lock); True once every peer's has."""
        self._unfinished -= 1
        return self._unfinished == 0

    def abort(self, reason: str = "abort() called by prefill's host") -> None:
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
        row_plans: RowPlans | None = None,
    ) -> tuple[TransferPlan, TransferPlan | None]:
        """This chunk's plan and (last chunk) metadata plan; adds their bytes per state type to ``totals``.
        ``row_plans``: the peer's metadata row plans planned before (``DecodePeer.row_plans``), reused."""
        dst_pages = req.indices.get(KV_PAGE_SPACE)
        allocated = len(dst_pages) if dst_pages is not None else 0
        n = len(pages)
        lo, hi = self._sent_pages, self._sent_pages + n
        if hi > allocated:
            raise PlanError(f"prefill sent {hi} pages in total but decode rank {req.decode_rank} allocated {allocated}")
        if last and hi != allocated:
            raise PlanError(f"the last chunk ends at page {hi} but decode rank {req.decode_rank} allocated {allocated} pages")
        src: dict[str, Indices] = {}
        dst: dict[str, Indices] = {}
        if n and dst_pages is not None and route.spaces.get(KV_PAGE_SPACE) is not None:
            src[KV_PAGE_SPACE], dst[KV_PAGE_SPACE] = pages, dst_pages[lo:hi]
        if state and not last:
            raise PlanError("state indices are sent with the last chunk")
        if last:
            for space, idx in state.items():
                if space not in route.spaces:
                    own = {s.name for s in route.src.index_spaces}
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
            meta_plan = (row_plans or RowPlans()).plan(route, self.metadata_row, req.metadata_row, totals)
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

