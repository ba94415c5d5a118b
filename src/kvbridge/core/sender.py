"""The prefill side of one request: a :class:`Sender`, and how it plans and writes each chunk."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from . import protocol as P
from .backend import TransferCancelled, TransferTimeout
from .checksum import ChecksumError, default_algorithm, summarise
from .layers import LayeredPlan, layer_list
from .layout import KV_PAGE_SPACE, METADATA_SPACE
from .metrics import metrics
from .pairing import Route
from .plan import Indices, PlanError, TransferPlan
from .room import Poll, Room
from .row import read_row
from .worker import Group

if TYPE_CHECKING:
    from .manager import SessionConfig
    from .prefill import DecodePeer, PrefillManager

__all__ = ["DecodeRequest", "Sender"]

log = logging.getLogger(__name__)

Totals = dict[str, tuple[int, int]]  # state type -> (bytes, descriptors)


@dataclass
class _Job:
    """One chunk's writes to one decode peer."""

    peer: DecodePeer
    plan: TransferPlan
    meta_plan: TransferPlan | None
    totals: Totals
    layered: LayeredPlan | None = None  # ``plan`` grouped by layer, once a write takes only some (_split)
    seconds: float = 0.0  # time spent writing so far (metrics)
    # Announced layer groups not yet taken by the worker: (groups, ready) per layer_ready(), in order.
    announced: list[tuple[list[int], Any]] = field(default_factory=list)
    queued: bool = False  # a _write_layers call is queued or running on the peer's worker
    complete: bool = False  # every layer of the chunk was announced: the write that takes the last ends the chunk
    # Set by layer_ready() for the chunk's last layer: ends a lingering worker's wait (_linger).
    arrived: threading.Event = field(default_factory=threading.Event)


