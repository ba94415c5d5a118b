"""A single I/O thread that owns zmq sockets and runs callbacks.

zmq sockets are not thread-safe, so every socket lives on one thread. Other
threads hand it outgoing frames through :meth:`IOLoop.send`, which wakes the
poller through a pipe; :meth:`IOLoop.call` runs a function on the I/O thread.
A periodic ``tick`` runs timeouts and heartbeats.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from . import protocol as P

log = logging.getLogger(__name__)

Handler = Callable[[zmq.Socket, list[bytes]], None]
#: Returns the socket to send on, looked up on the I/O thread (None: drop the message).
SocketGetter = Callable[[], "zmq.Socket | None"]


class IOLoop:
    def __init__(self, name: str, tick: Callable[[], None] | None = None, tick_interval: float = 0.05) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._handlers: dict[zmq.Socket, Handler] = {}
        self._outbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._tick = tick
        self._tick_interval = tick_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def on_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # -- used on the I/O thread only -------------------------------------------------
    def add_socket(self, sock: zmq.Socket, handler: Handler) -> None:
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket) -> None:
        if sock in self._handlers:
            self._poller.unregister(sock)
            del self._handlers[sock]
        sock.close(linger=0)

    # -- thread-safe -------------------------------------------------------------------
    def send(self, sock_getter: SocketGetter, frames: list[bytes]) -> None:
        """Send ``frames`` on the socket ``sock_getter()`` returns, on the I/O thread."""
        self.call(lambda: _send(sock_getter(), frames))

    def call(self, fn: Callable[[], None]) -> None:
        if self.on_io_thread():
            fn()
            return
        self._outbox.put((fn,))
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed during shutdown
            pass

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread.is_alive() and not self.on_io_thread():
            self._thread.join(timeout)

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        next_tick = time.monotonic() + self._tick_interval
        try:
            while not self._stop.is_set():
                timeout_ms = max(0.0, (next_tick - time.monotonic()) * 1000)
                events = dict(self._poller.poll(int(timeout_ms)))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                self._drain_outbox()
                for sock, handler in list(self._handlers.items()):
                    # A handler may have removed (closed) another socket meanwhile.
                    if sock in self._handlers and events.get(sock, 0) & zmq.POLLIN:
                        self._read(sock, handler)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self._tick_interval
                    if self._tick is not None:
                        try:
                            self._tick()
                        except Exception:
                            log.exception("kvbridge I/O tick failed")
            self._drain_outbox()
        finally:
            for sock in list(self._handlers):
                self.remove_socket(sock)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _drain_outbox(self) -> None:
        while True:
            try:
                (fn,) = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                log.exception("kvbridge I/O call failed")

    def _read(self, sock: zmq.Socket, handler: Handler) -> None:
        # Bounded: at most 256 messages per socket per wake-up so one chatty peer
        # cannot starve the others or the tick.
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handler(sock, frames)
            except Exception:
                log.exception("kvbridge control handler failed")
            if sock not in self._handlers:  # the handler closed it
                return


def _send(sock: zmq.Socket | None, frames: list[bytes]) -> None:
    if sock is None:
        return
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        log.warning("kvbridge control socket is full; dropped a message")
    except zmq.ZMQError as exc:
        log.warning("kvbridge control send failed: %s", exc)


def routed_message(sock: zmq.Socket, frames: list[bytes], who: str) -> tuple[bytes, P.Message] | None:
    """``(identity, message)`` of a frame pair read from a ROUTER socket, or None.

    A malformed or undecodable message is logged and answered with a
    :class:`~kvbridge.core.protocol.Reject` saying why; the server keeps serving.
    """
    if len(frames) != 2:
        log.warning("%s: dropped a control message with %d frames", who, len(frames))
        return None
    ident, data = frames
    try:
        return ident, P.decode(data)
    except P.ProtocolError as exc:
        log.warning("%s: rejected a control message from %r: %s", who, ident[:64], exc)
        _send(sock, [ident, P.encode(P.Reject(reason=str(exc)))])
        return None
