"""The router: sends each request to a prefill server and a decode server, returns decode's tokens.

    python -m kvbridge.demo.router --prefill tcp://127.0.0.1:PORT --decode tcp://127.0.0.1:PORT

It asks both servers who they are (prefill's answer carries its kvbridge
bootstrap address), prints ``READY {"front": ...}`` and serves clients over a
zmq ROUTER socket, one JSON object per message:

- ``{"op": "generate", "id", "prompt": [token, ...], "max_new_tokens"}``: the
  router picks a *room* (the id prefill and decode share), sends the prompt to
  prefill and the prompt, the room and prefill's bootstrap address to decode,
  then answers ``{"op": "first", "id", "token"}`` as soon as decode has the
  first token and ``{"op": "done", "id", "ok", "reason", "tokens", "draft",
  "prefill": {...}, "decode": {...}}`` once both servers have answered;
- ``{"op": "stats"}``: both servers' kvbridge metrics, per rank;
- ``{"op": "shutdown"}``: stops both servers, then the router.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import zmq

from kvbridge.demo.parent import follow_parent

__all__ = ["main"]


class Router:
    def __init__(self, prefill: str, decode: str, host: str, port: int, request_timeout: float) -> None:
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        if port:
            self.front.bind(f"tcp://{host}:{port}")
        else:
            port = self.front.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.servers = {}
        for role, address in (("prefill", prefill), ("decode", decode)):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.servers[role] = sock
        self.timeout = request_timeout
        self.requests: dict[int, dict[str, Any]] = {}  # room -> the client's request and what came back
        self.pending_stats: list[tuple[bytes, dict[str, Any]]] = []
        self.running = True

    def ask(self, role: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request to a server and its answer (start-up and shutdown only)."""
        sock = self.servers[role]
        sock.send(json.dumps(msg).encode())
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"the {role} server did not answer {msg['op']!r} within {timeout:g} s")
        return json.loads(sock.recv())

    def start(self, timeout: float) -> None:
        info = {role: self.ask(role, {"op": "info"}, timeout) for role in self.servers}
        for role, answer in info.items():
            if answer.get("role") != role:
                raise SystemExit(f"router: the server given as --{role} is a {answer.get('role')} server")
        if info["prefill"]["seed"] != info["decode"]["seed"] or info["prefill"]["draft"] != info["decode"]["draft"]:
            raise SystemExit("router: prefill and decode must run the same model (--seed, --draft)")
        self.bootstrap = info["prefill"]["bootstrap"]

    def serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self.front, *self.servers.values()):
            poller.register(sock, zmq.POLLIN)
        while self.running:
            for sock, _ in poller.poll(100):
                if sock is self.front:
                    ident, payload = self.front.recv_multipart()
                    self.from_client(ident, json.loads(payload))
                else:
                    self.from_server(json.loads(sock.recv()))
            self.expire()

    def to_client(self, ident: bytes, msg: dict[str, Any]) -> None:
        self.front.send_multipart([ident, json.dumps(msg).encode()])

    def from_client(self, ident: bytes, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "generate":
            room = random.getrandbits(63)
            self.requests[room] = {"ident": ident, "id": msg.get("id"), "since": time.monotonic()}
            self.servers["prefill"].send(json.dumps({"op": "prefill", "room": room, "prompt": msg["prompt"]}).encode())
            self.servers["decode"].send(json.dumps({"op": "decode", "room": room, "prompt": msg["prompt"],
                                                    "max_new_tokens": msg["max_new_tokens"],
                                                    "bootstrap": self.bootstrap}).encode())
        elif op == "stats":
            self.pending_stats.append((ident, {}))
            for sock in self.servers.values():
                sock.send(json.dumps({"op": "stats"}).encode())
        elif op == "shutdown":
            for sock in self.servers.values():
                sock.send(json.dumps({"op": "shutdown"}).encode())
            self.to_client(ident, {"op": "bye"})
            self.running = False
        else:
            self.to_client(ident, {"op": "error", "reason": f"unknown op {op!r}; known: generate, stats, shutdown"})

    def from_server(self, msg: dict[str, Any]) -> None:
        if msg["op"] == "stats":
            ident, got = self.pending_stats[0]
            got[msg["role"]] = msg["ranks"]
            if len(got) == 2:
                self.pending_stats.pop(0)
                self.to_client(ident, {"op": "stats", **got})
            return
        req = self.requests.get(msg.get("room", -1))
        if req is None:
            return  # expired already
        if msg["op"] == "first":
            self.to_client(req["ident"], {"op": "first", "id": req["id"], "token": msg["token"]})
        elif msg["op"] in ("prefilled", "done"):
            role, other = ("prefill", "decode") if msg["op"] == "prefilled" else ("decode", "prefill")
            req[role] = msg
            if other in req:
                self.finish(msg["room"])
            elif not msg["ok"]:  # the other server would otherwise wait for its timeouts
                self.servers[other].send(json.dumps({"op": "abort", "room": msg["room"],
                                                     "reason": f"{role} failed: {msg['reason']}"}).encode())

    def finish(self, room: int, reason: str | None = None) -> None:
        req = self.requests.pop(room)
        p, d = req.get("prefill", {}), req.get("decode", {})
        ok = reason is None and p.get("ok") and d.get("ok")
        if reason is None:
            reason = "; ".join(f"{role}: {m['reason']}" for role, m in (("prefill", p), ("decode", d)) if not m.get("ok"))
        self.to_client(req["ident"], {"op": "done", "id": req["id"], "ok": bool(ok), "reason": reason or None,
                                      "tokens": d.get("tokens", []), "draft": d.get("draft", []),
                                      "prefill": p, "decode": d})

    def expire(self) -> None:
        now = time.monotonic()
        for room in [r for r, q in self.requests.items() if now - q["since"] > self.timeout]:
            self.finish(room, f"no answer within the router's request timeout ({self.timeout:g} s)")

    def close(self) -> None:
        self.front.close()
        for sock in self.servers.values():
            sock.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # ends with the kvbridge demo that started it, even a SIGKILLed one
    parser = argparse.ArgumentParser(prog="python -m kvbridge.demo.router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, metavar="ADDRESS", help="prefill server's front, tcp://HOST:PORT")
    parser.add_argument("--decode", required=True, metavar="ADDRESS", help="decode server's front, tcp://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0,
                        help="port to listen on, 0 for any free port (default: %(default)s)")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds to wait for both servers (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds before a request is failed (default: %(default)s)")
    args = parser.parse_args(argv)
    router = Router(args.prefill, args.decode, args.host, args.port, args.request_timeout)
    try:
        router.start(args.connect_timeout)
        print("READY " + json.dumps({"front": router.address, "bootstrap": router.bootstrap}), flush=True)
        router.serve()
    except TimeoutError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 1
    finally:
        router.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
