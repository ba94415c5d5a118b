"""A sender's writes, on its decode peer's worker thread: one room's chunk, the layers of a
layer-wise chunk as they become final, and chunks of many rooms queued for one peer in one write.

What they need of the room is :class:`WritingRoom` (a :class:`~.sender.Sender`), and of the
manager :class:`~.peers.PrefillSide`: this module imports neither ``sender`` nor ``prefill``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..control import protocol as P
from ..control.metrics import metrics
from ..planning.indices import PlanError
from ..planning.layers import LayeredPlan
from ..planning.pairing import Totals
from ..planning.stage_index import RegionPieces
from ..planning.transferplan import TransferPlan
from ..transfer.backend import TransferCancelled, TransferTimeout
from .checksum import ChecksumError, choose, summarise
from .peers import DecodePeer, DecodeRequest, PrefillSide
from .room import Poll
from .row import read_row

__all__ = ["ChunkWrite", "Job", "WritingRoom", "after_layers", "write_chunks", "write_layers"]



@dataclass
class Job:
    """One chunk's writes to one decode peer."""

    peer: DecodePeer
    plan: TransferPlan
    meta_plan: TransferPlan | None
    totals: Totals
    layered: LayeredPlan | None = None  # ``plan`` grouped by layer, once a write takes only some (split)
    seconds: float = 0.0  # time spent writing so far (metrics)
    # Announced layer groups not yet taken by the worker: (groups, ready) per layer_ready(), in order.
    announced: list[tuple[list[int], Any]] = field(default_factory=list)
    queued: bool = False  # a write_layers call is queued or running on the peer's worker
    complete: bool = False  # every layer of the chunk was announced: the write that takes the last ends the chunk
    # Submissions of the room's later chunks to this peer, held until this chunk is written (after_layers).
    held: list[Callable[[], None]] = field(default_factory=list)
    _arrived: threading.Event | None = field(default=None, repr=False)

    @property
    def arrived(self) -> threading.Event:
        """Set by layer_ready() for the chunk's last layer: ends a lingering worker's wait (linger). Made
        when first used (under the manager's lock): a chunk sent whole never waits for layers (#27)."""
        if self._arrived is None:
            self._arrived = threading.Event()
        return self._arrived


class WritingRoom(Protocol):
    """What the writes use of a :class:`~.sender.Sender`."""

    room: int
    manager: PrefillSide

    def poll(self) -> Poll: ...
    def request(self, peer_id: str) -> DecodeRequest | None: ...
    def layer_names(self, groups: Sequence[int]) -> str: ...
    def write_started(self, peer_id: str, at: float) -> None: ...
    def write_ended(self, peer_id: str) -> None: ...
    def take_written(self, peer_id: str) -> list[TransferPlan | None] | None: ...
    def peer_landed(self) -> bool: ...


def write(s: WritingRoom, job: Job, plans: Sequence[TransferPlan | None], what: str) -> bool:
    """Write ``plans`` in order into the job's peer; False if the room failed (now or before).

    The room's liveness is checked before every batch (``PrefillManager.live``):
    once it failed, or decode's lease ran out, no further batch starts, and
    ``Fenced`` goes out when this write returns.
    """
    m = s.manager
    peer = job.peer
    if not m.begin_write(s, peer):
        return False
    start = time.monotonic()
    deadline = start + m.config.transfer_timeout
    s.write_started(peer.peer_id, start)
    try:
        for p in plans:
            if p is not None and len(p):
                # No announce: a chunk's layers before its last write are not staged on both sides; the write
                # that ends the chunk (write_chunks) may be (docs/architecture.md, "Staging").
                m.transport.write(peer.peer_id, p, deadline, lambda: m.live(s, peer, wait=True))
    except TransferCancelled:
        return False  # the room failed (live() says why); end_write fences it
    except Exception as exc:
        kind = "timeout" if isinstance(exc, TransferTimeout) else "transfer_error"
        m.fail_sender(s, f"transfer of {what} to {peer.peer_id!r} failed: {exc}", kind)
        return False
    finally:
        s.write_ended(peer.peer_id)
        job.seconds += time.monotonic() - start
        m.end_write(s, peer)
    return True


