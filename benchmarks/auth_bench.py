"""What authenticating control messages costs: seal + open per message, and a round trip with and without.

    python benchmarks/auth_bench.py

Prints two tables. The first times :class:`kvbridge.core.auth.Auth` alone
(seal on one side, open on the other, replay check included) for message
sizes from a heartbeat to a 4 MiB transfer request. The second times a
DEALER -> ROUTER -> DEALER round trip over loopback TCP: plain frames, frames
sealed and opened by kvbridge, and CurveZMQ (libzmq's encryption, the
alternative docs/security.md weighs) for comparison.
"""

from __future__ import annotations

import os
import threading
import time

import zmq

from kvbridge.core.auth import Auth, Sealer

SIZES = [64, 1024, 64 << 10, 4 << 20]


def seal_open_us(size: int, n: int) -> float:
    auth = Auth(os.urandom(32))
    sealer, payload, me = Sealer(), os.urandom(size), {b"127.0.0.1:5000"}
    t0 = time.perf_counter()
    for _ in range(n):
        auth.open(auth.seal(payload, b"127.0.0.1:5000", sealer), me)
    return (time.perf_counter() - t0) / n * 1e6


def round_trip_us(mode: str, size: int, n: int) -> float:
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    auth = Auth(os.urandom(32)) if mode == "kvbridge" else None
    if mode == "curve":
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        server.curve_server, server.curve_secretkey = True, ssec
        client.curve_serverkey, client.curve_publickey, client.curve_secretkey = spub, cpub, csec
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.setsockopt(zmq.IDENTITY, b"client")
    client.connect(f"tcp://127.0.0.1:{port}")
    payload = os.urandom(size)
    s_seal, c_seal = Sealer(), Sealer()
    to_server = f"127.0.0.1:{port}".encode()

    def serve() -> None:
        for _ in range(n + 10):
            ident, frame = server.recv_multipart()
            if auth is not None:
                auth.open(frame, {to_server})
                frame = auth.seal(payload, ident, s_seal)
            server.send_multipart([ident, frame])

    thread = threading.Thread(target=serve)
    thread.start()
    times = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        client.send(auth.seal(payload, to_server, c_seal) if auth is not None else payload)
        frame = client.recv()
        if auth is not None:
            auth.open(frame, {b"client"})
        if i >= 10:  # the first ones include connecting (and the CURVE handshake)
            times.append(time.perf_counter() - t0)
    thread.join()
    server.close(0)
    client.close(0)
    ctx.term()
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    print("seal + open, one message (median of a loop)")
    print(f"{'bytes':>10} {'us/message':>12} {'MB/s':>10}")
    for size in SIZES:
        n = 20000 if size <= 1024 else (2000 if size <= 65536 else 50)
        us = seal_open_us(size, n)
        print(f"{size:>10} {us:>12.2f} {size / us:>10.0f}")
    print()
    print("round trip over loopback TCP, median microseconds")
    print(f"{'bytes':>10} {'plain':>10} {'kvbridge':>10} {'ratio':>7} {'curve':>10} {'ratio':>7}")
    for size in SIZES[:3]:
        n = 2000 if size <= 1024 else 500
        plain, sealed, curve = (round_trip_us(m, size, n) for m in ("plain", "kvbridge", "curve"))
        print(f"{size:>10} {plain:>10.1f} {sealed:>10.1f} {sealed / plain:>7.2f} {curve:>10.1f} {curve / plain:>7.2f}")


if __name__ == "__main__":
    main()
