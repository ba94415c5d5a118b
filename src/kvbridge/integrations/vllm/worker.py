"""The worker-side half of KVBridgeConnector: managers, senders, receivers, completions.

One ``PrefillManager`` (producer) and/or ``DecodeManager`` (consumer) per
worker, built once vLLM registers its KV cache tensors. Prefill: a finished
request's room gets a ``Sender`` from the step's metadata; once every decode
rank's request has arrived it sends the request's blocks in one chunk (the
tail decode asked for); the request is reported ``finished_sending`` (vLLM
frees its blocks) at SUCCESS or FAILED. Decode: ``start_load_kv`` creates a
``Receiver`` per request and tells prefill its blocks; SUCCESS reports
``finished_recving``; FAILED reports it too, with its blocks as load
errors, but only once no byte of the room can land any more
(``Receiver.fenced``): until then vLLM keeps the blocks.

Decode-first requests (``decode_first.py``): prefill opens the room's
``Sender`` when vLLM admits the request; the step that ends its prompt sends
it layer-wise if decode's blocks are known by then (``layerwise.py``), else
whole once they are (the same path as a finished request).
"""

from __future__ import annotations

import logging
from typing import Any

from kvbridge import BootstrapServer, DecodeManager, Poll, PrefillManager, Receiver, Sender

from .layerwise import LayerwiseSends, send_when_ready
from .layout import MAMBA_SPACE
from .metadata import KVBridgeMetadata, RecvSpec, SendSpec

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)