def write_layers(s: WritingRoom, job: Job, chunk: int, last: bool) -> None:
    """Write the layers announced for this peer whose source is final; the chunk's last ones end it.

    Layers go as soon as their source is final: the first one announced is
    waited for (``ready.synchronize()``), then every one after it that is
    ready too (``ready.query()``, or announced without ``ready``) goes in the
    same write; a layer still computing is left for the next call, queued
    behind this one, so it holds back neither the layers before it nor
    other rooms' writes. Layers that piled up while the worker was busy go
    together. When layers come faster than a write's fixed cost and what is
    held would be a write mostly of that cost (:func:`worth_waiting`, from
    the peer's measured ``write_cost`` and ``byte_time`` and the
    announcements' pace), the worker lingers up to that cost for the next one
    and writes them together: a fast copy pays one fixed cost for many layers,
    as a per-chunk send does; compute-bound, or when a layer's bytes dominate,
    one write per layer. The write that takes the chunk's last layer also takes
    what has no layer, then (last chunk) the metadata row, then tells decode,
    all in this one call.
    """
    m = s.manager
    with m.lock:
        first = job.announced[0] if job.announced else None
        if first is None or s.poll() == Poll.FAILED:
            end_layers(job, done=job.complete or s.poll() == Poll.FAILED)
            return
    if first[1] is not None:
        try:
            first[1].synchronize()
        except Exception as exc:
            with m.lock:
                end_layers(job, done=True)  # the room fails below: what is held behind it writes nothing
            m.fail_sender(s, f"room {s.room} chunk {chunk} {s.layer_names(first[0])}: waiting for the layers' "
                                f"source (ready.synchronize()) failed: {exc}", "transfer_error")
            return
    groups, final = take_ready(s, job, [], first=True)
    if not final and worth_waiting(s, job, groups):
        groups, final = linger(s, job, groups)
    try:
        if not final:
            body = split(s, job).groups(groups)
        elif len(groups) == len(m.layer_index.keys):  # every layer came before this write could start
            body = job.plan  # the chunk as planned, as a per-chunk send writes it
        else:
            body = split(s, job).groups([*groups, m.layer_index.tail])
    except PlanError as exc:  # a descriptor outside this rank's layer regions (validated: not expected)
        with m.lock:
            end_layers(job, done=True)  # the room fails below: what is held behind it writes nothing
        m.fail_sender(s, f"room {s.room} chunk {chunk}: {exc}", "bad_request")
        return
    if final:
        write_chunks([ChunkWrite(s, job, chunk, last, body, f" ({s.layer_names(groups)})" if groups else "")])
    elif len(body):  # none: this rank sends these layers no byte (MLA)
        start = time.monotonic()
        if write(s, job, [body], f"chunk {chunk} ({s.layer_names(groups)})"):
            job.peer.note_write(body.total_bytes, time.monotonic() - start)
    with m.lock:
        if job.announced and s.poll() != Poll.FAILED:
            job.peer.worker.submit(functools.partial(write_layers, s, job, chunk, last))  # job.queued stays
        else:
            end_layers(job, done=(job.complete and not job.announced) or s.poll() == Poll.FAILED)


def after_layers(earlier: Job | None, submit: Callable[[], None]) -> bool:
    """Hold a later chunk's write to a peer (``submit``) while ``earlier`` (the room's previous layer-wise
    chunk to that peer) still has a :func:`write_layers` call queued: it is submitted once that chunk is
    written. True if held; False: nothing was held, the caller submits. Under the manager's lock.

    A write_layers call that leaves a layer still computing queues the next call behind the peer's other
    jobs, so other rooms' writes are not held back. The room's own later chunk must not run first: the last
    chunk's ``Done`` would reach decode (SUCCESS there) before the earlier chunk's remaining layers landed,
    and decode drops a staged window of a room it no longer holds (issue #29).
    """
    if earlier is not None and earlier.queued:
        earlier.held.append(submit)
        return True
    return False


def end_layers(job: Job, done: bool) -> None:
    """Under the manager's lock: no :func:`write_layers` call of ``job`` is queued any more. ``done``: its
    chunk is written (every layer was taken and the last write returned) or the room failed; then the later
    chunks held behind it (:func:`after_layers`) are submitted, in order."""
    job.queued = False
    if done:
        held, job.held = job.held, []
        for submit in held:
            submit()


