"""Where a small request's time goes: timestamps at each step, in both processes, as one timeline.

``kvbridge bench request --trace`` installs :func:`install` in the prefill
process and in its decode child before either starts a manager: it wraps
the steps below (the host's calls, the I/O threads' sends and receives,
planning, the transfer worker, the transport and the backend's write) to
record ``(time, thread, step)``. Both processes read the same clock
(``time.perf_counter_ns``, CLOCK_MONOTONIC on Linux), so the events merge
into one timeline. :func:`timeline` cuts it at each request's
``Receiver.init`` and gives, per step, the median time from there; the
differences between neighbouring rows are what each hand-off, step and
network leg costs. Each wrapper adds ~1 us, so traced requests are a little
slower than the untraced cells: the trace explains, the cells measure.
"""

from __future__ import annotations

import collections
import functools
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

#: ``(time in ns, thread name, step)``, or with a key naming what the step belongs to (a staging slot:
#: :mod:`kvbridge.bench.windows`): what one process recorded.
Event = tuple[int, str, str] | tuple[int, str, str, int]

_events: list[Event] = []
_wrapped: set[object] = set()
#: Whether each event's thread name also says which thread (``name@ident``): several threads of one name (two
#: prefill ranks' workers and I/O threads in one process: :mod:`kvbridge.bench.windows`) stay apart.
_idents = False


def _record(step: str, key: int | None = None, at: int | None = None) -> None:
    """Record ``step`` (``at``: when, in ``perf_counter_ns``; default now) on this thread, with ``key``."""
    now, current = time.perf_counter_ns() if at is None else at, threading.current_thread()
    thread = f"{current.name}@{current.ident}" if _idents else current.name
    _events.append((now, thread, step) if key is None else (now, thread, step, key))


def _wrap(owner: Any, name: str, label: str, leave: bool = True,
          key: Callable[[tuple[Any, ...], Any], int | None] | None = None) -> None:
    """Record ``label >`` when ``owner.name`` (a plain function or method, possibly inherited) is entered,
    and ``label <`` when it returns (``leave``); ``key(args, result)`` (``result`` None on entry): the
    key recorded with each (None: none)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        _record(label + " >", None if key is None else key(args, None))
        result = None
        try:
            result = original(*args, **kwargs)
            return result
        finally:
            if leave:
                _record(label + " <", None if key is None else key(args, result))

    setattr(owner, name, traced)


def install(backend_class: type | None = None) -> None:
    """Wrap the steps of a request (once per process); ``backend_class``: also its ``write`` (once per class)."""
    if backend_class is not None and backend_class not in _wrapped:
        _wrapped.add(backend_class)
        _wrap(backend_class, "write", f"{backend_class.__name__}.write")
    if "core" in _wrapped:
        return
    _wrapped.add("core")
    from kvbridge.core.control import channel, ioloop
    from kvbridge.core.sessions import manager, prefill, receiver, room, sender, writes
    from kvbridge.core.transfer import transport

    _wrap(receiver.Receiver, "init", "Receiver.init")
    _wrap(room.Room, "wait", "Room.wait")
    _wrap(manager.TransferManager, "wait_any", "wait_any")
    _wrap(ioloop.IOLoop, "_drain_outbox", "I/O thread awake", leave=False)
    _wrap(channel.Channel, "send", "zmq send")
    _wrap(sender.Sender, "send", "Sender.send")
    _wrap(sender.Sender, "_plan_chunk", "plan")
    _wrap(writes, "write_chunks", "transfer worker")
    _wrap(transport.Transport, "write", "Transport.write")
    _wrap(prefill.PrefillManager, "notify", "Done handed to I/O")

    receive = channel.Channel.receive

    def traced_receive(self: channel.Channel, frames: list[bytes]) -> Any:
        got = receive(self, frames)
        _record(f"received {type(got[1]).__name__ if got else 'nothing'}")
        return got

    channel.Channel.receive = traced_receive  # type: ignore[method-assign]
    advance = room.Room.advance

    def traced_advance(self: room.Room, state: room.Poll, *args: Any, **kwargs: Any) -> bool:
        _record(f"room -> {state.name}")
        return advance(self, state, *args, **kwargs)

    room.Room.advance = traced_advance  # type: ignore[method-assign]


def events() -> list[Event]:
    """What this process recorded so far."""
    return list(_events)


def reset() -> None:
    """Forget what was recorded (the steps stay wrapped)."""
    _events.clear()


def _thread(name: str) -> str:
    """The role of the thread an event names (its ``@ident``, if recorded, left out)."""
    name = name.partition("@")[0]
    if name == "MainThread":
        return "host"
    if name.startswith("kvbridge-xfer"):
        return "transfer worker"
    if name in ("kvbridge-prefill", "kvbridge-decode"):
        return "I/O"
    return name


def timeline(sides: dict[str, Sequence[Event]], skip: int = 20) -> tuple[list[dict[str, Any]], int]:
    """Per step, the median time from the request's ``Receiver.init`` (us), in order; and how many requests.

    ``sides`` maps a side (``"prefill"``, ``"decode"``) to its events. Each
    request runs from one ``Receiver.init`` to the next; the first ``skip``
    are warm-up. A step is the n-th occurrence of (side, thread, step) within
    a request; steps seen in fewer than half of the requests are left out.
    """
    merged = sorted((t, side, _thread(th), step) for side, evs in sides.items() for t, th, step, *_ in evs)
    starts = [i for i, e in enumerate(merged) if e[1] == "decode" and e[3] == "Receiver.init >"]
    offsets: dict[tuple[str, str, str, int], list[float]] = collections.defaultdict(list)
    requests = 0
    for a, b in zip(starts[skip:], starts[skip + 1:]):
        requests += 1
        t0 = merged[a][0]
        seen: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for t, side, thread, step in merged[a:b]:
            seen[(side, thread, step)] += 1
            offsets[(side, thread, step, seen[(side, thread, step)])].append((t - t0) / 1000)
    rows = sorted((statistics.median(v), k) for k, v in offsets.items() if len(v) >= requests / 2)
    out = []
    previous = 0.0
    for at, (side, thread, step, n) in rows:
        out.append({"at_us": at, "delta_us": at - previous, "side": side, "thread": thread,
                    "step": step + (f" (#{n})" if n > 1 else "")})
        previous = at
    return out, requests


def format_timeline(backend: str, rows: list[dict[str, Any]], requests: int) -> Any:
    from kvbridge import ui

    columns = ["us from init", "+us", "side", "thread", "step"]
    return ui.table(columns, [(f"{r['at_us']:.0f}", f"{r['delta_us']:.0f}", r["side"], r["thread"], r["step"]) for r in rows],
                    title=f"{backend}: one 1-page request, step by step (median of {requests} traced sequential requests; "
                    "'>' entered, '<' returned)", right=columns[:2])

