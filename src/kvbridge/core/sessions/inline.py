"""Small chunks written by the thread that sent them, with no hand-off to the peer's worker (issue #27).

On a busy 2-core host the hand-off to a peer's worker thread cost 75-100 us of a
1-page request. :func:`inline_write` decides, under the manager's lock, whether the
sending thread writes a chunk itself; :func:`write_inline` runs it. Jobs submitted
to the peer's worker meanwhile wait for its release, so a peer's writes still run
one at a time, in order, with the same fence.
"""

from __future__ import annotations

import logging
import time

from .peers import PrefillSide
from .writes import ChunkWrite, Job, write_chunks

__all__ = ["INLINE_MAX_BYTES", "INLINE_MAX_DESCRIPTORS", "inline_write", "write_inline"]

log = logging.getLogger(__name__)

#: A chunk at most this large (bytes, descriptors) may be written by the thread that sent it: a small
#: request then costs no hand-off; a larger one does not hold the host's thread for its bytes.
INLINE_MAX_BYTES = 256 << 10
INLINE_MAX_DESCRIPTORS = 64


def inline_write(m: PrefillSide, job: Job) -> bool:
    """Whether this thread writes ``job`` itself (under the lock): the lanes moving something to the peer
    allow it (``BackendCapabilities.inline_writes``) and the peer is on this host (a write there completes even if
    the peer is frozen: the host's thread is never held by a peer), the chunk is small, decode's lease is
    valid (the write would not wait for a renewal), no other room is ready to send (the host is about to
    send it: both chunks then go to the worker, which writes them together) and the worker is idle
    (claimed here if so). Never on the I/O thread, which must stay free to renew decode's lease."""
    peer = job.peer
    rows = job.meta_plan.total_bytes if job.meta_plan is not None and not peer.inline_row else 0
    return (not m.ready and len(job.plan) <= INLINE_MAX_DESCRIPTORS and job.plan.total_bytes + rows <= INLINE_MAX_BYTES
            and time.monotonic() < peer.lease_until and m.transport.writes_inline(peer.peer_id)
            and not m.loop.on_io_thread() and peer.worker.claim())


def write_inline(write: ChunkWrite) -> None:
    """Run a claimed write on this thread, then hand the peer's queue back to its worker."""
    sender = write.sender
    try:
        write_chunks([write])
    except Exception as exc:  # as the worker's thread would log it; the room does not hang on it
        log.exception("kvbridge transfer job failed unexpectedly")
        sender.manager.fail_sender(sender, f"room {sender.room}: the write of chunk {write.chunk} failed "
                                           f"unexpectedly: {type(exc).__name__}: {exc}", "transfer_error")
    finally:
        write.job.peer.worker.release()
