"""Core's half of the backend contract: one policy around every backend.

A :class:`Transport` holds an ordered list of lanes (:mod:`kvbridge.core.transfer.lanes`:
which backend moves which pair of regions to a peer) and does, from each
backend's declared :class:`~kvbridge.core.description.records.BackendCapabilities`, what no
adapter repeats: memory kinds checked at registration and at handshake, a
write's descriptors located once (where a peer's regions need it) and grouped
by lane and memory kind, plans cut and split into batches within the declared
limits, the deadline and the room's liveness checked before every batch, and
the connections of a peer whose write failed reset (``Backend.abort_peer``).

:func:`open_transport` is the one place core creates backends: from a name or a
comma-separated list of names (:func:`~kvbridge.core.transfer.lanes.lane_names`), a
:class:`BackendSpec`, a ready :class:`Backend` instance, or ``None`` for the
default lanes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from . import relay, staging
from .landing import Landing
from .lanes import FENCE_BATCH_BYTES, FENCE_BATCH_DESCRIPTORS, Lane, Route, backend_name, lane_names, make_route, route_peer
from .backend import _checkpoint, _live, Backend, BackendConfig, TransferCancelled, TransferError, TransferTimeout, host_id
from ..description.layout import Region, StagingOffer
from ..planning.regions import RegionTable
from ..planning.transferplan import Memory, TransferPlan
from ..description.plugins import PluginError, get_registry, import_object
from ..description.records import BackendCapabilities, BackendSpec, assign_options
from .pipeline import Pipeline, Wait

__all__ = ["FENCE_BATCH_BYTES", "FENCE_BATCH_DESCRIPTORS", "BackendChoice", "Lane", "Transport", "lane_names",
           "open_transport"]

log = logging.getLogger(__name__)

#: What a manager accepts as its backend: a name, names separated by commas (lanes, in order), a
#: spec, a ready backend, or None for the default lanes.
BackendChoice = Union[str, BackendSpec, Backend, None]

#: A write still inside its backend this long after its deadline has its peer's TCP connections
#: reset (:meth:`Transport.reset_overdue`): an engine blocked past the deadline (Mooncake waits for
#: its own timeout) must not close them itself, which would leave what they queued to land later.
RESET_GRACE = 0.25


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


class Transport:
    """Lanes of backends plus the policy core applies to every backend alike."""

    def __init__(self, lanes: Sequence[Lane]) -> None:
        if not lanes:
            raise ValueError("a transport needs at least one backend")
        names = [lane.name for lane in lanes]
        if len(set(names)) != len(names):
            raise ValueError(f"a backend is named more than once in the lanes {names}")
        self.lanes = list(lanes)
        #: The lanes as a host names them: "nixl", or "cuda_ipc,nixl".
        self.name = ",".join(names)
        self.host = host_id()
        self._regions: list[Region] = []
        self._local = RegionTable(())
        self._peers: dict[str, _Peer] = {}
        #: ``SessionConfig.staging``: auto, on or off (``core/transfer/relay.py``); set before :meth:`register`.
        self.staging_mode = "auto"
        #: Decode's staging slots, scattered into place (``core/transfer/landing.py``); None on prefill.
        self.landing: Landing | None = None
        #: Windows written per staging choice (``relay.choose``), for ``describe()`` and the benchmarks.
        self.windows = {"direct": 0, "gather": 0, "both": 0}
        #: Called with each window's choice (the manager counts it in its metrics; the transport knows none).
        self.on_window: Callable[[str], None] = lambda how: None
        #: One lane: the route of a peer it was not told of (the backend refuses a peer it does not know).
        self._single = Route(0, RegionTable(()), np.zeros((0, 0), np.int64)) if len(self.lanes) == 1 else None

    @classmethod
    def of(cls, backend: Backend, name: str, capabilities: BackendCapabilities | None = None) -> Transport:
        """A transport of one lane: ``backend`` under ``name`` (its class's capabilities by default)."""
        return cls([Lane(name, backend, capabilities or type(backend).capabilities)])

    @property
    def backend(self) -> Backend:
        """The last lane's backend: the one that reaches farthest (for ``describe()`` and tests)."""
        return self.lanes[-1].backend

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.lanes[-1].capabilities

    # -- memory -----------------------------------------------------------------------------
    def check_memory(self, regions: Sequence[Region], whose: str) -> None:
        """Raise :class:`TransferError` naming the first region of a memory kind no lane moves."""
        kinds = {k for lane in self.lanes for k in lane.capabilities.memory_kinds}
        for r in regions:
            if r.mem not in kinds:
                raise TransferError(
                    f"{whose} region {r.name!r} is {r.mem} memory, but backend {self.name!r} moves "
                    f"{' and '.join(sorted(kinds))} only (its BackendCapabilities.memory_kinds); "
                    "use a backend that declares it (`kvbridge plugins` lists what each moves)"
                )

    def register(self, regions: Sequence[Region], *, sends: bool = True) -> None:
        """Register with each lane the regions of the kinds it moves. Unless ``staging_mode`` is off, the
        first lane moving host memory also registers a staging buffer (unless that backend opts out):
        gathered windows on a rank that ``sends`` (``core/transfer/staging.py``), landing slots on the other
        (``core/transfer/landing.py``)."""
        self.check_memory(regions, "local")
        staged = self.staging_mode == "off"
        for lane in self.lanes:
            caps = lane.capabilities
            mine = list(lane.backend.select([r for r in regions if r.mem in caps.memory_kinds]))
            stage = None
            extra: list[Region] = []
            if not staged and "dram" in caps.memory_kinds and caps.host_staging:
                if sends:
                    stage = staging.Staging(mine)
                    extra.append(stage.region)
                else:
                    self.landing = Landing(mine)
                    extra.append(self.landing.region)
            staged = staged or "dram" in caps.memory_kinds
            lane.backend.register([*mine, *extra])
            lane.regions, lane.staging = mine, stage
        self._regions = list(regions)
        self._local = RegionTable(regions)

    def metadata(self) -> dict[str, bytes]:
        """Each lane's connection metadata, by backend name (sent to peers in the handshake)."""
        return {lane.name: lane.backend.metadata() for lane in self.lanes}

    def add_peer(
        self, peer: str, metadata: Mapping[str, bytes] | bytes, regions: Sequence[Region], host: str | None = None,
        staging_offer: StagingOffer | None = None,
    ) -> None:
        """Prepare writes to ``peer``: every lane it runs too and can reach (``host``: its
        :func:`~kvbridge.core.transfer.backend.host_id`; None: this host) adds it; each pair of regions goes to
        the first lane holding both. Raises :class:`TransferError` if some pair has none, naming what
        each lane said. ``metadata``: the peer's :meth:`metadata` (plain bytes: the one lane's, for a
        transport of one). ``staging_offer``: the peer's staging slots lent to this rank (its
        ``Hello``), written like its regions and used where ``staging_mode`` allows."""
        if isinstance(metadata, (bytes, bytearray)):
            if len(self.lanes) != 1:
                raise TypeError(f"peer {peer!r}: metadata for the lanes {self.name!r} must be a dict by backend name")
            metadata = {self.lanes[0].name: bytes(metadata)}
        host = self.host if host is None else host
        self.check_memory(regions, f"peer {peer!r}")
        self.remove_peer(peer)
        state = self._state(peer)
        state.same_host = host == self.host
        state.slots = None
        if staging_offer is not None and any(lane.staging for lane in self.lanes):  # used where staging_mode allows
            regions = [*regions, staging_offer.region]
            state.slots = relay.RemoteSlots(staging_offer)
        if len(self.lanes) == 1:  # nothing to share out: the backend takes the peer or refuses it
            self.lanes[0].backend.add_peer(peer, metadata.get(self.lanes[0].name, b""), regions)
            self._state(peer).route = make_route(np.zeros((len(self._regions), len(regions)), np.int64), self._local,
                                                 regions)
            return
        route = self._state(peer).route = route_peer(self.lanes, self._regions, peer, metadata, regions, host == self.host)
        log.info("%s: peer %r goes through %s", self.name, peer, ", ".join(self.lanes[i].name for i in route.used))

    def lanes_of(self, peer: str) -> list[str]:
        """The lanes that move something to ``peer`` (empty for an unknown peer)."""
        route = self._route_of(peer, None)
        return [] if route is None else [self.lanes[i].name for i in route.used]

    def _state(self, peer: str) -> _Peer:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer()
        return state

    def _route_of(self, peer: str, default: Route | None) -> Route | None:
        state = self._peers.get(peer)
        return state.route if state is not None and state.route is not None else default

    def remove_peer(self, peer: str) -> None:
        state = self._peers.get(peer)
        route = None if state is None else state.route
        if state is not None:
            state.route = None  # the rest stays (_Peer says why)
        for lane in self.lanes if route is None else [self.lanes[i] for i in route.used]:
            lane.backend.remove_peer(peer)

    def reset(self, peer: str, why: str, stuck: bool = False) -> None:
        """Have every lane drop what its engine still holds for ``peer`` (``Backend.abort_peer``: TCP
        engines reset their connections to it if its host no longer answers), so that nothing of a
        write that failed or timed out lands later. ``stuck``: a write is still inside the engine past
        its deadline; connections are reset whether it answers or not, which ends the engine's wait.
        The engine reconnects for the next write (:meth:`_post` retries it where the engine fails one
        first)."""
        route = self._route_of(peer, self._single)
        lanes = self.lanes if route is None else [self.lanes[i] for i in route.used]
        n = sum(lane.backend.abort_peer(peer, stuck) for lane in lanes)
        if n:
            self._state(peer).resets += n
            log.warning("%s: reset %d connection(s) to peer %r (%s) so nothing queued in them lands later",
                        self.name, n, peer, why)

    def fence_delay(self, peer: str) -> float:
        """Seconds until the engine certainly has no work left of a write to ``peer`` that failed
        (``Backend.drain_after_failure`` after it raised; 0 for most engines): ``Fenced`` waits that long."""
        state = self._peers.get(peer)
        return 0.0 if state is None else max(0.0, state.drain_until - time.monotonic())

    def reset_overdue(self, now: float) -> None:
        """Reset the connections of peers whose write is still inside the backend ``RESET_GRACE``
        past its deadline (the I/O thread calls this on its tick); once per write."""
        for peer, state in list(self._peers.items()):
            if now > state.overdue:
                state.overdue = math.inf
                self.reset(peer, "a write ran past its deadline", stuck=True)

    def close(self) -> None:
        for lane in self.lanes:
            lane.backend.close()

    # -- writes -----------------------------------------------------------------------------
    def batches(self, plan: TransferPlan) -> list[TransferPlan]:
        """``plan`` as the last lane receives it (views): cut and split within its declared limits."""
        return self.lanes[-1].batches(plan)

    def unstaged(self, peer: str, slot: int) -> bool:
        """Decode scattered (or dropped) the window in its staging ``slot``: it may be written again."""
        state = self._peers.get(peer)
        return state is not None and state.slots is not None and state.slots.give_back(slot)

    def write(self, peer: str, plan: TransferPlan, deadline: float, live: Callable[[], bool] | None = None,
              announce: Callable[[int, TransferPlan], None] | None = None) -> None:
        """Write a validated ``plan`` into ``peer``, each part through its lane, batch by batch; the
        deadline and ``live()`` are checked before each batch.

        ``announce(slot, pieces)``: tells the peer a window landed in its staging ``slot``, to be
        scattered to ``pieces`` (destination addresses and sizes); staging on both sides is used only
        when given (the caller names the rooms: ``P.Staged``).

        Raises :class:`TransferTimeout` once the deadline has passed and
        :class:`TransferCancelled` once ``live()`` is false (no further batch
        is started either way: this is what fences a failed room), and passes
        on the backend's :class:`TransferError`, saying how much had landed before.
        """
        route = self._route_of(peer, self._single)
        if route is None:
            raise TransferError(f"{self.name}: write to unknown peer {peer!r} (no handshake, or removed)")
        token = _live.set(live)  # the backend re-checks right before it posts (backend.may_post)
        check = _checkpoint.set(lambda where: self._check(peer, deadline, live, where))
        try:
            if route.whole is not None and (route.memory is not None or not route.table.places):
                self._write_lane(self.lanes[route.whole], peer, plan, deadline, live, route.memory, announce)
                return
            # Located once: each part goes to its lane, one memory kind and device a side per part.
            src = self._local.locate(plan.src_addr, plan.nbytes)[0]
            dst = route.table.locate(plan.dst_addr, plan.nbytes)[0]
            src_place, dst_place = self._local.place[src], route.table.place[dst]
            n_src, n_dst = len(self._local.places), len(route.table.places)
            key = (route.lanes[src, dst] * n_src + src_place) * n_dst + dst_place
            for k in np.unique(key).tolist():  # in lane order
                pick = key == k
                part = plan if pick.all() else TransferPlan(plan.src_addr[pick], plan.dst_addr[pick], plan.nbytes[pick])
                lane, rest = divmod(k, n_src * n_dst)
                memory = Memory(*self._local.places[rest // n_dst], *route.table.places[rest % n_dst])
                self._write_lane(self.lanes[lane], peer, part, deadline, live, memory, announce)
        finally:
            _checkpoint.reset(check)
            _live.reset(token)

    def _write_lane(self, lane: Lane, peer: str, plan: TransferPlan, deadline: float, live: Callable[[], bool] | None,
                    memory: Memory | None, announce: Callable[[int, TransferPlan], None] | None = None) -> None:
        """``plan`` through ``lane``, batch by batch, each batch told where its descriptors are (``memory``);
        up to ``lane.in_flight`` batches posted at once (``core/transfer/pipeline.py``), the fence checked before each."""
        pipe = Pipeline(lane.in_flight, lane.capabilities.max_descriptors_in_flight)
        state = self._state(peer)
        posted = 0

        def guarded(step: Callable[[], None]) -> None:
            """``step`` (a post or a wait); a failure resets the peer's connections and is raised naming
            what had landed, once every batch still in flight was waited for."""
            try:
                step()
            except TransferError as exc:
                pipe.abandon(deadline)
                state.overdue = math.inf
                if not isinstance(exc, TransferCancelled):  # cancelled: the backend posted nothing more
                    state.drain_until = time.monotonic() + lane.backend.drain_after_failure
                    self.reset(peer, f"a write failed: {type(exc).__name__}")
                if posted == 0:
                    raise
                raise type(exc)(f"{exc} (after {posted} batch(es) posted; {pipe.landed} B had landed)") from exc

        def post(batch: TransferPlan, of: str = "") -> None:
            nonlocal posted

            def step() -> None:
                pipe.make_room(deadline, len(batch))
                self._check(peer, deadline, live, f"after {posted}{of} batches ({pipe.landed} of {plan.total_bytes} B landed)")
                state.overdue = deadline + RESET_GRACE
                retry = lambda: self._check(peer, deadline, live, "before a retry")  # noqa: E731
                if pipe.limit == 1 or state.resets:  # one at a time; after a reset, with _post's retries
                    self._post(lane, peer, batch, deadline, retry)
                    pipe.landed_now(batch.total_bytes)
                else:
                    pipe.add(self._post_async(lane, peer, batch, deadline), batch.total_bytes, len(batch))
                if not pipe.pending:
                    state.overdue = math.inf

            batch.memory = memory
            guarded(step)
            posted += 1

        def settle() -> None:
            guarded(lambda: pipe.drain(deadline))
            state.overdue = math.inf

        host = memory is not None and memory.src_kind == memory.dst_kind == "dram"
        slots = state.slots if host and announce is not None else None
        for window in self._windows(lane, plan, state, slots is not None):
            how = relay.choose(window, self.staging_mode, state.same_host, slots is not None) if lane.staging else "direct"
            staged = slot = None
            if how == "both":
                assert slots is not None and lane.staging is not None
                slot = slots.take(lambda where: self._check(peer, deadline, live, where))
                staged = lane.staging.stage_to(window, slots.address(slot), lane.batch_bytes)
                if staged is None:
                    slots.give_back(slot)
                    slot = None
            elif how == "gather":
                staged = lane.staging.stage(window, lane.batch_bytes)  # type: ignore[union-attr]
            how = how if staged is not None else "direct"
            self.windows[how] += 1
            self.on_window(how)
            if slot is None and slots is not None:  # written into place: after every window staged before it
                slots.settle(lambda where: self._check(peer, deadline, live, where))  # not under its later scatter
            if staged is None:
                batches = lane.batches(window)
                of = f" of {len(batches)}" if window is plan else ""  # the whole plan: its count is known
                for batch in batches:
                    post(batch, of)
                continue
            local = memory
            if memory is not None:  # staged batches come from the staging buffer
                memory = memory._replace(src_kind="dram", src_device=lane.staging.region.device)  # type: ignore[union-attr]
            try:
                for batch in staged.batches(lane.batch_descriptors):
                    post(batch)
                settle()  # the slice is reused once the engine reads it no more
            except BaseException:
                if slot is not None:
                    slots.retire()  # type: ignore[union-attr]  # the engine may still land bytes in it
                raise
            finally:
                memory = local
                staged.release()  # landed, or failed and waited for: the engine reads the slice no more
            if slot is not None:  # landed in the peer's slot (a failed write keeps it: bytes may still land there)
                assert slots is not None and announce is not None
                try:
                    announce(slot, relay.runs(window))
                except BaseException:
                    slots.give_back(slot)
                    raise
        settle()
        if slots is not None:  # returns once decode scattered every window: in place, as a direct write is
            slots.settle(lambda where: self._check(peer, deadline, live, where))
        lane.peak_in_flight = max(lane.peak_in_flight, pipe.peak)

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

    def _windows(self, lane: Lane, plan: TransferPlan, state: _Peer, remote: bool) -> Iterator[TransferPlan]:
        """The plan in windows that staging may gather (one slice each), or whole when it cannot help."""
        limit = relay.MAX_PIECE if state.same_host else relay.MAX_PIECE_REMOTE
        if (lane.staging is None or self.staging_mode == "off" or len(plan) < 2
                or (self.staging_mode == "auto" and plan.total_bytes > len(plan) * limit)):
            yield plan  # pieces too large on average to be worth copying: written as planned
            return
        most = relay.REMOTE_WINDOW_DESCRIPTORS if remote else staging.WINDOW_DESCRIPTORS
        size = min(lane.staging.slice_bytes, lane.batch_bytes)
        if remote and state.slots is not None:
            size = min(size, state.slots.offer.slice_bytes)
        yield from plan.batches(most, size)

    def _check(self, peer: str, deadline: float, live: Callable[[], bool] | None, where: str) -> None:
        """The one check before every batch: the deadline, then whether the room is still live."""
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{self.name}: write to peer {peer!r} passed its deadline {where}")
        if live is not None and not live():
            raise TransferCancelled(f"{self.name}: write to peer {peer!r} stopped {where}: the room is no longer live")

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name,
                               "lanes": {p: self.lanes_of(p) for p in sorted(self._peers) if self._peers[p].route}}
        for lane in self.lanes:
            if lane.staging is not None:
                out["staging"] = {**lane.staging.stats(), "mode": self.staging_mode, "windows_by_choice": dict(self.windows)}
            out.setdefault("batches_in_flight", {})[lane.name] = {"limit": lane.in_flight, "peak": lane.peak_in_flight}
            out.update(lane.backend.describe())
        if self.landing is not None:
            out["landing"] = {**self.landing.stats(), "mode": self.staging_mode}
        return out


def open_transport(
    backend: BackendChoice,
    *,
    host: str,
    name: str,
    transfer_timeout: float,
    options: Mapping[str, str],
    fast_path: bool = True,
) -> Transport:
    """Create (or wrap) the backends a manager was given; options are checked before any engine exists.

    ``backend`` is a registered name or names separated by commas (the lanes, in order), a
    :class:`BackendSpec` (its factory is imported; it need not be registered), a :class:`Backend`
    instance (used as it is: ``options`` must then be empty) or ``None`` (the default lanes:
    :meth:`~kvbridge.core.description.plugins.Registry.default_lanes`). Each option goes to the lane that
    declares it. ``fast_path=False`` drops lanes that only reach this host (``cross_host=False``)
    from the default lanes (``SessionConfig.gpu_fast_path``).
    """
    if isinstance(backend, Backend):
        if options:
            raise ValueError(
                f"backend options {sorted(options)} were given with a ready {type(backend).__name__} instance; "
                "pass them to the backend's own BackendConfig instead"
            )
        return Transport.of(backend, backend_name(backend))
    registry = get_registry()
    if isinstance(backend, BackendSpec):
        specs = [backend]
    elif isinstance(backend, str) or backend is None:
        specs = registry.lanes(",".join(lane_names(backend, fast_path)))
    else:
        raise TypeError(f"backend must be a name, a BackendSpec or a Backend instance, got {type(backend).__name__}")
    parsed = [spec.parse_options(mine) for spec, mine in zip(specs, assign_options(specs, options))]
    lanes: list[Lane] = []
    try:
        for spec, opts in zip(specs, parsed):
            factory = (import_object(spec.factory, f"backend {spec.name!r}") if isinstance(backend, BackendSpec)
                       else registry.load_backend(spec.name))
            instance = factory(BackendConfig(host=host, name=name, transfer_timeout=transfer_timeout, options=opts))
            if not isinstance(instance, Backend):
                raise PluginError(
                    f"backend {spec.name!r}: factory {spec.factory!r} made a {type(instance).__name__}, not a Backend")
            lanes.append(Lane(spec.name, instance, spec.capabilities))
    except BaseException:
        for lane in lanes:
            lane.backend.close()
        raise
    return Transport(lanes)
