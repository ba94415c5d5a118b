"""Transfer metrics: a process-wide, thread-safe collector, optionally exported to Prometheus.

Core records into it as rooms move (senders, receivers and managers); a host reads
it with :func:`snapshot` and clears it with :func:`reset`. What is counted:

- **bytes and descriptors** per (backend, state type), for every transfer job
  (one chunk to one decode rank, plus the metadata row with the last chunk)
  whose write completed. Bytes are the planned bytes, counted per state type
  while the plan is built; descriptors are the planned descriptors (a backend
  may split them further to its own limits).
- **transfer latency** per backend, in seconds: from the moment a transfer
  job starts on its worker thread until its write returns (the chunk's last
  byte has landed). One observation per completed job that moved bytes.
- **bootstrap latency** per (backend, role), in seconds: decode, from
  ``Receiver`` creation until the handshake with every prefill rank is done
  (``WAITING_FOR_INPUT``); prefill, from ``Sender`` creation until every
  decode rank's request has arrived.
- **refused control messages** per (endpoint, reason), the reason being one
  of :data:`REJECT_REASONS`: every message a prefill rank, decode rank or
  bootstrap endpoint refused (not authenticated, altered, replayed,
  malformed, or refused by policy).
- **rooms** that succeeded per (backend, role), and **failures** per
  (backend, role, reason), the reason being one of :data:`FAILURE_REASONS`,
  decided where core fails the room.

:func:`snapshot` returns plain JSON-ready data::

    {
      "backends": {
        "<backend>": {
          "bytes":        {"<state_type>": int, ...},
          "descriptors":  {"<state_type>": int, ...},
          "transfer_seconds": HISTOGRAM,
          "bootstrap_seconds": {"<role>": HISTOGRAM, ...},
          "rooms_succeeded": {"<role>": int, ...},
          "failures": {"<role>": {"<reason>": int, ...}, ...}
        }, ...
      },
      "control_rejected": {"<endpoint>": {"<reason>": int, ...}, ...},
      "prometheus": bool      # whether the Prometheus collector is registered
    }

    HISTOGRAM = {"count": int, "sum": float,
                 "buckets": {"<upper bound>": int, ..., "+Inf": int}}   # cumulative

Roles are ``"prefill"`` and ``"decode"``; a backend appears once anything was
recorded for it, and keys appear only once counted (a missing key is zero).

If ``prometheus_client`` is importable, a collector reading the same data is
registered in its default registry on first use (the first room that records
anything, or :func:`snapshot`), never as a side effect of importing kvbridge;
or call :func:`register_prometheus` with your own registry: counters ``kvbridge_transfer_bytes_total`` and
``kvbridge_transfer_descriptors_total`` {backend, state_type},
``kvbridge_rooms_succeeded_total`` {backend, role} and
``kvbridge_failures_total`` {backend, role, reason},
``kvbridge_control_rejected_total`` {endpoint, reason},
``kvbridge_staging_windows_total`` {backend, how}; histograms
``kvbridge_transfer_seconds`` {backend} and ``kvbridge_bootstrap_seconds``
{backend, role}. :func:`reset` resets those too.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAILURE_REASONS",
    "REJECT_REASONS",
    "TRANSFER_BUCKETS",
    "BOOTSTRAP_BUCKETS",
    "Metrics",
    "METRICS",
    "metrics",
    "snapshot",
    "reset",
    "register_prometheus",
]

log = logging.getLogger(__name__)

#: Failure reasons (the ``reason`` label): short, stable words.
FAILURE_REASONS: Mapping[str, str] = {
    "timeout": "a bootstrap, waiting or transfer timeout expired (or the engine's write deadline)",
    "peer_dead": "the other side stopped answering heartbeats",
    "bad_request": "bad index lists or page counts, from the host or the other side",
    "aborted": "abort() on this side or the other, or the manager was closed",
    "transfer_error": "the backend's write failed",
    "layout": "the two sides cannot pair: layouts, backend names, or a rejected handshake",
    "checksum": "the end-to-end checksum did not match, or could not be computed (SessionConfig.checksum)",
    "rejected": "the prefill rank rejected this room's request (e.g. a duplicate)",
    "remote": "the prefill rank reported the room failed (its own metrics say why)",
    "bootstrap": "the bootstrap endpoint answered something unusable",
}

#: Why a control message was refused (the ``reason`` label of ``kvbridge_control_rejected_total``).
REJECT_REASONS: Mapping[str, str] = {
    "unauthenticated": "no seal, where a secret is set (or a seal, where none is)",
    "forged": "the seal does not match: altered, truncated, or sealed with another secret",
    "misaddressed": "sealed for another endpoint",
    "stale": "sealed outside the replay window (replayed, or clocks apart)",
    "replayed": "a message its connection had already sent",
    "malformed": "undecodable, a wrong type, a wrong version, or wrong frames",
    "refused": "well-formed but refused by policy: a bad registration, a limit, no handshake",
}

#: Upper bounds (seconds) of the transfer latency histogram.
TRANSFER_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
#: Upper bounds (seconds) of the bootstrap latency histogram.
BOOTSTRAP_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


@dataclass
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, last one is +Inf; not cumulative
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"count": sum(self.counts), "sum": self.total, "buckets": dict(self.cumulative())}


class Metrics:
    """Counters and histograms of one process. Every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prometheus = False
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            self._bytes: dict[tuple[str, str], int] = {}
            self._descriptors: dict[tuple[str, str], int] = {}
            self._transfer: dict[str, _Histogram] = {}
            self._bootstrap: dict[tuple[str, str], _Histogram] = {}
            self._succeeded: dict[tuple[str, str], int] = {}
            self._failures: dict[tuple[str, str, str], int] = {}
            self._rejected: dict[tuple[str, str], int] = {}
            self._windows: dict[tuple[str, str], int] = {}

    # -- recording (called by core) -------------------------------------------------
    def window(self, backend: str, how: str) -> None:
        """One window of a write, by how it was written: ``direct``, ``gather`` or ``both`` (``core/transfer/relay.py``)."""
        with self._lock:
            self._windows[backend, how] = self._windows.get((backend, how), 0) + 1

    def transfer(self, backend: str, totals: Mapping[str, tuple[int, int]], seconds: float) -> None:
        """One completed transfer job: ``totals`` is ``state_type -> (bytes, descriptors)``."""
        with self._lock:
            for state_type, (nbytes, descriptors) in totals.items():
                key = (backend, state_type)
                self._bytes[key] = self._bytes.get(key, 0) + nbytes
                self._descriptors[key] = self._descriptors.get(key, 0) + descriptors
            hist = self._transfer.get(backend)
            if hist is None:
                hist = self._transfer[backend] = _Histogram(TRANSFER_BUCKETS)
            hist.observe(seconds)

    def bootstrap(self, backend: str, role: str, seconds: float) -> None:
        """One room's bootstrap latency on ``role``'s side."""
        with self._lock:
            hist = self._bootstrap.get((backend, role))
            if hist is None:
                hist = self._bootstrap[(backend, role)] = _Histogram(BOOTSTRAP_BUCKETS)
            hist.observe(seconds)

    def succeeded(self, backend: str, role: str) -> None:
        with self._lock:
            self._succeeded[(backend, role)] = self._succeeded.get((backend, role), 0) + 1

    def failed(self, backend: str, role: str, reason: str) -> None:
        """One failed room; ``reason`` should be one of :data:`FAILURE_REASONS`."""
        if reason not in FAILURE_REASONS:
            log.debug("metrics: failure reason %r is not one of the documented reasons", reason)
        with self._lock:
            key = (backend, role, reason)
            self._failures[key] = self._failures.get(key, 0) + 1

    def rejected(self, endpoint: str, reason: str) -> None:
        """One refused control message at ``endpoint``; ``reason`` is one of :data:`REJECT_REASONS`."""
        with self._lock:
            key = (endpoint, reason)
            self._rejected[key] = self._rejected.get(key, 0) + 1

    # -- reading ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything recorded, as plain JSON-ready data (structure in the module docstring)."""
        backends: dict[str, dict[str, Any]] = {}

        def entry(backend: str) -> dict[str, Any]:
            if backend not in backends:
                backends[backend] = {
                    "bytes": {},
                    "descriptors": {},
                    "transfer_seconds": _Histogram(TRANSFER_BUCKETS).as_dict(),
                    "bootstrap_seconds": {},
                    "rooms_succeeded": {},
                    "failures": {},
                    "staging_windows": {},
                }
            return backends[backend]

        with self._lock:
            for (backend, state_type), n in self._bytes.items():
                entry(backend)["bytes"][state_type] = n
            for (backend, state_type), n in self._descriptors.items():
                entry(backend)["descriptors"][state_type] = n
            for backend, hist in self._transfer.items():
                entry(backend)["transfer_seconds"] = hist.as_dict()
            for (backend, role), hist in self._bootstrap.items():
                entry(backend)["bootstrap_seconds"][role] = hist.as_dict()
            for (backend, role), n in self._succeeded.items():
                entry(backend)["rooms_succeeded"][role] = n
            for (backend, role, reason), n in self._failures.items():
                entry(backend)["failures"].setdefault(role, {})[reason] = n
            for (backend, how), n in self._windows.items():
                entry(backend)["staging_windows"][how] = n
            rejected: dict[str, dict[str, int]] = {}
            for (endpoint, reason), n in self._rejected.items():
                rejected.setdefault(endpoint, {})[reason] = n
        return {"backends": backends, "control_rejected": rejected, "prometheus": self.prometheus}

    def _families(self) -> Iterator[Any]:
        """Prometheus metric families built from the current values (one consistent read)."""
        from prometheus_client.core import HistogramMetricFamily

        with self._lock:
            data_bytes = dict(self._bytes)
            data_desc = dict(self._descriptors)
            transfer = {k: (h.cumulative(), h.total) for k, h in self._transfer.items()}
            boot = {k: (h.cumulative(), h.total) for k, h in self._bootstrap.items()}
            succeeded = dict(self._succeeded)
            failures = dict(self._failures)
            rejected = dict(self._rejected)
            windows = dict(self._windows)
        yield _counter("kvbridge_transfer_bytes", "Bytes written by completed transfer jobs", ["backend", "state_type"],
                       data_bytes)
        yield _counter("kvbridge_transfer_descriptors", "Planned descriptors of completed transfer jobs",
                       ["backend", "state_type"], data_desc)
        hist = HistogramMetricFamily("kvbridge_transfer_seconds", "Transfer job start to its last byte landing",
                                     labels=["backend"])
        for backend, (buckets, total) in transfer.items():
            hist.add_metric([backend], buckets, total)
        yield hist
        hist = HistogramMetricFamily("kvbridge_bootstrap_seconds",
                                     "Room creation to handshake done (decode) or all requests arrived (prefill)",
                                     labels=["backend", "role"])
        for (backend, role), (buckets, total) in boot.items():
            hist.add_metric([backend, role], buckets, total)
        yield hist
        yield _counter("kvbridge_rooms_succeeded", "Rooms that reached SUCCESS", ["backend", "role"], succeeded)
        yield _counter("kvbridge_failures", "Rooms that reached FAILED, by reason", ["backend", "role", "reason"],
                       failures)
        yield _counter("kvbridge_staging_windows", "Windows of writes by how they were written: direct, gather "
                       "(prefill only) or both (staged on both sides)", ["backend", "how"], windows)
        yield _counter("kvbridge_control_rejected", "Control messages refused, by endpoint and reason",
                       ["endpoint", "reason"], rejected)


