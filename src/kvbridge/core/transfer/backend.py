"""The contract every transport implements, and core's half of it.

A backend only moves bytes it is told to move. It registers memory, exports
its metadata for peers and imports theirs, writes one batch of a validated
:class:`~kvbridge.core.planning.plan.TransferPlan` into a peer (prefill pushes), and
closes. Everything else is core's (:class:`~kvbridge.core.transfer.transport.Transport`),
identical for every backend and driven by the backend's declared
:class:`~kvbridge.core.description.records.BackendCapabilities`:

- memory kinds are checked before :meth:`Backend.register` and before
  :meth:`Backend.add_peer` (a region of an undeclared kind is refused, naming it);
- plans are bounds-checked against both sides' regions, then split into
  batches within ``max_descriptors_per_batch``, ``max_descriptors_in_flight``
  and ``max_bytes_per_batch`` (longer descriptors are cut);
- the deadline is checked before every batch;
- options arrive parsed and defaulted, typed by the backend's ``OptionSpec``\\ s.

Threading: core calls :meth:`Backend.write` from its transfer worker threads,
at most one write per peer at a time and never from the host's scheduler
thread (a backend declaring ``batches_in_flight`` > 1 gets :meth:`Backend.post`
instead: up to that many batches posted to a peer, from one thread, each
waited for in order). ``write`` blocks until every byte of the batch has landed at the
destination or raises; it must return or raise by ``deadline``
(``time.monotonic()`` seconds), shortening the engine's own timeouts to match.
Once ``write`` has returned or raised, the engine must have no work left for
that batch (cancel it, or wait for it): core tells decode a failed room is
fenced, so decode may hand its pages back to the host, when the room's
running write has returned. Core checks the room is live before every batch;
a backend that prepares a request before posting it, or posts a batch as
several engine requests, calls :func:`may_post` right before each post and
raises :class:`TransferCancelled` when it says no, so that a process stalled
(frozen) between the check and the post does not post a room decode has
given up on.

The destination learns about completion from core's control plane (core
sends a ``Done`` message after the last write returns), so a backend whose
engine has native notifications may use them but does not have to.
"""

from __future__ import annotations

import abc
import contextvars
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..description.layout import Region
from ..planning.transferplan import TransferPlan
from ..description.records import BackendCapabilities

__all__ = [
    "Backend", "BackendConfig", "TransferCancelled", "TransferError", "TransferTimeout", "checkpoint", "expired", "host_id",
    "may_post", "wait_until",
]

#: The live check of the write running on this thread (set by core around ``Backend.write``).
_live: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("kvbridge_live", default=None)
#: The deadline-and-liveness check of the write running on this thread (set by core around ``Backend.write``).
_checkpoint: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("kvbridge_checkpoint", default=None)


def may_post() -> bool:
    """Whether the write running on this thread may still post engine work: its room is live
    and decode's lease valid (core's fence). True outside a write core started."""
    live = _live.get()
    return live is None or live()


def checkpoint(where: str = "between posts") -> None:
    """Core's check between two engine posts of one write: raise :class:`TransferTimeout` once the
    write's deadline has passed and :class:`TransferCancelled` once its room is no longer live.

    For a backend that takes whole plans (``BackendCapabilities.whole_plans``) and posts them in
    several pieces (kernel launches, engine requests): the fence core would otherwise check between
    batches. A no-op outside a write core started.
    """
    check = _checkpoint.get()
    if check is not None:
        check(where)


def _landed(deadline: float) -> None:
    """The ``wait`` of a batch :meth:`Backend.post` wrote synchronously: nothing left to wait for."""


def expired(deadline: float) -> bool:
    """Whether ``deadline`` (``time.monotonic()`` seconds, as ``Backend.write`` gets it) has passed."""
    return time.monotonic() >= deadline


#: How long :func:`wait_until` polls without a pause (small writes finish within tens of microseconds),
#: and the longest pause it grows to after that.
POLL_SPIN = 200e-6
POLL_MAX_SLEEP = 1e-3


def wait_until(done: Callable[[], bool], deadline: float, progress: Callable[[], bool] | None = None) -> bool:
    """Poll an engine until ``done()`` or ``deadline``; True if done, False if the deadline came first.

    ``progress()`` (optional) drives the engine once and says whether it moved; while nothing moves for
    :data:`POLL_SPIN` seconds the loop sleeps between polls, doubling the pause up to
    :data:`POLL_MAX_SLEEP` (and never past the deadline), so a slow peer does not cost a core.
    """
    quiet_since = time.monotonic()
    pause = 10e-6
    while not done():
        now = time.monotonic()
        if now >= deadline:
            return False
        if progress is not None and progress():
            quiet_since, pause = now, 10e-6
        elif now - quiet_since > POLL_SPIN:
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, POLL_MAX_SLEEP)
    return True


