"""The ``kv_transfer_params`` a kvbridge prefill returns and a kvbridge decode takes.

A router passes the prefill response's ``kv_transfer_params`` unchanged into
the decode request, as it does for vLLM's NixlConnector. kvbridge's own keys
are prefixed ``kvbridge_``; the NixlConnector-style keys (``do_remote_prefill``,
``remote_block_ids``, ``remote_host``, ...) are filled too, so routers that
look at them find what they expect.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BadTransferParams", "RemotePrefill", "RoomCounter", "decode_first_params", "parse_decode_first",
           "parse_remote_prefill", "prefill_params"]

#: Largest room id: rooms travel as unsigned 64-bit integers; keep them positive int64.
_ROOM_BITS = 62


#: The key that marks a decode-first (layer-wise) request, on both legs.
DECODE_FIRST = "kvbridge_decode_first"


class BadTransferParams(ValueError):
    """A decode request's ``kv_transfer_params`` cannot be used; the text says which key and why."""


class RoomCounter:
    """Unique room ids for one prefill process: a random 30-bit prefix and a 32-bit counter.

    Rooms are never derived from request ids (two ids that hash alike would
    share a room and lose a request); the random prefix keeps two prefill
    servers that feed one decode apart.
    """

    def __init__(self) -> None:
        self._prefix = secrets.randbits(_ROOM_BITS - 32) << 32
        self._next = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._next = (self._next + 1) & 0xFFFFFFFF
            return self._prefix | self._next


def prefill_params(
    *, room: int, bootstrap: str, block_ids: Sequence[Sequence[int]], num_tokens: int, engine_id: str,
    request_id: str, tp_size: int,
) -> dict[str, Any]:
    """What prefill's ``request_finished`` returns for the router to pass to decode."""
    host, _, port = bootstrap.rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvbridge_room": room,
        "kvbridge_bootstrap": bootstrap,
        "kvbridge_block_ids": [list(map(int, g)) for g in block_ids],
        "kvbridge_num_tokens": int(num_tokens),
        # NixlConnector's names, for routers that read them (kvbridge reads only its own keys).
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [list(map(int, g)) for g in block_ids],
        "remote_host": host,
        "remote_port": int(port),
        "tp_size": tp_size,
    }


@dataclass(frozen=True)
class RemotePrefill:
    """A checked decode-side view of prefill's parameters."""

    room: int
    bootstrap: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


def parse_remote_prefill(params: Mapping[str, Any], num_groups: int, request_id: str) -> RemotePrefill:
    """Check the ``kvbridge_*`` keys of a decode request's ``kv_transfer_params``.

    Raises :class:`BadTransferParams` naming the request, the key, its value and what it must be.
    """
    where = f"request {request_id!r}: kv_transfer_params"
    missing = [k for k in ("kvbridge_room", "kvbridge_bootstrap", "kvbridge_block_ids", "kvbridge_num_tokens")
               if k not in params]
    if missing:
        raise BadTransferParams(
            f"{where} lack {', '.join(missing)} (has: {', '.join(sorted(map(str, params))) or 'nothing'}); pass the "
            "prefill response's kv_transfer_params to decode unchanged"
        )
    room = check_room(params["kvbridge_room"], where)
    bootstrap = _check_bootstrap(params["kvbridge_bootstrap"], where)
    groups = params["kvbridge_block_ids"]
    if (not isinstance(groups, (list, tuple)) or len(groups) != num_groups
            or not all(isinstance(g, (list, tuple)) for g in groups)):
        raise BadTransferParams(
            f"{where}: kvbridge_block_ids must be {num_groups} list(s) of block ids (one per KV cache group of this "
            f"model), got {str(groups)[:200]}; prefill and decode must serve the same model"
        )
    for g, ids in enumerate(groups):
        bad = [b for b in ids if isinstance(b, bool) or not isinstance(b, int) or b < 0]
        if bad:
            raise BadTransferParams(f"{where}: kvbridge_block_ids[{g}] holds {bad[:5]}, not block ids (integers >= 0)")
    num_tokens = params["kvbridge_num_tokens"]
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise BadTransferParams(f"{where}: kvbridge_num_tokens must be a positive integer, got {num_tokens!r}")
    return RemotePrefill(room, bootstrap, tuple(tuple(g) for g in groups), num_tokens)


def decode_first_params(bootstrap: str, room: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A router's ``(prefill, decode)`` ``kv_transfer_params`` for one decode-first request.

    Decode-first: the router sends both legs at once (decode's may come
    first); decode allocates its blocks and tells prefill, and prefill sends
    each layer while its last prefill step computes (``save_kv_layer``).
    ``bootstrap`` is the prefill server's ``kv_connector_extra_config.bootstrap``;
    ``room`` (default: random) must be unique among the requests that prefill
    server has in flight.
    """
    room = room if room is not None else (secrets.randbits(_ROOM_BITS) or 1)
    check_room(room, "decode_first_params")
    prefill = {"do_remote_decode": True, DECODE_FIRST: True, "kvbridge_room": room}
    decode = {"do_remote_prefill": True, DECODE_FIRST: True, "kvbridge_room": room, "kvbridge_bootstrap": bootstrap}
    parse_decode_first(decode, "decode_first_params")
    return prefill, decode


def check_room(room: Any, where: str) -> int:
    """``room`` if it is a valid room id; raises :class:`BadTransferParams` naming ``where`` otherwise."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 < room < 2**63:
        raise BadTransferParams(f"{where}: kvbridge_room must be an integer in 1 .. 2**63-1, got {room!r}")
    return room


def parse_decode_first(params: Mapping[str, Any], request_id: str) -> tuple[int, str]:
    """``(room, bootstrap)`` of a decode-first decode request; raises :class:`BadTransferParams` naming the key."""
    where = f"request {request_id!r}: kv_transfer_params"
    missing = [k for k in ("kvbridge_room", "kvbridge_bootstrap") if k not in params]
    if missing:
        raise BadTransferParams(
            f"{where} mark a decode-first request ({DECODE_FIRST}) but lack {', '.join(missing)}; a router builds "
            "both legs' parameters with kvbridge.integrations.vllm.decode_first_params(prefill bootstrap address)"
        )
    return check_room(params["kvbridge_room"], where), _check_bootstrap(params["kvbridge_bootstrap"], where)


def _check_bootstrap(bootstrap: Any, where: str) -> str:
    host, sep, port = bootstrap.rpartition(":") if isinstance(bootstrap, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadTransferParams(f"{where}: kvbridge_bootstrap must be HOST:PORT, got {bootstrap!r}")
    return bootstrap
