"""A single I/O thread that owns zmq sockets and runs callbacks.

zmq sockets are not thread-safe, so one thread owns them: it reads them and
runs handlers, :meth:`IOLoop.call` hands it a function (through a queue and a
pipe), and a periodic ``tick`` runs timeouts and heartbeats. It holds a lock
whenever it is awake; :meth:`IOLoop.send` sends from the calling thread when
that lock is free (the I/O thread sleeps) and nothing handed over waits, else
it hands the send to the I/O thread.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

log = logging.getLogger(__name__)

#: How long messages queued when the loop stops may still take to leave (zmq's linger, in ms);
#: the process's exit waits for them at most this long.
STOP_LINGER_MS = 1000

#: A tick this late (seconds) means the I/O thread was held up: what arrived meanwhile is read first.
STALL = 0.25

Handler = Callable[[zmq.Socket, list[bytes]], None]
# Plain ints: zmq's are enum flags, and every ``&`` with one builds an enum member (on each wake-up).
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)


class Sends(Protocol):
    """What :meth:`IOLoop.send` sends on: a :class:`~kvbridge.core.control.channel.Channel`."""

    sock: zmq.Socket

    def send(self, payload: bytes, ident: bytes | None = None) -> None: ...


#: Returns the channel to send on, looked up as the message goes out, with the loop's lock held (None: drop it).
SocketGetter = Callable[[], "Sends | None"]


class IOLoop:
    def __init__(self, name: str, tick: Callable[[], None] | None = None, tick_interval: float = 0.05) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        # The thread sleeps on each socket's ZMQ_FD and the wake pipe, and asks a socket for ZMQ_EVENTS only
        # when its descriptor fired or code may have used the socket since it was last asked (see _run).
        # zmq.Poller asked every socket before and after each wait, each ask a getpid and a poll: #27.
        self._poll = select.poll()
        self._handlers: dict[zmq.Socket, Handler] = {}
        self._fds: dict[int, zmq.Socket] = {}  # each socket's ZMQ_FD
        self._outbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        # Guards _wake_w against its close at stop: a write after it would go to whatever file
        # reused the descriptor's number (a worker's Fenced can come after the loop stopped).
        self._wake_lock = threading.Lock()
        os.set_blocking(self._wake_r, False)
        self._poll.register(self._wake_r, select.POLLIN)
        #: True while the I/O thread may go to sleep: only then does a call write to the wake pipe.
        self._idle = False
        #: Sockets to ask for ZMQ_EVENTS before the thread sleeps (added ones: a message may wait already).
        self._ask: list[zmq.Socket] = []
        #: Sockets a Channel sent on from this thread since they were last asked (``_io.sent`` there).
        self._sent: set[zmq.Socket] = set()
        #: Sockets whose descriptor fired since they were last read: read without asking first (see _read).
        self._fired: set[zmq.Socket] = set()
        #: Held by whoever uses the sockets: the I/O thread, except while it sleeps; a thread sending (send).
        #: zmq's rule for a socket used by several threads: a full memory barrier between them (a lock).
        self._lock = threading.Lock()
        self._tick = tick
        self._tick_interval = tick_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ident: int | None = None  # the I/O thread's, once it runs (compared per call: no Thread property)

    def start(self) -> None:
        self._thread.start()

    def on_io_thread(self) -> bool:
        return threading.get_ident() == self._ident

    # -- used on the I/O thread only (or before start) -----------------------------------
    def add_socket(self, sock: zmq.Socket, handler: Handler) -> None:
        """Read ``sock`` with ``handler``, which sends on this loop's sockets through
        :class:`~kvbridge.core.control.channel.Channel` only (the loop then asks them again before it sleeps)."""
        fd = int(sock.getsockopt(zmq.FD))
        self._handlers[sock] = handler
        self._fds[fd] = sock
        self._poll.register(fd, select.POLLIN)
        self._ask.append(sock)

    def remove_socket(self, sock: zmq.Socket, linger_ms: int = 0) -> None:
        """Stop polling ``sock`` and close it; what it still queues is dropped, or sent for up to ``linger_ms``."""
        if sock in self._handlers:
            del self._handlers[sock]
            fd = int(sock.getsockopt(zmq.FD))
            del self._fds[fd]
            self._poll.unregister(fd)  # before the close: zmq closes the descriptor, and its number is reused
        sock.close(linger=linger_ms)

    # -- thread-safe -------------------------------------------------------------------
    def send(self, channel: SocketGetter, *payloads: bytes, ident: bytes | None = None,
             then: Callable[[], None] | None = None) -> None:
        """Send ``payloads`` in order (to ``ident`` on a ROUTER) on the channel ``channel()`` returns; then call
        ``then``, also after a send that failed (logged, never the caller's).

        From the calling thread when the I/O thread sleeps and nothing handed over waits for it (no hand-off:
        the thread's wake-up cost 20-60 us per message, #27); else on the I/O thread. Either way the sockets'
        lock is held, so sealing and sending follow one order per socket, and each thread's messages leave
        in the order it sent them.
        """
        if not self.on_io_thread() and self._outbox.empty() and self._lock.acquire(blocking=False):
            try:
                # Not running (not started, stopped: its sockets are closed) or a call handed over first: queue.
                now = self._ident is not None and self._outbox.empty()
                if now:
                    self._send(channel, payloads, ident)
            except Exception:  # as on the I/O thread: logged, never the caller's
                log.exception("kvbridge I/O call failed")
            finally:
                self._lock.release()
            if now:
                if then is not None:
                    then()
                return

        def send() -> None:
            try:
                self._send(channel, payloads, ident)
            finally:  # as above: a failed send is logged (by the loop) and ``then`` still runs
                if then is not None:
                    then()

        self.call(send)

    def _send(self, channel: SocketGetter, payloads: tuple[bytes, ...], ident: bytes | None) -> None:
        """Send on ``channel()`` (holding the lock); off the I/O thread, ask the socket for ZMQ_EVENTS after."""
        chan = channel()
        if chan is None:
            return
        for payload in payloads:
            chan.send(payload, ident)
        if _io.sent is None and chan.sock in self._handlers and int(chan.sock.getsockopt(_EVENTS)) & _POLLIN:
            # The send may have taken the signal of a message that arrived: the I/O thread reads it.
            self._ask.append(chan.sock)
            self._wake()

    def call(self, fn: Callable[[], None]) -> None:
        if self.on_io_thread():
            fn()
            return
        self._outbox.put((fn,))
        # The thread sets _idle before it looks at the outbox for the last time before sleeping: either it
        # sees this call there, or this sees _idle set (the GIL orders both). A busy thread needs no byte.
        if self._idle:
            self._wake()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive() and not self.on_io_thread():
            self._thread.join(timeout)

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:  # the loop has stopped and closed its pipe
                return
            try:
                os.write(self._wake_w, b"x")
            except OSError:  # the pipe is full: the loop is awake anyway
                pass

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        """Wait, run the calls handed over, read the sockets that may hold messages, tick.

        A ZMQ_FD is edge-triggered: it signals that a socket's state may have changed, and any use of the
        socket (a send, a receive, asking ZMQ_EVENTS) may take that signal while a message waits. So a
        socket is asked for ZMQ_EVENTS, and read while it says POLLIN, after its descriptor fired; after a
        call or the tick (any code), every socket is asked before the thread sleeps again; after the
        handlers, each socket a :class:`Channel` sent on meanwhile (handlers send through channels).
        One that gave its 256 messages of a wake-up is asked again too.
        """
        self._lock.acquire()  # released only while the thread sleeps, and at its end
        self._ident = threading.get_ident()
        _io.sent = self._sent
        next_tick = time.monotonic() + self._tick_interval
        outbox, fds, wake_r = self._outbox, self._fds, self._wake_r
        try:
            while not self._stop.is_set():
                timeout = 0
                if not self._ask:
                    self._idle = True
                    if outbox.empty():
                        # Rounded up: truncated, the last millisecond before each tick polled with 0 (a busy loop).
                        timeout = max(0, math.ceil((next_tick - time.monotonic()) * 1000))
                self._lock.release()
                try:
                    fired = self._poll.poll(timeout)
                finally:
                    self._lock.acquire()
                for fd, _ in fired:
                    sock = fds.get(fd)
                    if sock is not None:
                        self._ask.append(sock)
                        self._fired.add(sock)
                    elif fd == wake_r:
                        try:
                            os.read(wake_r, 65536)
                        except BlockingIOError:
                            pass
                self._idle = False
                if self._drain_outbox():
                    self._ask_all()  # a call may have used any socket
                self._read_asked()
                now = time.monotonic()
                if now >= next_tick:
                    if now - next_tick > STALL:
                        # This thread did not run for a while (a long call, a frozen or swapped-out
                        # process): read what arrived meanwhile before the tick judges peers silent.
                        self._ask_all()
                        self._read_asked()
                    next_tick = time.monotonic() + self._tick_interval
                    if self._tick is not None:
                        try:
                            self._tick()
                        except Exception:
                            log.exception("kvbridge I/O tick failed")
                        self._ask_all()  # it sends (heartbeats, Failed)
            self._drain_outbox()
        finally:
            for sock in list(self._handlers):
                # Messages sent just before the loop stopped (a room's Done, each room's Failed at
                # close) may still be in zmq's queue: closing with linger 0 dropped them, and
                # decode waited for a Done its prefill had already counted as SUCCESS.
                self.remove_socket(sock, STOP_LINGER_MS)
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1
            _io.sent = None
            self._ident = None  # a thread started later may get the same id
            self._lock.release()

    def _ask_all(self) -> None:
        self._ask = list(self._handlers)
        self._sent.clear()

    def _read_asked(self) -> None:
        """Read every socket in ``_ask`` that says POLLIN; leave in ``_ask`` those to ask again before sleeping."""
        asked, self._ask = list(dict.fromkeys(self._ask)), []
        fired, self._fired = self._fired, set()
        last = -1  # the index in ``asked`` of the last socket whose handler ran
        for i, sock in enumerate(asked):
            handler = self._handlers.get(sock)  # None: removed, by a handler perhaps
            if handler is not None and self._read(sock, handler, sock in fired):
                last = i
        sent = self._sent
        if sent:
            # Handlers sent on them: ask again each one not asked after the last handler ran.
            skip = {*asked[last:], *self._ask}
            self._ask += [s for s in sent if s not in skip and s in self._handlers]
            sent.clear()

    def _drain_outbox(self) -> bool:
        """Run the calls handed over; whether there were any."""
        outbox = self._outbox
        ran = False
        while not outbox.empty():  # this thread alone takes from it: not empty, get_nowait() succeeds
            (fn,) = outbox.get_nowait()
            ran = True
            try:
                fn()
            except Exception:
                log.exception("kvbridge I/O call failed")
        return ran

    def _read(self, sock: zmq.Socket, handler: Handler, fired: bool = False) -> bool:
        """Read ``sock`` while ZMQ_EVENTS says POLLIN; whether a handler ran. ``fired``: its descriptor fired,
        so a message most likely waits: received without asking first (a receive that finds none takes the
        signal as the ask would, and ends the read). Each ask is a Python enum lookup in pyzmq and a syscall
        or two in libzmq, before the handler of every message that wakes this thread (#27)."""
        # Bounded: at most 256 messages per socket per wake-up so one chatty peer
        # cannot starve the others or the tick.
        for i in range(256):
            if (i or not fired) and not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                return i > 0
            try:
                frames = _recv_frames(sock)
            except zmq.Again:
                return i > 0
            try:
                handler(sock, frames)
            except Exception:
                log.exception("kvbridge control handler failed")
            if sock not in self._handlers:  # the handler closed it
                return True
        self._ask.append(sock)  # it may hold more: asked again before the thread sleeps
        return True


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """``recv_multipart(NOBLOCK)``, told of a next frame by the frame, not by asking (``RCVMORE``): #27."""
    frames = []
    while True:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes)
        if not frame.more:
            return frames


class _IOThread(threading.local):
    #: On an IOLoop's thread: the set of sockets sent on since the loop last asked them (else None).
    sent: set[zmq.Socket] | None = None


_io = _IOThread()
