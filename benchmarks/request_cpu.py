"""CPU and Python calls per small request, both managers' threads counted (issue #27).

    python benchmarks/request_cpu.py [--backends nixl,memory] [--requests N] [--repeat R] [--top K]

Prefill and decode managers run in this one process, on 127.0.0.1, each host
on its own thread, as ``kvbridge bench request`` runs them in two processes:
decode's host creates a ``Receiver`` and calls ``init`` (one 4 KiB page and a
64-byte metadata row), prefill's host (its ``Sender`` created ahead) sends the
page when the room is WAITING_FOR_INPUT, decode's host waits for SUCCESS;
every request's bytes are checked (the host threads are the benchmark's: their
calls are counted too, a few dozen per request). After a warm-up, N sequential
requests are run R times per backend and two numbers are printed per request:

- **Python calls**: every Python function call on every thread of the process
  (the hosts, both I/O threads, the workers), counted by ``cProfile`` started
  on each thread (``threading.setprofile`` before the managers start their
  threads) and read before and after the N requests. It does not depend on
  the machine's load, so it is the number to compare before and after a change
  (a request is the same work every time; idle I/O-thread ticks add a few).
- **CPU us**: ``time.process_time()`` (every thread of the process, zmq's and
  the engine's included) over the N requests, without the profiler; median
  (min-max) of the R repeats; with the part spent in the kernel and the
  context switches (voluntary and not: each hand-off between threads is at
  least one) per request (``getrusage``, medians). Unlike wall time it is not
  inflated by waiting for a loaded machine's cores, though a loaded core still
  runs code slower, and NIXL's progress thread (waking every
  ``progress_delay_us``) is counted at the rate requests run.

``--top K`` prints, per backend, the Python calls per request by thread and
the K functions with the most CPU of their own per request in the counted run (the profiler's clock is each thread's CPU
time, ``time.thread_time``; the profiler inflates Python functions' share),
with their calls per request and their CPU including callees
(default 0: none).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

for _k, _v in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
    os.environ.setdefault(_k, _v)

from kvbridge.bench.request import CONFIG, Cell, _check, dst_pages, pools, src_pages  # noqa: E402
from kvbridge.core.control.bootstrap import BootstrapServer  # noqa: E402
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender  # noqa: E402

CELL = Cell(pages=1, inflight=1, requests=0)


#: From Python 3.12 cProfile sits on ``sys.monitoring``: one profiler at a time in a process, seeing every
#: thread (a second ``enable()`` raises "Another profiling tool is already active", which killed each thread
#: the per-thread hook started in, the bootstrap server's first). Calls are counted the same; the per-thread
#: split is lost and CPU with callees mixes threads' stacks.
ONE_PROFILER = sys.version_info >= (3, 12)


class Profiles:
    """One ``cProfile.Profile`` per thread, each enabled on the thread's first call (before Python 3.12; from
    3.12 one for the process: :data:`ONE_PROFILER`); summed on demand."""

    def __init__(self) -> None:
        self.all: list[cProfile.Profile] = []
        self.names: list[str] = []  # each profile's thread
        self._local = threading.local()
        self._lock = threading.Lock()

    def _start(self) -> None:
        p = cProfile.Profile(time.thread_time)
        self._local.p = p
        with self._lock:
            self.all.append(p)
            self.names.append(threading.current_thread().name)
        p.enable()

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        sys.setprofile(None)
        if getattr(self._local, "p", None) is None:
            self._start()

    def install(self) -> None:
        if not ONE_PROFILER:
            threading.setprofile(self.hook)
        self._start()
        if ONE_PROFILER:
            self.names[-1] = "every thread"

    def stop(self) -> None:
        if not ONE_PROFILER:
            threading.setprofile(None)  # type: ignore[arg-type]
        for p in self.all:
            p.disable()

    def per_thread(self) -> dict[str, int]:
        """Python calls so far per thread name (threads of one name summed)."""
        out: dict[str, int] = {}
        with self._lock:
            profs = list(zip(self.names, self.all))
        for name, p in profs:
            out[name] = out.get(name, 0) + sum(e.callcount for e in p.getstats()  # type: ignore[attr-defined]
                                               if not isinstance(e.code, str))
        return out

    def counts(self) -> dict[Any, tuple[int, float, float]]:
        """``(calls, own CPU s, CPU s with callees)`` so far per function (C functions included), every thread."""
        out: dict[Any, tuple[int, float, float]] = {}
        with self._lock:
            profs = list(self.all)
        for p in profs:
            for e in p.getstats():  # type: ignore[attr-defined]
                c, own, cum = out.get(e.code, (0, 0.0, 0.0))
                # A recursive function's entries count its inner calls' time again: only its outer time is kept.
                out[e.code] = (c + e.callcount, own + e.inlinetime, cum + e.totaltime)
        return out


def _name(code: Any) -> str:
    if isinstance(code, str):
        return code
    return f"{os.path.relpath(code.co_filename)}:{code.co_firstlineno}({code.co_name})"


class Pair:
    """Both managers and their hosts' threads; ``run(n)`` runs n sequential 1-page requests."""

    def __init__(self, backend: str) -> None:
        self.kv, self.meta, args = pools(fill=False)
        self.src_kv, self.src_meta, src_args = pools(fill=True)
        self.server = BootstrapServer("127.0.0.1")
        self.prefill = PrefillManager(src_args, backend, bootstrap=self.server.address, config=CONFIG)
        self.decode = DecodeManager(args, backend, config=CONFIG)
        self.next_room = 1

    def _serve(self, first: int, n: int, problems: list[str]) -> None:
        # Prefill's host: the sender of the next request is created ahead, as bench request's host does.
        i = 0
        s = Sender(self.prefill, first, metadata_row=0)
        while i < n:
            nxt = Sender(self.prefill, first + i + 1, metadata_row=0) if i + 1 < n else None
            if s.wait(Poll.WAITING_FOR_INPUT, 60) != Poll.WAITING_FOR_INPUT:
                problems.append(f"prefill room {s.room}: {s.poll().name} {s.failure()}")
                return
            s.send(src_pages(CELL, i), last=True)
            if s.wait(Poll.SUCCESS, 60) != Poll.SUCCESS:
                problems.append(f"prefill room {s.room}: {s.failure()}")
                return
            i += 1
            if nxt is not None:
                s = nxt

    def run(self, n: int) -> list[str]:
        problems: list[str] = []
        first = self.next_room
        self.next_room += n + 1
        host = threading.Thread(target=self._serve, args=(first, n, problems))
        host.start()
        for i in range(n):
            dst = dst_pages(CELL, i)
            self.kv[dst] = 0
            self.meta[0] = 0
            recv = Receiver(self.decode, first + i, bootstrap=self.server.address)
            recv.init(dst, metadata_row=0)
            if recv.wait(Poll.SUCCESS, 60) != Poll.SUCCESS:
                problems.append(f"decode room {recv.room}: {recv.poll().name} {recv.failure()}")
                break
            problems += _check(self.kv, self.meta, self.src_kv, self.src_meta, CELL, i)
        host.join(120)
        return problems

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.server.close()


