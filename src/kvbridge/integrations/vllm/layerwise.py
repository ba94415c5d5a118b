"""Prefill's worker side of layer-wise sending: which layers are final, announced to their rooms.

A decode-first request's last prefill step sends its blocks with
``Sender.send(..., layerwise=True)`` (``worker.py``); then, as vLLM's
attention layers call ``save_kv_layer`` during the forward, each kvbridge
layer is announced with ``Sender.layer_ready`` once every vLLM layer whose
bytes it holds has been saved (layers that alias one region: all of them),
with a CUDA event recorded on the current stream where the cache is on a GPU
(the transfer thread waits on it, not the host). ``wait_for_save`` announces
whatever the forward did not report (a layer that never calls
``save_kv_layer``), after the whole forward.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvbridge import Sender

__all__ = ["LayerwiseSends", "ready_event", "send_when_ready"]

log = logging.getLogger(__name__)


def ready_event(tensor: Any) -> Any:
    """A CUDA event recorded after the kernels queued so far on the current stream; None for host memory."""
    if not getattr(tensor, "is_cuda", False):
        return None  # the forward ran synchronously on the host: the bytes are final now
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def send_when_ready(sender: Sender, pages: list[int], tensor: Any) -> None:
    """Send a request's blocks whole, after the kernels queued so far on the current stream (host memory: now).

    For a decode-first request whose decode asked only after its last prefill step started: on a GPU
    that step's kernels may still be running, so every layer is announced with one event, not sent bare.
    """
    event = ready_event(tensor)
    if event is None or not sender.layers:
        sender.send(pages, last=True)
        return
    sender.send(pages, last=True, layerwise=True)
    for draft in (False, True):
        ids = [lid for lid, d in sender.layers if d == draft]
        if ids:
            sender.layer_ready(ids, draft=draft, ready=event)


class LayerwiseSends:
    """The rooms sent layer-wise in the current step, and the layers announced to them so far."""

    def __init__(self, owners: Mapping[str, int]) -> None:
        self.owners = dict(owners)  # vLLM layer name -> the kvbridge layer id holding its bytes
        self.names_of: dict[int, set[str]] = {}
        for name, lid in self.owners.items():
            self.names_of.setdefault(lid, set()).add(name)
        self.rooms: dict[str, tuple[Sender, set[int]]] = {}  # request id -> sender, its layers not announced
        self.saved: dict[int, set[str]] = {}  # kvbridge layer -> its vLLM layers saved this step

    def start(self, req_id: str, sender: Sender) -> None:
        """``sender`` just sent its chunk layer-wise: every one of its layers must be announced this step."""
        self.rooms[req_id] = (sender, {lid for lid, draft in sender.layers if not draft})

    def saved_layer(self, name: str, tensor: Any) -> None:
        """``save_kv_layer(name, ...)``: announce the kvbridge layer once all its vLLM layers are saved."""
        if not self.rooms:
            return
        lid = self.owners.get(name)
        if lid is None:
            return  # not a registered cache (e.g. a layer sharing another's KV cache)
        seen = self.saved.setdefault(lid, set())
        seen.add(name)
        if seen >= self.names_of[lid]:
            self._announce([lid], ready_event(tensor))

    def end_step(self, tensor: Any = None) -> None:
        """``wait_for_save``: announce every layer not announced yet; the step's layer-wise chunks are complete."""
        if self.rooms:
            left = sorted(set().union(*(layers for _, layers in self.rooms.values())))
            if left:
                log.debug("kvbridge: layers %s were not reported by save_kv_layer; announced after the forward", left)
                self._announce(left, ready_event(tensor))
        self.rooms.clear()
        self.saved.clear()

    def _announce(self, lids: list[int], ready: Any) -> None:
        for sender, left in self.rooms.values():
            mine = [lid for lid in lids if lid in left]
            if mine:
                left.difference_update(mine)
                sender.layer_ready(mine, ready=ready)
