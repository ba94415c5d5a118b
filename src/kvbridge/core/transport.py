"""Core's half of the backend contract: one policy around every backend.

A :class:`Transport` wraps a :class:`~kvbridge.core.backend.Backend` and does,
from the backend's declared :class:`~kvbridge.core.records.BackendCapabilities`,
what no adapter repeats: memory kinds checked at registration and at
handshake, plans cut and split into batches within the declared limits, the
deadline checked before every batch. The backend only moves one batch.

It also owns the same-host GPU fast path (:mod:`kvbridge.core.gpu`): when a
peer on this host sent CUDA IPC handles of its GPU regions, descriptors from
local GPU memory into them are copied by one kernel per write instead of
going through the engine, whatever the backend; the rest still goes through
the backend. ``fast_path=False`` turns it off.

:func:`open_transport` is the one place core creates backends. It takes what a
manager was given: a registered name, a resolved :class:`BackendSpec`, a
ready :class:`Backend` instance (as an HTTP client takes a transport object),
or ``None`` for the default backend.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Callable
from typing import Any, Union

from . import gpu, staging, tcpfence
from .backend import _live, Backend, BackendConfig, TransferCancelled, TransferError, TransferTimeout
from .layout import Region
from .plan import RegionTable, TransferPlan
from .plugins import PluginError, get_registry, import_object
from .records import BackendCapabilities, BackendSpec

__all__ = ["BackendChoice", "Transport", "open_transport"]

log = logging.getLogger(__name__)

#: What a manager accepts as its backend.
BackendChoice = Union[str, BackendSpec, Backend, None]

#: Every batch stays within these, whatever the backend allows: the fence is
#: checked between batches, so they bound what a prefill frozen inside an engine
#: call can still write when it resumes after decode reported FAILED
#: (docs/failures.md). Measured cost on nixl: within noise (docs/failures.md).
FENCE_BATCH_DESCRIPTORS = 1024
FENCE_BATCH_BYTES = 16 << 20

#: A write still inside its backend this long after its deadline has its peer's TCP connections
#: reset (:meth:`Transport.reset_overdue`): an engine blocked past the deadline (Mooncake waits for
#: its own timeout) must not close them itself, which would leave what they queued to land later.
RESET_GRACE = 0.25


class Transport:
    """A backend plus the policy core applies to every backend alike."""

    def __init__(
        self, backend: Backend, name: str, capabilities: BackendCapabilities | None = None, *, fast_path: bool = True
    ) -> None:
        self.backend = backend
        self.name = name
        self.capabilities = capabilities or type(backend).capabilities
        self.fast_path = fast_path
        self._batch_descriptors = min(self.capabilities.batch_descriptors or FENCE_BATCH_DESCRIPTORS, FENCE_BATCH_DESCRIPTORS)
        self._batch_bytes = min(self.capabilities.max_bytes_per_batch or FENCE_BATCH_BYTES, FENCE_BATCH_BYTES)
        self._regions: list[Region] = []
        # peer -> (its mapped GPU allocations, the local device copying into them, whether every descriptor does)
        self._gpu_peers: dict[str, tuple[gpu.GpuPeer, int, bool]] = {}
        self._vram = RegionTable(())  # local GPU regions: which device a source address lives on
        self._staging: staging.Staging | None = None  # host staging of strided sources (core/staging.py)
        self._tcp: dict[str, tuple[tcpfence.Endpoint, ...]] = {}  # peer -> where its engine listens
        self._running: dict[str, float] = {}  # peer -> when its write in the backend is overdue (reset_overdue)
        self._was_reset: dict[str, int] = {}  # peer -> connections reset() reset since its last write
        self._failed_at: dict[str, float] = {}  # peer -> when a write to it last raised (fence_delay)

    # -- memory -----------------------------------------------------------------------------
    def check_memory(self, regions: Sequence[Region], whose: str) -> None:
        """Raise :class:`TransferError` naming the first region of a memory kind the backend does not move."""
        kinds = self.capabilities.memory_kinds
        for r in regions:
            if r.mem not in kinds:
                raise TransferError(
                    f"{whose} region {r.name!r} is {r.mem} memory, but backend {self.name!r} moves "
                    f"{' and '.join(kinds)} only (its BackendCapabilities.memory_kinds); "
                    "use a backend that declares it (`kvbridge plugins` lists what each moves)"
                )

    def register(self, regions: Sequence[Region], *, sends: bool = True) -> None:
        """Register the rank's regions; a rank that ``sends`` strided host pieces also registers a
        staging buffer with them (``core/staging.py``), unless the backend opts out."""
        self.check_memory(regions, "local")
        stage = None
        if sends and self.capabilities.host_staging and "dram" in self.capabilities.memory_kinds and staging.wanted(regions):
            stage = staging.Staging(regions)
        self.backend.register([*regions, stage.region] if stage is not None else regions)
        self._staging = stage
        self._regions = list(regions)
        self._vram = RegionTable([r for r in regions if r.mem == "vram"])

    def metadata(self) -> bytes:
        return self.backend.metadata()

    def local_metadata(self) -> bytes:
        """What a same-host peer needs to copy into this rank's GPU regions directly (b"": nothing)."""
        return gpu.local_metadata(self._regions) if self.fast_path else b""

    def add_peer(
        self, peer: str, metadata: bytes, regions: Sequence[Region], local_metadata: bytes = b"",
        tcp: Sequence[tcpfence.Endpoint] = (),
    ) -> None:
        """Prepare writes to ``peer``; ``tcp``: where its engine listens (this rank resets its
        connections to them when a write fails: :meth:`reset`)."""
        self.check_memory(regions, f"peer {peer!r}")
        endpoints = tcpfence.checked(tcp, f"peer {peer!r}")
        self.backend.add_peer(peer, metadata, regions)
        self._tcp[peer] = endpoints
        self._gpu_peers.pop(peer, None)
        if self.fast_path and local_metadata and len(self._vram):
            # The copies run on one local GPU (a rank's usual one; with several, the lowest-numbered:
            # the others' descriptors go through the backend).
            device = int(self._vram.device.min())
            try:
                mapped = gpu.open_peer(local_metadata, device)
            except Exception as exc:  # the backend path still works
                log.warning("GPU fast path to peer %r unavailable: %s", peer, exc)
                mapped = None
            if mapped is not None:
                # Every local region on that GPU and every peer region mapped: no descriptor needs sorting.
                whole = len(self._vram) == len(self._regions) and {r.device for r in self._regions} == {device} \
                    and mapped.covers(regions)
                self._gpu_peers[peer] = mapped, device, whole
                log.info("GPU fast path on for peer %r", peer)

    def remove_peer(self, peer: str) -> None:
        # Mappings stay open until the process ends: a write in flight may still use them,
        # and CUDA opens a handle once per device in a process anyway.
        self._gpu_peers.pop(peer, None)
        self._tcp.pop(peer, None)
        # _was_reset and _failed_at stay: the engine still pools the connections reset to that endpoint
        # and may still drain a failed write into it. A peer dropped then handshaking again (the same
        # id: decode after a prefill resumed from a freeze) failed one write per reset connection when
        # they were not retried (measured: the resumed room failed), and a Fenced sent at the drop
        # must still wait out the drain.
        self.backend.remove_peer(peer)

    def reset(self, peer: str, why: str, stuck: bool = False) -> None:
        """Reset this process's TCP connections to ``peer``'s engine if its host no longer answers,
        dropping what they still queue: a write to it failed or timed out, and nothing of it may land
        later (core/tcpfence.py). ``stuck``: a write is still inside the engine past its deadline;
        they are reset whether it answers or not, which ends the engine's wait. The engine
        reconnects for the next write (:meth:`_post` retries it where the engine fails one first)."""
        endpoints = self._tcp.get(peer)
        if not endpoints:
            return
        n = tcpfence.abort(endpoints, only_unreachable=not stuck)
        if n:
            self._was_reset[peer] = self._was_reset.get(peer, 0) + n
            log.warning("%s: reset %d TCP connection(s) to peer %r (%s) so nothing queued in them lands later",
                        self.name, n, peer, why)

    def fence_delay(self, peer: str) -> float:
        """Seconds until the engine certainly has no work left of a write to ``peer`` that failed
        (``Backend.drain_after_failure`` after it raised; 0 for most engines): ``Fenced`` waits that long."""
        at = self._failed_at.get(peer)
        if at is None:
            return 0.0
        return max(0.0, at + self.backend.drain_after_failure - time.monotonic())

    def reset_overdue(self, now: float) -> None:
        """Reset the connections of peers whose write is still inside the backend ``RESET_GRACE``
        past its deadline (the I/O thread calls this on its tick); once per write."""
        for peer, due in list(self._running.items()):
            if now > due:
                self._running[peer] = math.inf
                self.reset(peer, "a write ran past its deadline", stuck=True)

    def close(self) -> None:
        self.backend.close()

    # -- writes -----------------------------------------------------------------------------
    def batches(self, plan: TransferPlan) -> list[TransferPlan]:
        """``plan`` as the backend will receive it: cut and split within the declared limits (views)."""
        # A plan within every limit (the fence's caps included) is one batch as it is (most requests:
        # one chunk, one metadata row); cutting and slicing it cost more than the engine's own write.
        if len(plan) <= self._batch_descriptors and plan.total_bytes <= self._batch_bytes:
            return [plan] if len(plan) else []
        plan = plan.cut(self._batch_bytes)
        return list(plan.batches(self._batch_descriptors, self._batch_bytes))

    def write(self, peer: str, plan: TransferPlan, deadline: float, live: Callable[[], bool] | None = None) -> None:
        """Write a validated ``plan`` into ``peer`` batch by batch; deadline and ``live()`` are checked before each.

        Raises :class:`TransferTimeout` once the deadline has passed and
        :class:`TransferCancelled` once ``live()`` is false (no further batch
        is started either way: this is what fences a failed room), and passes
        on the backend's :class:`TransferError`, saying how much had landed before.
        """
        route = self._gpu_peers.get(peer)
        if route is not None:
            self._check(peer, deadline, live, "before it started")
            plan = self._copy_on_gpu(peer, *route, plan, lambda: self._check(peer, deadline, live, "between GPU copy slices"))
            if not len(plan):  # the kernel copied it all (the usual case): nothing for the backend
                return
        landed = 0
        posted = 0
        token = _live.set(live)  # the backend re-checks right before it posts (backend.may_post)

        def post(batch: TransferPlan, of: str = "") -> None:
            nonlocal landed, posted
            self._check(peer, deadline, live, f"after {posted}{of} batches ({landed} of {plan.total_bytes} B landed)")
            self._running[peer] = deadline + RESET_GRACE
            try:
                self._post(peer, batch, deadline, lambda: self._check(peer, deadline, live, "before a retry"))
            except TransferError as exc:
                if not isinstance(exc, TransferCancelled):  # cancelled: the backend posted nothing
                    self._failed_at[peer] = time.monotonic()
                    self.reset(peer, f"a write failed: {type(exc).__name__}")
                if posted == 0:
                    raise
                raise type(exc)(f"{exc} (batch {posted + 1}; the {posted} before it, {landed} B, landed)") from exc
            finally:
                self._running.pop(peer, None)
            landed += batch.total_bytes
            posted += 1

        try:
            for window in self._windows(plan):
                staged = self._staging.stage(window, self._batch_bytes) if self._staging is not None else None
                if staged is None:
                    batches = self.batches(window)
                    of = f" of {len(batches)}" if window is plan else ""  # the whole plan: its count is known
                    for batch in batches:
                        post(batch, of)
                    continue
                try:
                    for batch in staged.batches(self._batch_descriptors):
                        post(batch)
                finally:
                    staged.release()  # write() returned or raised: the engine reads the slice no more
        finally:
            _live.reset(token)

    def _post(self, peer: str, batch: TransferPlan, deadline: float, check: Callable[[], None]) -> None:
        """``backend.write``, again if it failed (not timed out) as the first write since :meth:`reset`
        reset ``n`` of the peer's connections, up to ``n`` times: an engine that pools connections
        (Mooncake) fails one call per reset connection it picks, dropping it, then reconnects. A retry
        writes the same bytes to the same places, after ``check`` (deadline and liveness) again."""
        retries = self._was_reset.pop(peer, 0)
        while True:
            try:
                self.backend.write(peer, batch, deadline)
                return
            except TransferError as exc:
                if retries == 0 or isinstance(exc, (TransferCancelled, TransferTimeout)):
                    raise
                retries -= 1
                failed = type(exc).__name__
                log.info("%s: write to peer %r failed after its connections were reset; retrying: %s", self.name, peer, exc)
            try:
                check()
            except TransferCancelled:
                # The attempt that failed was posted (write() takes a cancel for "nothing posted"):
                # reset as after any failed write, or what it queued may land after the room failed.
                self.reset(peer, f"a write failed: {failed}")
                raise

    def _windows(self, plan: TransferPlan) -> Iterator[TransferPlan]:
        """The plan in windows that staging may gather (one slice each), or whole when it cannot help."""
        if self._staging is None or len(plan) < 2 or plan.total_bytes > len(plan) * staging.MAX_PIECE:
            yield plan  # pieces too large on average to be worth copying: the batches of today
            return
        yield from plan.batches(staging.WINDOW_DESCRIPTORS, min(self._staging.slice_bytes, self._batch_bytes))

    def _check(self, peer: str, deadline: float, live: Callable[[], bool] | None, where: str) -> None:
        """The one check before every batch: the deadline, then whether the room is still live."""
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{self.name}: write to peer {peer!r} passed its deadline {where}")
        if live is not None and not live():
            raise TransferCancelled(f"{self.name}: write to peer {peer!r} stopped {where}: the room is no longer live")

    def _copy_on_gpu(
        self, peer: str, mapped: gpu.GpuPeer, device: int, whole: bool, plan: TransferPlan, check: Callable[[], None]
    ) -> TransferPlan:
        """Copy the descriptors from ``device`` to the mapped peer GPU with the kernel; return the rest for
        the backend. ``whole``: every descriptor qualifies (decided per region at add_peer).

        ``check`` (deadline and liveness) runs between slices (:meth:`write` checked right before the first).
        """
        if whole:
            parts, hints = plan.factors(), plan.hints()  # as the planner left it: rows x columns, unexpanded
            rest = TransferPlan.empty()
        else:
            region, from_gpu = self._vram.locate(plan.src_addr, plan.nbytes)
            fast = from_gpu & (self._vram.device[region] == device) & mapped.inside(plan.dst_addr, plan.nbytes)
            if not fast.any():
                return plan
            parts, hints = [gpu.arrays_part(plan.src_addr[fast], plan.dst_addr[fast], plan.nbytes[fast])], [(0, 0)]
            rest = TransferPlan(plan.src_addr[~fast], plan.dst_addr[~fast], plan.nbytes[~fast])
        try:
            gpu.copy(device, parts, mapped, check, hints)
        except (TransferTimeout, TransferCancelled):
            raise
        except Exception as exc:
            raise TransferError(f"{self.name}: GPU copy to peer {peer!r} failed: {exc}") from exc
        return rest

    def describe(self) -> dict[str, Any]:
        staged = {"staging": self._staging.stats()} if self._staging is not None else {}
        return {"backend": self.name, "gpu_fast_path_peers": sorted(self._gpu_peers), **staged, **self.backend.describe()}


