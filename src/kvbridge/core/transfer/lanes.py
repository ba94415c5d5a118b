"""Lanes: the backends of one transport, in order, and which of them moves what to a peer.

A transport holds an ordered list of :class:`Lane` objects, each a backend with its
declared capabilities. At the handshake, :func:`route_peer` asks every lane
the peer runs too, and can reach, to add it (``cross_host=False``: only a
peer on this host), and gives each pair of (local region, peer region) to the
first lane holding both: ``cuda_ipc,nixl`` sends GPU -> GPU on one host
through CUDA IPC and everything else through NIXL. The :class:`Route` it
returns is kept for the peer; a write uses it without asking again
(``Transport.write``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .backend import Backend, TransferError
from ..description.layout import Region
from ..planning.regions import RegionTable
from ..planning.transferplan import Memory, TransferPlan
from ..description.plugins import SAME_HOST_LANES, get_registry
from ..description.records import BackendCapabilities, BackendSpec
from .pipeline import FENCE_BATCHES_IN_FLIGHT, in_flight
from .staging import Staging

__all__ = [
    "FENCE_BATCH_BYTES", "FENCE_BATCH_DESCRIPTORS", "Lane", "Route", "backend_name", "lane_names", "make_route", "route_peer",
]

log = logging.getLogger(__name__)

#: A batch of a lane keeping the most batches in flight (``FENCE_BATCHES_IN_FLIGHT``) stays within these,
#: whatever the backend allows: the fence is checked before every batch, so what is in flight to a peer, at
#: most ``FENCE_BATCHES_IN_FLIGHT`` times these (64 MiB, 4096 descriptors), is what a prefill frozen inside an
#: engine call can still write when it resumes after decode reported FAILED (docs/failures.md). A lane keeping
#: fewer in flight gets batches as much larger as keeps that bound (:meth:`Lane.__post_init__`).
#: A backend that declares ``whole_plans`` checks the fence between its own posts instead.
FENCE_BATCH_DESCRIPTORS = 1024
FENCE_BATCH_BYTES = 16 << 20


@dataclass
class Lane:
    """One backend of a transport, with what core derives from its declaration."""

    name: str
    backend: Backend
    capabilities: BackendCapabilities
    #: The local regions it registered (those of the memory kinds it moves).
    regions: list[Region] = field(default_factory=list)
    #: Host staging of strided sources (core/transfer/staging.py), on the first lane that moves host memory.
    staging: Staging | None = None
    #: GPU staging (the same, on GPU memory, staged on both sides only), on the first lane reaching
    #: other hosts that moves GPU memory, with staging auto or on (``Transport.register``).
    device_staging: Staging | None = None

    def __post_init__(self) -> None:
        caps = self.capabilities
        #: Batches core keeps posted to one peer at once (core/transfer/pipeline.py), and the most seen.
        self.in_flight = in_flight(caps)
        self.peak_in_flight = 0
        if caps.whole_plans:  # the backend checks the fence between its own posts (backend.checkpoint)
            self.batch_descriptors = caps.batch_descriptors or 1 << 62
            self.batch_bytes = caps.max_bytes_per_batch or 1 << 62
        else:  # the same bound in flight however the backend keeps it: 4 x 16 MiB, 2 x 32 MiB or 1 x 64 MiB
            share = FENCE_BATCHES_IN_FLIGHT // self.in_flight
            self.batch_descriptors = min(caps.batch_descriptors or 1 << 62, share * FENCE_BATCH_DESCRIPTORS)
            self.batch_bytes = min(caps.max_bytes_per_batch or 1 << 62, share * FENCE_BATCH_BYTES)

    def batches(self, plan: TransferPlan) -> list[TransferPlan]:
        """``plan`` as the backend will receive it: cut and split within the declared limits (views)."""
        # A plan within every limit (the fence's caps included) is one batch as it is (most requests:
        # one chunk, one metadata row); cutting and slicing it cost more than the engine's own write.
        if len(plan) <= self.batch_descriptors and plan.total_bytes <= self.batch_bytes:
            return [plan] if len(plan) else []
        plan = plan.cut(self.batch_bytes)
        return list(plan.batches(self.batch_descriptors, self.batch_bytes))


@dataclass
class Route:
    """How writes to one peer are shared among the lanes (made once per peer: :func:`route_peer`)."""

    #: The lane moving every descriptor to this peer, when one does.
    whole: int | None
    #: The peer's regions, and the lane of each (local, peer) region pair in the order
    #: ``RegionTable`` sorts them (every pair has one: the handshake refused a peer otherwise).
    table: RegionTable
    lanes: npt.NDArray[np.int64]
    #: Where every descriptor is, when one lane moves everything and each side's regions share one
    #: memory kind and device (most ranks): no descriptor is located then.
    memory: Memory | None = None

    @property
    def used(self) -> list[int]:
        """The lanes moving something to the peer, in order."""
        return [self.whole] if self.whole is not None else np.unique(self.lanes).tolist()


def make_route(lanes: npt.NDArray[np.int64], local: RegionTable, regions: Sequence[Region]) -> Route:
    """The route of a peer with ``regions`` whose (local, peer) region pairs go to ``lanes``."""
    used = np.unique(lanes)
    whole = int(used[0]) if len(used) == 1 else 0 if not lanes.size else None
    theirs = RegionTable(regions)
    memory = None
    if whole is not None and len(local.places) <= 1 and len(theirs.places) <= 1:
        (src_kind, src_device), = local.places or [("dram", 0)]
        (dst_kind, dst_device), = theirs.places or [("dram", 0)]
        memory = Memory(src_kind, src_device, dst_kind, dst_device)
    return Route(whole, theirs, lanes, memory)


def route_peer(lanes: Sequence[Lane], local_regions: Sequence[Region], peer: str, metadata: Mapping[str, bytes],
               regions: Sequence[Region], same_host: bool) -> Route:
    """Add ``peer`` to every lane it runs too and can reach; each pair of regions to the first lane
    holding both. Raises :class:`TransferError` if some pair has none, naming what each lane said
    (and removes the peer from the lanes that took it)."""
    name = ",".join(lane.name for lane in lanes)
    local = sorted(local_regions, key=lambda r: r.addr)
    theirs = sorted(regions, key=lambda r: r.addr)
    table = np.full((len(local), len(theirs)), -1, np.int64)
    why: list[str] = []
    for i, lane in enumerate(lanes):
        caps = lane.capabilities
        if lane.name not in metadata:
            why.append(f"{lane.name}: the peer does not run it")
            continue
        if not caps.cross_host and not same_host:
            why.append(f"{lane.name}: the peer is on another host")
            continue
        mine = np.array([r.mem in caps.memory_kinds and r in lane.regions for r in local], bool)
        its = np.array([r.mem in caps.memory_kinds for r in theirs], bool)
        if not mine.any() or not its.any():
            why.append(f"{lane.name}: no memory of the kinds it moves on both sides")
            continue
        try:
            lane.backend.add_peer(peer, metadata[lane.name], [r for r in theirs if r.mem in caps.memory_kinds])
        except Exception as exc:
            why.append(f"{lane.name}: {exc}")
            log.info("%s: lane %r does not take peer %r: %s", name, lane.name, peer, exc)
            continue
        free = (table < 0) & mine[:, None] & its[None, :]
        table[free] = i
    missing = np.argwhere(table < 0)
    if len(missing):
        for i in np.unique(table[table >= 0]).tolist():
            lanes[i].backend.remove_peer(peer)
        a, b = local[missing[0][0]], theirs[missing[0][1]]
        raise TransferError(
            f"no backend of {name!r} moves peer {peer!r}'s memory: e.g. local region {a.name!r} ({a.mem}) "
            f"-> its {b.name!r} ({b.mem}), {len(missing)} region pair(s) in all; " + "; ".join(why)
        )
    return make_route(table, RegionTable(local_regions), regions)


def backend_name(backend: Backend) -> str:
    """The registered name of ``backend``'s class, or its class name if no registration names it."""
    cls = type(backend)
    target = f"{cls.__module__}:{cls.__qualname__}"
    for name, reg in get_registry().backends.items():
        if isinstance(reg.spec, BackendSpec) and reg.spec.factory == target:
            return name
    return cls.__name__


def lane_names(backend: str | None, fast_path: bool = True) -> list[str]:
    """The lanes a manager gets for ``backend`` (``--transfer-backend``): a comma-separated list as
    named; one name after the available same-host lanes; None the default lanes. ``fast_path=False``
    (``SessionConfig.gpu_fast_path``) leaves the same-host lanes out of the last two."""
    registry = get_registry()
    if backend is None:
        return registry.default_lanes(fast_path)
    if "," in backend:
        return registry.lane_names(backend)
    registry.backend_spec(backend)  # an unknown name: the registry's error
    near = registry.same_host_lanes() if fast_path and backend not in SAME_HOST_LANES else []
    return [*near, backend]
