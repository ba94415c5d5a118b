"""The "raw engine" column of the transfer benchmark for NIXL.

:func:`raw` takes the agent and the one peer of a connected
:class:`~kvbridge.core.sessions.session.PrefillManager` whose backend is ``nixl`` and
returns a function that moves exactly a plan's descriptors with NIXL's own
calls, used the fastest way NIXL offers for a repeated transfer: both
descriptor lists are built and the request is created (``initialize_xfer``)
once, outside the timed function; each call only re-posts the same request
(``transfer``, allowed once the previous post reached DONE) and spins on
``check_xfer_state`` until DONE. Nothing of kvbridge runs inside the timed
function: no planning, no deadline checks, no sleeping between polls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.sessions.session import PrefillManager

__all__ = ["raw"]


def raw(mgr: PrefillManager, plan: TransferPlan, mem: str = "DRAM", device: int = 0,
        peer_device: int | None = None) -> Callable[[], None]:
    """A zero-argument function that writes ``plan`` to ``mgr``'s only peer through raw NIXL calls.

    ``mem`` is NIXL's memory type of both sides ("DRAM" or "VRAM"), on ``device`` here and on
    ``peer_device`` (default: ``device``) at the peer, as each side registered it."""
    backend: Any = mgr.backend
    agent = backend._live_agent()
    peers = list(backend._peers.values())
    if len(peers) != 1:
        raise RuntimeError(f"raw NIXL benchmark needs exactly one connected peer, the backend has {len(peers)}")
    n = len(plan)
    local, remote = np.zeros((n, 3), np.uint64), np.zeros((n, 3), np.uint64)
    local[:, 0], remote[:, 0] = plan.src_addr, plan.dst_addr
    local[:, 1] = remote[:, 1] = plan.nbytes
    local[:, 2], remote[:, 2] = device, device if peer_device is None else peer_device
    handle = agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), peers[0].agent
    )

    def go() -> None:
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL write of {n} descriptors ended in state {state!r}")

    return go
