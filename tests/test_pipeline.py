"""Pipelined batches (core/transfer/pipeline.py): several batches posted to a peer at once, the fence still checked before each.

An in-process backend posts by recording the batch and copies with ``ctypes.memmove``
only when core waits for it, so what is in flight, and in what order it lands, is
observable; its bytes are checked against pages copied independently of the planner.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from kvbridge.core import BackendCapabilities, Region, TransferPlan
from kvbridge.core.transfer.backend import Backend, BackendConfig, TransferCancelled, TransferError
from kvbridge.core.transfer.pipeline import FENCE_BATCHES_IN_FLIGHT, Pipeline, in_flight
from kvbridge.core.transfer.transport import FENCE_BATCH_BYTES, Transport

PAGE = 1 << 20
PAGES = 80  # 80 MiB: five fence-sized batches of 16 MiB


class _Deferred(Backend):
    """Posts by recording; copies a batch when core waits for it."""

    capabilities = BackendCapabilities(memory_kinds=("dram",), host_staging=False, batches_in_flight=8)

    def __init__(self) -> None:
        super().__init__(BackendConfig())
        self.pending: list[TransferPlan] = []
        self.peak = 0
        self.fail_wait = -1  # the index of the batch whose wait fails (-1: none)
        self.posts = 0

    def register(self, regions: Sequence[Region]) -> None:
        pass

    def metadata(self) -> bytes:
        return b"in-process"

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        pass

    def remove_peer(self, peer: str) -> None:
        pass

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        self.post(peer, batch, deadline)(deadline)

    def post(self, peer: str, batch: TransferPlan, deadline: float) -> Callable[[float], None]:
        index = self.posts
        self.posts += 1
        self.pending.append(batch)
        self.peak = max(self.peak, len(self.pending))

        def wait(deadline: float) -> None:
            assert self.pending[0] is batch, "core waits for batches oldest first"
            self.pending.pop(0)
            if index == self.fail_wait:
                raise TransferError(f"batch {index} failed")
            for s, d, n in zip(batch.src_addr.tolist(), batch.dst_addr.tolist(), batch.nbytes.tolist()):
                ctypes.memmove(d, s, n)
        return wait

    def close(self) -> None:
        pass


def _setup() -> tuple[Transport, _Deferred, np.ndarray, np.ndarray, np.ndarray, TransferPlan]:
    """A transport writing PAGES pages of ``src`` to a scattered page order ``order`` of ``dst``."""
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, (PAGES, PAGE), dtype=np.uint8)
    dst = np.zeros_like(src)
    backend = _Deferred()
    transport = Transport.of(backend, "deferred")
    mine = Region(name="src", addr=src.ctypes.data, nbytes=src.nbytes, stride=PAGE, role="k", index_space="kv_page")
    theirs = Region(name="dst", addr=dst.ctypes.data, nbytes=dst.nbytes, stride=PAGE, role="k", index_space="kv_page")
    transport.register([mine])
    transport.add_peer("decode", b"in-process", [theirs])
    order = rng.permutation(PAGES)
    plan = TransferPlan(src.ctypes.data + PAGE * np.arange(PAGES, dtype=np.int64),
                        dst.ctypes.data + PAGE * order.astype(np.int64), np.full(PAGES, PAGE, np.int64))
    return transport, backend, src, dst, order, plan


def test_batches_in_flight_is_capped_by_the_fence_bound() -> None:
    assert in_flight(BackendCapabilities(batches_in_flight=64)) == FENCE_BATCHES_IN_FLIGHT
    assert in_flight(BackendCapabilities()) == 1
    assert in_flight(BackendCapabilities(batches_in_flight=64, whole_plans=True)) == 1
    with pytest.raises(ValueError, match="batches_in_flight must be a positive integer"):
        BackendCapabilities(batches_in_flight=0)


def test_a_pipelined_write_lands_byte_exact_with_the_cap_in_flight() -> None:
    transport, backend, src, dst, order, plan = _setup()
    transport.write("decode", plan, time.monotonic() + 30)
    assert np.array_equal(dst[order], src)
    assert not backend.pending, "every posted batch was waited for before write returned"
    assert backend.peak == FENCE_BATCHES_IN_FLIGHT
    assert backend.posts == plan.total_bytes // FENCE_BATCH_BYTES
    assert transport.describe()["batches_in_flight"]["deferred"] == {"limit": FENCE_BATCHES_IN_FLIGHT,
                                                                    "peak": FENCE_BATCHES_IN_FLIGHT}


def test_a_room_that_dies_stops_posting_and_what_was_posted_is_waited_for() -> None:
    transport, backend, _src, _dst, _order, plan = _setup()
    checks = 0

    def live() -> bool:  # the room dies after its second check: two batches posted, none after
        nonlocal checks
        checks += 1
        return checks <= 2

    with pytest.raises(TransferCancelled, match="no longer live"):
        transport.write("decode", plan, time.monotonic() + 30, live)
    assert backend.posts == 2
    assert not backend.pending, "the batches in flight were waited for before write raised"


def test_a_failed_batch_is_raised_after_every_batch_in_flight_was_waited_for() -> None:
    transport, backend, _src, _dst, _order, plan = _setup()
    backend.fail_wait = 1
    with pytest.raises(TransferError, match=r"batch 1 failed.*16777216 B had landed"):
        transport.write("decode", plan, time.monotonic() + 30)
    assert not backend.pending
    assert backend.posts == FENCE_BATCHES_IN_FLIGHT + 1, "batch 1's wait came when the 5th batch needed room"


def test_the_descriptor_cap_waits_before_a_batch_would_pass_it() -> None:
    waited: list[int] = []
    pipe = Pipeline(4, max_descriptors=1024)
    for i, n in enumerate((600, 400, 100)):
        pipe.make_room(0.0, n)
        pipe.add(lambda _d, i=i: waited.append(i), n << 10, n)
    assert waited == [0], "the third batch (100) would have made 1100 descriptors in flight"
    pipe.drain(0.0)
    assert waited == [0, 1, 2] and pipe.landed == 1100 << 10


def test_a_batchs_then_runs_once_it_landed_never_when_it_failed_or_was_abandoned() -> None:
    # What a staged window hangs on its last batch (its slice released, its Staged sent): only after its bytes
    # landed, oldest first.
    ran: list[str] = []

    def failing(_deadline: float) -> None:
        raise TransferError("lost")

    pipe = Pipeline(4)
    pipe.add(lambda _d: None, 1, 1, lambda: ran.append("a"))
    pipe.add(failing, 1, 1, lambda: ran.append("b"))
    pipe.add(lambda _d: None, 1, 1, lambda: ran.append("c"))
    assert ran == []
    pipe.wait_oldest(0.0)
    assert ran == ["a"]
    with pytest.raises(TransferError, match="lost"):
        pipe.wait_oldest(0.0)
    pipe.abandon(0.0)
    assert ran == ["a"] and pipe.pending == 0
