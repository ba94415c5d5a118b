"""Where a staged window's time goes: each step of its cycle, in both processes, window by window.

``kvbridge bench transfer --trace`` (host memory with ``--page-kib``, or ``--device cuda``)
installs :func:`install` in the prefill process and in its decode child before either starts a
manager. It wraps the steps of a window staged on both sides (``core/transfer/writing.py``
``_write_lane``) with :mod:`kvbridge.bench.trace`'s mechanism, recording ``(time, thread, step,
window)``: the decode slot's address names the window (``RemoteSlots.address`` on prefill, the same
in decode's ``Landing``), as a slot holds one window from the moment prefill's worker takes it until
prefill's I/O thread frees it, and the address tells apart the slots of the decode ranks in one
process (head slices, TP 1 -> 2). Threads are recorded with their ident (two prefill ranks in one
process, TP 2 -> 1, have workers and I/O threads of one name). One cycle of a slot:

- prefill's transfer worker: ``slot wait >`` (it asks for a decode slot; waits while both are
  being scattered), ``slot taken``, ``gather >``/``<`` (into its slice; on a GPU one kernel, then
  the stream synchronised; before ``slot wait >`` when every slot was being scattered), per batch
  ``post >``/``<`` and, when the worker next waits for it, ``landing wait >`` then ``landed``;
  ``Staged handed to I/O >``/``<`` (``writes.announce``);
- prefill's I/O thread: ``Staged sent``;
- decode's I/O thread: ``received Staged`` (when its channel took it in), ``on Staged >`` (then decode's lock), ``scatter >``/``<``
  (on a GPU, synchronised), ``Unstaged sent``, ``on Staged <``;
- prefill's I/O thread: ``received Unstaged``, ``slot freed >``.

Both processes read the same clock (``time.perf_counter_ns``), so the events merge into one
timeline; only events inside the traced rooms' spans count. :func:`cycles` cuts each slot's
events into cycles, :func:`summarise` gives per step the median time from the cycle's start, the
median and p90 gap from the step before, and, per window, the time each thread spent in each
activity. Each wrapper adds ~1 us; the trace explains, the untraced columns measure.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvbridge.bench import trace

__all__ = ["install", "cycles", "summarise", "format_summary", "print_summaries"]

_local = threading.local()


def _slot(args: tuple[Any, ...], result: Any) -> int | None:
    """The window this worker thread took a decode slot for last: the window it is gathering and posting."""
    return getattr(_local, "slot", None)


def _landing_key(landing: Any, slot: int) -> int:
    """The window in decode's ``slot`` of ``landing``: the slot's address, which prefill knows too
    (``RemoteSlots.address``), unique over the decode ranks of one process."""
    return int(landing.region.addr + slot * landing.slice_bytes)


def install() -> None:
    """Wrap the steps of a staged window's cycle (once per process)."""
    if "windows" in trace._wrapped:
        return
    trace._wrapped.add("windows")
    trace._idents = True  # two prefill ranks in one process: their workers and I/O threads share names
    from kvbridge.core.control import channel, protocol
    from kvbridge.core.sessions import decode, writes
    from kvbridge.core.transfer import landing, relay, staging, transport, writing

    take = relay.RemoteSlots.take

    def traced_take(self: relay.RemoteSlots, check: Any) -> int:
        trace._record("slot wait >")
        slot = take(self, check)
        _local.slot = self.address(slot)
        # A worker writes to one peer: its slots' windows by slot number, for announce() below.
        _local.windows = {**getattr(_local, "windows", {}), slot: _local.slot}
        trace._record("slot taken", _local.slot)
        return slot

    relay.RemoteSlots.take = traced_take  # type: ignore[method-assign]
    trace._wrap(staging.Staging, "stage_to", "gather")  # may come before its slot is taken: see cycles()
    post_async = writing.LaneWrites._post_async

    def traced_post(self: writing.LaneWrites, lane: Any, peer: str, batch: Any, deadline: float) -> Any:
        slot = getattr(_local, "slot", None)
        trace._record("post >", slot)
        wait = post_async(self, lane, peer, batch, deadline)
        trace._record("post <", slot)

        def waited(deadline: float) -> None:
            trace._record("landing wait >", slot)
            wait(deadline)
            trace._record("landed", slot)
        return waited

    writing.LaneWrites._post_async = traced_post  # type: ignore[method-assign]
    trace._wrap(writing.LaneWrites, "_post", "post and land", key=_slot)  # one batch in flight: posted and waited
    announce = writes.announce

    def traced_announce(m: Any, peer: Any, rooms: Any, slot: int, pieces: Any) -> None:
        _local.sending = getattr(_local, "windows", {}).get(slot)  # encoded on this thread: "Staged sent" is keyed by it
        trace._record("Staged handed to I/O >", _local.sending)
        try:
            announce(m, peer, rooms, slot, pieces)
        finally:
            trace._record("Staged handed to I/O <", _local.sending)
            _local.sending = None

    writes.announce = traced_announce
    on_staged = decode.DecodeManager._on_staged

    def traced_on_staged(self: decode.DecodeManager, server: Any, rank: Any, msg: Any) -> None:
        key = _landing_key(self.transport.landing, msg.slot) if self.transport.landing is not None else None
        trace._record("received Staged", key, getattr(_local, "received", None))  # when the channel took it
        _local.sending = key  # the Unstaged it answers is encoded on this thread
        trace._record("on Staged >", key)
        try:
            on_staged(self, server, rank, msg)
        finally:
            trace._record("on Staged <", key)
            _local.sending = None

    decode.DecodeManager._on_staged = traced_on_staged  # type: ignore[method-assign]
    trace._wrap(landing.Landing, "scatter", "scatter", key=lambda args, result: _landing_key(args[0], args[2].slot))
    unstaged = transport.Transport.unstaged

    def traced_unstaged(self: transport.Transport, peer: str, slot: int) -> bool:
        state = self._peers.get(peer)
        key = state.slots.address(slot) if state is not None and state.slots is not None else None
        trace._record("received Unstaged", key, getattr(_local, "received", None))
        trace._record("slot freed >", key)
        return unstaged(self, peer, slot)

    transport.Transport.unstaged = traced_unstaged  # type: ignore[method-assign]

    # Which payloads are Staged or Unstaged (and their window): known where they are encoded, recorded when sent.
    encode, encoded = protocol.encode, {}

    def traced_encode(msg: protocol.Message) -> bytes:
        data = encode(msg)
        if isinstance(msg, (protocol.Staged, protocol.Unstaged)):
            encoded[id(data)] = (type(msg).__name__, getattr(_local, "sending", None))
        return data

    protocol.encode = traced_encode
    send, receive = channel.Channel.send, channel.Channel.receive

    def traced_send(self: channel.Channel, payload: bytes, ident: bytes | None = None) -> None:
        what = encoded.pop(id(payload), None)
        if what is not None:  # before: the peer may receive it before send() returns here
            trace._record(f"{what[0]} sent", what[1])
        send(self, payload, ident)

    def traced_receive(self: channel.Channel, frames: list[bytes]) -> Any:
        got = receive(self, frames)
        if got is not None and isinstance(got[1], (protocol.Staged, protocol.Unstaged)):
            _local.received = time.perf_counter_ns()  # recorded, keyed, where it is handled (above)
        return got

    channel.Channel.send = traced_send  # type: ignore[method-assign]
    channel.Channel.receive = traced_receive  # type: ignore[method-assign]


