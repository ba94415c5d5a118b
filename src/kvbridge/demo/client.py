"""A client of the router: send prompts, receive the first token and then all tokens.

    python -m kvbridge.demo.client --router tcp://127.0.0.1:PORT "The quick brown fox"

Prompts are text; the model's tokens are bytes, so the reply is printed as
the token ids and their bytes (a model with random weights writes noise).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

import zmq

__all__ = ["Client", "main"]


class Client:
    """Requests over one DEALER socket; :meth:`events` yields the router's answers as they come."""

    def __init__(self, router: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(router)
        self._ids = itertools.count()

    def submit(self, prompt: list[int], max_new_tokens: int) -> int:
        """Send one request; returns its id (the ``id`` of its events)."""
        rid = next(self._ids)
        self.send({"op": "generate", "id": rid, "prompt": prompt, "max_new_tokens": max_new_tokens})
        return rid

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.send(json.dumps(msg).encode())

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next answer, or None after ``timeout`` seconds."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return json.loads(self.sock.recv())

    def call(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request whose answer has the same ``op`` (stats, shutdown's ``bye``)."""
        self.send(msg)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            answer = self.receive(left)
            if answer is not None and answer["op"] in (msg["op"], "bye", "error"):
                return answer
        raise TimeoutError(f"the router did not answer {msg['op']!r} within {timeout:g} s")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.demo.client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, metavar="ADDRESS", help="the router's front, tcp://HOST:PORT")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the answer (default: %(default)s)")
    parser.add_argument("prompt", help="the prompt text")
    args = parser.parse_args(argv)
    client = Client(args.router)
    try:
        start = time.monotonic()
        client.submit(list(args.prompt.encode()), args.max_new_tokens)
        while (answer := client.receive(max(0.0, start + args.timeout - time.monotonic()))) is not None:
            if answer["op"] == "first":
                print(f"first token {answer['token']} after {1e3 * (time.monotonic() - start):.1f} ms")
            elif answer["op"] == "done":
                if not answer["ok"]:
                    print(f"failed: {answer['reason']}", file=sys.stderr)
                    return 1
                print(f"tokens {answer['tokens']}\ntext   {bytes(answer['tokens'])!r}")
                return 0
        print(f"no answer within {args.timeout:g} s", file=sys.stderr)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