@dataclass
class _LayeredChunk:
    """A chunk sent with ``layerwise=True`` whose layers are being announced."""

    chunk: int
    last: bool
    jobs: list[_Job]
    announced: set[int] = field(default_factory=set)  # layer groups posted
    touched: float = field(default_factory=time.monotonic)  # send() or the latest layer_ready()


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
    checksum: bool = False  # either side asked for the end-to-end checksum

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

    Layer-wise: ``send(pages, layerwise=True)`` plans the chunk but posts
    nothing; the host then calls :meth:`layer_ready` as each layer (or group
    of layers) of the chunk has been computed, and that layer's KV and state
    go out on the transfer threads while the host computes the next. Once
    every one of :attr:`layers` has been announced, the chunk's metadata row
    (last chunk) and its completion follow.
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
        self._layered: _LayeredChunk | None = None
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

        Returns at once; progress shows in :meth:`poll`. Bad indices (out of
        range, more pages than decode allocated, a slot-list mismatch) fail
        the room with the reason, on both sides.

        With ``layerwise=True`` the chunk is planned now (and bad indices fail
        the room now) but nothing moves until :meth:`layer_ready` announces
        its layers; every layer in :attr:`layers` must be announced before
        the next ``send()``.
        """
        m = self.manager
        with m.lock:
            if self.poll() == Poll.FAILED:
                return
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
            jobs: list[_Job] = []
            try:
                pages = m.source_indices(KV_PAGE_SPACE, page_indices)
                state = {space: m.source_indices(space, idx) for space, idx in (state_indices or {}).items()}
                for peer_id, req in sorted(self._requests.items()):
                    peer = m.peer(peer_id)
                    if peer is None:
                        raise PlanError(f"decode peer {peer_id!r} is gone")
                    totals: Totals = {}
                    plan, meta_plan = self._plan_chunk(peer.route, req, pages, state, last, totals)
                    jobs.append(_Job(peer, plan, meta_plan, totals))
                    if req.checksum:
                        self._written.setdefault(peer_id, []).extend((plan, meta_plan))
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
            if layerwise and m.layer_index.keys:  # a rank without layers has nothing to wait for
                self._layered = _LayeredChunk(chunk, last, jobs)
                return
        for job in jobs:
            # Grouped: chunks of other rooms queued for this peer meanwhile go out in the same writes.
            job.peer.worker.submit(Group(_write_chunks, _ChunkWrite(self, job, chunk, last, job.plan)))

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
            # is queued at a time; it takes every layer announced by then (see _write_layers).
            for job in lc.jobs:
                job.announced.append((groups, ready))
                job.complete = complete
                if complete:  # a lingering worker wakes for the last layer; the others it takes when its wait ends
                    job.arrived.set()
                if not job.queued:
                    job.queued = True
                    job.peer.worker.submit(functools.partial(self._write_layers, job, lc.chunk, lc.last))

    def _missing(self, lc: _LayeredChunk) -> str:
        return self._names([g for g in range(len(self.manager.layer_index.keys)) if g not in lc.announced])

    def _names(self, groups: Sequence[int]) -> str:
        """Layer groups for messages: ``layers 0, 1; draft layer 100``."""
        keys = self.manager.layer_index.keys
        out = []
        for draft in (False, True):
            ids = sorted(keys[g][0] for g in groups if keys[g][1] == draft)
            if ids:
                shown = ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")
                out.append(f"{'draft ' if draft else ''}layer{'s' if len(ids) > 1 else ''} {shown}")
        return "; ".join(out)

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
    def _write(self, job: _Job, plans: Sequence[TransferPlan | None], what: str) -> bool:
        """Write ``plans`` in order into the job's peer; False if the room failed (now or before).

        The room's liveness is checked before every batch (``PrefillManager.live``):
        once it failed, or decode's lease ran out, no further batch starts, and
        ``Fenced`` goes out when this write returns.
        """
        m = self.manager
        peer = job.peer
        if not m.begin_write(self, peer):
            return False
        start = time.monotonic()
        deadline = start + m.config.transfer_timeout
        self._busy[peer.peer_id] = start
        try:
            for p in plans:
                if p is not None and len(p):
                    # No announce: layer-wise writes are not staged on both sides (docs/architecture.md, "Staging").
                    m.transport.write(peer.peer_id, p, deadline, lambda: m.live(self, peer, wait=True))
        except TransferCancelled:
            return False  # the room failed (live() says why); end_write fences it
        except Exception as exc:
            kind = "timeout" if isinstance(exc, TransferTimeout) else "transfer_error"
            m.fail_sender(self, f"transfer of {what} to {peer.peer_id!r} failed: {exc}", kind)
            return False
        finally:
            self._busy.pop(peer.peer_id, None)
            job.seconds += time.monotonic() - start
            m.end_write(self, peer)
        return True

    def _write_layers(self, job: _Job, chunk: int, last: bool) -> None:
        """Write the layers announced for this peer whose source is final; the chunk's last ones end it.

        Layers go as soon as their source is final: the first one announced is
        waited for (``ready.synchronize()``), then every one after it that is
        ready too (``ready.query()``, or announced without ``ready``) goes in the
        same write; a layer still computing is left for the next call, queued
        behind this one, so it holds back neither the layers before it nor
        other rooms' writes. Layers that piled up while the worker was busy go
        together. When layers come faster than a write's fixed cost and what is
        held would be a write mostly of that cost (:meth:`_worth_waiting`, from
        the peer's measured ``write_cost`` and ``byte_time`` and the
        announcements' pace), the worker lingers up to that cost for the next one
        and writes them together: a fast copy pays one fixed cost for many layers,
        as a per-chunk send does; compute-bound, or when a layer's bytes dominate,
        one write per layer. The write that takes the chunk's last layer also takes
        what has no layer, then (last chunk) the metadata row, then tells decode,
        all in this one call.
        """
        m = self.manager
        with m.lock:
            first = job.announced[0] if job.announced else None
            if first is None or self.poll() == Poll.FAILED:
                job.queued = False
                return
        if first[1] is not None:
            try:
                first[1].synchronize()
            except Exception as exc:
                with m.lock:
                    job.queued = False
                m.fail_sender(self, f"room {self.room} chunk {chunk} {self._names(first[0])}: waiting for the layers' "
                                    f"source (ready.synchronize()) failed: {exc}", "transfer_error")
                return
        groups, final = self._take_ready(job, [], first=True)
        if not final and self._worth_waiting(job, groups):
            groups, final = self._linger(job, groups)
        try:
            if not final:
                body = self._split(job).groups(groups)
            elif len(groups) == len(m.layer_index.keys):  # every layer came before this write could start
                body = job.plan  # the chunk as planned, as a per-chunk send writes it
            else:
                body = self._split(job).groups([*groups, m.layer_index.tail])
        except PlanError as exc:  # a descriptor outside this rank's layer regions (validated: not expected)
            with m.lock:
                job.queued = False
            m.fail_sender(self, f"room {self.room} chunk {chunk}: {exc}", "bad_request")
            return
        if final:
            _write_chunks([_ChunkWrite(self, job, chunk, last, body, f" ({self._names(groups)})" if groups else "")])
        elif len(body):  # none: this rank sends these layers no byte (MLA)
            start = time.monotonic()
            if self._write(job, [body], f"chunk {chunk} ({self._names(groups)})"):
                job.peer.note_write(body.total_bytes, time.monotonic() - start)
        with m.lock:
            if job.announced and self.poll() != Poll.FAILED:
                job.peer.worker.submit(functools.partial(self._write_layers, job, chunk, last))  # job.queued stays
            else:
                job.queued = False

    def _take_ready(self, job: _Job, groups: list[int], first: bool = False) -> tuple[list[int], bool]:
        """Move the announced layers whose source is final (``first``: the first one regardless: it was
        waited for) from ``job.announced`` to ``groups``; also whether the chunk's last layer was taken."""
        with self.manager.lock:
            n = 1 if first else 0
            while n < len(job.announced) and _is_ready(job.announced[n][1]):
                n += 1
            for gs, _ in job.announced[:n]:
                groups.extend(gs)
            del job.announced[:n]
            job.arrived.clear()  # under the lock: an announcement after this sets it again
            return groups, job.complete and not job.announced

    def _split(self, job: _Job) -> LayeredPlan:
        """The job's plan grouped by layer, split when a write first takes only some of its layers: a
        chunk whose layers all come before its first write goes whole, unsplit, as a per-chunk send."""
        if job.layered is None:
            job.layered = self.manager.layer_index.split(job.plan)
        return job.layered

    def _worth_waiting(self, job: _Job, groups: list[int]) -> bool:
        """Whether to wait for the next layer rather than write ``groups`` now: the peer's writes are
        measured, layers come faster than a write costs, and ``groups``' bytes take less than that cost
        (a write of them is mostly its fixed cost; past that, writing now overlaps more). Their bytes
        are the chunk's share per layer: nothing is split for the estimate."""
        peer, gap = job.peer, self.manager.layer_gap
        cost, per_byte = peer.write_cost, peer.byte_time
        if cost is None or gap is None or gap >= cost:
            return False
        share = job.plan.total_bytes * len(groups) / max(1, len(self.manager.layer_index.keys))
        # No larger write measured yet (per_byte None): every write so far was small, its bytes cheap.
        return share * (per_byte or 0.0) < cost

    def _linger(self, job: _Job, groups: list[int]) -> tuple[list[int], bool]:
        """Wait up to the peer's write cost, take the layers announced meanwhile, again while that is
        worth it (:meth:`_worth_waiting`) and until the chunk's last layer is taken; bounded in count
        (each round takes a layer or waits) and in time.

        Only the chunk's last layer ends a wait early: woken by every announcement, this thread took
        the GIL from the host's thread between its layers, and on the H200 a host announcing 16
        layers without compute took ~120 us per layer, traced (layer-wise TTFT 3.2 ms against
        1.6 ms per chunk, in 4 writes; woken by the last only: 2.1 ms, 1 write)."""
        cost = job.peer.write_cost or 0.0
        until = time.monotonic() + cost
        for _ in range(4 * (len(self.manager.layer_index.keys) + 1)):
            now = time.monotonic()
            if now >= until:
                break
            if job.announced:  # the next one is announced but still computing (its ready.query() is false)
                time.sleep(min(cost / 4, until - now))
            else:
                job.arrived.wait(until - now)
            before = len(groups)
            groups, final = self._take_ready(job, groups)
            if final or self.poll() == Poll.FAILED:
                return groups, final
            if len(groups) > before:
                if not self._worth_waiting(job, groups):
                    break
                until = time.monotonic() + cost
        return groups, False


def _is_ready(ready: Any) -> bool:
    """Whether a layer's source is final without waiting: no ``ready`` handle, or its ``query()`` says so."""
    if ready is None:
        return True
    query = getattr(ready, "query", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:  # its synchronize() will raise it, as the first layer of a later write
        return False


@dataclass
class _ChunkWrite:
    """One room's chunk for one peer: ``body`` (the chunk, or what a layer-wise chunk had without a layer)."""

    sender: Sender
    job: _Job
    chunk: int
    last: bool
    body: TransferPlan
    what: str = ""  # in errors after "chunk N": which layers the body holds, if sent layer-wise


def _write_chunks(writes: list[_ChunkWrite]) -> None:
    """Chunks queued back to back for one peer (on its worker): every chunk's bytes in one write, then
    every metadata row (inside each room's ``Done`` when the peer takes rows that way,
    :mod:`kvbridge.core.row`; else in a second write), so each row still lands after its pages,
    then decode is told with one hand-off to the I/O thread.

    With many small requests in flight this is one backend write (and one NIXL request) for many
    rooms instead of two per room. The fence stays per room: each room's write is counted
    (``begin_write``/``end_write``), a batch starts only while every room in it is live, and a room
    that stopped being live is left out of the rest (:func:`_write_live`). A failed write fails every
    room in it; ``Done`` goes only to rooms still live, under the lock, so it never follows ``Failed``.
    """
    m = writes[0].sender.manager
    peer = writes[0].job.peer
    begun = [w for w in writes if m.begin_write(w.sender, peer)]
    if not begun:
        return
    live = begun
    start = time.monotonic()
    deadline = start + m.config.transfer_timeout
    for w in begun:
        w.sender._busy[peer.peer_id] = start
    try:
        live = _write_live(m, peer, live, lambda w: w.body, deadline)
        rows = time.monotonic()
        # Measured for layer-wise sending's coalescing: what a write costs (a small one), what a byte adds.
        body = sum(w.body.total_bytes for w in live)
        if body:
            peer.note_write(body, rows - start)
        # Rows as a second write, after the pages: unless each travels in its Done (below), or there is none.
        if not peer.inline_row and any(w.job.meta_plan is not None for w in live):
            live = _write_live(m, peer, live, lambda w: w.job.meta_plan, deadline)
            row_bytes = sum(w.job.meta_plan.total_bytes for w in live if w.job.meta_plan is not None)
            if row_bytes:
                peer.note_write(row_bytes, time.monotonic() - rows)
    except Exception as exc:
        kind = "timeout" if isinstance(exc, TransferTimeout) else "transfer_error"
        together = f" (written together with {len(live) - 1} other rooms' chunks)" if len(live) > 1 else ""
        for w in live:
            m.fail_sender(w.sender, f"transfer of chunk {w.chunk}{w.what} to {peer.peer_id!r} failed: {exc}{together}", kind)
        return
    finally:
        seconds = time.monotonic() - start
        for w in begun:
            w.sender._busy.pop(peer.peer_id, None)
            w.job.seconds += seconds
            m.end_write(w.sender, peer)  # a room that failed meanwhile is fenced here
    if not live:
        return
    summaries: dict[int, Any] = {}  # checksummed rooms' last chunk: the digest of what was written
    for w in list(live):
        if w.last and peer.peer_id in w.sender._written:
            try:
                summaries[id(w)] = summarise(w.sender._written.pop(peer.peer_id), default_algorithm(),
                                             m.config.max_message_bytes)
            except ChecksumError as exc:
                m.fail_sender(w.sender, f"room {w.sender.room}: {exc}", "checksum")
                live.remove(w)
    rows_in_done: dict[int, P.MetadataRow] = {}  # read now that the room's pages landed: the row goes after them
    if peer.inline_row:
        for w in live:
            req = w.sender.request(peer.peer_id)
            if w.last and w.job.meta_plan is not None and req is not None:
                rows_in_done[id(w)] = read_row(w.job.meta_plan, req.metadata_row)
    with m.lock:  # failing a room takes the lock too: Done never follows Failed
        live = [w for w in live if m.live(w.sender, peer)]
        # The last chunk's Done says it landed too: no ChunkDone before it (one message, one
        # wake-up of decode's host fewer per request).
        finished = False
        for w in live:
            if w.last:
                w.sender._unfinished -= 1
                if w.sender._unfinished == 0:
                    finished = m.finish(w.sender, Poll.SUCCESS, wake=False) or finished
        m.notify(peer, *(P.Done(room=w.sender.room, checksum=summaries.get(id(w)), row=rows_in_done.get(id(w))) if w.last
                         else P.ChunkDone(room=w.sender.room, chunk=w.chunk, last=False) for w in live), wake=finished)
    for w in live:
        if w.job.totals:  # something was written
            metrics().transfer(m.backend_name, w.job.totals, w.job.seconds)


def _write_live(
    m: PrefillManager, peer: DecodePeer, writes: list[_ChunkWrite],
    part: Callable[[_ChunkWrite], TransferPlan | None], deadline: float,
) -> list[_ChunkWrite]:
    """Write every live room's ``part`` together; return the rooms still live afterwards.

    Before every batch the write checks that every room in it is live; when one
    is not (it failed, or decode's lease lapsed for good), the write stops and
    is redone for the rooms still live (their bytes again: the same bytes to
    the same place). Each redo drops at least one room, so there are at most
    ``len(writes)`` of them.
    """
    for attempt in range(len(writes) + 1):
        if attempt:  # the first write's check before its first batch (below) covers every room in it
            writes = [w for w in writes if m.live(w.sender, peer, wait=True)]
        plan = TransferPlan.concat(p for w in writes if (p := part(w)) is not None)
        if not writes or not len(plan):
            return writes
        try:
            m.transport.write(peer.peer_id, plan, deadline, functools.partial(_all_live, m, peer, writes),
                              functools.partial(_announce, m, peer, tuple(sorted({w.sender.room for w in writes}))))
            return writes
        except TransferCancelled:
            continue  # a room stopped being live (live() failed it and says why): redo without it
    raise AssertionError("unreachable: every redo drops a room")  # pragma: no cover


def _announce(m: PrefillManager, peer: DecodePeer, rooms: tuple[int, ...], slot: int, pieces: TransferPlan) -> None:
    """Tell decode a window of these rooms' pieces landed in its staging ``slot`` (core/landing.py):
    sent before their ``Done``, on the same connection, so decode scatters it first."""
    m.notify(peer, P.Staged(rooms=rooms, slot=slot,
                            dst=pieces.dst_addr.astype("<i8").tobytes(), nbytes=pieces.nbytes.astype("<i8").tobytes()))


def _all_live(m: PrefillManager, peer: DecodePeer, writes: list[_ChunkWrite]) -> bool:
    """Whether every room of a grouped write may start another batch (waits out a short lease lapse)."""
    return all(m.live(w.sender, peer, wait=True) for w in writes)