def measure(backend: str, n: int, repeat: int, top: int) -> dict[str, Any]:
    # Calls: a pair whose every thread is profiled from its start.
    prof = Profiles()
    prof.install()
    pair = Pair(backend)
    try:
        problems = pair.run(20)  # warm-up: handshake, first plans, caches
        before, threads0 = prof.counts(), prof.per_thread()
        problems += pair.run(n)
        after, threads1 = prof.counts(), prof.per_thread()
    finally:
        prof.stop()
        pair.close()
    zero = (0, 0.0, 0.0)
    delta = {k: tuple(a - b for a, b in zip(v, before.get(k, zero))) for k, v in after.items()}
    py = sum(v[0] for k, v in delta.items() if not isinstance(k, str))
    allc = sum(v[0] for v in delta.values())
    if top:
        print(f"{backend}: Python calls per request by thread: " + ", ".join(
            f"{k} {(v - threads0.get(k, 0)) / n:.0f}" for k, v in sorted(threads1.items()) if v > threads0.get(k, 0)))
        if ONE_PROFILER:  # one clock across threads' stacks: its times mean nothing, its counts hold
            print(f"{backend}: the {top} functions called most per request (Python >= 3.12: no CPU per function)")
            for k, (c, _, _) in sorted(delta.items(), key=lambda kv: -kv[1][0])[:top]:
                print(f"  {c / n:7.1f}  {_name(k)}")
        else:
            print(f"{backend}: the {top} functions with the most own CPU per request (profiled)")
            print(f"  {'calls':>7} {'own us':>7} {'cum us':>7}")
            for k, (c, own, cum) in sorted(delta.items(), key=lambda kv: -kv[1][1])[:top]:
                print(f"  {c / n:7.1f} {own / n * 1e6:7.1f} {cum / n * 1e6:7.1f}  {_name(k)}")
    # CPU: another pair, no profiler.
    pair = Pair(backend)
    cpu: list[float] = []
    try:
        problems += pair.run(20)
        sys_us, switches = [], []
        for _ in range(repeat):
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            c0 = time.process_time()
            problems += pair.run(n)
            cpu.append((time.process_time() - c0) / n * 1e6)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            sys_us.append((r1.ru_stime - r0.ru_stime) / n * 1e6)
            switches.append((r1.ru_nvcsw - r0.ru_nvcsw + r1.ru_nivcsw - r0.ru_nivcsw) / n)
    finally:
        pair.close()
    return {"backend": backend, "requests": n, "python_calls": py / n, "all_calls": allc / n,
            "cpu_us": statistics.median(cpu), "cpu_us_min": min(cpu), "cpu_us_max": max(cpu),
            "sys_us": statistics.median(sys_us), "switches": statistics.median(switches), "problems": problems}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="nixl,memory")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--top", type=int, default=0)
    args = parser.parse_args()
    ok = True
    print(f"{'backend':8} {'Python calls/req':>16} {'with C calls':>12} {'CPU us/req median (min-max)':>28} "
          f"{'of it in the kernel':>19} {'context switches/req':>20}")
    for backend in args.backends.split(","):
        r = measure(backend, args.requests, args.repeat, args.top)
        print(f"{backend:8} {r['python_calls']:16.0f} {r['all_calls']:12.0f} "
              f"{r['cpu_us']:>14.0f} ({r['cpu_us_min']:.0f}-{r['cpu_us_max']:.0f}) {r['sys_us']:>19.0f} "
              f"{r['switches']:>20.1f}", flush=True)
        for p in r["problems"][:5]:
            print(f"  {backend}: problem: {p}")
        ok = ok and not r["problems"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
