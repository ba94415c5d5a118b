"""A transport's writes through one lane: staging windows and pipelined posting (a part of :class:`Transport`).

:class:`LaneWrites` holds what :meth:`Transport.write <kvbridge.core.transfer.transport.Transport.write>`
does with each lane's part of a plan: the plan cut into windows that staging may gather
(``core/transfer/staging.py``, ``core/transfer/relay.py``), batches posted up to the lane's
``in_flight`` at once (``core/transfer/pipeline.py``), the retries after a reset, and the one
check before every batch. :class:`_Peer` is what the transport keeps of each peer.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import relay, staging
from .backend import TransferCancelled, TransferError, TransferTimeout
from .lanes import Lane, Route
from .pipeline import Pipeline, Wait
from ..planning.stage_index import RegionPieces
from ..planning.transferplan import Memory, TransferPlan

__all__ = ["RESET_GRACE", "STAGED_IN_FLIGHT", "LaneWrites"]

log = logging.getLogger(__name__)

#: A write still inside its backend this long after its deadline has its peer's TCP connections
#: reset (:meth:`Transport.reset_overdue`): an engine blocked past the deadline (Mooncake waits for
#: its own timeout) must not close them itself, which would leave what they queued to land later.
RESET_GRACE = 0.25

#: Staged windows one write keeps in flight to a peer (gathered and posted, not landed yet): the next one is
#: gathered and posted while the last is written, and decode scatters one while the next lands. Each holds a
#: prefill slice and, staged on both sides, a decode slot: at most 2 of each per peer written to (decode lends
#: 2, ``landing.SLOTS_PER_PEER``).
STAGED_IN_FLIGHT = 2


@dataclass
class _Peer:
    """What the transport keeps of one peer. It outlives :meth:`Transport.remove_peer`: the engine still
    pools the connections reset to that endpoint and may still drain a failed write into it. A peer
    dropped then handshaking again (the same id: decode after a prefill resumed from a freeze) failed
    one write per reset connection when they were not retried (measured: the resumed room failed), and
    a ``Fenced`` sent at the drop must still wait out the drain."""

    #: How its writes are shared among the lanes; None once removed.
    route: Route | None = None
    #: When its write in a backend is overdue (:meth:`Transport.reset_overdue`); inf: none is.
    overdue: float = math.inf
    #: Connections :meth:`Transport.reset` reset since its last write (so many retries are allowed).
    resets: int = 0
    #: Until when an engine may still write what a failed write to it left (``drain_after_failure``).
    drain_until: float = 0.0
    #: The staging slots it lent this rank (staging on both sides: ``core/transfer/relay.py``); None: none.
    slots: relay.RemoteSlots | None = None
    #: Whether it runs on this host (``relay.choose``: engines cost more per descriptor across hosts).
    same_host: bool = True


class LaneWrites:
    """The write path of :class:`~.transport.Transport` (a part of it: it keeps the state below), kept
    here because it is one job: a lane's part of a plan, window by window and batch by batch."""

    name: str
    staging_mode: str
    windows: dict[str, int]
    on_window: Callable[[str], None]
    _state: Callable[[str], _Peer]
    reset: Callable[..., None]

    def _write_lane(self, lane: Lane, peer: str, plan: TransferPlan, deadline: float, live: Callable[[], bool] | None,
                    memory: Memory | None, announce: Callable[[int, list[RegionPieces]], None] | None = None) -> None:
        """``plan`` through ``lane``, batch by batch, each batch told where its descriptors are (``memory``);
        up to ``lane.in_flight`` batches posted at once (``core/transfer/pipeline.py``), the fence checked before each.
        Up to :data:`STAGED_IN_FLIGHT` staged windows in flight: the next window is gathered and posted while
        the last is still written, and decode scatters one while the next lands."""
        state = self._state(peer)
        if len(plan) == 1 and state.slots is None and not state.resets and plan.total_bytes <= lane.batch_bytes:
            self._write_one(lane, peer, plan, deadline, live, memory, state)
            return
        pipe = Pipeline(lane.in_flight, lane.capabilities.max_descriptors_in_flight)
        posted = 0
        #: Staged windows posted and not landed yet, oldest first: (window, the decode slot it went to, where
        #: decode scatters it: ``Staged``'s pieces).
        flying: deque[tuple[staging.Staged, int | None, list[RegionPieces] | None]] = deque()
        #: The write stopped at a check (deadline, room) and every batch in flight then landed: the decode slots
        #: of the windows in flight hold nothing the engine may still write, so they are given back, not retired.
        stopped = clean = False

        def check(where: str) -> None:
            nonlocal stopped
            try:
                self._check(peer, deadline, live, where)
            except TransferError:
                stopped = True
                raise

        def guarded(step: Callable[[], None]) -> None:
            """``step`` (a post or a wait); a failure resets the peer's connections and is raised naming
            what had landed, once every batch still in flight was waited for."""
            nonlocal clean
            try:
                step()
            except TransferError as exc:
                clean = pipe.abandon(deadline) and stopped
                self._failed(lane, peer, state, exc)
                if posted == 0:
                    raise
                raise type(exc)(f"{exc} (after {posted} batch(es) posted; {pipe.landed} B had landed)") from exc

        def post(batch: TransferPlan, where: Memory | None, of: str = "", then: Callable[[], None] | None = None) -> None:
            nonlocal posted

            def step() -> None:
                pipe.make_room(deadline, len(batch))
                check(f"after {posted}{of} batches ({pipe.landed} of {plan.total_bytes} B landed)")
                state.overdue = deadline + RESET_GRACE
                # Not check(): after a failed attempt, what it posted may still land (not a clean stop).
                retry = lambda: self._check(peer, deadline, live, "before a retry")  # noqa: E731
                if pipe.limit == 1 or state.resets:  # one at a time; after a reset, with _post's retries
                    self._post(lane, peer, batch, deadline, retry)
                    pipe.landed_now(batch.total_bytes)
                    if then is not None:
                        then()
                else:
                    pipe.add(self._post_async(lane, peer, batch, deadline), batch.total_bytes, len(batch), then)
                if not pipe.pending:
                    state.overdue = math.inf

            batch.memory = where
            guarded(step)
            posted += 1

        def settle() -> None:
            guarded(lambda: pipe.drain(deadline))
            state.overdue = math.inf

        def landed() -> None:
            """The oldest staged window landed: its slice is free, and decode is told to scatter its slot."""
            staged, slot, pieces = flying.popleft()
            staged.release()
            if slot is not None:
                assert slots is not None and announce is not None and pieces is not None
                try:
                    announce(slot, pieces)
                except BaseException:
                    slots.give_back(slot)
                    raise

        def into_place() -> None:
            """Before bytes are posted into place: every window staged to this peer before them is scattered
            (a layer-wise write rewriting a page an earlier chunk's staged window ended in must not land under
            that window's later scatter), this write's own included."""
            if earlier is not None and (any(slot is not None for _, slot, _ in flying) or not earlier.idle()):
                settle()
                earlier.settle(check)

        host = memory is not None and memory.src_kind == memory.dst_kind == "dram"
        landing = None if state.slots is None else state.slots.offer.region
        slots = (state.slots if host and landing is not None and landing.mem == "dram" and announce is not None
                 and self.staging_mode != "gather" else None)
        # GPU pages through an engine lane, to a peer that lent slots on the GPU they go to: staged on both
        # sides by the device seam (core/transfer/device.py), else written as planned.
        stager = lane.device_staging
        gpu = (stager is not None and memory is not None and landing is not None and announce is not None
               and memory.src_kind == memory.dst_kind == landing.mem == "vram"
               and memory.src_device == stager.region.device and memory.dst_device == landing.device)
        if gpu:
            slots = state.slots
        else:
            stager = lane.staging
        # Windows staged to this peer by any earlier write land at their scatter: whatever this write puts in
        # place waits for them, announced or not (into_place).
        earlier = (state.slots if landing is not None and memory is not None and memory.dst_kind == landing.mem
                   and (host or memory.dst_device == landing.device) else None)
        staged_memory = memory
        if memory is not None and stager is not None:  # staged batches come from the staging buffer
            staged_memory = memory._replace(src_kind=stager.region.mem, src_device=stager.region.device)
        # Host staging gathers host memory only: sources known to be elsewhere (GPU pages through NIXL, no GPU
        # slots) are written as planned, without a window cut or a choice made per window.
        stages = gpu or (lane.staging is not None and (memory is None or memory.src_kind == "dram"))
        try:
            for window in self._windows(lane, plan, state, slots is not None, gpu) if stages else (plan,):
                mode = "auto" if self.staging_mode == "gather" else self.staging_mode  # gather: auto without slots
                how = ("direct" if not stages else relay.choose_device(window, mode) if gpu
                       else relay.choose(window, mode, state.same_host, slots is not None))
                staged = slot = pieces = None
                if how != "direct":
                    assert stager is not None
                    # At most STAGED_IN_FLIGHT windows (slices) in flight; one more waits for the oldest to land.
                    while flying and (len(flying) >= STAGED_IN_FLIGHT or stager.free() == 0):
                        guarded(lambda: pipe.wait_oldest(deadline))
                if how == "both":
                    assert slots is not None and stager is not None
                    # A slot is free again once decode scattered it: the windows in flight keep one free to wait for.
                    while flying and sum(s is not None for _, s, _ in flying) >= slots.usable():
                        guarded(lambda: pipe.wait_oldest(deadline))
                    # No slot free: one comes back only after decode scattered a window, and a window is announced
                    # once this thread sees it land. Waiting for those in flight first tells decode as they land;
                    # left until after the next gather and post, a landed window waited there while decode idled
                    # (traced, nixl, 64 KiB pages: 3.8 ms of a 4.8 ms window period, `bench transfer --trace`).
                    while flying and slots.free() == 0:
                        guarded(lambda: pipe.wait_oldest(deadline))
                    if slots.usable() > 0:
                        # Every slot is being scattered: gather into a slice meanwhile, aimed at the slot once free.
                        early = stager.stage_to(window, 0) if slots.free() == 0 else None
                        try:
                            slot = slots.take(check)
                        except BaseException:
                            if early is not None:
                                early.release()
                            raise
                        staged = (early.aim(slots.address(slot)) if early is not None
                                  else stager.stage_to(window, slots.address(slot)))
                        # Where decode scatters it, said in its regions' units; a window that cannot be said
                        # so (RemoteSlots.pieces) is written as planned.
                        pieces = slots.pieces(staged.window) if staged is not None else None
                        if pieces is None:
                            if staged is not None:
                                staged.release()
                                staged = None
                            slots.give_back(slot)
                            slot = None
                elif how == "gather":
                    staged = lane.staging.stage(window)  # type: ignore[union-attr]
                how = how if staged is not None else "direct"
                self.windows[how] += 1
                self.on_window(how)
                if staged is None:
                    into_place()
                    batches = lane.batches(window)
                    of = f" of {len(batches)}" if window is plan else ""  # the whole plan: its count is known
                    for batch in batches:
                        post(batch, memory, of)
                    continue
                where = staged_memory
                if slot is not None and landing is not None and where is not None:
                    where = where._replace(dst_kind=landing.mem, dst_device=landing.device)
                else:
                    into_place()
                flying.append((staged, slot, pieces))
                batches = lane.batches(staged.runs)  # a window larger than the lane's batch (GPU) goes in several
                for i, batch in enumerate(batches):  # the slice is reused once the engine reads it no more
                    post(batch, where, then=landed if i == len(batches) - 1 else None)
                if staged.rest is not None:  # pieces of a region too odd to gather: as planned
                    into_place()
                    for batch in lane.batches(staged.rest):
                        post(batch, memory)
            settle()
        except BaseException:
            if pipe.pending:  # the engine reads no staged slice any more once every batch was waited for
                clean = pipe.abandon(deadline) and stopped
            while flying:
                staged, slot, _ = flying.popleft()
                staged.release()
                if slot is not None:  # a failed write keeps it (bytes may still land there) unless all landed
                    slots.give_back(slot) if clean else slots.retire()  # type: ignore[union-attr]
            raise
        if slots is not None:  # returns once decode scattered every window: in place, as a direct write is
            slots.settle(check)
        lane.peak_in_flight = max(lane.peak_in_flight, pipe.peak)

    def _write_one(self, lane: Lane, peer: str, plan: TransferPlan, deadline: float, live: Callable[[], bool] | None,
                   memory: Memory | None, state: _Peer) -> None:
        """:meth:`_write_lane` of a plan of one descriptor within the batch limits, to a peer lending no staging
        slots and no reset to retry after: one ``write`` (one batch: nothing to pipeline), the same checks,
        without the pipeline, windows and closures (a small request's fixed cost, issue #27)."""
        self.windows["direct"] += 1
        self.on_window("direct")
        plan.memory = memory
        try:
            self._check(peer, deadline, live, f"after 0 of 1 batches (0 of {plan.total_bytes} B landed)")
            state.overdue = deadline + RESET_GRACE
            self._post(lane, peer, plan, deadline, lambda: self._check(peer, deadline, live, "before a retry"))
        except TransferError as exc:  # as _write_lane's guarded(): nothing else was posted, so raised as it is
            self._failed(lane, peer, state, exc)
            raise
        state.overdue = math.inf

    def _failed(self, lane: Lane, peer: str, state: _Peer, exc: TransferError) -> None:
        """A write to ``peer`` through ``lane`` failed: no reset is due for it any more, and unless it was
        cancelled (the backend then posted nothing more) the peer's connections are reset and the engine
        given ``drain_after_failure`` to finish what it had posted."""
        state.overdue = math.inf
        if not isinstance(exc, TransferCancelled):
            state.drain_until = time.monotonic() + lane.backend.drain_after_failure
            self.reset(peer, f"a write failed: {type(exc).__name__}")

    def _post_async(self, lane: Lane, peer: str, batch: TransferPlan, deadline: float) -> Wait:
        """``backend.post``, its engine's own exceptions (and its wait's) raised as the contract's."""
        def named(exc: Exception) -> TransferError:
            return TransferError(f"{lane.name}: write to peer {peer!r} failed: {type(exc).__name__}: {exc}")

        try:
            wait = lane.backend.post(peer, batch, deadline)
        except TransferError:
            raise
        except Exception as exc:
            raise named(exc) from exc

        def checked(deadline: float) -> None:
            try:
                wait(deadline)
            except TransferError:
                raise
            except Exception as exc:
                raise named(exc) from exc
        return checked

    def _post(self, lane: Lane, peer: str, batch: TransferPlan, deadline: float, check: Callable[[], None]) -> None:
        """``backend.write``, again if it failed (not timed out) as the first write since :meth:`reset`
        reset ``n`` of the peer's connections, up to ``n`` times: an engine that pools connections
        (Mooncake) fails one call per reset connection it picks, dropping it, then reconnects. A retry
        writes the same bytes to the same places, after ``check`` (deadline and liveness) again."""
        state = self._state(peer)
        retries, state.resets = state.resets, 0
        while True:
            try:
                lane.backend.write(peer, batch, deadline)
                return
            except TransferError as exc:
                if retries == 0 or isinstance(exc, (TransferCancelled, TransferTimeout)):
                    raise
                retries -= 1
                failed = type(exc).__name__
                log.info("%s: write to peer %r failed after its connections were reset; retrying: %s", lane.name, peer, exc)
            except Exception as exc:  # an engine's own exception type: the contract's, naming the lane
                raise TransferError(f"{lane.name}: write to peer {peer!r} failed: {type(exc).__name__}: {exc}") from exc
            try:
                check()
            except TransferCancelled:
                # The attempt that failed was posted (write() takes a cancel for "nothing posted"):
                # reset as after any failed write, or what it queued may land after the room failed.
                self.reset(peer, f"a write failed: {failed}")
                raise

    def _windows(self, lane: Lane, plan: TransferPlan, state: _Peer, remote: bool,
                 gpu: bool = False) -> Iterator[TransferPlan]:
        """The plan in windows that staging may gather (one slice each), or whole when it cannot help.
        ``gpu``: windows of GPU pages for ``lane.device_staging``."""
        stager = lane.device_staging if gpu else lane.staging
        limit = (relay.MAX_PIECE_DEVICE if gpu else relay.MAX_PIECE if state.same_host else relay.MAX_PIECE_REMOTE)
        if (stager is None or self.staging_mode == "off" or len(plan) < 2
                or (self.staging_mode in ("auto", "gather") and plan.total_bytes > len(plan) * limit)):
            yield plan  # pieces too large on average to be worth copying: written as planned
            return
        most = relay.REMOTE_WINDOW_DESCRIPTORS if remote else staging.WINDOW_DESCRIPTORS
        size = stager.slice_bytes  # may be larger than a batch (GPU): its runs go in several batches, each checked
        if remote and state.slots is not None:
            size = min(size, state.slots.offer.slice_bytes)
        yield from plan.batches(most, size)

    def _check(self, peer: str, deadline: float, live: Callable[[], bool] | None, where: str) -> None:
        """The one check before every batch: the deadline, then whether the room is still live."""
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{self.name}: write to peer {peer!r} passed its deadline {where}")
        if live is not None and not live():
            raise TransferCancelled(f"{self.name}: write to peer {peer!r} stopped {where}: the room is no longer live")