class WorkerSide:
    """Worker-side state of one connector; ``KVBridgeConnector`` delegates to it."""

    def __init__(self, settings: Any, *, producer: bool, consumer: bool, tp_rank: int, multi_group: bool) -> None:
        self.settings = settings
        self.producer, self.consumer = producer, consumer
        self.tp_rank = tp_rank
        self.multi_group = multi_group  # vLLM takes block-level errors for one KV cache group only
        self.bootstrap_server: BootstrapServer | None = None
        self.prefill: PrefillManager | None = None
        self.decode: DecodeManager | None = None
        self.senders: dict[str, tuple[Sender, SendSpec | None, bool]] = {}  # req -> sender, what (None: not yet), sent
        self.layerwise = LayerwiseSends({})
        self.running: set[str] = set()  # decode-first requests vLLM has not finished yet (their blocks stay held)
        self.any_cache: Any = None  # a registered cache tensor (its device, for wait_for_save's event)
        self._begun: KVBridgeMetadata | None = None  # the step metadata begin_sends() last took
        self.receivers: dict[str, tuple[Receiver | None, RecvSpec]] = {}
        self.load_errors: set[int] = set()
        self.unfenced: set[str] = set()  # FAILED rooms not yet fenced (reported once they are)

    def register(self, kvargs: Any, owners: dict[str, int], any_cache: Any = None) -> None:
        """Build the managers over ``kvargs``; ``owners``: vLLM layer name -> kvbridge layer id (layer-wise sends)."""
        self.layerwise = LayerwiseSends(owners)
        self.any_cache = any_cache
        cfg = self.settings.transfer
        session = cfg.session_config()
        if self.producer:
            if self.settings.serve_bootstrap and self.tp_rank == 0:
                host, _, port = cfg.bootstrap.rpartition(":")
                self.bootstrap_server = BootstrapServer(host, int(port), secret_file=cfg.secret_file)
            self.prefill = PrefillManager(kvargs, cfg.backend, bootstrap=cfg.bootstrap, config=session)
        if self.consumer:
            self.decode = DecodeManager(kvargs, cfg.backend, config=session)

    # -- each step ---------------------------------------------------------------------------
    def _sender(self, req_id: str, room: int) -> Sender:
        """The request's open ``Sender``, or a new one for ``room``."""
        if req_id in self.senders:
            return self.senders[req_id][0]
        if self.prefill is None:
            raise RuntimeError("KVBridgeConnector: asked to send on a worker without kv_producer role")
        return Sender(self.prefill, room)

    def begin_sends(self, meta: KVBridgeMetadata) -> None:
        """This step's opens, sends and aborts, once per step's metadata.

        Called from the step's first ``save_kv_layer`` (vLLM 0.33 runs ``start_load_kv`` after the
        forward, too late for a layer-wise send) and again from ``start_load_kv`` (a no-op then).
        """
        if meta is self._begun:
            return
        self._begun = meta
        for req_id, room in meta.to_open.items():
            self.senders[req_id] = (self._sender(req_id, room), None, False)
            self.running.add(req_id)
        for req_id, spec in meta.to_send.items():
            sender = self._sender(req_id, spec.room)
            sent = False
            if spec.layerwise and sender.poll() == Poll.WAITING_FOR_INPUT:  # decode's blocks are known: per layer
                sender.send(self._source_blocks(sender, spec), last=True, layerwise=True)  # one group: no state
                self.layerwise.start(req_id, sender)
                sent = True
            elif spec.layerwise and sender.poll() == Poll.BOOTSTRAPPING:
                log.info("kvbridge: request %s (room %d): decode's blocks are not known at its last prefill step; "
                         "it is sent whole once they are", req_id, spec.room)
            self.senders[req_id] = (sender, spec, sent)
        for req_id, (room, why) in meta.to_abort.items():
            sender = self._sender(req_id, room)
            sender.abort(why)
            self.senders[req_id] = (sender, self.senders.get(req_id, (None, None))[1], True)

    def start_load_kv(self, meta: KVBridgeMetadata) -> None:
        self.begin_sends(meta)
        for req_id, spec in meta.to_recv.items():
            if spec.error is not None:
                self.receivers[req_id] = (None, spec)
                continue
            if self.decode is None:
                raise RuntimeError("KVBridgeConnector: asked to receive on a worker without kv_consumer role")
            recv = Receiver(self.decode, spec.room, bootstrap=spec.bootstrap)
            recv.init(spec.block_ids, {MAMBA_SPACE: spec.state_ids} if spec.state_ids else None)
            self.receivers[req_id] = (recv, spec)

    def results(self, finished_req_ids: set[str] = frozenset()) -> tuple[set[str], set[str], set[str]]:  # type: ignore[assignment]
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        A decode request vLLM finished (aborted) while its room loads gets the room aborted: vLLM
        keeps its blocks until it is reported finished receiving, which kvbridge's fencing makes
        safe (FAILED only once no byte of the room can land any more).
        """
        for req_id in finished_req_ids & self.receivers.keys():
            recv = self.receivers[req_id][0]
            if recv is not None:
                recv.abort("the request was finished by vLLM while loading")
        # vLLM's scheduler frees a request's blocks at finished_sending: report a decode-first request only
        # once vLLM finished it (its room may be done first, or fail while the request still runs).
        self.running -= finished_req_ids
        sent: set[str] = set()
        for req_id, (sender, spec, done) in list(self.senders.items()):
            state = sender.poll()
            if state == Poll.WAITING_FOR_INPUT and not done and spec is not None:
                if spec.layerwise:  # its last prefill step may still run on the GPU
                    send_when_ready(sender, self._source_blocks(sender, spec), self.any_cache)
                else:  # a finished request: its step's output was processed, the bytes are final
                    sender.send(self._source_blocks(sender, spec), self._state_blocks(spec), last=True)
                self.senders[req_id] = (sender, spec, True)
                state = sender.poll()
            if state in (Poll.SUCCESS, Poll.FAILED) and req_id not in self.running:
                if state == Poll.FAILED:
                    log.warning("kvbridge: sending request %s (room %d) failed: %s", req_id, sender.room, sender.failure())
                del self.senders[req_id]
                sent.add(req_id)
        recvd: set[str] = set()
        failed: set[str] = set()
        for req_id, (recv, spec) in list(self.receivers.items()):
            state = Poll.FAILED if recv is None else recv.poll()
            if state not in (Poll.SUCCESS, Poll.FAILED):
                continue
            if recv is not None and not recv.fenced:
                # FAILED at fence_timeout while a prefill rank may still write (frozen, cut off): vLLM
                # would reuse the blocks once told, so keep them until it confirms or its process is gone.
                if req_id not in self.unfenced:
                    self.unfenced.add(req_id)
                    log.warning("kvbridge: request %s (room %d) failed (%s) but a prefill rank may still write "
                                "its blocks; they stay held until it confirms or is gone", req_id, spec.room,
                                recv.failure())
                continue
            self.unfenced.discard(req_id)
            del self.receivers[req_id]
            recvd.add(req_id)
            if state == Poll.FAILED:
                why = spec.error if recv is None else recv.failure()
                log.error("kvbridge: loading request %s (room %d) failed: %s; %d block(s) reported", req_id,
                          spec.room, why, len(spec.block_ids))
                if self.multi_group:
                    failed.add(req_id)
                else:
                    self.load_errors.update(spec.block_ids)
                    self.load_errors.update(spec.state_ids)
        return sent, recvd, failed

    @staticmethod
    def _state_blocks(spec: SendSpec) -> dict[str, list[int]] | None:
        """The request's Mamba state blocks (``mamba_page`` indices), or None without Mamba groups."""
        if not spec.state_groups:
            return None
        return {MAMBA_SPACE: [b for g in spec.state_groups for b in spec.block_ids[g]]}

    def _source_blocks(self, sender: Sender, spec: SendSpec) -> list[int]:
        """Prefill's KV blocks in decode's order: every attention group's, or (one group) the tail decode asked for."""
        flat = [b for g, ids in enumerate(spec.block_ids) if g not in spec.state_groups for b in ids]
        asked = {len(req.indices["kv_page"].array) for pid in sender.peer_ids()
                 if (req := sender.request(pid)) is not None and "kv_page" in req.indices}
        if len(asked) == 1 and not self.multi_group:
            n = asked.pop()
            return flat[len(flat) - n:] if n <= len(flat) else flat  # too many asked: kvbridge fails the room
        return flat

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self) -> None:
        for recv, _ in self.receivers.values():
            if recv is not None:
                recv.abort("vLLM worker shut down")
        for sender, _, _ in self.senders.values():
            sender.abort("vLLM worker shut down")
        for obj in (self.decode, self.prefill, self.bootstrap_server):
            if obj is not None:
                obj.close()
        self.senders.clear()
        self.receivers.clear()
