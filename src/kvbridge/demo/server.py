"""A host server with kvbridge inside: prefill or decode, its TP ranks as processes.

    python -m kvbridge.demo.server --role prefill --tp 2 --transfer-backend mooncake
    python -m kvbridge.demo.server --role decode --tp 1 --transfer-backend mooncake

Once every rank is up, rank 0 prints one line, ``READY {"front": ..., ...}``
(prefill adds its kvbridge bootstrap address). The supervisor process forks
one process per TP rank; they join a gloo group on 127.0.0.1 and run the
model's tensor parallelism and the lock-step control (``ranks.py``) over it.

Where kvbridge comes in (the parts a host server copies):

- **start-up** (:meth:`RankServer.__init__`): the caches are described once
  (``Caches.kvargs()``: every pool through its state handler) and each rank
  makes its manager: ``PrefillManager`` (registered with the bootstrap server
  that prefill rank 0 runs) or ``DecodeManager``;
- **prefill** (:class:`PrefillServer`): a ``Sender`` per request and rank;
  chunked prefill. With ``--layerwise`` (the default) a chunk is sent with
  ``send(..., layerwise=True)`` before it is computed and each layer is
  announced (``layer_ready``) as the model has written its caches, so the
  transfer runs during compute; the chunk's last layer is announced only
  after the metadata row is filled in (last chunk). A chunk computed before
  decode's destination lists arrived is sent whole once they have, as with
  ``--no-layerwise``, where each chunk's pages go when the chunk is
  computed; the last chunk carries the state indices;
- **decode** (:class:`DecodeServer`): allocate pages and slots, a ``Receiver``
  per request and rank, ``init`` with where everything goes; when every rank
  reports SUCCESS (the metadata row, written last, has landed) it reads the
  first token from that row and decodes from what it received.

Front protocol (zmq ROUTER on rank 0, one JSON object per message):
``{"op": "info"}``, ``{"op": "prefill", "room", "prompt"}`` (answered by
``prefilled``), ``{"op": "decode", "room", "prompt", "max_new_tokens",
"bootstrap"}`` (answered by ``first`` then ``done``), ``{"op": "abort", "room", "reason"}``,
``{"op": "stats"}``, ``{"op": "shutdown"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import datetime
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import zmq

from kvbridge.config import TransferConfig, add_transfer_args
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.control.metrics import snapshot
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender
from kvbridge.demo.parent import follow_parent

from .cache import META, Caches, Seq, Sizes
from .generate import Output, decode_step, prefill_chunks
from .model import LAYERS, TP, Model, ModelConfig
from .ranks import Control

__all__ = ["Announcer", "add_arguments", "fill_row", "main"]

log = logging.getLogger(__name__)
FAULTS = ("corrupt-kv-page", "drop-mamba-state")


def _faults(text: str) -> list[str]:
    faults = text.split(",")
    if not set(faults) <= set(FAULTS):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(FAULTS)}, got {text!r}")
    return faults


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, choices=("prefill", "decode"),
                        help="which half of the pair this server is")
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2, 4), help="tensor-parallel ranks (default: 1)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model and caches live (default: cpu)")
    parser.add_argument("--port", type=int, default=0, help="front port on --transfer-host (default: 0, any free port)")
    parser.add_argument("--chunk-size", type=_positive, default=64,
                        help="prefill chunk, in tokens, a multiple of 16 (default: 64)")
    parser.add_argument("--slots", type=_positive, default=16, help="requests held at once (default: 16)")
    parser.add_argument("--draft", action=argparse.BooleanOptionalAction, default=True, help="run the MTP draft head")
    parser.add_argument("--seed", type=int, default=0, help="model weights seed; both servers must agree (default: 0)")
    parser.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill: send each layer of a chunk as it is computed, not the chunk once computed "
                             "(default: on)")
    # Tests only: damage what arrived for the first requests (one fault each), to prove the token check notices.
    parser.add_argument("--inject-fault", type=_faults, default=[], help=argparse.SUPPRESS)
    add_transfer_args(parser)


# -- layer-wise sending ---------------------------------------------------------------------------
class Announcer:
    """``prefill_chunks``' ``on_layer``: announces the layers of a chunk sent with ``send(..., layerwise=True)``
    (after :meth:`start`) as the model writes each one's caches, except the chunk's last layer, which
    :meth:`finish` announces once the host has written what must land before it (with the last chunk,
    the metadata row: kvbridge writes it once every layer is announced). Does nothing between chunks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sender: Sender | None = None
        self.announced: set[tuple[int, bool]] = set()

    def start(self, sender: Sender) -> None:
        self.sender, self.announced = sender, set()

    def __call__(self, layer: int, draft: bool) -> None:
        s = self.sender
        if s is not None and (layer, draft) in s.layers and (layer, draft) != s.layers[-1]:
            s.layer_ready(layer, draft=draft, ready=self.ready())
            self.announced.add((layer, draft))

    def finish(self) -> None:
        """Announce the rest of the chunk's layers (its last, and any the model did not report)."""
        s, self.sender = self.sender, None
        if s is None:
            return
        rest = [key for key in s.layers if key not in self.announced]
        for draft in (False, True):
            ids = [layer for layer, d in rest if d == draft]
            if ids:
                s.layer_ready(ids, draft=draft, ready=self.ready())

    def ready(self) -> Any:
        """On CUDA, an event after the kernels queued so far (the transfer threads wait on it); on CPU, None."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event


def fill_row(caches: Caches, seq: Seq, room: int, prompt_len: int) -> None:
    """The metadata row kvbridge writes last (the commit point): the first token and the draft head's guess."""
    first, guess = seq.first
    row = caches.meta[seq.row]
    row.zero_()
    for key, value in (("room", room), ("prompt_len", prompt_len), ("first_token", first), ("draft_token", guess)):
        row[META[key]] = value