def take_ready(s: WritingRoom, job: Job, groups: list[int], first: bool = False) -> tuple[list[int], bool]:
    """Move the announced layers whose source is final (``first``: the first one regardless: it was
    waited for) from ``job.announced`` to ``groups``; also whether the chunk's last layer was taken."""
    with s.manager.lock:
        n = 1 if first else 0
        while n < len(job.announced) and is_ready(job.announced[n][1]):
            n += 1
        for gs, _ in job.announced[:n]:
            groups.extend(gs)
        del job.announced[:n]
        job.arrived.clear()  # under the lock: an announcement after this sets it again
        return groups, job.complete and not job.announced


def split(s: WritingRoom, job: Job) -> LayeredPlan:
    """The job's plan grouped by layer, split when a write first takes only some of its layers: a
    chunk whose layers all come before its first write goes whole, unsplit, as a per-chunk send."""
    if job.layered is None:
        job.layered = s.manager.layer_index.split(job.plan)
    return job.layered


def worth_waiting(s: WritingRoom, job: Job, groups: list[int]) -> bool:
    """Whether to wait for the next layer rather than write ``groups`` now: the peer's writes are
    measured, layers come faster than a write costs, and ``groups``' bytes take less than that cost
    (a write of them is mostly its fixed cost; past that, writing now overlaps more). Their bytes
    are the chunk's share per layer: nothing is split for the estimate."""
    peer, gap = job.peer, s.manager.layer_gap
    cost, per_byte = peer.write_cost, peer.byte_time
    if cost is None or gap is None or gap >= cost:
        return False
    share = job.plan.total_bytes * len(groups) / max(1, len(s.manager.layer_index.keys))
    # No larger write measured yet (per_byte None): every write so far was small, its bytes cheap.
    return share * (per_byte or 0.0) < cost


def linger(s: WritingRoom, job: Job, groups: list[int]) -> tuple[list[int], bool]:
    """Wait up to the peer's write cost, take the layers announced meanwhile, again while that is
    worth it (:func:`worth_waiting`) and until the chunk's last layer is taken; bounded in count
    (each round takes a layer or waits) and in time.

    Only the chunk's last layer ends a wait early: woken by every announcement, this thread took
    the GIL from the host's thread between its layers, and on the H200 a host announcing 16
    layers without compute took ~120 us per layer, traced (layer-wise TTFT 3.2 ms against
    1.6 ms per chunk, in 4 writes; woken by the last only: 2.1 ms, 1 write)."""
    cost = job.peer.write_cost or 0.0
    until = time.monotonic() + cost
    for _ in range(4 * (len(s.manager.layer_index.keys) + 1)):
        now = time.monotonic()
        if now >= until:
            break
        if job.announced:  # the next one is announced but still computing (its ready.query() is false)
            time.sleep(min(cost / 4, until - now))
        else:
            job.arrived.wait(until - now)
        before = len(groups)
        groups, final = take_ready(s, job, groups)
        if final or s.poll() == Poll.FAILED:
            return groups, final
        if len(groups) > before:
            if not worth_waiting(s, job, groups):
                break
            until = time.monotonic() + cost
    return groups, False


