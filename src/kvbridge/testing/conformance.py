"""The backend conformance suite: what every kvbridge transport must do, end to end.

A backend's distribution runs it with one small test file::

    from kvbridge.testing.conformance import BackendConformance

    class TestMyTransport(BackendConformance):
        backend = "mytransport"        # the name its BackendSpec registers
        # backend_options = {"key": "value"}   optional, for every manager
        # timeout_scale = 2.0                  optional, for slow transports

or, for any installed backend, ``kvbridge conformance mytransport``. The
built-in backends run it the same way (``tests/test_conformance.py``).

What it checks is what depends on the transport, with real engines in
separate prefill and decode processes: the Backend contract as core drives
it (batches within the declared limits land byte-exact and nowhere else,
before ``write`` returns; a write to a stopped peer returns by its deadline;
removed peers and closed engines refuse writes); pages fragmented and
contiguous, in several chunks, many requests in flight; the metadata row as
the commit point; every state handler across heterogeneous TP; a killed or
frozen decode failing rooms within their deadlines; managers closing with
rooms in flight. Core's own policy (the whole TP/PP matrix, the index-length
policy, hostile requests, aborts, heartbeats) is the same for every backend
and is tested once, over the ``memory`` backend, in kvbridge's own tests.
Each test is written against the source pattern with plain numpy, never
through the planner. Tests that need a capability
(:func:`~kvbridge.testing.requirements.requires`) are skipped, naming it,
when the registration does not declare it.

Needs pytest and numpy only (plus pyzmq, a kvbridge dependency).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.core.transfer.backend import Backend, TransferError, TransferTimeout
from kvbridge.core.description.layout import KVArgs, Region
from kvbridge.core.planning.plan import TransferPlan, plan_pages
from kvbridge.core.description.plugins import get_registry
from kvbridge.core.description.records import BackendCapabilities
from kvbridge.core.sessions.session import Poll, Receiver, Sender
from kvbridge.core.transfer.transport import Transport, open_transport
from kvbridge.testing.e2e import SENTINEL, meta_row_for, pattern, schedule
from kvbridge.testing.harness import (
    START_WAIT,
    BackendHarness,
    Child,
    LocalDecode,
    LocalPrefill,
    all_succeeded,
    check_contract,
    finished,
    wait_until,
)
from kvbridge.testing.requirements import REQUIREMENTS, requires

__all__ = ["BackendConformance", "requires"]

#: How a prefill sender may fail when its decode dies or freezes mid-transfer.
DEAD_PEER_REASON = (r"transfer of chunk \d+( \([^)]*\))? to '.+' failed: |transfer did not complete within transfer_timeout="
                    r"|decode peer '.+' gave no sign of life for |decode peer '.+' sent nothing for ")
PAGE, PAGES, BYTES = 256, 64, 4096  # in-process engine pair: a page region and a byte region per side
ENGINE_TIMEOUT = 5.0  # BackendConfig.transfer_timeout of in-process engines, as in the e2e scenarios


class _Buffer:
    """One buffer of the in-process engine pair, in host memory (numpy) or, for a backend that moves
    GPU memory only, on the GPU (torch); tests read it back as numpy."""

    def __init__(self, host: np.ndarray, mem: str) -> None:
        self.mem = mem
        if mem == "vram":
            import torch

            self._data: Any = torch.from_numpy(host.copy()).to("cuda")
            self.addr = int(self._data.data_ptr())
        else:
            self._data = host.copy()
            self.addr = int(self._data.ctypes.data)
        self.nbytes = host.nbytes

    def now(self) -> np.ndarray:
        """What the buffer holds (a copy, for GPU memory)."""
        if self.mem == "vram":
            import torch

            torch.cuda.synchronize()
            return np.asarray(self._data.cpu().numpy())
        return np.asarray(self._data)

    def clear(self) -> None:
        if self.mem == "vram":
            self._data.zero_()
        else:
            self._data.fill(0)


@dataclass
class Engines:
    """Two engines of the backend in this process: ``source`` writes into ``dest`` (peer ``"dest"``).

    Buffers are host memory, or GPU memory for a backend that declares no other kind.
    """

    source: Transport
    dest: Transport
    src: list[np.ndarray]  # [pages (PAGES, PAGE), bytes (BYTES,)], a pattern (host copies of what the buffers hold)
    src_bufs: list[_Buffer]
    dst_bufs: list[_Buffer]  # the same shapes, zeroed before each test
    src_regions: list[Region]
    dst_regions: list[Region]

    def dst(self, i: int) -> np.ndarray:
        """Destination buffer ``i`` as it is now (0: pages, 1: bytes)."""
        return self.dst_bufs[i].now()

    def add_dest(self) -> None:
        self.source.add_peer("dest", self.dest.metadata(), self.dst_regions)

    def plan(self, src_pages: list[int], dst_pages: list[int]) -> TransferPlan:
        plan = plan_pages([self.src_bufs[0].addr], [self.dst_bufs[0].addr], [PAGE], src_pages, dst_pages)
        plan.validate(self.src_regions, self.dst_regions)
        return plan


def _regions(bufs: list[_Buffer]) -> list[Region]:
    pages, raw = bufs
    device = 0
    if pages.mem == "vram":
        import torch

        device = torch.cuda.current_device()
    return [Region(name="pages", addr=pages.addr, nbytes=pages.nbytes, stride=PAGE, role="k",
                   index_space="kv_page", layer=0, mem=pages.mem, device=device),
            Region(name="bytes", addr=raw.addr, nbytes=raw.nbytes, stride=64, role="metadata",
                   index_space="metadata_row", mem=raw.mem, device=device)]


def _engine(cls: type[BackendConformance], role: str) -> Transport:
    """The backend as core drives it: options parsed, memory kinds checked, plans split to its limits."""
    return open_transport(cls.backend, host="127.0.0.1", name=f"conformance-{role}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                          transfer_timeout=ENGINE_TIMEOUT * cls.timeout_scale, options=dict(cls.backend_options))


def _write(engine: Transport, peer: str, plan: TransferPlan, deadline: float, slack: float) -> None:
    """``engine.write``, failing the test (not hanging it) if it neither returns nor raises by its deadline."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            engine.write(peer, plan, deadline)
            outcome.append(None)
        except BaseException as exc:  # re-raised in the test's thread
            outcome.append(exc)

    writer = threading.Thread(target=run, name="conformance-write", daemon=True)
    writer.start()
    end = max(deadline, time.monotonic()) + slack
    while writer.is_alive() and time.monotonic() < end:
        writer.join(0.05)
        engine.reset_overdue(time.monotonic())  # as a prefill manager's I/O thread does on its tick
    if writer.is_alive():
        pytest.fail(f"write to {peer!r} neither returned nor raised within {slack}s after its deadline")
    if outcome[0] is not None:
        raise outcome[0]


