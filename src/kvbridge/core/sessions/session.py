"""Sessions: one manager per rank and role, one sender or receiver per request.

Prefill side::

    mgr = PrefillManager(kvargs, "mooncake", bootstrap="127.0.0.1:8998")
    sender = Sender(mgr, room, metadata_row=row)
    # poll() until WAITING_FOR_INPUT (decode's destination lists have arrived)
    sender.send(chunk_pages)                    # once per prefill chunk
    sender.send(last_pages, state_indices={"slot": [s]}, last=True)
    # poll() until SUCCESS or FAILED

    # or layer-wise, the transfer behind the compute: announce the chunk, then its layers
    sender.send(chunk_pages, layerwise=True)
    for layer in range(num_layers):
        ...                                     # compute the layer
        sender.layer_ready(layer)               # its KV and state move now

Decode side::

    mgr = DecodeManager(kvargs, "mooncake")
    recv = Receiver(mgr, room, bootstrap="127.0.0.1:8998")
    recv.init(page_indices, state_indices={"slot": [s]}, metadata_row=row)
    # poll() until SUCCESS (the metadata row has landed) or FAILED

A manager's backend is a registered name, a ``BackendSpec``, a ready
``Backend`` instance, or None: the default, the first available of nixl, ucx
and mooncake (``kvbridge.core.description.plugins.BACKEND_PREFERENCE``).

``poll()`` never blocks and is monotone: BOOTSTRAPPING < WAITING_FOR_INPUT <
TRANSFERRING < SUCCESS, with FAILED sticky; ``failure()`` gives the reason.
Everything a manager holds for a room is released when the room reaches
SUCCESS or FAILED (including by ``abort()`` or a timeout). No byte of a room
lands after FAILED: decode reports it once every prefill rank confirmed it
stopped writing (``Fenced``) or ``fence_timeout`` passed, so ``abort()``
returns at once and ``poll()`` says FAILED a little later (docs/failures.md).

Commit point: prefill writes the KV pages and state of every chunk, then the
metadata row, and only then sends ``Done``; decode reaches SUCCESS on ``Done``
from every prefill rank, so SUCCESS means the metadata row (written last) has landed.
A small row in host memory on both sides (``SessionConfig.inline_row_bytes``)
travels inside ``Done`` instead of as a write of its own; decode checks it and
copies it into place before it counts that ``Done`` (kvbridge.core.sessions.row).

Timeouts (:class:`SessionConfig`, seconds):

- ``bootstrap_timeout`` (30): decode must find and handshake with the prefill
  ranks, and a prefill sender must receive decode's request, within it;
- ``waiting_timeout`` (300): after ``init``, decode must see the room complete;
- ``transfer_timeout`` (60): one chunk's write must complete within it;
- ``fence_timeout`` (None: ``transfer_timeout + heartbeat_timeout``): how long
  decode waits for prefill's ``Fenced`` before it reports a given-up room FAILED;
- ``sender_grace`` (5): how long prefill keeps a request whose room has no
  ``Sender`` before decode is told it failed;
- ``heartbeat_interval`` (1) / ``heartbeat_timeout`` (5): decode pings each
  prefill rank it uses; either side declares the other dead after
  ``heartbeat_timeout`` of silence and fails every room shared with it.

``instance_name`` (decode, ``""``: unnamed): a name a decode instance keeps across
restarts and no other live instance uses; a prefill rank then fails a killed process's
rooms as soon as a new process of the same name and rank handshakes, instead of by its
lease (docs/failures.md, "Restarts").

The parts, one concern each: :mod:`~kvbridge.core.sessions.room` (the state machine),
:mod:`~kvbridge.core.sessions.manager` (what both roles share),
:mod:`~kvbridge.core.sessions.prefill` and :mod:`~kvbridge.core.sessions.sender` (the prefill
side and its chunk planning), :mod:`~kvbridge.core.sessions.worker` (per-peer transfer
threads), :mod:`~kvbridge.core.sessions.decode` and :mod:`~kvbridge.core.sessions.receiver`
(the decode side), :mod:`~kvbridge.core.transfer.transport` (the policy around every
backend). This module gathers the public names.
"""

from __future__ import annotations

from .decode import DecodeManager
from ..description.layout import KV_PAGE_SPACE, METADATA_SPACE
from .manager import SessionConfig, TransferManager
from .prefill import PrefillManager
from .receiver import Receiver
from .room import Poll
from .sender import Sender

__all__ = [
    "KV_PAGE_SPACE",
    "METADATA_SPACE",
    "Poll",
    "SessionConfig",
    "TransferManager",
    "PrefillManager",
    "DecodeManager",
    "Sender",
    "Receiver",
]
