"""What the scheduler-side connector tells the workers each step (picklable: vLLM ships it to worker processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["KVBridgeMetadata", "RecvSpec", "SendSpec"]


@dataclass
class SendSpec:
    """Prefill: send a request's blocks in ``room`` (blocks per KV cache group, nulls dropped).

    ``layerwise``: a decode-first request's last prefill step; its layers go
    out as ``save_kv_layer`` reports them, if decode's blocks are known by then.
    ``state_groups``: the groups (Mamba) whose blocks are state blocks, sent in
    the ``mamba_page`` index space; the others' blocks are ``kv_page`` indices.
    """

    room: int
    block_ids: tuple[tuple[int, ...], ...]
    layerwise: bool = False
    state_groups: tuple[int, ...] = ()


@dataclass
class RecvSpec:
    """Decode: receive ``room`` from ``bootstrap`` into ``block_ids``.

    ``error`` set: nothing is asked for; the worker reports every block of
    ``block_ids`` as failed (a bad ``kv_transfer_params``, a block prefill
    no longer holds). ``state_ids``: the request's Mamba state blocks
    (``mamba_page`` indices, in prefill's order), apart from ``block_ids``.
    """

    room: int
    bootstrap: str
    block_ids: tuple[int, ...]
    error: str | None = None
    state_ids: tuple[int, ...] = ()


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    to_send: dict[str, SendSpec] = field(default_factory=dict)
    to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    #: Decode-first requests just admitted on prefill: their room's ``Sender`` opens now (request id -> room).
    to_open: dict[str, int] = field(default_factory=dict)
    #: Decode-first requests vLLM ended before they were sent: request id -> (room, why); decode is told.
    to_abort: dict[str, tuple[int, str]] = field(default_factory=dict)