class _Gate:
    """A layer's ``ready`` handle (``Sender.layer_ready``) whose source becomes final when the test says so:
    ``query()`` is false and ``synchronize()`` waits (bounded) until :meth:`open`."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def open(self) -> None:
        self._event.set()

    def query(self) -> bool:
        return self._event.is_set()

    def synchronize(self) -> None:
        if not self._event.wait(30.0):
            raise TimeoutError("the test never opened this layer's gate")


class BackendConformance(BackendHarness):
    """Subclass with ``backend = "<registered name>"``; see the module docstring."""

    # -- 1. the Backend contract, two engines in this process ------------------------------------------
    # A static method: pytest 10 removes class-scoped fixtures defined as instance methods.
    @pytest.fixture(scope="class")
    @staticmethod
    def _engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
        cls = request.cls
        check_contract(cls)
        rng = np.random.default_rng(7)
        src = [rng.integers(1, 256, (PAGES, PAGE), dtype=np.uint8), rng.integers(1, 256, BYTES, dtype=np.uint8)]
        kinds = get_registry().backend_spec(cls.backend).capabilities.memory_kinds
        mem = "dram" if "dram" in kinds else "vram"  # a GPU-only backend's pair lives on the GPU
        if mem == "vram" and not REQUIREMENTS["cuda_device"].met(BackendCapabilities()):
            pytest.skip(f"backend {cls.backend!r} moves GPU memory only and this machine has no CUDA device")
        src_bufs = [_Buffer(a, mem) for a in src]
        dst_bufs = [_Buffer(np.zeros_like(a), mem) for a in src]
        source = _engine(cls, "source")
        try:
            dest = _engine(cls, "dest")
        except BaseException:
            source.close()
            raise
        try:
            engines = Engines(source, dest, src, src_bufs, dst_bufs, _regions(src_bufs), _regions(dst_bufs))
            source.register(engines.src_regions)
            dest.register(engines.dst_regions)
            engines.add_dest()
            yield engines
        finally:
            source.close()
            dest.close()

    @pytest.fixture
    def engines(self, _engines: Engines) -> Engines:
        for b in _engines.dst_bufs:
            b.clear()
        return _engines

    def test_registration_names_a_backend_class_declaring_the_same_capabilities(self) -> None:
        spec = get_registry().backend_spec(self.backend)
        factory = get_registry().load_backend(self.backend)
        assert isinstance(factory, type) and issubclass(factory, Backend), (
            f"BackendSpec.factory {spec.factory!r} must name a subclass of kvbridge.core.transfer.backend.Backend, got {factory!r}")
        assert factory.capabilities == spec.capabilities, (
            f"{factory.__qualname__}.capabilities {factory.capabilities} differ from the registration's "
            f"{spec.capabilities}: use one BackendCapabilities object for both")

    def test_a_write_lands_byte_exact_and_touches_nothing_else(self, engines: Engines) -> None:
        # Fragmented and contiguous pages, plus descriptors of odd sizes at odd offsets
        # (heterogeneous TP moves parts of items).
        src_pages, dst_pages = [3, 4, 5, 9, 20, 21, 63, 0], [0, 1, 2, 10, 40, 41, 7, 63]
        offsets = np.array([[1, 7, 3], [100, 50, 17], [333, 1000, 251], [2048, 4000, 96]])
        odd = TransferPlan(engines.src_bufs[1].addr + offsets[:, 0], engines.dst_bufs[1].addr + offsets[:, 1],
                           offsets[:, 2].copy())
        plan = TransferPlan.concat([engines.plan(src_pages, dst_pages), odd])
        plan.validate(engines.src_regions, engines.dst_regions)
        _write(engines.source, "dest", plan, time.monotonic() + self.scaled(5.0), self.slack)

        want_pages = np.zeros_like(engines.src[0])
        want_pages[dst_pages] = engines.src[0][src_pages]
        want_bytes = np.zeros_like(engines.src[1])
        for s, d, n in offsets:
            want_bytes[d:d + n] = engines.src[1][s:s + n]
        broken = ("right after write() returned, the destination differs from the plan's source bytes: a write "
                  "must move exactly the planned bytes, every batch of them, and return only once they have landed")
        np.testing.assert_array_equal(engines.dst(0), want_pages, err_msg=broken)
        np.testing.assert_array_equal(engines.dst(1), want_bytes, err_msg=broken)

    def test_warm_writes_nothing_and_the_writes_after_it_land(self, engines: Engines) -> None:
        # Core calls warm (optional) after add_peer with batches shaped like the peer's requests, before
        # the handshake is answered; it prepares (connects, compiles) and must not write any of them.
        plans = [engines.plan([0, 1, 2], [5, 6, 7]), engines.plan([9], [30])]
        engines.source.warm("dest", plans)
        engines.source.warm("nobody", plans)  # a peer it does not know: nothing to prepare, no error
        time.sleep(0.1)  # an engine that posted anyway would have landed by now
        assert not engines.dst(0).any(), "warm() wrote bytes: it must only prepare for writes"
        _write(engines.source, "dest", plans[0], time.monotonic() + self.scaled(5.0), self.slack)
        np.testing.assert_array_equal(engines.dst(0)[[5, 6, 7]], engines.src[0][[0, 1, 2]])

    def test_a_write_whose_deadline_has_passed_raises_transfer_timeout_and_moves_nothing(self, engines: Engines) -> None:
        with pytest.raises(TransferTimeout):
            _write(engines.source, "dest", engines.plan(list(range(8)), list(range(8))), time.monotonic() - 0.001, self.slack)
        time.sleep(0.2)  # an engine that posted anyway would have landed by now
        assert not engines.dst(0).any(), "a write past its deadline moved bytes"

    def test_a_write_to_a_removed_peer_raises_transfer_error_naming_it(self, engines: Engines) -> None:
        engines.source.remove_peer("dest")
        try:
            with pytest.raises(TransferError, match="'dest'"):
                _write(engines.source, "dest", engines.plan([1], [1]), time.monotonic() + self.scaled(5.0), self.slack)
            engines.source.remove_peer("dest")  # unknown peers are ignored
        finally:
            engines.add_dest()
        assert not engines.dst(0).any()

    def test_adding_a_known_peer_again_replaces_it_and_writes_still_land(self, engines: Engines) -> None:
        # Core re-adds a peer whose decode handshakes again, without removing it first.
        engines.add_dest()
        _write(engines.source, "dest", engines.plan([5, 6], [8, 9]), time.monotonic() + self.scaled(5.0), self.slack)
        np.testing.assert_array_equal(engines.dst(0)[[8, 9]], engines.src[0][[5, 6]])

    def test_close_is_idempotent_and_a_later_write_raises(self, engines: Engines) -> None:
        closing = _engine(type(self), "closing")
        try:
            closing.register(engines.src_regions)
            closing.add_peer("dest", engines.dest.metadata(), engines.dst_regions)
        finally:
            closing.close()
        closing.close()
        with pytest.raises(TransferError):
            _write(closing, "dest", engines.plan([1], [1]), time.monotonic() + self.scaled(5.0), self.slack)
        assert not engines.dst(0).any()

    def test_the_write_after_core_reset_the_peers_connections_arrives(self, engines: Engines) -> None:
        # Core has the backend reset its connections to a peer whose write overran its deadline, idle
        # ones too (Backend.abort_peer; kvbridge.plugins.tcpfence for TCP engines). The next write must
        # land: the engine reconnects, or fails a call per reset connection it picks, which core
        # retries (Mooncake does).
        plan = engines.plan([1, 2, 30], [3, 4, 60])
        _write(engines.source, "dest", plan, time.monotonic() + self.scaled(5.0), self.slack)  # connected
        engines.source.reset("dest", "the conformance suite", stuck=True)
        engines.dst_bufs[0].clear()
        _write(engines.source, "dest", plan, time.monotonic() + self.scaled(5.0), self.slack)
        want = np.zeros_like(engines.src[0])
        want[[3, 4, 60]] = engines.src[0][[1, 2, 30]]
        np.testing.assert_array_equal(engines.dst(0), want)

    @requires("dram")  # the stopped peer is a child process with host pools
    def test_a_write_to_a_frozen_peer_returns_by_its_deadline_and_the_peer_recovers(
        self, engines: Engines, children: Callable[..., Child]
    ) -> None:
        # The peer's process is stopped (SIGSTOP): engines that need it to answer must give
        # up at the deadline; engines that write into a stopped process (CMA) may succeed.
        # The deadline is the one core gives every write: now + BackendConfig.transfer_timeout.
        sc = self.scenario(decode_pages=1024)
        peer = children("engine", sc)
        hex_meta, kvargs_json = peer.first_line("ENGINE")
        regions = list(msgspec.json.decode(kvargs_json, type=KVArgs).regions)
        # Its metadata says where its engine listens, for engines that reset connections to a peer
        # whose write overran its deadline (Backend.abort_peer), ending an engine call still waiting.
        engines.source.add_peer("frozen", msgspec.msgpack.decode(bytes.fromhex(hex_meta)), regions)
        try:
            plan = plan_pages([engines.src_bufs[0].addr], [regions[0].addr], [PAGE], np.arange(PAGES), np.arange(PAGES))
            plan.validate(engines.src_regions, regions)
            _write(engines.source, "frozen", plan, time.monotonic() + self.scaled(5.0), self.slack)  # connected
            peer.freeze()
            budget = self.scaled(ENGINE_TIMEOUT)
            t0 = time.monotonic()
            try:
                _write(engines.source, "frozen", plan, t0 + budget, self.slack)
            except TransferError:  # TransferTimeout at the deadline, or the engine's own timeout, if shorter, before it
                pass
            assert time.monotonic() - t0 < budget + self.slack, "a write to a stopped peer overran its deadline"
            peer.thaw()
            _write(engines.source, "frozen", plan, time.monotonic() + self.scaled(5.0), self.slack)
        finally:
            engines.source.remove_peer("frozen")
            peer.kill()

    @requires("vram", "cuda_device")
    def test_gpu_memory_pages_arrive_byte_exact(self) -> None:
        import torch

        src_t = torch.randint(1, 256, (PAGES, PAGE), dtype=torch.uint8, device="cuda")
        dst_t = torch.zeros_like(src_t)
        regions = [Region(name="pages", addr=t.data_ptr(), nbytes=t.numel(), stride=PAGE, role="k", index_space="kv_page",
                          layer=0, mem="vram", device=t.device.index or 0) for t in (src_t, dst_t)]
        source, dest = _engine(type(self), "gpu-source"), _engine(type(self), "gpu-dest")
        try:
            source.register(regions[:1])
            dest.register(regions[1:])
            source.add_peer("dest", dest.metadata(), regions[1:])
            s, d = [3, 4, 5, 9, 63], [0, 1, 2, 30, 31]
            _write(source, "dest", plan_pages([src_t.data_ptr()], [dst_t.data_ptr()], [PAGE], s, d),
                   time.monotonic() + self.scaled(5.0), self.slack)
            torch.cuda.synchronize()
            want = np.zeros((PAGES, PAGE), np.uint8)
            want[d] = src_t.cpu().numpy()[s]
            np.testing.assert_array_equal(dst_t.cpu().numpy(), want)
        finally:
            source.close()
            dest.close()

    # -- 2. pages end to end: many requests, chunks, the commit point --------------------------------
    @requires("dram")  # pools in host memory
    def test_fragmented_and_contiguous_requests_in_chunks_arrive_byte_exact_with_64_in_flight(
        self, children: Callable[..., Child]
    ) -> None:
        # Lengths 1..1024 pages, half fragmented and half contiguous on each side, 1-4
        # chunks each, 64 requests initiated before any is waited on. Decode checks every
        # destination byte and that every page no request wrote still holds the sentinel.
        sc = self.scenario(requests=200, max_pages=1024, concurrency=64, max_chunks=4, prefill_pages=16384,
                           decode_pages=64 * 1024 + 1024, deadline=120.0)
        prefill = children("prefill", sc)
        decode = children("decode", sc, bootstrap=prefill.bootstrap)
        rc_d, d = decode.finish(sc.deadline + 10)
        rc_p, p = prefill.finish()
        assert rc_d == 0 and d is not None, f"decode exited with {rc_d}, last line {d}: {decode.stderr()[-3000:]}"
        assert d["requests"] == sc.requests and d["failed"] == [] and d["mismatched_regions"] == 0
        assert d["active_rooms"] == 0
        assert rc_p == 0 and p == {"role": "prefill", "failed": 0, "active_rooms": 0}, prefill.stderr()[-3000:]

    @requires("dram")  # pools in host memory
    def test_fragmented_requests_staged_on_both_sides_arrive_byte_exact(self, children: Callable[..., Child]) -> None:
        # Staging forced on (SessionConfig.staging="on"): scattered 4 KiB pages are gathered on prefill,
        # written into decode's staging slots and scattered there before each Done (core/transfer/relay.py),
        # checksummed where they land. Decode checks every destination byte and the sentinels.
        sc = self.scenario(requests=12, max_pages=128, concurrency=6, max_chunks=3, page_nbytes=4096, prefill_pages=1024,
                           decode_pages=4096, staging="on", checksum=True, deadline=120.0)
        prefill = children("prefill", sc)
        decode = children("decode", sc, bootstrap=prefill.bootstrap)
        rc_d, d = decode.finish(sc.deadline + 10)
        rc_p, p = prefill.finish()
        assert rc_d == 0 and d is not None, f"decode exited with {rc_d}, last line {d}: {decode.stderr()[-3000:]}"
        assert d["requests"] == sc.requests and d["failed"] == [] and d["mismatched_regions"] == 0
        assert rc_p == 0 and p == {"role": "prefill", "failed": 0, "active_rooms": 0}, prefill.stderr()[-3000:]

    @requires("dram")  # pools in host memory
    def test_thousands_of_one_page_requests_leave_no_rooms_behind(self, children: Callable[..., Child]) -> None:
        sc = self.scenario(requests=4096, max_pages=1, max_chunks=1, concurrency=64, deadline=60.0)
        prefill = children("prefill", sc)
        decode = children("decode", sc, bootstrap=prefill.bootstrap)
        rc_d, d = decode.finish(sc.deadline + 10)
        rc_p, p = prefill.finish()
        assert rc_d == 0 and d is not None, f"decode exited with {rc_d}, last line {d}: {decode.stderr()[-3000:]}"
        assert d["requests"] == sc.requests and d["failed"] == [] and d["mismatched_regions"] == 0
        assert d["active_rooms"] == 0
        assert rc_p == 0 and p == {"role": "prefill", "failed": 0, "active_rooms": 0}, prefill.stderr()[-3000:]

    @requires("dram")  # pools in host memory
    def test_success_follows_every_page_and_the_metadata_row_lands_last(
        self, local_decode: Callable[..., LocalDecode], children: Callable[..., Child]
    ) -> None:
        # Requests of up to 2048 pages in up to 8 chunks, one at a time, into every other
        # decode page (nothing coalesces). Decode watches its own memory while it polls:
        # when the metadata row appears every page must be there, and SUCCESS must come
        # only after both (write() returns once bytes have landed, not once posted).
        sc = self.scenario(requests=4, max_pages=2048, max_chunks=8, concurrency=1, prefill_pages=4096,
                           decode_pages=4 * 2 * 2048)
        words = sc.page_nbytes // 4
        decode = local_decode(sc, meta_rows=sc.requests)
        prefill = children("prefill", sc)
        expected = [np.full_like(a, SENTINEL) for a in decode.pools.kv]
        expected_meta = np.full_like(decode.pools.meta, SENTINEL)
        cursor = 0
        for row, req in enumerate(schedule(sc)):
            dst = cursor + 2 * np.arange(len(req.src_pages))
            cursor += 2 * len(req.src_pages)
            want = [pattern(e, np.asarray(req.src_pages), words) for e in range(len(expected))]

            def pages_landed() -> bool:
                return all(np.array_equal(got[dst], w) for got, w in zip(decode.pools.kv, want))

            def meta_landed() -> bool:
                return np.array_equal(decode.pools.meta[row], meta_row_for(req.room))

            recv = Receiver(decode.mgr, req.room, bootstrap=prefill.bootstrap)
            recv.init(dst, metadata_row=row)
            pages_when_meta_landed = None
            deadline = time.monotonic() + sc.waiting_timeout
            while True:
                state = recv.poll()  # read first: whatever is checked after a SUCCESS had landed before it
                if pages_when_meta_landed is None and meta_landed():
                    pages_when_meta_landed = pages_landed()
                if state in (Poll.SUCCESS, Poll.FAILED):
                    break
                assert time.monotonic() < deadline, f"room {req.room} not finished within {sc.waiting_timeout}s"
                time.sleep(0.0002)
            assert state == Poll.SUCCESS, recv.failure()
            assert pages_when_meta_landed is not False, f"room {req.room}: the metadata row landed before every page had"
            assert meta_landed() and pages_landed(), f"room {req.room}: SUCCESS before every byte had landed"
            for e, w in enumerate(want):
                expected[e][dst] = w
            expected_meta[row] = meta_row_for(req.room)
        for e, (got, exp) in enumerate(zip(decode.pools.kv, expected)):
            np.testing.assert_array_equal(got, exp, err_msg=f"region {e}: a byte outside the requests changed")
        np.testing.assert_array_equal(decode.pools.meta, expected_meta)
        rc, result = prefill.finish()
        assert rc == 0 and result == {"role": "prefill", "failed": 0, "active_rooms": 0}, prefill.stderr()[-3000:]
        assert decode.mgr.active_rooms() == 0

    # -- 3. every state handler across heterogeneous TP (the whole matrix, PP and the index policy are
    #       core's: tests/test_policy.py runs them once, over the memory backend) ----------------------
    @staticmethod
    def _row_writes(prefill: LocalPrefill) -> list[bool]:
        """Per write prefill makes to decode, in the order they returned: whether it held the metadata row."""
        writes: list[bool] = []
        write = prefill.mgr.transport.write
        lo, hi = prefill.pools.meta.ctypes.data, prefill.pools.meta.ctypes.data + prefill.pools.meta.nbytes

        def recording(peer: str, plan: TransferPlan, deadline: float, live: Any = None, announce: Any = None) -> None:
            write(peer, plan, deadline, live, announce)
            writes.append(bool(((plan.src_addr >= lo) & (plan.src_addr < hi)).any()))

        prefill.mgr.transport.write = recording  # type: ignore[method-assign]
        return writes

    def _one_room(self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child],
                  **changes: Any) -> list[bool]:
        """One 64-page request, decode checking every byte (the metadata row too); what each write held."""
        prefill, decode, sender, req = self.waiting_room(
            local_prefill, children, **{"requests": 1, "max_pages": 64, "max_chunks": 1, "concurrency": 1, **changes})
        writes = self._row_writes(prefill)
        sender.send(req.src_pages, last=True)
        wait_until(finished(sender), self.scaled(START_WAIT), "sender")
        assert sender.poll() == Poll.SUCCESS, sender.failure()
        rc, d = decode.finish()
        assert rc == 0 and d is not None and d["requests"] == 1 and d["mismatched_regions"] == 0, decode.stderr()[-3000:]
        return writes

    @requires("dram")  # pools in host memory
    def test_a_small_metadata_row_in_host_memory_travels_in_done_and_arrives_byte_exact(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        writes = self._one_room(local_prefill, children)
        assert writes and not any(writes), f"the metadata row was written by the engine ({writes}), not carried in Done"

    @requires("dram")  # pools in host memory
    def test_a_metadata_row_over_inline_row_bytes_is_written_by_the_engine_after_the_pages(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        # The path GPU-memory rows take: the engine writes the row, alone, after every page.
        writes = self._one_room(local_prefill, children, inline_row_bytes=0)
        assert len(writes) >= 2 and writes[-1] and not any(writes[:-1]), writes

    def test_every_state_handler_arrives_byte_exact_from_prefill_tp2_to_decode_tp4(self, children: Callable[..., Child]) -> None:
        # Full KV, SWA, NSA indexer, Mamba conv/temporal, DeepSeek-V4 compressed caches into
        # decode host rows of another geometry, draft pools and metadata rows, every rank's
        # every buffer checked against the global tensors sliced with plain numpy. Token-major
        # pages split by heads: partial descriptors of odd sizes at odd offsets.
        spec = self.hybrid_spec(prefill_tp=2, decode_tp=4, layout="nhd", draft=True)
        p, d, _ = self.run_hybrid(children, spec)
        all_succeeded(p, d)
        assert self.backend in p["lanes"], f"backend {self.backend!r} moved nothing; lanes used: {p['lanes']}"

    @pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (1, 4), (4, 1)])
    def test_every_state_handler_arrives_byte_exact_across_tp(
        self, children: Callable[..., Child], prefill_tp: int, decode_tp: int
    ) -> None:
        # The hybrid model of the test above, across the other TP pairs. Prefill TP < decode TP
        # with token-major pages sends strided token rows; where the backend allows host staging
        # (BackendCapabilities.host_staging, the default), core gathers them into its registered
        # staging buffer and posts contiguous runs: that path must land the same bytes.
        spec = self.hybrid_spec(prefill_tp=prefill_tp, decode_tp=decode_tp, layout="nhd", draft=True, requests=2,
                                staging="gather")
        p, d, _ = self.run_hybrid(children, spec)
        all_succeeded(p, d)
        if prefill_tp < decode_tp and get_registry().backend_spec(self.backend).capabilities.host_staging:
            assert p["staged_windows"] > 0, "host memory, NHD pages, prefill TP < decode TP: core should have staged"

    @requires("dram")  # pools in host memory
    @pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)])
    def test_every_state_handler_arrives_byte_exact_across_tp_staged_on_both_sides(
        self, children: Callable[..., Child], prefill_tp: int, decode_tp: int
    ) -> None:
        # The hybrid model with staging forced on (SessionConfig.staging="on"), both TP directions: token rows
        # gathered on prefill (TP 1 -> 2), or written into decode's staging slots and scattered there (TP 2 -> 1,
        # the strided destination), every rank's every buffer checked against the global tensors.
        spec = self.hybrid_spec(prefill_tp=prefill_tp, decode_tp=decode_tp, layout="nhd", requests=1, staging="on")
        p, d, _ = self.run_hybrid(children, spec)
        all_succeeded(p, d)
        if get_registry().backend_spec(self.backend).capabilities.host_staging:
            assert p["staged_windows"] > 0, "staging forced on, host memory: core should have staged"

    # -- 4. layer-wise sending: each layer posted as the host finishes it -----------------------------
    @pytest.mark.parametrize("staging", ["off", "auto"])
    def test_layerwise_every_state_handler_arrives_byte_exact_from_prefill_tp2_to_decode_tp4(
        self, children: Callable[..., Child], staging: str
    ) -> None:
        # The hybrid model of section 3, each chunk sent with layerwise=True: layer by layer
        # (first chunk), then every target layer in one call and the draft layer in another.
        # With staging "auto", the write that ends each chunk (its last layers, state, row) stages windows of
        # small pieces, on both sides where decode lent slots: it must still land before the room's Done,
        # behind the chunk's earlier layers and ahead of the next chunk (issue #29).
        spec = self.hybrid_spec(prefill_tp=2, decode_tp=4, layout="nhd", draft=True, layerwise=True, staging=staging)
        p, d, _ = self.run_hybrid(children, spec)
        all_succeeded(p, d)
        if staging == "auto" and "dram" in self.capabilities.memory_kinds and self.capabilities.host_staging:
            assert p["staged_windows"] > 0, "staging auto, host memory, scattered small pages: core should have staged"

    @requires("dram")  # pools in host memory
    def test_layerwise_requests_in_chunks_arrive_byte_exact_with_8_in_flight(self, children: Callable[..., Child]) -> None:
        sc = self.scenario(requests=24, max_pages=256, concurrency=8, max_chunks=4, decode_pages=8 * 256, layerwise=True)
        prefill = children("prefill", sc)
        decode = children("decode", sc, bootstrap=prefill.bootstrap)
        rc_d, d = decode.finish(sc.deadline + 10)
        rc_p, p = prefill.finish()
        assert rc_d == 0 and d is not None, f"decode exited with {rc_d}, last line {d}: {decode.stderr()[-3000:]}"
        assert d["requests"] == sc.requests and d["failed"] == [] and d["mismatched_regions"] == 0
        assert rc_p == 0 and p == {"role": "prefill", "failed": 0, "active_rooms": 0}, prefill.stderr()[-3000:]

    def _layerwise_room(self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
                        ) -> tuple[LocalPrefill, Child, Sender, Any]:
        prefill, decode, sender, req = self.waiting_room(local_prefill, children, requests=1, max_pages=512, max_chunks=1,
                                                         concurrency=1)
        assert sender.layers == ((0, False), (1, False))
        sender.send(req.src_pages, last=True, layerwise=True)
        return prefill, decode, sender, req

    @requires("dram")  # pools in host memory
    def test_layerwise_room_succeeds_only_once_every_layer_was_announced(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        prefill, decode, sender, _ = self._layerwise_room(local_prefill, children)
        sender.layer_ready(0)
        time.sleep(0.3)  # a sender that completed without layer 1 would have by now
        assert sender.poll() == Poll.TRANSFERRING, "the room completed before its last layer was announced"
        sender.layer_ready(1)
        wait_until(finished(sender), self.scaled(10.0), "sender after the last layer")
        assert sender.poll() == Poll.SUCCESS, sender.failure()
        rc, d = decode.finish()
        assert rc == 0 and d is not None and d["requests"] == 1 and d["failed"] == [], decode.stderr()[-3000:]
        assert d["mismatched_regions"] == 0

    @requires("dram")  # pools in host memory
    def test_layerwise_chunk_still_computing_its_last_layer_lands_before_the_next_chunk_ends_the_room(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        # Chunk 0's layer 1 is still computing (its ready handle's query() says no) when the host sends the
        # last chunk and announces all its layers. The transfer thread writes chunk 0's layer 0 and leaves
        # layer 1 for a later call; the last chunk's write must not overtake that call: its Done ends the room,
        # decode reports SUCCESS, and chunk 0's layer 1 would land after it (or, staged on both sides, be
        # dropped by decode for a room it no longer holds: issue #29).
        prefill, decode, sender, req = self.waiting_room(local_prefill, children, requests=1, max_pages=512,
                                                         max_chunks=1, concurrency=1, bootstrap_timeout=START_WAIT)
        assert sender.layers == ((0, False), (1, False))
        pages = np.asarray(req.src_pages)
        half = len(pages) // 2
        assert half >= 1, f"the request has {len(pages)} pages; two chunks need at least 2"
        layer0, layer1 = _Gate(), _Gate()
        try:
            sender.send(pages[:half], layerwise=True)
            sender.layer_ready(0, ready=layer0)
            sender.layer_ready(1, ready=layer1)
            sender.send(pages[half:], last=True, layerwise=True)
            sender.layer_ready([0, 1])
            layer0.open()
            time.sleep(0.3)  # the last chunk, written ahead of chunk 0's layer 1, would have ended the room by now
            assert sender.poll() == Poll.TRANSFERRING, (
                f"the room reached {sender.poll().name} while chunk 0's layer 1 was still computing")
        finally:
            layer1.open()
        wait_until(finished(sender), self.scaled(10.0), "sender after chunk 0's layer 1")
        assert sender.poll() == Poll.SUCCESS, sender.failure()
        rc, d = decode.finish()
        assert rc == 0 and d is not None and d["requests"] == 1 and d["failed"] == [], decode.stderr()[-3000:]
        assert d["mismatched_regions"] == 0

    @requires("dram")  # pools in host memory
    def test_layerwise_fault_mid_way_fails_the_room_on_both_sides_with_a_reason(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        # Layer 0 goes out; then the engine loses the peer (as when core drops it), so
        # layer 1's write raises: nothing may report SUCCESS, both sides say why.
        prefill, decode, sender, req = self._layerwise_room(local_prefill, children)
        sender.layer_ready(0)
        (peer_id,) = sender.peer_ids()
        prefill.mgr.transport.remove_peer(peer_id)
        sender.layer_ready(1)
        wait_until(finished(sender), self.scaled(10.0), "sender after the fault")
        assert sender.poll() == Poll.FAILED
        reason = sender.failure() or ""
        assert re.match(r"transfer of chunk 0 \(layers? [01](, 1)?\) to '.+' failed: ", reason), reason
        rc, d = decode.finish()
        assert d is not None, decode.stderr()[-3000:]
        assert rc == 1 and d["requests"] == 0, "decode reported SUCCESS for a room whose layer never landed"
        assert [f["room"] for f in d["failed"]] == [req.room] and d["failed"][0]["reason"].endswith(f": {reason}"), (
            d["failed"], reason)

    # -- 5. dead and frozen peers --------------------------------------------------------------------
    def _big_request(self) -> Any:
        # One request of at least 10,000 pages; prefill sends every other source page, so
        # nothing coalesces: one descriptor per page and region, seconds of work on slow engines.
        # Not staged: a gather would make it one fast copy, and these tests need a write under way.
        big = self.scenario(prefill_pages=32768, decode_pages=16384, max_pages=16384, max_chunks=1, requests=1,
                            staging="off")
        return next(s for s in (msgspec.structs.replace(big, seed=i) for i in range(100))
                    if len(schedule(s)[0].src_pages) >= 10_000)

    @requires("dram")  # pools in host memory
    def test_decode_killed_mid_transfer_fails_the_sender_in_time_and_the_prefill_serves_the_next_decode(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        big = self._big_request()
        (req,) = schedule(big)
        prefill = local_prefill(big)
        doomed = children("decode", big, bootstrap=prefill.address)
        sender = self.sender_when_asked(prefill, req.room)
        sender.send(np.arange(len(req.src_pages)) * 2, last=True)
        # Kill at once: the fastest backend here (memory) needs ~30 ms for the whole chunk, which a
        # sleep of that order on a loaded machine outlasts. The write is starting or under way.
        doomed.kill()
        state = sender.poll()
        assert state != Poll.SUCCESS, "the chunk finished before the kill; make it larger"
        cfg = prefill.mgr.config
        bound = cfg.transfer_timeout + cfg.heartbeat_timeout + self.slack  # wait_until fails the test past it
        wait_until(finished(sender), bound, "sender after the decode was killed")
        assert sender.poll() == Poll.FAILED
        assert re.match(DEAD_PEER_REASON, sender.failure() or ""), sender.failure()
        self.serve_a_fresh_decode(prefill, children, self.scenario(prefill_pages=big.prefill_pages, seed=1))

    @requires("dram")  # pools in host memory
    def test_decode_frozen_mid_transfer_fails_the_sender_in_time_and_the_prefill_serves_another_decode(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        # SIGSTOP: the decode's sockets stay open but nothing answers. The host is still
        # prefilling (the last chunk never comes), so only failure detection ends the room,
        # also on engines that can write into a stopped process (CMA).
        big = self._big_request()
        (req,) = schedule(big)
        prefill = local_prefill(big)
        frozen = children("decode", big, bootstrap=prefill.address)
        sender = self.sender_when_asked(prefill, req.room)
        sender.send(np.arange(len(req.src_pages) - 1) * 2)
        time.sleep(0.02)  # let the write start
        frozen.freeze()
        try:
            cfg = prefill.mgr.config
            bound = cfg.transfer_timeout + cfg.heartbeat_timeout + self.slack  # wait_until fails the test past it
            wait_until(finished(sender), bound, "sender after the decode froze")
            assert sender.poll() == Poll.FAILED
            assert re.match(DEAD_PEER_REASON, sender.failure() or ""), sender.failure()
            # A stopped peer must not hold up the engine for the others.
            self.serve_a_fresh_decode(prefill, children, self.scenario(prefill_pages=big.prefill_pages, seed=1))
        finally:
            frozen.kill()  # SIGCONT, then SIGKILL

    # -- 6. closing with rooms in flight -------------------------------------------------------------
    def _closed_cleanly(self, closer: Child, role: str, transfer_timeout: float) -> dict[str, Any]:
        rc, result = closer.finish()
        assert rc == 0, f"{role} exited with {rc}:\n{closer.stderr()[-3000:]}"
        assert result is not None and result["role"] == f"{role}-close"
        assert set(result["before_close"].values()) == {"TRANSFERRING"}, result["before_close"]
        # In-flight writes to a live peer finish, or end at their deadline: close never waits longer.
        assert result["close_seconds"] < transfer_timeout, result["close_seconds"]
        assert result["rooms"] == {room: {"state": "FAILED", "reason": f"{role} manager closed"} for room in result["before_close"]}
        assert result["active_rooms"] == 0
        return result

    @requires("dram")  # pools in host memory
    def test_prefill_manager_closed_with_rooms_in_flight_fails_every_room_on_both_sides_and_exits_cleanly(
        self, local_decode: Callable[..., LocalDecode], children: Callable[..., Child]
    ) -> None:
        sc = self.scenario(requests=8, max_pages=256, concurrency=8, decode_pages=8 * 256)
        closer = children("prefill-close", sc)
        decode = local_decode(sc)
        receivers, cursor = [], 0
        for row, req in enumerate(schedule(sc)):
            recv = Receiver(decode.mgr, req.room, bootstrap=closer.bootstrap)
            recv.init(np.arange(cursor, cursor + len(req.src_pages)), metadata_row=row)
            cursor += len(req.src_pages)
            receivers.append(recv)
        self._closed_cleanly(closer, "prefill", sc.transfer_timeout)
        # Decode hears the close or, if that message was lost with the socket, stops hearing heartbeats.
        wait_until(lambda: all(finished(r)() for r in receivers), sc.heartbeat_timeout + self.slack, "receivers")
        for recv in receivers:
            assert recv.poll() == Poll.FAILED
            assert re.fullmatch(r"prefill tp0/pp0 at 127\.0\.0\.1:\d+(: prefill manager closed| sent nothing for .*)",
                                recv.failure() or ""), recv.failure()
        assert decode.mgr.active_rooms() == 0

    @requires("dram")  # pools in host memory
    def test_decode_manager_closed_with_rooms_in_flight_fails_every_room_on_both_sides_and_exits_cleanly(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        sc = self.scenario(requests=8, max_pages=256, concurrency=8, decode_pages=8 * 256)
        prefill = local_prefill(sc)
        closer = children("decode-close", sc, bootstrap=prefill.address)
        wave = schedule(sc)
        # The first once its request came (the driver is up), the others at once, before or after theirs.
        senders = [self.sender_when_asked(prefill, wave[0].room)]
        senders += [Sender(prefill.mgr, req.room, metadata_row=row) for row, req in enumerate(wave) if row]
        wait_until(lambda: all(s.poll() >= Poll.WAITING_FOR_INPUT for s in senders), self.scaled(START_WAIT), "requests")
        for sender, req in zip(senders, wave):
            sender.send(req.src_pages[:(len(req.src_pages) + 1) // 2])  # never the last chunk
        self._closed_cleanly(closer, "decode", sc.transfer_timeout)
        wait_until(lambda: all(finished(s)() for s in senders), sc.heartbeat_timeout + self.slack, "senders")
        for sender in senders:
            assert sender.poll() == Poll.FAILED
            assert re.match(r"aborted by decode: decode manager closed$|" + DEAD_PEER_REASON, sender.failure() or ""), (
                sender.failure())
        assert prefill.mgr.active_rooms() == 0
        self.serve_a_fresh_decode(prefill, children, self.scenario(seed=1))
