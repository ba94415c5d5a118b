"""Pipelined batches: more than one batch of a write posted to a peer at once, within the fence's bound.

Core checks the fence (deadline, room liveness) before every batch it posts, so
a prefill frozen inside an engine call can only finish what it had posted when
it resumes. Posting batches one after another bounded that to one batch
(``FENCE_BATCH_BYTES``), but left the engine idle between batches: each batch
waited for the last to land, then paid the post's fixed cost on an empty
wire. A backend declaring ``BackendCapabilities.batches_in_flight`` > 1
(``Backend.post``) gets its next batch posted while the last still moves, up
to :data:`FENCE_BATCHES_IN_FLIGHT` batches: what a frozen prefill can still
write is then that many batches (docs/failures.md), still checked before each.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..description.records import BackendCapabilities

__all__ = ["FENCE_BATCHES_IN_FLIGHT", "Pipeline", "in_flight"]

#: Most batches core keeps posted to one peer through one lane, whatever the backend declares:
#: with ``FENCE_BATCH_BYTES`` this bounds what a prefill frozen inside an engine call can still
#: write after it resumes (4 x 16 MiB, 4 x 1024 descriptors; docs/failures.md).
FENCE_BATCHES_IN_FLIGHT = 4

#: A posted batch's wait: returns once it landed, raises ``TransferError`` (``Backend.post``).
Wait = Callable[[float], None]


def in_flight(capabilities: BackendCapabilities) -> int:
    """Batches core keeps posted to one peer through a backend with these ``capabilities``.

    1 for a backend taking whole plans: it checks the fence between its own posts and gets one call.
    """
    if capabilities.whole_plans:
        return 1
    return max(1, min(capabilities.batches_in_flight, FENCE_BATCHES_IN_FLIGHT))


class Pipeline:
    """The batches of one write posted to one peer through one lane and not yet landed, oldest first.

    Not thread-safe: one write's thread owns it (core posts a peer's batches from one thread).
    """

    def __init__(self, limit: int, max_descriptors: int | None = None) -> None:
        if limit < 1:
            raise ValueError(f"a pipeline keeps at least 1 batch in flight, got {limit}")
        self.limit = limit
        #: Most descriptors in flight at once (``BackendCapabilities.max_descriptors_in_flight``).
        self.max_descriptors = max_descriptors
        self._waits: deque[tuple[Wait, int, int, Callable[[], None] | None]] = deque()
        self._descriptors = 0
        #: Bytes of the batches that have landed (their wait returned).
        self.landed = 0
        #: Most batches that were in flight at once (for ``describe()`` and the benchmarks).
        self.peak = 0

    @property
    def pending(self) -> int:
        """Batches posted and not yet waited for."""
        return len(self._waits)

    def add(self, wait: Wait, nbytes: int, descriptors: int, then: Callable[[], None] | None = None) -> None:
        """Record a posted batch of ``nbytes`` and ``descriptors``; ``wait`` is what ``Backend.post`` returned;
        ``then`` is called once it landed (not when it failed or was abandoned)."""
        self._waits.append((wait, nbytes, descriptors, then))
        self._descriptors += descriptors
        self.peak = max(self.peak, len(self._waits))

    def landed_now(self, nbytes: int) -> None:
        """Record a batch written synchronously (``Backend.write``)."""
        self.landed += nbytes

    def make_room(self, deadline: float, descriptors: int = 0) -> None:
        """Wait for the oldest batches until one more (of ``descriptors``) may be posted; raises as their wait does."""
        cap = self.max_descriptors
        while len(self._waits) >= self.limit or (cap is not None and self._waits and self._descriptors + descriptors > cap):
            self.wait_oldest(deadline)

    def drain(self, deadline: float) -> None:
        """Wait for every batch in flight, oldest first; raises the first failure (then abandon())."""
        while self._waits:
            self.wait_oldest(deadline)

    def abandon(self, deadline: float) -> bool:
        """After a failure: still wait for every batch in flight (the engine must have no work left
        once the write returns), ignoring their own failures: the first one is being raised. True when
        every one of them landed (its wait returned)."""
        landed = True
        while self._waits:
            wait, _, n, _ = self._waits.popleft()
            self._descriptors -= n
            try:
                wait(deadline)
            except Exception:  # noqa: BLE001 - the write already failed; this one is reported by it
                landed = False
        return landed

    def wait_oldest(self, deadline: float) -> None:
        """Wait for the oldest batch in flight, then call its ``then``; raises as its wait does."""
        wait, nbytes, n, then = self._waits[0]
        try:
            wait(deadline)
        finally:
            self._waits.popleft()  # waited for, landed or not: the engine holds nothing of it
            self._descriptors -= n
        self.landed += nbytes
        if then is not None:
            then()