# -- jobs -----------------------------------------------------------------------------------------
@dataclass
class Job:
    room: int
    prompt: list[int]
    client: str  # the router's identity, for the answers (rank 0)
    seq: Seq | None = None  # where it lives in this rank's caches, once admitted


@dataclass
class PrefillJob(Job):
    sender: Sender | None = None
    compute: Iterator[tuple[int, int]] | None = None
    unsent: list[tuple[list[int], bool]] = field(default_factory=list)  # (pages, last) computed, not sent yet
    announcer: Announcer | None = None
    next_start: int = 0  # the first prompt token of the next chunk to compute
    chunks: int = 0  # computed so far
    layerwise_chunks: int = 0
    computed_at: float | None = None
    last_sent_at: float | None = None
    compute_s: float = 0.0
    transfer_s: float | None = None


@dataclass
class DecodeJob(Job):
    receiver: Receiver | None = None
    max_new_tokens: int = 1
    bootstrap: str = ""
    out: Output | None = None
    landed_at: float | None = None


# -- the rank loop ------------------------------------------------------------------------------
class RankServer:
    """One TP rank. Every rank runs the same loop on the same inputs; rank 0 also talks to the router."""

    role = ""
    final_op = ""  # the op of a request's last answer
    manager: PrefillManager | DecodeManager

    def __init__(self, args: argparse.Namespace, transfer: TransferConfig, rank: int, model_group: Any) -> None:
        self.args, self.transfer = args, transfer
        self.control = Control(rank, args.tp)
        self.rank = rank
        self.device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if args.device == "cuda" else "cpu")
        self.cfg = ModelConfig(draft=args.draft, seed=args.seed)
        tp = TP(rank, args.tp, model_group)
        self.model = Model(self.cfg, tp, self.device)
        self.caches = Caches(self.cfg, tp, self.device, self.role, Sizes(slots=args.slots))
        self.kvargs = self.caches.kvargs()  # every pool, described once through its state handler
        self.jobs: dict[int, Any] = {}  # room -> job, in arrival order (the same on every rank)
        self.waiting: list[Any] = []  # arrived, not yet allocated
        self.front: zmq.Socket | None = None
        self.stopping = False
        self.info: dict[str, Any] = {"role": self.role, "tp": args.tp, "device": args.device,
                                     "backend": transfer.backend, "draft": args.draft, "seed": args.seed}

    # rank 0's socket; every rank gets what it read through ``control.broadcast``
    def _bind(self) -> None:
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        host, port = self.transfer.host, self.args.port
        if port:
            self.front.bind(f"tcp://{host}:{port}")
        else:
            port = self.front.bind_to_random_port(f"tcp://{host}")
        self.info["front"] = f"tcp://{host}:{port}"

    def _receive(self, busy: bool) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if self.rank == 0:
            assert self.front is not None
            if self.front.poll(0 if busy else 10):
                while self.front.poll(0) and len(msgs) < 64:
                    ident, payload = self.front.recv_multipart()
                    try:
                        msg = json.loads(payload)
                        if not isinstance(msg, dict):
                            raise ValueError("not a JSON object")
                    except ValueError as exc:
                        self.front.send_multipart([ident, json.dumps({"op": "error", "reason": str(exc)}).encode()])
                        continue
                    msg["_ident"] = ident.hex()
                    msgs.append(msg)
        return self.control.broadcast(msgs)

    def reply(self, msg: dict[str, Any], to: str) -> None:
        """Rank 0 answers the router (``to``: the identity its request came from)."""
        if self.rank == 0 and self.front is not None:
            self.front.send_multipart([bytes.fromhex(to), json.dumps(msg).encode()])

    def run(self) -> None:
        if self.rank == 0:
            self._bind()
        self.start()
        self.control.barrier()
        if self.rank == 0:
            print("READY " + json.dumps(self.info), flush=True)
        try:
            while not self.stopping:
                for msg in self._receive(busy=bool(self.jobs or self.waiting or getattr(self, "fencing", None))):
                    self.handle(msg)
                self.step()
        finally:
            self.close()

    def handle(self, msg: dict[str, Any]) -> None:
        op, to = msg.get("op"), msg["_ident"]
        if op == "info":
            self.reply({"op": "info", **self.info}, to)
        elif op == "stats":
            ranks = self.control.gather(snapshot())  # kvbridge's metrics of every rank
            self.reply({"op": "stats", "role": self.role, "ranks": ranks}, to)
        elif op == "shutdown":
            self.reply({"op": "bye"}, to)
            self.stopping = True
        elif op == "abort":  # the other server failed this request: stop waiting for it
            room = msg.get("room")
            job = self.jobs.get(room) if isinstance(room, int) else None
            job = job or next((j for j in self.waiting if j.room == room), None)
            if job is not None:
                if job in self.waiting:
                    self.waiting.remove(job)
                self.finish(job, False, str(msg.get("reason") or "aborted by the router"))
        elif op == self.role:
            problem = self.check(msg)
            if problem is None:
                self.waiting.append(self.new_job(msg))
            else:  # answered at once, nothing allocated
                self.reply({"op": self.final_op, "room": msg.get("room"), "ok": False, "reason": problem}, to)
        else:
            self.reply({"op": "error", "reason": f"unknown op {op!r} for a {self.role} server"}, to)

    def check(self, msg: dict[str, Any]) -> str | None:
        """Why a request cannot be served, or None."""
        room, prompt = msg.get("room"), msg.get("prompt")
        if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
            return f"room must be an integer in 0 .. 2**63-1, got {room!r}"
        if room in self.jobs or any(j.room == room for j in self.waiting):
            return f"room {room} is already being served"
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and 0 <= t < self.cfg.vocab for t in prompt):
            return f"prompt must be a non-empty list of token ids in 0 .. {self.cfg.vocab - 1}"
        return None

    def admit(self) -> None:
        """Allocate for waiting requests, oldest first, as long as the pools allow."""
        while self.waiting:
            job = self.waiting[0]
            job.seq = self.caches.alloc(job.room, self.capacity(job))
            if job.seq is None:
                if not self.jobs and not getattr(self, "fencing", None):  # nothing will ever be freed: it can never fit
                    self.waiting.pop(0)
                    self.finish(job, False, f"needs {self.capacity(job)} tokens of cache, more than this server has")
                    continue
                return
            self.waiting.pop(0)
            self.jobs[job.room] = job
            self.started(job)

    def close(self) -> None:
        self.manager.close()
        if self.front is not None:
            self.front.close()
            self.ctx.term()

    # -- what each role does ---------------------------------------------------------------------
    def start(self) -> None:
        """Make this rank's kvbridge manager."""
        raise NotImplementedError

    def new_job(self, msg: dict[str, Any]) -> Any:
        raise NotImplementedError

    def capacity(self, job: Any) -> int:
        """Tokens of cache the request needs."""
        raise NotImplementedError

    def started(self, job: Any) -> None:
        """The request has its places in the caches: make its Sender or Receiver."""
        raise NotImplementedError

    def step(self) -> None:
        """One iteration of the loop: admit, compute, move requests along."""
        raise NotImplementedError

    def finish(self, job: Any, ok: bool, reason: str | None) -> None:
        """Release the request's places and answer the router."""
        raise NotImplementedError


