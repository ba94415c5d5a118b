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
from typing import Any, Union

import numpy as np

from . import device, relay, staging
from .device import OnDevice
from .landing import Landing, device_slots
from .lanes import FENCE_BATCH_BYTES, FENCE_BATCH_DESCRIPTORS, Lane, Route, backend_name, lane_names, make_route, route_peer
from .backend import _checkpoint, _live, Backend, BackendConfig, TransferError, host_id
from ..description.layout import Region, StagingOffer
from ..planning.regions import RegionTable
from ..planning.stage_index import RegionPieces
from ..planning.transferplan import Memory, TransferPlan
from ..description.plugins import PluginError, get_registry, import_object
from ..description.records import BackendCapabilities, BackendSpec, assign_options
from .writing import LaneWrites, _Peer

__all__ = ["FENCE_BATCH_BYTES", "FENCE_BATCH_DESCRIPTORS", "BackendChoice", "Lane", "Transport", "lane_names",
           "open_transport"]

log = logging.getLogger(__name__)

#: What a manager accepts as its backend: a name, names separated by commas (lanes, in order), a
#: spec, a ready backend, or None for the default lanes.
BackendChoice = Union[str, BackendSpec, Backend, None]


class Transport(LaneWrites):
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
        #: ``SessionConfig.staging``: gather, auto, on or off (``core/transfer/relay.py``); set before :meth:`register`.
        self.staging_mode = "gather"
        #: ``SessionConfig.gpu_staging_slice_bytes``: a GPU staging slice (prefill) and landing slot (decode);
        #: set before :meth:`register`.
        self.device_slice_bytes = staging.DEVICE_SLICE_BYTES
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
        mines = [list(lane.backend.select([r for r in regions if r.mem in lane.capabilities.memory_kinds]))
                 for lane in self.lanes]
        gpu = self._device_staging(mines)
        for i, (lane, mine) in enumerate(zip(self.lanes, mines)):
            caps = lane.capabilities
            stage = device_stage = None
            extra: list[Region] = []
            if gpu is not None and gpu[0] == i:  # GPU staging (core/transfer/device.py)
                if sends:
                    size = self.device_slice_bytes
                    device_stage = staging.Staging(mine, staging.device_slices(size), size, device=gpu[1])
                    extra.append(device_stage.region)
                else:  # decode's one offer lends GPU slots: its host regions' windows go as planned
                    size = self.device_slice_bytes
                    self.landing = Landing(mine, device_slots(size), size, device=gpu[1], order=regions)
                    extra.append(self.landing.region)
            if not staged and "dram" in caps.memory_kinds and caps.host_staging:
                if sends:
                    stage = staging.Staging(mine, staging.SLICES, staging.SLICE_BYTES)
                    extra.append(stage.region)
                elif self.staging_mode in ("auto", "on") and gpu is None:  # gather: prefill's side only
                    self.landing = Landing(mine, slice_bytes=staging.SLICE_BYTES, order=regions)
                    extra.append(self.landing.region)
            staged = staged or "dram" in caps.memory_kinds
            lane.backend.register([*mine, *extra])
            lane.regions, lane.staging, lane.device_staging = mine, stage, device_stage
        self._regions = list(regions)
        self._local = RegionTable(regions)

    def _device_staging(self, mines: Sequence[Sequence[Region]]) -> tuple[int, OnDevice] | None:
        """Which lane stages GPU memory, and on which GPU: the first lane reaching other hosts (an engine:
        per-descriptor costs are what staging saves) that moves GPU memory, when ``staging_mode`` is auto
        or on and this rank registers GPU regions with it; None otherwise, or when the device seam cannot
        be loaded (core/transfer/device.py; then GPU windows are written as planned)."""
        if self.staging_mode not in ("auto", "on"):
            return None
        for i, (lane, mine) in enumerate(zip(self.lanes, mines)):
            caps = lane.capabilities
            if caps.cross_host and caps.host_staging and "vram" in caps.memory_kinds:
                gpus = sorted({r.device for r in mine if r.mem == "vram"})
                if not gpus:
                    return None
                copy = device.load()
                if copy is None:
                    return None
                if len(gpus) > 1:
                    log.info("%s: GPU staging on GPU %d only (regions on GPUs %s)", self.name, gpus[0], gpus)
                return i, OnDevice(copy, gpus[0])
        return None

    def _usable(self, offer: StagingOffer, same_host: bool) -> bool:
        """Whether this rank stages into ``offer``'s slots: host slots with host staging; GPU slots with GPU
        staging, except to a peer on this host reached by a same-host GPU lane (``cuda_ipc``: it takes GPU
        pairs first, and the slots were not registered with it)."""
        if offer.region.mem == "dram":
            return any(lane.staging for lane in self.lanes)
        near = same_host and any(not lane.capabilities.cross_host and "vram" in lane.capabilities.memory_kinds
                                 for lane in self.lanes)
        return not near and any(lane.device_staging for lane in self.lanes)

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
        if staging_offer is not None and self._usable(staging_offer, state.same_host):  # used where staging_mode allows
            state.slots = relay.RemoteSlots(staging_offer, regions)  # regions as Staged names them
            regions = [*regions, staging_offer.region]
        if len(self.lanes) == 1:  # nothing to share out: the backend takes the peer or refuses it
            self.lanes[0].backend.add_peer(peer, metadata.get(self.lanes[0].name, b""), regions)
            self._state(peer).route = make_route(np.zeros((len(self._regions), len(regions)), np.int64), self._local,
                                                 regions)
            return
        route = self._state(peer).route = route_peer(self.lanes, self._regions, peer, metadata, regions, host == self.host)
        log.info("%s: peer %r goes through %s", self.name, peer, ", ".join(self.lanes[i].name for i in route.used))

    def writes_inline(self, peer: str) -> bool:
        """Whether core may write small chunks to ``peer`` from the host's thread: the peer runs on this
        host (as its handshake said) and every lane moving something to it declares
        ``BackendCapabilities.inline_writes`` (a lane moving nothing to it, such as ``cuda_ipc`` for host
        memory, does not count)."""
        state = self._peers.get(peer)
        if state is None or state.route is None or not state.same_host:
            return False
        return all(self.lanes[i].capabilities.inline_writes for i in state.route.used)

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
              announce: Callable[[int, list[RegionPieces]], None] | None = None) -> None:
        """Write a validated ``plan`` into ``peer``, each part through its lane, batch by batch; the
        deadline and ``live()`` are checked before each batch.

        ``announce(slot, pieces)``: tells the peer a window landed in its staging ``slot``, to be
        scattered to ``pieces`` (runs of pieces in its regions, numbered as ``add_peer`` was given them,
        in unit offsets: ``stage_index.RegionPieces``); staging on both sides is used only when given
        (the caller names the rooms: ``P.Staged``).

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
            for lane, part, memory in self._parts(route, plan):
                self._write_lane(self.lanes[lane], peer, part, deadline, live, memory, announce)
        finally:
            _checkpoint.reset(check)
            _live.reset(token)

    def _parts(self, route: Route, plan: TransferPlan) -> Iterator[tuple[int, TransferPlan, Memory | None]]:
        """``plan`` shared out among the lanes, in lane order: ``(lane, part, where its descriptors are)``, one
        memory kind and device a side per part (None: not located, one lane moves everything)."""
        if route.whole is not None and (route.memory is not None or not route.table.places):
            yield route.whole, plan, route.memory
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
            yield lane, part, Memory(*self._local.places[rest // n_dst], *route.table.places[rest % n_dst])

    def warms(self, peer: str) -> bool:
        """Whether a lane moving something to ``peer`` prepares for its writes (overrides ``Backend.warm``)."""
        route = self._route_of(peer, self._single)
        return route is not None and any(_warms(self.lanes[i].backend) for i in route.used)

    def warm(self, peer: str, plans: Sequence[TransferPlan]) -> None:
        """Have the lanes prepare for writes to ``peer`` like ``plans`` (``Backend.warm``): each lane that
        prepares gets its batches of them as :meth:`write` hands them over unstaged. Nothing is written."""
        route = self._route_of(peer, self._single)
        if route is None:
            return
        batches: dict[int, list[TransferPlan]] = {}
        for plan in plans:
            for lane, part, memory in self._parts(route, plan):
                if _warms(self.lanes[lane].backend):
                    for batch in self.lanes[lane].batches(part):
                        batch.memory = memory
                        batches.setdefault(lane, []).append(batch)
        for lane, mine in sorted(batches.items()):
            self.lanes[lane].backend.warm(peer, mine)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name,
                               "lanes": {p: self.lanes_of(p) for p in sorted(self._peers) if self._peers[p].route}}
        for lane in self.lanes:
            if lane.staging is not None:
                out["staging"] = {**lane.staging.stats(), "mode": self.staging_mode, "windows_by_choice": dict(self.windows)}
            if lane.device_staging is not None:
                out["device_staging"] = {**lane.device_staging.stats(), "mode": self.staging_mode,
                                         "windows_by_choice": dict(self.windows)}
            out.setdefault("batches_in_flight", {})[lane.name] = {"limit": lane.in_flight, "peak": lane.peak_in_flight}
            out.update(lane.backend.describe())
        if self.landing is not None:
            out["landing"] = {**self.landing.stats(), "mode": self.staging_mode}
        return out


def _warms(backend: Backend) -> bool:
    return type(backend).warm is not Backend.warm


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