#: A gather made before its window's slot wait (every slot was being scattered): ``gather while waiting >``/``<``.
EARLY = "gather while waiting"

#: One event of a merged timeline: (time in ns, side, thread, step, slot or None).
Merged = tuple[int, str, str, str, "int | None"]


def cycles(sides: dict[str, Sequence[Sequence[Any]]], spans: Sequence[tuple[int, int]]) -> list[list[Merged]]:
    """Every complete cycle of a slot (``slot wait >``, or an early ``gather >``, .. ``slot freed >``) inside one of
    ``spans`` (ns), in order.

    ``sides`` maps a side (``"prefill"``, ``"decode"``) to its events (:data:`kvbridge.bench.trace.Event`).
    Each side's events of a slot are cut into that side's cycles (prefill's start at ``slot taken``,
    decode's at ``received Staged``) and the n-th of each are one window: across processes, an event
    recorded after a send may come after the peer already acted on it."""
    def inside(t: int) -> bool:
        return any(a <= t <= b for a, b in spans)

    # Each thread as recorded (two prefill ranks' workers apart), named by its role once cut into cycles.
    merged = sorted((e[0], side, e[1], e[2], e[3] if len(e) > 3 else None)
                    for side, evs in sides.items() for e in evs if inside(e[0]))
    # A worker's events before it took the slot of their window ("slot wait >", and a gather made while every slot
    # was being scattered: before it even asked), and the slot it took last (its gather, unkeyed, comes after).
    pending: dict[tuple[str, str], list[Merged]] = {}
    current: dict[tuple[str, str], list[Merged]] = {}
    per: dict[tuple[str, int], list[list[Merged]]] = collections.defaultdict(list)
    for e in merged:
        _, side, thread, step, slot = e
        where = (side, thread)
        if step == "slot wait >":
            pending.setdefault(where, []).append(e)
        elif step in ("gather >", "gather <"):
            cycle = current.get(where)
            early = (where in pending or cycle is None
                     or (step == "gather >" and any(x[3] in ("gather >", EARLY + " >") for x in cycle)))
            if early:
                pending.setdefault(where, []).append(e[:3] + (EARLY + step[len("gather"):],) + e[4:])
            else:
                cycle.append(e)  # type: ignore[union-attr]
        elif slot is None:
            continue
        elif step == "slot taken":
            per[(side, slot)].append([p[:4] + (slot,) for p in pending.pop(where, [])] + [e])  # type: ignore[misc]
            current[where] = per[(side, slot)][-1]
        elif step == "received Staged" or not per[(side, slot)]:
            per[(side, slot)].append([e])
        else:
            per[(side, slot)][-1].append(e)
    done = []
    for (side, slot), mine in per.items():
        if side != "prefill":
            continue
        theirs = per.get(("decode", slot), [])
        for i, c in enumerate(mine):
            steps = {e[3] for e in c}
            if "slot freed >" in steps and "slot taken" in steps and i < len(theirs):
                done.append(sorted(e[:2] + (trace._thread(e[2]),) + e[3:] for e in c + theirs[i]))
    return sorted(done, key=lambda c: c[0][0])


