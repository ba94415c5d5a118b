"""The control plane's I/O thread (``kvbridge.core.control.ioloop.IOLoop``), with real zmq sockets.

It sleeps on each socket's ZMQ_FD, which is edge-triggered: any use of a socket may take the signal that
a message arrived. These tests start loops without a tick (which would ask every socket again every few
milliseconds and hide a lost wake-up) and fail when a message or a call is left waiting.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import zmq

from kvbridge.core.control.auth import Auth
from kvbridge.core.control.channel import Channel
from kvbridge.core.control.ioloop import IOLoop
from kvbridge.testing.harness import wait_until

#: Bounds every wait: a lost wake-up leaves the loop asleep for good (no tick here), so a test fails, not hangs.
WAIT = 10.0


def _pair(loop: IOLoop, handler, dealer: zmq.Socket | None = None):  # type: ignore[no-untyped-def]
    """A ROUTER in the test's thread and a DEALER (``dealer`` or a new one) connected to it, polled by
    ``loop`` with ``handler``; returns ``(router, dealer, the dealer's routing id at the router)``."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    if dealer is None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)

    def setup() -> None:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        loop.add_socket(dealer, handler)
        dealer.send(b"hello")

    loop.call(setup)
    router.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
    ident, hello = router.recv_multipart()
    assert hello == b"hello"
    return router, dealer, ident


def test_messages_that_arrive_while_the_loop_is_busy_and_then_sends_are_all_read() -> None:
    """Messages arrive while the I/O thread runs a call; the call then sends on the socket (a send may
    take the descriptor's signal) and the handler answers each message on it. More arrive per round
    than the loop reads per wake-up (256): every one is read, with no tick to ask again."""
    loop = IOLoop("test-busy", tick=None, tick_interval=3600)
    got: list[bytes] = []

    def handler(sock: zmq.Socket, frames: list[bytes]) -> None:
        got.extend(frames)
        sock.send(b"ack")

    loop.start()
    router, dealer, ident = _pair(loop, handler)
    try:
        per_round, rounds = 600, 5
        for r in range(rounds):
            sent = threading.Event()

            def busy() -> None:
                sent.wait(WAIT)
                time.sleep(0.02)  # zmq delivers meanwhile; then a send, more than 1 ms after the last
                dealer.send(b"busy")

            loop.call(busy)
            for i in range(per_round):
                router.send_multipart([ident, b"%d" % (r * per_round + i)])
            sent.set()
            wait_until(lambda: len(got) == (r + 1) * per_round, WAIT, f"round {r}: {per_round} messages")
        assert got == [b"%d" % i for i in range(rounds * per_round)]
    finally:
        loop.stop()
        router.close(linger=0)


def test_messages_that_arrive_while_a_handler_sends_on_their_socket_are_read() -> None:
    """A handler of one socket sends on another (through its Channel) while messages arrive there (the
    send may take that socket's signal): they are read, with no tick to ask again."""
    loop = IOLoop("test-cross", tick=None, tick_interval=3600)
    got: list[bytes] = []
    arrived = threading.Event()
    chan = Channel(loop.ctx, zmq.DEALER, Auth(b"test"), endpoint="decode", max_bytes=1 << 20)

    def on_first(_sock: zmq.Socket, _frames: list[bytes]) -> None:
        arrived.wait(WAIT)
        time.sleep(0.02)  # zmq delivers meanwhile; then a send, more than 1 ms after the last
        chan.send(b"from the first's handler")

    loop.start()
    pairs = [_pair(loop, on_first), _pair(loop, lambda _s, frames: got.extend(frames), chan.sock)]
    try:
        for r in range(5):
            (first, _, first_ident), (second, _, second_ident) = pairs
            first.send_multipart([first_ident, b"go"])
            time.sleep(0.01)  # the first's handler runs
            for i in range(10):
                second.send_multipart([second_ident, b"%d" % (r * 10 + i)])
            arrived.set()
            wait_until(lambda: len(got) == (r + 1) * 10, WAIT, f"round {r}: the second socket's messages")
            arrived.clear()
        assert got == [b"%d" % i for i in range(50)]
    finally:
        loop.stop()
        for router, _, _ in pairs:
            router.close(linger=0)


class _SlowToWake:
    """An I/O loop's poller that, while ``gate`` is clear, holds the thread before it looks at its descriptors."""

    def __init__(self, poller: Any) -> None:
        self.poller = poller
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()

    def poll(self, timeout: int) -> list[tuple[int, int]]:
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait(WAIT)
        return self.poller.poll(timeout)

    def register(self, fd: int, events: int) -> None:
        self.poller.register(fd, events)

    def unregister(self, fd: int) -> None:
        self.poller.unregister(fd)


def test_messages_that_arrive_before_another_thread_sends_on_their_socket_are_read() -> None:
    """Messages arrive while the I/O thread sleeps and has not looked yet; another thread then sends
    on the socket itself (IOLoop.send), which takes the socket's signal: they are read all the same."""
    loop = IOLoop("test-inline", tick=None, tick_interval=3600)
    slow = loop._poll = _SlowToWake(loop._poll)
    got: list[bytes] = []
    chan = Channel(loop.ctx, zmq.DEALER, Auth(b"test"), endpoint="decode", max_bytes=1 << 20)
    loop.start()
    router, _, ident = _pair(loop, lambda _s, frames: got.extend(frames), chan.sock)
    try:
        for r in range(3):
            slow.held.clear()
            slow.gate.clear()
            loop.call(lambda: None)  # one more pass: the thread is then held before it sleeps
            assert slow.held.wait(WAIT)
            for i in range(10):
                router.send_multipart([ident, b"%d" % (r * 10 + i)])
            time.sleep(0.02)  # zmq delivers and signals meanwhile; the send below comes over 1 ms after the last
            loop.send(lambda: chan, b"from another thread")
            slow.gate.set()
            wait_until(lambda: len(got) == (r + 1) * 10, WAIT, f"round {r}: 10 messages")
        assert got == [b"%d" % i for i in range(30)]
    finally:
        slow.gate.set()
        loop.stop()
        router.close(linger=0)


def test_calls_handed_over_from_many_threads_all_run() -> None:
    """Four threads hand the loop calls, in bursts and one by one, as it sleeps and as it runs: none
    waits for a later call or a tick to wake the loop."""
    loop = IOLoop("test-calls", tick=None, tick_interval=3600)
    loop.start()
    ran = [0]
    per_thread, threads = 3000, 4

    def count() -> None:
        ran[0] += 1

    def hand_over(seed: int) -> None:
        for i in range(per_thread):
            loop.call(count)
            if (i + seed) % 7 == 0:
                time.sleep(0.0002)  # let the loop fall asleep now and then

    workers = [threading.Thread(target=hand_over, args=(k,)) for k in range(threads)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(WAIT)
        wait_until(lambda: ran[0] == per_thread * threads, WAIT, f"{ran[0]} of {per_thread * threads} calls ran")
    finally:
        loop.stop()


def test_messages_sent_just_before_the_io_loop_stops_still_leave() -> None:
    """A room's Done is handed to the I/O thread and the room counted as SUCCESS at once; a host
    that closes its manager right after must not lose it (closing with linger 0 dropped what zmq
    still queued: the last rooms of a 4,096-room CI run failed at decode by heartbeat)."""
    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.PULL)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    loop = IOLoop("test-stop-linger")
    loop.start()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 0)
    payload, count = b"x" * 65536, 512  # 32 MiB: more than zmq flushes before the loop's close

    def setup() -> None:
        push.connect(f"tcp://127.0.0.1:{port}")
        loop.add_socket(push, lambda _s, _f: None)

    loop.call(setup)
    for _ in range(count):
        loop.call(lambda: push.send(payload))
    loop.stop()
    got = 0
    sink.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        while got < count:
            sink.recv()
            got += 1
    except zmq.Again:
        pass
    finally:
        sink.close(linger=0)
    assert got == count, f"{count - got} of {count} messages sent before stop() never left"