class PrefillServer(RankServer):
    role, final_op = "prefill", "prefilled"
    manager: PrefillManager

    def start(self) -> None:
        # Prefill rank 0 runs the bootstrap server every decode rank looks prefill's ranks up in.
        self.bootstrap = None
        if self.rank == 0:
            host, _, port = (self.transfer.bootstrap or f"{self.transfer.host}:0").rpartition(":")
            self.bootstrap = BootstrapServer(host, int(port), secret_file=self.transfer.secret_file)
        address = self.control.broadcast(self.bootstrap.address if self.bootstrap else None)
        self.info["bootstrap"] = address
        self.manager = PrefillManager(self.kvargs, self.transfer.backend, bootstrap=address,
                                      config=self.transfer.session_config())

    def new_job(self, msg: dict[str, Any]) -> PrefillJob:
        return PrefillJob(room=msg["room"], prompt=msg["prompt"], client=msg["_ident"])

    def capacity(self, job: PrefillJob) -> int:
        return len(job.prompt)

    def started(self, job: PrefillJob) -> None:
        assert job.seq is not None
        # Decode's destination lists may already be here (kept by the manager) or arrive later.
        job.sender = Sender(self.manager, job.room, metadata_row=job.seq.row)
        job.announcer = Announcer(self.device)
        job.compute = prefill_chunks(self.model, self.caches, job.seq, job.prompt, self.args.chunk_size,
                                     on_layer=job.announcer)

    def step(self) -> None:
        self.admit()
        jobs = list(self.jobs.values())  # the same on every rank, as the collectives below need
        states = self.control.min([int(j.sender.poll()) for j in jobs])
        done = [j for j, state in zip(jobs, states) if state == Poll.SUCCESS and j.last_sent_at is not None]
        # Transfer latency: the last chunk handed to kvbridge -> the room done, on the slowest rank.
        for job, seconds in zip(done, self.control.max([j.sender.ended - j.last_sent_at for j in done])):
            job.transfer_s = seconds
            self.finish(job, True, None)
        for job, state in zip(jobs, states):
            if state == Poll.FAILED:
                self.finish(job, False, job.sender.failure() or "failed on another TP rank")
            elif state >= Poll.WAITING_FOR_INPUT and job.unsent:
                self._send(job)
        self._compute_one_chunk({j.room: Poll(state) for j, state in zip(jobs, states)})

    def _compute_one_chunk(self, states: dict[int, Poll]) -> None:
        """One chunk of a request still computing (``states``: each room's poll(), min over the ranks).

        Layer-wise, the oldest request whose decode lists every rank has goes first, and its chunk is
        sent before it is computed, its layers announced as they are; if no request has them yet, the
        oldest computes rather than leave the model idle, and its chunk waits in ``unsent`` to go whole.
        The choice rests on min-reduced states only: every rank computes the same chunk the same way.
        """
        computing = [j for j in self.jobs.values() if j.computed_at is None and j.room in states]
        ready = [j for j in computing if states[j.room] in (Poll.WAITING_FOR_INPUT, Poll.TRANSFERRING)]
        streaming = bool(self.args.layerwise and ready)
        job = ready[0] if streaming else computing[0] if computing else None
        if job is None:
            return
        assert job.compute is not None and job.seq is not None and job.sender is not None and job.announcer is not None
        P = self.cfg.page_size
        start, end = job.next_start, min(len(job.prompt), job.next_start + self.args.chunk_size)
        last = end == len(job.prompt)
        pages = job.seq.pages[start // P: -(-end // P) if last else end // P]
        if streaming:
            self._send(job)  # chunks computed before decode's lists arrived go first, whole
            state = self.caches.transfer_indices(job.seq, len(job.prompt))[1] if last else None
            job.sender.send(pages, state_indices=state, last=last, layerwise=True)
            job.announcer.start(job.sender)
        t0 = time.monotonic()
        got = next(job.compute)
        assert got == (start, end), (got, start, end)
        job.next_start, job.chunks = end, job.chunks + 1
        if streaming:
            if last:
                fill_row(self.caches, job.seq, job.room, len(job.prompt))
            if last:  # stamped before the hand-off: the room may end before finish() returns
                job.last_sent_at = time.monotonic()
            job.announcer.finish()  # the chunk's last layer, once the row is final
            job.layerwise_chunks += 1
        else:
            job.unsent.append((pages, last))
        job.compute_s += time.monotonic() - t0
        if last:
            job.computed_at = time.monotonic()
            next(job.compute, None)  # let the generator finish

    def _send(self, job: PrefillJob) -> None:
        """Send the chunks computed but not sent yet, each whole."""
        assert job.seq is not None and job.sender is not None
        for pages, last in job.unsent:
            if not last:
                job.sender.send(pages)
                continue
            fill_row(self.caches, job.seq, job.room, len(job.prompt))
            _, state = self.caches.transfer_indices(job.seq, len(job.prompt))
            # Stamped before send(): a small last chunk may be written, and the room end, inside it (inline writes).
            job.last_sent_at = time.monotonic()
            job.sender.send(pages, state_indices=state, last=True)  # then kvbridge writes the metadata row
        job.unsent = []

    def finish(self, job: PrefillJob, ok: bool, reason: str | None) -> None:
        if job.sender is not None and job.sender.poll() != Poll.FAILED and not ok:
            job.sender.abort(reason or "failed")
        self.jobs.pop(job.room, None)
        if job.seq is not None:
            self.caches.free(job.seq)
        self.reply({"op": "prefilled", "room": job.room, "ok": ok, "reason": reason, "compute_ms": 1e3 * job.compute_s,
                    "chunks": job.chunks, "layerwise_chunks": job.layerwise_chunks,
                    # what the transfer added after the last chunk was computed: the latency compute did not hide
                    "transfer_ms": 1e3 * job.transfer_s if job.transfer_s is not None else None}, job.client)

    def close(self) -> None:
        super().close()
        if self.bootstrap is not None:
            self.bootstrap.close()


class DecodeServer(RankServer):
    role, final_op = "decode", "done"
    manager: DecodeManager

    def start(self) -> None:
        self.manager = DecodeManager(self.kvargs, self.transfer.backend, config=self.transfer.session_config())
        self.faults = list(self.args.inject_fault)
        self.fencing: list[DecodeJob] = []  # aborted, pages held until poll() says FAILED

    def check(self, msg: dict[str, Any]) -> str | None:
        n, bootstrap = msg.get("max_new_tokens"), msg.get("bootstrap")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return f"max_new_tokens must be a whole number >= 1, got {n!r}"
        if not isinstance(bootstrap, str) or ":" not in bootstrap:
            return f"bootstrap must be prefill's HOST:PORT, got {bootstrap!r}"
        return super().check(msg)

    def new_job(self, msg: dict[str, Any]) -> DecodeJob:
        return DecodeJob(room=msg["room"], prompt=msg["prompt"], client=msg["_ident"],
                         max_new_tokens=msg["max_new_tokens"], bootstrap=msg["bootstrap"])

    def capacity(self, job: DecodeJob) -> int:
        return len(job.prompt) + job.max_new_tokens

    def started(self, job: DecodeJob) -> None:
        assert job.seq is not None
        job.receiver = Receiver(self.manager, job.room, bootstrap=job.bootstrap)
        pages, state = self.caches.transfer_indices(job.seq, len(job.prompt))
        job.receiver.init(pages, state_indices=state, metadata_row=job.seq.row)

    def step(self) -> None:
        for job in [j for j in self.fencing if j.receiver.poll() in (Poll.FAILED, Poll.SUCCESS)]:
            self.fencing.remove(job)
            self.caches.free(job.seq)
        self.admit()
        receiving = [j for j in self.jobs.values() if j.out is None]
        for job, state in zip(receiving, self.control.min([int(j.receiver.poll()) for j in receiving])):
            if state == Poll.FAILED:
                self.finish(job, False, job.receiver.failure() or "failed on another TP rank")
            elif state == Poll.SUCCESS:
                self._landed(job)
        for job in [j for j in self.jobs.values() if j.out is not None]:
            assert job.seq is not None and job.out is not None
            if len(job.out.tokens) >= job.max_new_tokens:
                self.finish(job, True, None)
                continue
            token, guess = decode_step(self.model, self.caches, job.seq, job.out.tokens[-1])
            job.out.tokens.append(token)
            job.out.draft.append(guess)

    def _landed(self, job: DecodeJob) -> None:
        """Every rank has everything (the metadata row is written last): decode from it."""
        assert job.seq is not None
        row = self.caches.meta[job.seq.row].tolist()
        if row[META["room"]] != job.room or row[META["prompt_len"]] != len(job.prompt):
            self.finish(job, False, f"metadata row {job.seq.row} holds room {row[META['room']]}, not {job.room}")
            return
        if self.faults:
            self._damage(job.seq, self.faults.pop(0))
        job.seq.length = len(job.prompt)
        job.out = Output([row[META["first_token"]]], [row[META["draft_token"]]])
        job.landed_at = time.monotonic()
        self.reply({"op": "first", "room": job.room, "token": job.out.tokens[0]}, job.client)

    def _damage(self, s: Seq, fault: str) -> None:
        """``--inject-fault``: what a broken transfer would leave behind."""
        if fault == "corrupt-kv-page":  # garbage bytes in the first page, every KV layer
            g = torch.Generator().manual_seed(1)
            for layer in (LAYERS["full"], LAYERS["sparse"]):
                for buf in (self.caches.k[layer], self.caches.v[layer]):
                    page = buf[s.pages[0]].view(torch.uint8)
                    page.copy_(torch.randint(0, 256, page.shape, generator=g, dtype=torch.uint8))
        else:
            self.caches.conv[s.slot].zero_()
            self.caches.ssm[s.slot].zero_()

    def finish(self, job: DecodeJob, ok: bool, reason: str | None) -> None:
        if job.receiver is not None and job.receiver.poll() not in (Poll.FAILED, Poll.SUCCESS):
            job.receiver.abort(reason or "failed")
        self.jobs.pop(job.room, None)
        if job.seq is not None:
            if job.receiver is not None and job.receiver.poll() not in (Poll.FAILED, Poll.SUCCESS):
                self.fencing.append(job)  # prefill may still be writing its pages: free them at FAILED
            else:
                self.caches.free(job.seq)
        out = job.out or Output()
        self.reply({"op": "done", "room": job.room, "ok": ok, "reason": reason, "tokens": out.tokens,
                    "draft": out.draft if self.cfg.draft else [],
                    "decode_ms": 1e3 * (time.monotonic() - job.landed_at) if job.landed_at else None}, job.client)


# -- processes ------------------------------------------------------------------------------------
def _rank_main(rank: int, args: argparse.Namespace, transfer: TransferConfig, store: str) -> None:
    with contextlib.suppress(Exception):  # die with the supervisor, however it ends (Linux)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor handles Ctrl-C and stops the ranks
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)  # ranks share the cores
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s {args.role}-tp{rank} %(name)s: %(message)s")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=120))
    model_group = None  # gloo, the control group, on CPU
    if args.device == "cuda" and args.tp > 1 and torch.cuda.device_count() >= args.tp:
        model_group = dist.new_group(backend="nccl")  # one GPU per rank: NCCL for the model's all-reduces
    server = (PrefillServer if args.role == "prefill" else DecodeServer)(args, transfer, rank, model_group)
    # What start-up made (torch's, the model's, the managers') lives as long as the rank: frozen, a full garbage
    # collection no longer walks it. Unfrozen, one took 75-96 ms on an H200 host, every thread stopped mid-request.
    gc.collect()
    gc.freeze()
    server.run()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # ends with the kvbridge demo that started it, even a SIGKILLed one
    parser = argparse.ArgumentParser(prog="python -m kvbridge.demo.server", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    transfer = TransferConfig.from_args(args, parser)  # a bad backend or option exits 2 with the usage line
    if args.chunk_size % ModelConfig.page_size:
        parser.error(f"argument --chunk-size: must be a multiple of the page size {ModelConfig.page_size}, "
                     f"got {args.chunk_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda was asked for but torch sees no CUDA device")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # TP traffic stays on loopback
    tmp = tempfile.mkdtemp(prefix=f"kvbridge-{args.role}-")
    # Forked ranks start in milliseconds (torch is imported once, here); CUDA is not fork-safe once
    # initialised (is_available() above may have), so CUDA ranks start afresh.
    ctx: Any = mp.get_context("spawn" if args.device == "cuda" else "fork")
    store = os.path.join(tmp, "store")  # the ranks' rendezvous (torch.distributed FileStore)
    ranks = [ctx.Process(target=_rank_main, args=(r, args, transfer, store), name=f"{args.role}-tp{r}")
             for r in range(args.tp)]
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    for p in ranks:
        p.start()
    try:
        while not stop and all(p.exitcode in (None, 0) for p in ranks) and any(p.is_alive() for p in ranks):
            time.sleep(0.05)
    finally:
        for p in ranks:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 5
        for p in ranks:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
    failed = [f"{p.name} exited with {p.exitcode}" for p in ranks if p.exitcode not in (0, -signal.SIGTERM)]
    if failed and not stop:
        print(f"{parser.prog}: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is closed; skip the interpreter's teardown of torch (half a second)