def _p90(values: Sequence[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.9 * len(values)))]


#: Per window, what each thread spends its time in: (side, thread, activity, entered, left).
ACTIVITIES = [
    ("prefill", "transfer worker", "waiting for a decode slot", "slot wait >", "slot taken"),
    ("prefill", "transfer worker", "gathering (incl. sync)", "gather >", "gather <"),
    ("prefill", "transfer worker", "gathering while waiting for a slot", EARLY + " >", EARLY + " <"),
    ("prefill", "transfer worker", "posting batches", "post >", "post <"),
    ("prefill", "transfer worker", "waiting for a batch to land", "landing wait >", "landed"),
    ("prefill", "transfer worker", "posting, one batch in flight: until it landed", "post and land >", "post and land <"),
    ("prefill", "transfer worker", "handing Staged to I/O", "Staged handed to I/O >", "Staged handed to I/O <"),
    ("decode", "I/O", "on Staged (lock, scatter, Unstaged)", "on Staged >", "on Staged <"),
    ("decode", "I/O", "scattering (incl. sync)", "scatter >", "scatter <"),
]


#: Returns that overlap the next steps on other threads: in each thread's time (:data:`ACTIVITIES`), not in the chain.
CONCURRENT = ("Staged handed to I/O <", "on Staged <")