def test_a_call_after_the_io_loop_stopped_writes_into_no_other_file() -> None:
    """A worker that outlived close() (its Fenced, its Done) calls loop.call: the wake-up byte must
    not go to the file that reused the closed wake pipe's descriptor number."""
    loop = IOLoop("test-stopped-wake")
    loop.start()
    old = loop._wake_w
    loop.stop()
    fds = [os.pipe() for _ in range(4)]  # one of them takes the old number (lowest free first)
    try:
        loop.call(lambda: None)
        for r, w in fds:
            os.set_blocking(r, False)
            with pytest.raises(BlockingIOError):
                got = os.read(r, 8)
                pytest.fail(f"{got!r} written into an unrelated pipe (fds {r}, {w}; the loop's was {old})")
    finally:
        for r, w in fds:
            os.close(r)
            os.close(w)


def test_a_socket_whose_descriptor_fired_without_a_message_is_read_again_when_one_comes() -> None:
    """A socket whose ZMQ_FD fired is received from without asking ZMQ_EVENTS first; when the signal
    was not a message (a command, or another thread's use took the message's), that receive finds none,
    takes the signal as an ask would, and messages that come later are still read (no tick here)."""
    loop = IOLoop("test-fired", tick=None, tick_interval=3600)
    got: list[bytes] = []
    loop.start()
    router, dealer, ident = _pair(loop, lambda _s, frames: got.extend(frames))
    try:
        for r in range(5):
            def spurious() -> None:  # as if its descriptor fired with nothing to read
                loop._fired.add(dealer)
                loop._ask.append(dealer)
            loop.call(spurious)
            wait_until(lambda: not loop._fired and loop._idle, WAIT, f"round {r}: the empty read")
            router.send_multipart([ident, b"%d" % r])
            wait_until(lambda: len(got) == r + 1, WAIT, f"round {r}: the message after it")
        assert got == [b"%d" % r for r in range(5)]
    finally:
        loop.stop()
        router.close(linger=0)


@pytest.mark.parametrize("handed_over", [True, False])
def test_a_send_that_fails_still_calls_then(handed_over: bool) -> None:
    """``send(..., then=...)`` calls ``then`` once the send is over, also when the send raised (logged, as any
    I/O call's error): prefill wakes its hosts there after a room's ``Done`` (``PrefillManager.notify``), so a
    send that failed on the I/O thread left a host asleep on a room already SUCCESS, until its own timeout.
    Sent from the calling thread, the failure was already logged and ``then`` called."""
    loop = IOLoop("test-then", tick=None, tick_interval=3600)
    woken = threading.Event()

    def broken() -> Any:
        raise RuntimeError("no channel here")

    if handed_over:
        loop.send(broken, b"x", then=woken.set)  # the loop does not run yet: handed over to its thread
        loop.start()
    else:
        loop.start()
        wait_until(lambda: loop._idle, WAIT, "the loop asleep")
        loop.send(broken, b"x", then=woken.set)
    try:
        assert woken.wait(WAIT), "then was not called after the failed send"
    finally:
        loop.stop()