def host_id() -> str:
    """This host's identity (its boot id): two processes see the same one only on the same host and
    boot. A lane whose backend does not reach other hosts is used only with peers that send the same."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class TransferError(RuntimeError):
    """A write failed. The message says what the engine reported."""


class TransferTimeout(TransferError):
    """A write did not complete by its deadline."""


class TransferCancelled(TransferError):
    """A write was stopped between batches because its room is no longer live (core's fence)."""


@dataclass(frozen=True)
class BackendConfig:
    """What core tells a backend when creating it.

    ``host`` is the address the engine should listen on and advertise
    (127.0.0.1 in tests). ``name`` is this endpoint's name, unique per
    process and role. ``transfer_timeout`` is kvbridge's per-write deadline
    in seconds; engines with internal timeouts should not wait longer.
    ``options`` are the backend's declared options, parsed to their types,
    every declared one present (at its default when not given).
    """

    host: str = "127.0.0.1"
    name: str = ""
    transfer_timeout: float = 30.0
    options: Mapping[str, Any] = field(default_factory=dict)


class Backend(abc.ABC):
    """Base class of transports. Subclasses set :attr:`capabilities`."""

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()
    #: Seconds the engine may still write a batch's bytes after :meth:`write` raised. 0, as the
    #: contract wants (return only once the engine has no work left for the batch); an engine
    #: that cannot be made to stop sets its own deadline here, and core holds back ``Fenced``
    #: for the peer that long after a failed write (docs/failures.md).
    drain_after_failure: float = 0.0

    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    def select(self, regions: Sequence[Region]) -> Sequence[Region]:
        """Of ``regions`` (this rank's, of the memory kinds the backend declares), those it moves.

        Core registers only these with it and leaves the others to the lanes after it (a copy kernel
        launched on one GPU takes that GPU's regions). Default: all of them.
        """
        return regions

    @abc.abstractmethod
    def register(self, regions: Sequence[Region]) -> None:
        """Register local memory so peers may read or write it. Called once, before :meth:`metadata`."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """This endpoint's connection metadata, sent to peers in the handshake."""

    @abc.abstractmethod
    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """Prepare to write to ``peer`` (its metadata and registered regions).

        Called again for a known peer when it handshakes again: replace it.
        """

    def warm(self, peer: str, batches: Sequence[TransferPlan]) -> None:
        """Optional: prepare for writes to ``peer`` shaped like ``batches``, so that the first requests do
        not pay for it (compile a kernel, open a connection).

        Core calls it after :meth:`add_peer`, on a thread of its own, with small batches planned from the
        pairing of the two layouts (runs of one to 256 pages of every index space, layer by layer too), as
        :meth:`write` would receive them; the peer's handshake is acknowledged once it returns, or after
        ``SessionConfig.warm_timeout`` seconds if it is still running. Nothing is written. It may block; it
        must not raise for a peer it took (a failure here only makes the first writes slower). Default:
        nothing to prepare.
        """

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``; later writes to it fail. Unknown peers are ignored."""

    @abc.abstractmethod
    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        """Write one batch into ``peer``'s memory; return once every byte has landed.

        ``batch`` is within the declared limits and inside registered memory
        on both sides. Raises :class:`TransferError` (or :class:`TransferTimeout`
        past ``deadline``) on failure; bytes of a failed write may have partly
        landed.
        """

    def post(self, peer: str, batch: TransferPlan, deadline: float) -> Callable[[float], None]:
        """Post one batch into ``peer`` and return its ``wait(deadline)``, which returns once every byte
        of it has landed or raises as :meth:`write` does (pipelined writes: a backend declaring
        ``BackendCapabilities.batches_in_flight`` > 1 overrides this; core then posts the next batch
        before waiting for this one).

        Core posts one peer's batches from one thread, in order, and calls every ``wait`` it got, oldest
        first, before its write returns, failed or not (so the engine has no work left once it returns,
        as :meth:`write` promises). Default: :meth:`write`, then a ``wait`` with nothing left to wait for.
        """
        self.write(peer, batch, deadline)
        return _landed

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister memory and release the engine. Idempotent."""

    def abort_peer(self, peer: str, stuck: bool = False) -> int:
        """Drop what the engine still holds for ``peer`` after a write to it failed or timed out, so
        none of it lands later (TCP engines: reset the connections to a peer whose host no longer
        answers; all of them when ``stuck``, a write still inside the engine past its deadline,
        which also ends that wait). Returns how many connections were reset; core then retries a
        write that fails on one of them (``Transport._post``). Default: nothing to drop, 0."""
        return 0

    def describe(self) -> dict[str, Any]:
        """Free-form facts for logs and ``explain`` output."""
        return {}