def is_ready(ready: Any) -> bool:
    """Whether a layer's source is final without waiting: no ``ready`` handle, or its ``query()`` says so."""
    if ready is None:
        return True
    query = getattr(ready, "query", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:  # its synchronize() will raise it, as the first layer of a later write
        return False


@dataclass
class ChunkWrite:
    """One room's chunk for one peer: ``body`` (the chunk, or what a layer-wise chunk had without a layer)."""

    sender: WritingRoom
    job: Job
    chunk: int
    last: bool
    body: TransferPlan
    what: str = ""  # in errors after "chunk N": which layers the body holds, if sent layer-wise


def write_chunks(writes: list[ChunkWrite]) -> None:
    """Chunks queued back to back for one peer (on its worker): every chunk's bytes in one write, then
    every metadata row (inside each room's ``Done`` when the peer takes rows that way,
    :mod:`kvbridge.core.sessions.row`; else in a second write), so each row still lands after its pages,
    then decode is told (from this thread, or with one hand-off to the I/O thread: ``IOLoop.send``).

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
        w.sender.write_started(peer.peer_id, start)
    try:
        live = write_live(m, peer, live, lambda w: w.body, deadline)
        rows = time.monotonic()
        # Measured for layer-wise sending's coalescing: what a write costs (a small one), what a byte adds.
        body = sum(w.body.total_bytes for w in live)
        if body:
            peer.note_write(body, rows - start)
        # Rows as a second write, after the pages: unless each travels in its Done (below), or there is none.
        if not peer.inline_row and any(w.job.meta_plan is not None for w in live):
            live = write_live(m, peer, live, lambda w: w.job.meta_plan, deadline)
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
            w.sender.write_ended(peer.peer_id)
            w.job.seconds += seconds
            m.end_write(w.sender, peer)  # a room that failed meanwhile is fenced here
    if not live:
        return
    summaries: dict[int, Any] = {}  # checksummed rooms' last chunk: the digest of what was written
    for w in list(live):
        written = w.sender.take_written(peer.peer_id) if w.last else None
        if written is not None:
            try:
                local = m.kvargs.regions
                summaries[id(w)] = summarise(written, choose(local, peer.route.dst.regions), m.config.max_message_bytes,
                                             local)
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
        for w in live:  # counted before this rank's SUCCESS is visible: a snapshot of its final rooms is whole
            if w.job.totals:  # something was written
                metrics().transfer(m.backend_name, w.job.totals, w.job.seconds)
        # This rank's rooms end before their Done leaves (their end is stamped there, not after a send that may
        # hand the GIL to a busy host thread: a Done sent first moved the demo's transfer latency, measured at
        # prefill's SUCCESS, from 1.0 to 1.2-1.9 ms on this VM and 1.2-1.4 to 1.4-1.7 ms on an H200); their
        # hosts are woken once Done is on its way.
        finished = False
        for w in live:
            if w.last and w.sender.peer_landed():
                finished = m.finish(w.sender, Poll.SUCCESS, wake=False) or finished
        # The last chunk's Done says it landed too: no ChunkDone before it (one message, one
        # wake-up of decode's host fewer per request).
        m.notify(peer, *[P.Done(room=w.sender.room, checksum=summaries.get(id(w)), row=rows_in_done.get(id(w)))
                         if w.last else P.ChunkDone(room=w.sender.room, chunk=w.chunk, last=False) for w in live],
                 wake=finished)


def write_live(
    m: PrefillSide, peer: DecodePeer, writes: list[ChunkWrite],
    part: Callable[[ChunkWrite], TransferPlan | None], deadline: float,
) -> list[ChunkWrite]:
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
            rooms = {w.sender.room for w in writes}
            live = (functools.partial(m.live, writes[0].sender, peer, wait=True) if len(writes) == 1  # no generator
                    else functools.partial(all_live, m, peer, writes))
            # Staged on both sides only for one room: decode drops a window with any room it gave up in it, so a
            # window shared by rooms would fail the others with one given up (docs/architecture.md, "Staging").
            m.transport.write(peer.peer_id, plan, deadline, live,
                              functools.partial(announce, m, peer, tuple(rooms)) if len(rooms) == 1 else None)
            return writes
        except TransferCancelled:
            continue  # a room stopped being live (live() failed it and says why): redo without it
    raise AssertionError("unreachable: every redo drops a room")  # pragma: no cover


def announce(m: PrefillSide, peer: DecodePeer, rooms: tuple[int, ...], slot: int, pieces: list[RegionPieces]) -> None:
    """Tell decode a window of these rooms' pieces landed in its staging ``slot`` (core/transfer/landing.py), and where
    they go: sent before their ``Done``, on the same connection, so decode scatters it first."""
    m.notify(peer, P.Staged(rooms=rooms, slot=slot, pieces=tuple(
        P.StagedRegion(region=p.region, unit=p.unit, offsets=p.offsets.tobytes(),
                       counts=b"" if p.counts is None else p.counts.tobytes()) for p in pieces)))


def all_live(m: PrefillSide, peer: DecodePeer, writes: list[ChunkWrite]) -> bool:
    """Whether every room of a grouped write may start another batch (waits out a short lease lapse)."""
    return all(m.live(w.sender, peer, wait=True) for w in writes)