def summarise(found: list[list[Merged]], seconds: float, nbytes: int, staged: int | None = None) -> dict[str, Any]:
    """The steps of ``found``'s cycles in order (median time from ``slot taken``, negative before it; median and
    p90 gap from the step above in the same window; in how many windows; us; steps in fewer than a tenth left out), the time per window each thread spent per activity (:data:`ACTIVITIES`), and
    windows/s and GB/s over the traced rooms (``seconds`` in all, ``nbytes`` moved, ``staged`` windows
    staged in them, as the transport counted: default, the cycles found)."""
    offsets: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    named: list[dict[tuple[str, str, str], float]] = []
    for c in found:
        t0 = next(e[0] for e in c if e[3] == "slot taken")  # before it: the slot wait, a gather while waiting
        seen, mine = collections.Counter[tuple[str, str, str]](), {}
        for t, side, thread, step, _ in c:
            seen[(side, thread, step)] += 1
            n = seen[(side, thread, step)]
            key = (side, thread, step + (f" (#{n})" if n > 1 else ""))
            mine[key] = (t - t0) / 1000
            offsets[key].append(mine[key])
        named.append(mine)
    order = sorted((statistics.median(v), k) for k, v in offsets.items()
                   if len(v) >= len(found) / 10 and k[2] not in CONCURRENT)
    keys = [k for _, k in order]
    gaps: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    for mine in named:
        previous = None
        for k in keys:
            if k in mine:
                gaps[k].append(0.0 if previous is None else mine[k] - previous)  # the first: no step above
                previous = mine[k]
    steps = [{"side": k[0], "thread": k[1], "step": k[2], "at_us": at, "gap_us": statistics.median(gaps[k]),
              "gap_p90_us": _p90(gaps[k]), "windows": len(offsets[k])} for at, k in order]
    spent = []
    for side, thread, what, enter, leave in ACTIVITIES:
        total, opened = 0.0, {}
        for c in found:
            for t, s, th, step, slot in c:
                if (s, th) != (side, thread):
                    continue
                if step == enter:
                    opened[slot] = t
                elif step == leave and slot in opened:
                    total += (t - opened.pop(slot)) / 1000
        spent.append({"side": side, "thread": thread, "activity": what,
                      "us_per_window": total / max(1, len(found))})
    windows = len(found) if staged is None else staged
    return {"windows": len(found), "staged": windows, "windows_per_s": windows / seconds if seconds else None,
            "GBps": nbytes / seconds / 1e9 if seconds else None,
            "window_us": seconds * 1e6 / windows if windows else None, "steps": steps, "spent": spent}


def format_summary(title: str, summary: dict[str, Any]) -> list[Any]:
    """Two :func:`kvbridge.ui.table` s: the steps of a window's cycle, and each thread's time per window."""
    from kvbridge import ui

    rate = (f"{summary['windows']} of {summary['staged']} windows traced whole, {summary['windows_per_s']:.0f} windows/s, "
            f"{summary['GBps']:.2f} GB/s, one window every {summary['window_us']:.0f} us" if summary["windows"]
            else "no staged window traced")
    columns = ["us from slot taken", "+us median", "+us p90", "windows", "side", "thread", "step"]
    steps = ui.table(columns, [(f"{s['at_us']:.0f}", f"{s['gap_us']:.0f}", f"{s['gap_p90_us']:.0f}", s["windows"],
                                s["side"], s["thread"], s["step"]) for s in summary["steps"]],
                     title=f"{title}: a staged window's cycle, step by step ({rate}; medians over windows; "
                           "'>' entered, '<' returned)", right=columns[:3])
    period = summary["window_us"] or 0.0
    columns = ["side", "thread", "activity", "us per window", "of the period"]
    spent = ui.table(columns, [(s["side"], s["thread"], s["activity"], f"{s['us_per_window']:.0f}",
                                f"{s['us_per_window'] / period:.2f}" if period else "-") for s in summary["spent"]],
                     title=f"{title}: each thread's time per window (a window every {period:.0f} us)",
                     right=columns[3:])
    return [steps, spent]


def print_summaries(as_json: bool, traced: list[tuple[str, dict[str, Any]]]) -> None:
    """``--trace``: each titled summary's tables, after the results (on stderr with ``--json``: stdout holds the
    JSON, which has them as each row's ``trace``)."""
    import sys

    from kvbridge import ui

    for title, summary in traced:
        for t in format_summary(title, summary):
            ui.print_table(t, file=sys.stderr if as_json else None)