def backend_name(backend: Backend) -> str:
    """The registered name of ``backend``'s class, or its class name if no registration names it."""
    cls = type(backend)
    target = f"{cls.__module__}:{cls.__qualname__}"
    for name, reg in get_registry().backends.items():
        if isinstance(reg.spec, BackendSpec) and reg.spec.factory == target:
            return name
    return cls.__name__


def open_transport(
    backend: BackendChoice,
    *,
    host: str,
    name: str,
    transfer_timeout: float,
    options: Mapping[str, str],
    fast_path: bool = True,
) -> Transport:
    """Create (or wrap) the backend a manager was given; options are checked before any engine exists.

    ``backend`` is a registered name, a :class:`BackendSpec` (its factory is
    imported; it need not be registered), a :class:`Backend` instance (used
    as it is: ``options`` must then be empty) or ``None`` (the default: see
    :meth:`~kvbridge.core.plugins.Registry.default_backend`).
    """
    if isinstance(backend, Backend):
        if options:
            raise ValueError(
                f"backend options {sorted(options)} were given with a ready {type(backend).__name__} instance; "
                "pass them to the backend's own BackendConfig instead"
            )
        return Transport(backend, backend_name(backend), fast_path=fast_path)
    registry = get_registry()
    if backend is None:
        default = registry.default_backend()
        if default is None:
            installed = ", ".join(sorted(registry.backends)) or "none"
            raise PluginError(
                f"no transfer backend is available (installed: {installed}); install an engine, "
                "e.g. `pip install kvbridge[nixl]`, or a backend plugin"
            )
        backend = default
    if isinstance(backend, str):
        spec = registry.backend_spec(backend)
        factory = registry.load_backend(backend)
    elif isinstance(backend, BackendSpec):
        spec = backend
        factory = import_object(spec.factory, f"backend {spec.name!r}")
    else:
        raise TypeError(f"backend must be a name, a BackendSpec or a Backend instance, got {type(backend).__name__}")
    parsed = spec.parse_options(options)
    instance = factory(BackendConfig(host=host, name=name, transfer_timeout=transfer_timeout, options=parsed))
    if not isinstance(instance, Backend):
        raise PluginError(f"backend {spec.name!r}: factory {spec.factory!r} made a {type(instance).__name__}, not a Backend")
    return Transport(instance, spec.name, spec.capabilities, fast_path=fast_path)
