"""Prefill's scheduler-side bookkeeping for decode-first (layer-wise) requests.

vLLM's usual P/D flow (NixlConnector's, and this connector's default) hands
decode the request only after prefill finished it, so prefill cannot know
decode's blocks while it computes, and nothing can be sent layer by layer.
In the decode-first flow (vLLM's own MoRIIO connector's WRITE mode works the
same way) the router sends both legs at once with one room
(:func:`~kvbridge.integrations.vllm.params.decode_first_params`): decode
allocates its blocks and tells prefill through kvbridge's bootstrap while
prefill queues and computes, so by prefill's last prefill step decode's
blocks are usually known and each layer goes out as ``save_kv_layer``
reports it.

Here: a decode-first request opens its room's ``Sender`` when vLLM admits it
(``on_new_request``), so decode's request never waits for a sender that does
not exist yet; its blocks are tracked as vLLM allocates them; the step that
computes its last prompt tokens carries a layer-wise ``SendSpec`` (earlier
chunks' layers are final by then, so one layer-wise chunk covers them all).
The request keeps its blocks until the workers report the room done, and a
request vLLM ends early has its room aborted, so decode is told at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .metadata import KVBridgeMetadata, SendSpec
from .params import DECODE_FIRST, BadTransferParams, check_room

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["DecodeFirstPrefill", "is_decode_first"]

log = logging.getLogger(__name__)


def is_decode_first(params: Any) -> bool:
    return bool(params) and bool(params.get(DECODE_FIRST))


@dataclass
class _Tracked:
    request: Request
    room: int
    blocks: list[list[int]] = field(default_factory=list)  # per KV cache group, as vLLM allocated them
    sent: bool = False  # its layer-wise SendSpec went to the workers


class DecodeFirstPrefill:
    """Decode-first requests on a prefill scheduler; ``SchedulerSide`` delegates to it."""

    def __init__(self, num_groups: int, clip: Any) -> None:
        self.num_groups = num_groups
        self.clip = clip  # SchedulerSide._clip: each group's transferable blocks
        self.tracked: dict[str, _Tracked] = {}
        self.to_open: dict[str, int] = {}
        self.to_abort: dict[str, tuple[int, str]] = {}

    def admit(self, request: Request) -> None:
        """``on_new_request``: open the room now (decode may already have asked for it)."""
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_decode") and is_decode_first(params)):
            return
        rid = request.request_id
        try:
            room = check_room(params.get("kvbridge_room"), f"request {rid!r}: kv_transfer_params")
            if self.num_groups != 1:
                raise BadTransferParams(
                    f"request {rid!r}: decode-first (layer-wise) transfers need a model with one KV cache group; "
                    f"this one has {self.num_groups} (a hybrid model): send it through the default flow (prefill "
                    "first, then decode with the prefill response's kv_transfer_params)"
                )
        except BadTransferParams as exc:
            # Prefill serves the request as a plain one; decode's room fails (it refuses the same model, or
            # no sender opens within sender_grace) and decode recomputes or fails per its policy.
            log.error("kvbridge: %s; prefill runs it without a transfer", exc)
            params["do_remote_decode"] = False  # nothing to hand over: request_finished frees its blocks
            return
        self.tracked[rid] = _Tracked(request, room)
        self.to_open[rid] = room

    def allocated(self, request: Request, blocks: Any) -> None:
        """``update_state_after_alloc``: every block the request holds now (again after a preemption)."""
        t = self.tracked.get(request.request_id)
        if t is not None and not t.sent:
            t.blocks = [list(g) for g in blocks.get_block_ids()]

    def build(self, so: SchedulerOutput, meta: KVBridgeMetadata) -> None:
        """Add this step's opens, aborts and layer-wise sends (the step that ends a request's prompt) to ``meta``."""
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())
        for i, rid in enumerate(cached.req_ids):
            t = self.tracked.get(rid)
            new = cached.new_block_ids[i]
            if t is None or t.sent or new is None:
                continue
            if rid in resumed:  # back from a preemption: vLLM sends its whole new block list
                t.blocks = [list(g) for g in new]
            else:
                t.blocks = [old + list(add) for old, add in zip(t.blocks, new)]
        for rid, t in self.tracked.items():
            n = so.num_scheduled_tokens.get(rid, 0)
            if not t.sent and n and t.request.num_computed_tokens + n >= t.request.num_prompt_tokens:
                meta.to_send[rid] = SendSpec(t.room, self.clip(t.blocks), layerwise=True)
                t.sent = True
        meta.to_open, meta.to_abort = self.to_open, self.to_abort
        self.to_open, self.to_abort = {}, {}

    def finished(self, request: Request, block_ids: Any, to_send: dict[str, SendSpec]) -> bool | None:
        """``request_finished`` for a decode-first request: whether vLLM must keep its blocks (None: not one).

        Its room is open on the workers, which report it finished sending once it is SUCCESS or FAILED:
        vLLM keeps the blocks until then (a layer-wise write may be reading them).
        """
        from vllm.v1.request import RequestStatus

        t = self.tracked.pop(request.request_id, None)
        if t is None:
            return None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if normal and not t.sent:  # not expected (the last prompt step carries it); send it whole, now
            to_send[request.request_id] = SendSpec(t.room, self.clip(block_ids))
        elif not normal:
            self.to_abort[request.request_id] = (
                t.room, f"prefill's vLLM ended request {request.request_id!r} ({request.status.name}) before it was sent")
        return True