class _Collector:
    """A ``prometheus_client`` custom collector over a :class:`Metrics`."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        return self._metrics._families()


#: The process-wide collector core records into.
METRICS = Metrics()


_first_use = threading.Lock()
_exported = False


def metrics() -> Metrics:
    """The process-wide collector; the first call exports it to Prometheus's default registry, if installed."""
    global _exported
    if not _exported:
        with _first_use:
            if not _exported:
                _exported = True
                register_prometheus()
    return METRICS


def snapshot() -> dict[str, Any]:
    """The process-wide metrics as plain data (see the module docstring)."""
    return metrics().snapshot()


def reset() -> None:
    """Clear the process-wide metrics (and so what Prometheus reports)."""
    METRICS.reset()


def register_prometheus(registry: Any = None) -> bool:
    """Export the process-wide metrics to ``registry`` (default: ``prometheus_client.REGISTRY``).

    Returns False if ``prometheus_client`` is not installed. Registering twice
    in one registry is harmless.
    """
    try:
        import prometheus_client
    except ImportError:
        return False
    target = prometheus_client.REGISTRY if registry is None else registry
    try:
        target.register(_Collector(METRICS))
    except ValueError:  # already registered (the metric names are taken)
        log.debug("kvbridge metrics are already registered in %r", target)
    METRICS.prometheus = True
    return True


def _counter(name: str, doc: str, labels: list[str], values: dict[Any, int]) -> Any:
    """One counter family: a sample per key of ``values`` (a label value, or a tuple of them)."""
    from prometheus_client.core import CounterMetricFamily  # optional, as in collect()

    fam = CounterMetricFamily(name, doc, labels=labels)
    for key, n in values.items():
        fam.add_metric(list(key) if isinstance(key, tuple) else [key], n)
    return fam
