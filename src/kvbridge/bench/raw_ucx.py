"""The "raw engine" column of the transfer benchmark for UCX.

:func:`raw` takes the worker, endpoint and unpacked remote keys of a connected
:class:`~kvbridge.core.sessions.session.PrefillManager` whose backend is ``ucx`` and
returns a function that moves exactly a plan's descriptors with bare UCP
calls: one ``ucp_put_nbx`` per descriptor (requests released at once, as with
``put_nbi``), then ``ucp_ep_flush_nbx`` and a spin of
``ucp_worker_progress`` / ``ucp_request_check_status`` until the flush is
done. Argument lists (addresses, sizes, the remote key of each descriptor) are
built once, outside the timed function. Nothing of kvbridge runs inside it: no
deadline checks, no chunking, no sleeping between polls.
"""

from __future__ import annotations

from collections.abc import Callable
from ctypes import byref
from typing import Any

import numpy as np

from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.sessions.session import PrefillManager

__all__ = ["raw"]


def raw(mgr: PrefillManager, plan: TransferPlan) -> Callable[[], None]:
    """A zero-argument function that writes ``plan`` to ``mgr``'s only peer through raw UCP calls."""
    backend: Any = mgr.backend
    from kvbridge.plugins.ucx import _ucp

    peers = [p for p in backend._peers.values() if p.endpoint is not None]
    if len(peers) != 1:
        raise RuntimeError(f"raw UCX benchmark needs exactly one connected peer, the backend has {len(peers)}")
    peer = peers[0]
    idx = np.searchsorted(peer.starts, plan.dst_addr, side="right") - 1
    args = list(zip(plan.src_addr.tolist(), plan.nbytes.tolist(), plan.dst_addr.tolist(), peer.rkeys[idx].tolist()))
    lib = _ucp.lib
    put, free, flush = lib.ucp_put_nbx, lib.ucp_request_free, lib.ucp_ep_flush_nbx
    check, progress = lib.ucp_request_check_status, lib.ucp_worker_progress
    ep, worker = peer.endpoint.handle, backend._worker.handle
    param = _ucp.RequestParam()
    pparam = byref(param)
    err_min, inprogress = _ucp.ERR_PTR_MIN, _ucp.UCS_INPROGRESS

    def go() -> None:
        for src, n, dst, rkey in args:
            req = put(ep, src, n, dst, rkey, pparam)
            if req:
                if req >= err_min:
                    raise RuntimeError(f"raw ucp_put_nbx failed: {_ucp.status_string(req - (1 << 64))}")
                free(req)
        req = flush(ep, pparam)
        status = _ucp.ptr_status(req)
        if status == inprogress:
            while (status := check(req)) == inprogress:
                progress(worker)
            free(req)
        if status != _ucp.UCS_OK:
            raise RuntimeError(f"raw UCX flush of {len(args)} descriptors failed: {_ucp.status_string(status)}")

    return go
