"""The scheduler-side half of KVBridgeConnector: rooms, block lists, kv_transfer_params.

Prefill (``kv_producer``): a request that asks ``do_remote_decode`` keeps its
blocks when it finishes; its room, block ids and the bootstrap address go
back in ``kv_transfer_params``, and the workers send once decode asks.
Decode (``kv_consumer``): a request whose ``kv_transfer_params`` come from a
kvbridge prefill loads its whole prompt asynchronously (it waits in
``WAITING_FOR_REMOTE_KVS``); the workers receive into the blocks allocated.
Decode-first requests (``kvbridge_decode_first``, both legs sent at once) are
sent layer by layer; see ``decode_first.py``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .decode_first import DecodeFirstPrefill, is_decode_first
from .layout import mamba_groups, mamba_split
from .metadata import KVBridgeMetadata, RecvSpec, SendSpec
from .params import BadTransferParams, RoomCounter, parse_decode_first, parse_remote_prefill, prefill_params

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)

#: vLLM's null block (a placeholder for out-of-window sliding-window blocks).
NULL_BLOCK = 0


class SchedulerSide:
    """Scheduler-side state of one connector; ``KVBridgeConnector`` delegates to it."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, bootstrap: str | None, engine_id: str) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        self.kv_cache_config = kv_cache_config
        self.bootstrap = bootstrap
        self.engine_id = engine_id
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.rooms = RoomCounter()
        groups = kv_cache_config.kv_cache_groups
        # Sliding-window groups need only the blocks of the last window (+1 for a window not aligned to blocks).
        self.window_blocks = [
            -(-g.kv_cache_spec.sliding_window // g.kv_cache_spec.block_size) + 1
            if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 0
            for g in groups
        ]
        # Mamba groups' blocks are state blocks (layout.py's mamba_page space). Mamba2 states whose conv and SSM
        # state layout.py can slice move between any TP sizes; other kinds whole, between equal TP sizes only.
        self.state_groups = tuple(g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, MambaSpec))
        n_groups = mamba_groups(vllm_config.model_config.hf_text_config)
        self.mamba_whole = any(mamba_split(groups[g].kv_cache_spec, self.tp_size, n_groups) is None
                               for g in self.state_groups)
        self.to_send: dict[str, SendSpec] = {}
        self.to_recv: dict[str, RecvSpec] = {}
        self.sending: set[str] = set()  # finished prefill requests whose blocks the workers still hold
        self.decode_first = DecodeFirstPrefill(len(groups), self._clip)

    def _clip(self, block_ids: Any) -> tuple[tuple[int, ...], ...]:
        """Each group's transferable blocks: a sliding window's tail, without null placeholders."""
        out = []
        for ids, window in zip(block_ids, self.window_blocks):
            ids = list(ids)[-window:] if window else list(ids)
            out.append(tuple(int(b) for b in ids if b != NULL_BLOCK))
        return tuple(out)

    # -- decode ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.decode_first.allocated(request, blocks)  # prefill: a decode-first request's blocks
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if this is called again
        if num_external_tokens <= 0:
            return
        local = self._clip(blocks.get_unhashed_block_ids_all_groups())
        flat = tuple(b for g in local for b in g)
        try:
            if is_decode_first(params):
                self.to_recv[request.request_id] = self._decode_first_recv(request, local)
                return
            remote = parse_remote_prefill(params, len(self.kv_cache_config.kv_cache_groups), request.request_id)
            if request.num_prompt_tokens > remote.num_tokens:
                raise BadTransferParams(
                    f"request {request.request_id!r}: its prompt has {request.num_prompt_tokens} tokens but prefill "
                    f"computed {remote.num_tokens} (kvbridge_num_tokens); send decode the prompt prefill ran"
                )
            remote_tp = params.get("tp_size", self.tp_size)
            if self.mamba_whole and remote_tp != self.tp_size:
                raise BadTransferParams(
                    f"request {request.request_id!r}: prefill runs TP {remote_tp}, decode TP {self.tp_size}; "
                    "KVBridgeConnector moves this model's Mamba / linear-attention state whole, between equal TP "
                    "sizes only (it slices Mamba2 state whose config names n_groups)"
                )
            dst, state = self._pair(request.request_id, remote.block_ids, local)
            self.to_recv[request.request_id] = RecvSpec(remote.room, remote.bootstrap, dst, state_ids=state)
        except BadTransferParams as exc:
            log.error("kvbridge: %s; its %d block(s) are reported as failed loads", exc, len(flat))
            self.to_recv[request.request_id] = RecvSpec(0, "", flat, error=str(exc))

    def _decode_first_recv(self, request: Request, local: tuple[tuple[int, ...], ...]) -> RecvSpec:
        """A decode-first request: prefill's blocks are not known here; it sends them in decode's order."""
        room, bootstrap = parse_decode_first(request.kv_transfer_params, request.request_id)
        if len(local) != 1:
            raise BadTransferParams(
                f"request {request.request_id!r}: decode-first (layer-wise) transfers need a model with one KV cache "
                f"group; this one has {len(local)} (a hybrid model): send it through the default flow (prefill first, "
                "then decode with the prefill response's kv_transfer_params)"
            )
        return RecvSpec(room, bootstrap, local[0])

    def _pair(self, req_id: str, remote: tuple[tuple[int, ...], ...],
              local: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Decode's destination KV blocks and state blocks, each in the order prefill sends its own (each
        group's tail, group by group)."""
        dst: list[int] = []
        state: list[int] = []
        remote = self._clip(remote)
        for g, (src_ids, dst_ids) in enumerate(zip(remote, local)):
            if len(dst_ids) > len(src_ids):
                raise BadTransferParams(
                    f"request {req_id!r}: KV cache group {g} needs {len(dst_ids)} block(s) but prefill holds "
                    f"{len(src_ids)}; prefill and decode must serve the same model with the same block size"
                )
            if len(dst_ids) < len(src_ids) and len(local) > 1:
                raise BadTransferParams(
                    f"request {req_id!r}: decode hit its prefix cache in group {g} ({len(dst_ids)} of {len(src_ids)} "
                    "blocks to load); with several KV cache groups KVBridgeConnector loads whole requests only"
                )
            (state if g in self.state_groups else dst).extend(dst_ids)
        return tuple(dst), tuple(state)

    # -- prefill -----------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        keep = self.decode_first.finished(request, block_ids, self.to_send)
        if keep is not None:  # a decode-first request: its room is open on the workers until done
            self.sending.add(request.request_id)
            return keep, None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed: nothing to hand over
        if self.bootstrap is None:
            raise RuntimeError("KVBridgeConnector: a do_remote_decode request finished on an engine without "
                               "kv_connector_extra_config.bootstrap (HOST:PORT); set it on prefill engines")
        clipped = self._clip(block_ids)
        if not any(clipped):
            return False, None
        room = self.rooms.next()
        self.to_send[request.request_id] = SendSpec(room, clipped, state_groups=self.state_groups)
        self.sending.add(request.request_id)
        return True, prefill_params(room=room, bootstrap=self.bootstrap, block_ids=clipped,
                                    num_tokens=request.num_computed_tokens, engine_id=self.engine_id,
                                    request_id=request.request_id, tp_size=self.tp_size)

    # -- every step --------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self.decode_first.admit(request)

    def build_connector_meta(self, so: SchedulerOutput) -> KVBridgeMetadata:
        meta = KVBridgeMetadata(to_send=self.to_send, to_recv=self.to_recv)
        self.to_send, self.to_recv = {}, {}
        self.decode_first.build(so, meta)
        return meta

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_sending or ():
            self.sending.discard(req_id)

    def has_pending_push_work(self) -> bool:
        return bool(self.sending or self.to_send)
