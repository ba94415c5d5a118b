"""Deliberately broken backends: the conformance suite must fail each of them.

Each breaks one clause of the backend contract (:mod:`kvbridge.core.transfer.backend`)
the way real adapters have, on top of the ``memory`` backend. They are not
registered by kvbridge; ``tests/test_faulty_backends.py`` installs this
module as a plugin (an entry point in a temporary ``*.dist-info``) and runs
the suite against each, asserting which test fails and why.

- ``faulty-offbyone``: reads every source one byte too far (a wrong address);
- ``faulty-deadline``: waits for a stopped peer to resume, ignoring the deadline
  (as an engine that needs the receiver's help and has no timeout);
- ``faulty-dropbatch``: silently skips every third batch core hands it;
- ``faulty-early``: returns before the bytes have landed (copies 50 ms later);
- ``faulty-flipbyte``: writes every batch, then flips one byte of it (a corrupting
  link; what ``SessionConfig.checksum`` must catch).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import ClassVar

import numpy as np

from kvbridge.core.description.hookspecs import hookimpl
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.description.records import BackendCapabilities, BackendSpec
from kvbridge.testing.memory import CAPABILITIES, MemoryBackend, state

__all__ = ["BROKEN_CONTRACTS", "kvbridge_register_backends"]

STOPPED_WAIT_LIMIT = 60.0  # even a broken backend's loops are bounded


class OffByOne(MemoryBackend):
    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        self.copy(self._target(peer), peer, batch.src_addr + 1, batch.dst_addr, batch.nbytes)


class IgnoresDeadline(MemoryBackend):
    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        target = self._target(peer)
        super().write(peer, batch, deadline)
        give_up = time.monotonic() + STOPPED_WAIT_LIMIT
        while state(target.pid) == "T" and time.monotonic() < give_up:  # "waits for the peer's acknowledgement"
            time.sleep(0.01)


class DropsBatch(MemoryBackend):
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        memory_kinds=("dram",), cross_host=False, max_descriptors_per_batch=2)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._calls = 0

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        self._calls += 1
        if self._calls % 3:
            super().write(peer, batch, deadline)


class EarlySuccess(MemoryBackend):
    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        target = self._target(peer)

        def later() -> None:
            time.sleep(0.05)
            self.copy(target, peer, batch.src_addr, batch.dst_addr, batch.nbytes)

        threading.Thread(target=later, daemon=True).start()


class FlipsByte(MemoryBackend):
    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        super().write(peer, batch, deadline)
        if len(batch):  # the batch's first destination byte, inverted
            wrong = np.frombuffer(ctypes.string_at(int(batch.src_addr[0]), 1), np.uint8) ^ np.uint8(0xFF)
            self.copy(self._target(peer), peer, np.array([wrong.ctypes.data]), batch.dst_addr[:1], np.array([1]))


#: backend name -> (class, the broken contract in words)
BROKEN_CONTRACTS: dict[str, tuple[type[MemoryBackend], str]] = {
    "faulty-offbyone": (OffByOne, "writes bytes other than the plan's"),
    "faulty-deadline": (IgnoresDeadline, "does not return by its deadline"),
    "faulty-dropbatch": (DropsBatch, "reports success for a batch it did not write"),
    "faulty-early": (EarlySuccess, "returns before the bytes have landed"),
    "faulty-flipbyte": (FlipsByte, "corrupts one byte of every batch after writing it"),
}


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(name=name, factory=f"{__name__}:{cls.__name__}", description=f"BROKEN on purpose: {what}",
                    capabilities=cls.capabilities if cls is DropsBatch else CAPABILITIES)
        for name, (cls, what) in BROKEN_CONTRACTS.items()
    ]
