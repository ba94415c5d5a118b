"""The floor under a small request: kvbridge's threads and zmq hops with none of kvbridge's work.

    python benchmarks/request_floor.py [ROUND_TRIPS]

One request of ``kvbridge bench request`` crosses these threads: decode's host
hands its ``TransferRequest`` to decode's I/O thread (a queue and a pipe, as
``IOLoop.call``), which sends it over zmq (DEALER -> ROUTER, loopback TCP) to
prefill's I/O thread, which wakes prefill's host (a ``Condition``, as
``Room.wait``); the host hands ``Done`` to its I/O thread, which sends it back
over zmq to decode's I/O thread, which wakes decode's host. This script builds
exactly that (a child process is prefill) and moves a 64-byte message through
it, so its round trip is what the structure alone costs on this machine: the
difference to ``kvbridge bench request``'s 1-page p50 is kvbridge's own work
(issue #27). Prints p50 and p99 in microseconds.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq


class Loop:
    """An I/O thread owning one socket: callables handed over through a queue and a wake-up pipe."""

    def __init__(self, sock: zmq.Socket[Any], on_msg: Callable[[list[bytes]], None]) -> None:
        self.sock, self.on_msg = sock, on_msg
        self.outbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.r, zmq.POLLIN)
        threading.Thread(target=self.run, daemon=True).start()

    def call(self, fn: Callable[[], None]) -> None:
        self.outbox.put(fn)
        os.write(self.w, b"x")

    def run(self) -> None:
        while True:
            events = dict(self.poller.poll(50))
            if self.r in events:
                try:
                    os.read(self.r, 65536)
                except BlockingIOError:
                    pass
            while True:
                try:
                    fn = self.outbox.get_nowait()
                except queue.Empty:
                    break
                fn()
            if self.sock in events:
                while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self.on_msg(self.sock.recv_multipart(zmq.NOBLOCK))


def prefill() -> None:
    """The child: a ROUTER on its I/O thread; the host thread answers each message through it."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    cond, inbox = threading.Condition(threading.Lock()), []

    def on_msg(frames: list[bytes]) -> None:
        with cond:
            inbox.append(frames)
            cond.notify_all()

    loop = Loop(sock, on_msg)
    print(port, flush=True)
    while True:
        with cond:
            cond.wait_for(lambda: inbox)
            frames = inbox.pop(0)
        loop.call(lambda f=frames: sock.send_multipart(f))  # type: ignore[misc]


def decode(port: int, n: int) -> np.ndarray:
    """Round trips from decode's host thread and back to it, in seconds (after 100 unmeasured ones)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    cond, got = threading.Condition(threading.Lock()), []

    def on_msg(frames: list[bytes]) -> None:
        with cond:
            got.append(frames)
            cond.notify_all()

    loop = Loop(sock, on_msg)
    out = []
    for _ in range(n + 100):
        t0 = time.perf_counter()
        loop.call(lambda: sock.send(b"x" * 64))
        with cond:
            if not cond.wait_for(lambda: got, 5.0):
                raise RuntimeError("no answer within 5 s")
            got.clear()
        out.append(time.perf_counter() - t0)
    return np.asarray(out[100:])


def main() -> None:
    if sys.argv[1:2] == ["--prefill"]:
        prefill()
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    child = subprocess.Popen([sys.executable, __file__, "--prefill"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        us = decode(int(child.stdout.readline()), n) * 1e6
    finally:
        child.kill()
        child.wait()
    print(f"request floor (4 thread hand-offs + one zmq round trip, no kvbridge work): p50 {np.percentile(us, 50):.0f} us, "
          f"p99 {np.percentile(us, 99):.0f} us over {n} round trips")


if __name__ == "__main__":
    main()
