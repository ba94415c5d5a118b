"""Lanes: a transport's ordered backends, each pair of regions moved by the first lane holding both.

Two in-process backends copy with ``ctypes.memmove`` (source and destination
live in this process), so which lane moved which descriptor is observable:
``near`` moves GPU memory within one host (as ``cuda_ipc`` does) and takes
whole plans, checking core's fence itself; ``far`` moves both kinds anywhere.
The "GPU" regions are host arrays declared ``mem="vram"``: the kinds steer the
routing, and these backends never dereference anything but host memory.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest

from kvbridge.core import BackendCapabilities, Region, TransferPlan, checkpoint
from kvbridge.core.planning.transferplan import Memory
from kvbridge.core.transfer.backend import Backend, BackendConfig, TransferCancelled, TransferError
from kvbridge.core.transfer.transport import FENCE_BATCH_DESCRIPTORS, Lane, Transport

PAGE = 256
PAGES = 64


class _Copy(Backend):
    """Copies in this process; records every write it got."""

    refuse = ""

    def __init__(self) -> None:
        super().__init__(BackendConfig())
        self.writes: list[TransferPlan] = []
        self.registered: list[Region] = []

    def register(self, regions: Sequence[Region]) -> None:
        self.registered = list(regions)

    def metadata(self) -> bytes:
        return b"in-process"

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        if self.refuse:
            raise TransferError(self.refuse)

    def remove_peer(self, peer: str) -> None:
        pass

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        self.writes.append(batch)
        for src, dst, n in zip(batch.src_addr.tolist(), batch.dst_addr.tolist(), batch.nbytes.tolist()):
            checkpoint("between descriptors")
            ctypes.memmove(dst, src, n)

    def close(self) -> None:
        pass


NEAR = BackendCapabilities(memory_kinds=("vram",), cross_host=False, host_staging=False, whole_plans=True)
FAR = BackendCapabilities(memory_kinds=("dram", "vram"), host_staging=False)


def _pools(rng: np.random.Generator | None) -> tuple[list[np.ndarray], list[Region]]:
    """A host pool and a "GPU" pool of PAGES pages each (random when ``rng``, zeros otherwise)."""
    arrays = [rng.integers(1, 256, (PAGES, PAGE), dtype=np.uint8) if rng is not None else np.zeros((PAGES, PAGE), np.uint8)
              for _ in range(2)]
    regions = [Region(name=name, addr=a.ctypes.data, nbytes=a.nbytes, stride=PAGE, role="k", index_space="kv_page",
                      layer=i, mem=mem) for i, (name, a, mem) in enumerate(zip(("host", "gpu"), arrays, ("dram", "vram")))]
    return arrays, regions


def _plan(src: list[np.ndarray], dst: list[np.ndarray], s: list[int], d: list[int]) -> TransferPlan:
    """Pages ``s`` -> ``d`` in both pools, one descriptor per page (written independently of the planner)."""
    rows = [(a.ctypes.data + PAGE * i, b.ctypes.data + PAGE * j) for a, b in zip(src, dst) for i, j in zip(s, d)]
    arr = np.array(rows, np.int64)
    return TransferPlan(arr[:, 0], arr[:, 1], np.full(len(rows), PAGE, np.int64))


@pytest.fixture
def setup() -> dict:
    rng = np.random.default_rng(3)
    src, src_regions = _pools(rng)
    dst, dst_regions = _pools(None)
    near, far = _Copy(), _Copy()
    t = Transport([Lane("near", near, NEAR), Lane("far", far, FAR)])
    t.register(src_regions)
    return {"t": t, "near": near, "far": far, "src": src, "dst": dst, "dst_regions": dst_regions}


def _landed(s: dict, pages_src: list[int], pages_dst: list[int]) -> None:
    for a, b in zip(s["src"], s["dst"]):
        np.testing.assert_array_equal(b[pages_dst], a[pages_src])
        untouched = np.setdiff1d(np.arange(PAGES), pages_dst)
        assert not b[untouched].any(), "a page outside the plan was written"


def test_each_lane_registers_only_the_memory_kinds_it_moves(setup: dict) -> None:
    assert [r.name for r in setup["near"].registered] == ["gpu"]
    assert [r.name for r in setup["far"].registered] == ["host", "gpu"]


def test_gpu_pages_go_through_the_near_lane_and_host_pages_through_the_far_one_byte_exact(setup: dict) -> None:
    t = setup["t"]
    t.add_peer("decode", {"near": b"x", "far": b"y"}, setup["dst_regions"])
    assert t.lanes_of("decode") == ["near", "far"]
    s, d = [3, 4, 5, 9, 63], [0, 1, 2, 30, 31]
    t.write("decode", _plan(setup["src"], setup["dst"], s, d), deadline=float("inf"))
    _landed(setup, s, d)
    gpu, host = setup["dst"][1].ctypes.data, setup["dst"][0].ctypes.data
    (near_batch,) = setup["near"].writes
    assert ((near_batch.dst_addr >= gpu) & (near_batch.dst_addr < gpu + PAGES * PAGE)).all() and len(near_batch) == 5
    far_dst = np.concatenate([b.dst_addr for b in setup["far"].writes])
    assert ((far_dst >= host) & (far_dst < host + PAGES * PAGE)).all() and len(far_dst) == 5


@pytest.mark.parametrize("why, meta, host", [("on another host", {"near": b"x", "far": b"y"}, "another-host"),
                                             ("not running the near lane", {"far": b"y"}, None)])
def test_a_peer_the_near_lane_cannot_reach_gets_everything_through_the_far_lane(setup: dict, why, meta, host) -> None:
    t = setup["t"]
    t.add_peer("decode", meta, setup["dst_regions"], host=host)
    assert t.lanes_of("decode") == ["far"], why
    t.write("decode", _plan(setup["src"], setup["dst"], [1, 2], [7, 8]), deadline=float("inf"))
    _landed(setup, [1, 2], [7, 8])
    assert not setup["near"].writes


def test_a_near_lane_that_refuses_the_peer_leaves_it_to_the_next(setup: dict) -> None:
    setup["near"].refuse = "cannot map the peer's GPU memory"
    t = setup["t"]
    t.add_peer("decode", {"near": b"x", "far": b"y"}, setup["dst_regions"])
    assert t.lanes_of("decode") == ["far"]
    t.write("decode", _plan(setup["src"], setup["dst"], [0], [0]), deadline=float("inf"))
    _landed(setup, [0], [0])


def test_a_peer_whose_memory_no_lane_moves_is_refused_naming_the_pair_and_each_lanes_reason() -> None:
    near = _Copy()
    t = Transport([Lane("near", near, NEAR), Lane("far", _Copy(), BackendCapabilities(memory_kinds=("dram",)))])
    _, src_regions = _pools(np.random.default_rng(1))
    t.register(src_regions)
    _, dst_regions = _pools(None)
    with pytest.raises(TransferError, match=r"local region '\w+' \((dram|vram)\) -> its '\w+' \((dram|vram)\), 3 region pair.*near: the peer is on another host"):
        t.add_peer("decode", {"near": b"x", "far": b"y"}, dst_regions, host="another-host")


def test_a_whole_plans_lane_gets_the_plan_in_one_write_and_core_fences_it_between_posts(setup: dict) -> None:
    t = setup["t"]
    t.add_peer("decode", {"near": b"x", "far": b"y"}, setup["dst_regions"])
    gpu_src, gpu_dst = setup["src"][1], setup["dst"][1]
    n = PAGES * PAGE // 8  # 8-byte pieces, more than core's fence batch holds
    assert n > FENCE_BATCH_DESCRIPTORS
    pieces = np.arange(n, dtype=np.int64) * 8
    plan = TransferPlan(gpu_src.ctypes.data + pieces, gpu_dst.ctypes.data + pieces[::-1], np.full(n, 8, np.int64))
    t.write("decode", plan, deadline=float("inf"))
    assert [len(w) for w in setup["near"].writes] == [n]
    np.testing.assert_array_equal(gpu_dst.view(np.uint64).ravel(), gpu_src.view(np.uint64).ravel()[::-1])
    stopped = iter([True, True, False])  # live for core's check and the first descriptor, then not
    with pytest.raises(TransferCancelled, match="between descriptors"):
        t.write("decode", plan, deadline=float("inf"), live=lambda: next(stopped, False))
    assert len(setup["near"].writes) == 2  # posted once, stopped inside by checkpoint()


def test_a_transport_names_its_lanes_in_order_and_refuses_a_name_twice() -> None:
    assert Transport([Lane("near", _Copy(), NEAR), Lane("far", _Copy(), FAR)]).name == "near,far"
    with pytest.raises(ValueError, match="more than once"):
        Transport([Lane("far", _Copy(), FAR), Lane("far", _Copy(), FAR)])


# -- lanes through a session: bootstrap, handshake, the lanes both sides run ------------------------
def _kvargs(k: np.ndarray, meta: np.ndarray) -> "KVArgs":
    from kvbridge import IndexSpace, KVArgs

    return KVArgs(regions=(Region(name="k", addr=k.ctypes.data, nbytes=k.nbytes, stride=k.strides[0], role="k",
                                  index_space="kv_page", layer=0),
                           Region(name="meta", addr=meta.ctypes.data, nbytes=meta.nbytes, stride=64, role="metadata",
                                  index_space="metadata_row")),
                  dtype="bfloat16", page_size=16,
                  index_spaces=(IndexSpace("kv_page", PAGES, tokens=16), IndexSpace("metadata_row", 4)))


@pytest.mark.parametrize("prefill_lanes, decode_lanes, used", [
    ("memory,nixl", "memory,nixl", ["memory"]),  # both run memory: the first lane holding both takes every pair
    ("memory,nixl", "nixl", ["nixl"]),           # decode does not run memory: nixl takes it all
])
def test_a_session_over_lanes_moves_every_page_through_the_first_lane_both_sides_run(prefill_lanes, decode_lanes, used):
    from kvbridge import BootstrapServer, DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig

    rng = np.random.default_rng(5)
    p_k, p_meta = rng.integers(1, 256, (PAGES, PAGE), dtype=np.uint8), rng.integers(1, 256, (4, 64), dtype=np.uint8)
    d_k, d_meta = np.zeros_like(p_k), np.zeros_like(p_meta)
    server = BootstrapServer("127.0.0.1")
    config = SessionConfig(gpu_fast_path=False)  # one name is taken as it is (no same-host lanes before it)
    prefill = PrefillManager(_kvargs(p_k, p_meta), prefill_lanes, bootstrap=server.address, config=config)
    decode = DecodeManager(_kvargs(d_k, d_meta), decode_lanes, config=config)
    try:
        assert prefill.transport.name == prefill_lanes and decode.transport.name == decode_lanes
        recv = Receiver(decode, 7, bootstrap=server.address)
        recv.init(page_indices=[10, 11, 40], metadata_row=2)
        send = Sender(prefill, 7, metadata_row=1)
        assert send.wait(Poll.WAITING_FOR_INPUT, 30) == Poll.WAITING_FOR_INPUT, send.failure()
        send.send([0, 1, 5], last=True)
        assert recv.wait(Poll.SUCCESS, 30) == Poll.SUCCESS, recv.failure()
        np.testing.assert_array_equal(d_k[[10, 11, 40]], p_k[[0, 1, 5]])
        np.testing.assert_array_equal(d_meta[2], p_meta[1])
        assert not np.delete(d_k, [10, 11, 40], axis=0).any()
        assert [prefill.transport.lanes_of(p) for p in prefill.transport.describe()["lanes"]] == [used]
    finally:
        for obj in (decode, prefill, server):
            obj.close()


def test_core_hands_a_backend_batches_of_one_memory_kind_and_device_a_side_and_says_which() -> None:
    # One lane that moves both kinds: a write touching the host pool and the "GPU" pool arrives as one
    # batch per (source, destination) place, each told where it is (NIXL builds one list per kind).
    far = _Copy()
    t = Transport([Lane("far", far, FAR)])
    src, src_regions = _pools(np.random.default_rng(2))
    dst, dst_regions = _pools(None)
    t.register(src_regions)
    t.add_peer("decode", b"y", dst_regions)
    t.write("decode", _plan(src, dst, [1, 2, 3], [4, 5, 6]), deadline=float("inf"))
    for a, b in zip(src, dst):
        np.testing.assert_array_equal(b[[4, 5, 6]], a[[1, 2, 3]])
    got = sorted((w.memory, len(w)) for w in far.writes)
    assert got == [(Memory("dram", 0, "dram", 0), 3), (Memory("vram", 0, "vram", 0), 3)]
    for w in far.writes:  # each batch's descriptors are where it says
        pool = 0 if w.memory.src_kind == "dram" else 1
        assert ((w.src_addr >= src[pool].ctypes.data) & (w.src_addr < src[pool].ctypes.data + src[pool].nbytes)).all()


def test_a_peer_whose_regions_share_one_place_gets_its_batches_placed_without_a_lookup() -> None:
    far = _Copy()
    t = Transport([Lane("far", far, FAR)])
    src, src_regions = _pools(np.random.default_rng(2))
    dst, dst_regions = _pools(None)
    t.register(src_regions[:1])
    t.add_peer("decode", b"y", [msgspec.structs.replace(dst_regions[0], device=3)])
    t.write("decode", _plan(src[:1], dst[:1], [0, 9], [1, 2]), deadline=float("inf"))
    assert [w.memory for w in far.writes] == [Memory("dram", 0, "dram", 3)]
    np.testing.assert_array_equal(dst[0][[1, 2]], src[0][[0, 9]])


def test_gpu_sources_through_a_lane_that_stages_host_memory_are_written_as_planned_not_cut_into_windows() -> None:
    # Staging gathers host memory only: a GPU part (more descriptors than one staging window holds) goes
    # as one window, without a choice made per window, and lands byte-exact.
    from kvbridge.core.transfer.staging import WINDOW_DESCRIPTORS

    far = _Copy()
    t = Transport([Lane("far", far, BackendCapabilities(memory_kinds=("dram", "vram"), host_staging=True))])
    n = WINDOW_DESCRIPTORS + 4000
    rng = np.random.default_rng(9)
    src = rng.integers(1, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    regions = [Region(name="gpu", addr=a.ctypes.data, nbytes=a.nbytes, stride=1, role="k", index_space="kv_page",
                      layer=0, mem="vram") for a in (src, dst)]
    t.register(regions[:1])
    assert t.lanes[0].staging is not None  # the lane stages host memory, were there any
    t.add_peer("decode", b"y", regions[1:])
    order = rng.permutation(n)
    seen: list[str] = []
    t.on_window = seen.append
    t.write("decode", TransferPlan(src.ctypes.data + np.arange(n, dtype=np.int64), dst.ctypes.data + order,
                                   np.ones(n, np.int64)), deadline=float("inf"))
    assert seen == ["direct"]
    np.testing.assert_array_equal(dst[order], src)
    assert sum(len(w) for w in far.writes) == n and all(w.memory == Memory("vram", 0, "vram", 0) for w in far.writes)


@pytest.mark.parametrize("host_only, host, expect", [
    (True, None, True),  # the near lane moves nothing to this peer: only the far lane's capability counts
    (False, None, False),  # the near lane moves the GPU pages and does not declare inline writes
    (True, "another-host", False),  # a peer on another host is never written from the host's thread
])
def test_writes_inline_asks_only_the_lanes_that_move_something_to_the_peer(host_only, host, expect) -> None:
    _, src_regions = _pools(None)
    _, dst_regions = _pools(None)
    far_caps = BackendCapabilities(memory_kinds=("dram", "vram"), host_staging=False, inline_writes=True)
    t = Transport([Lane("near", _Copy(), NEAR), Lane("far", _Copy(), far_caps)])
    t.register(src_regions[:1] if host_only else src_regions)
    t.add_peer("decode", {"near": b"x", "far": b"y"}, dst_regions[:1] if host_only else dst_regions, host=host)
    assert t.lanes_of("decode") == (["far"] if host_only else ["near", "far"])
    assert t.writes_inline("decode") is expect
    assert t.writes_inline("stranger") is False


@pytest.mark.parametrize("outcome", ["prepared", "past warm_timeout", "failed"])
def test_a_prefill_rank_answers_a_handshake_once_its_lanes_prepared_for_the_peers_writes(monkeypatch, caplog, outcome):
    # A lane that prepares (Backend.warm: cuda_ipc compiles its kernels) gets plans shaped like the peer's
    # requests before the handshake is answered; decode sends no request until then, so its first requests
    # find the lane ready. A lane still preparing at SessionConfig.warm_timeout, or failing to, delays nothing more.
    import threading
    import time

    from kvbridge import BootstrapServer, DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
    from kvbridge.testing.memory import MemoryBackend

    release, got = threading.Event(), []

    def warm(self, peer: str, batches: Sequence[TransferPlan]) -> None:
        got.append((peer, batches))
        if outcome == "failed":
            raise RuntimeError("no compiler here")
        release.wait(20)

    monkeypatch.setattr(MemoryBackend, "warm", warm)
    rng = np.random.default_rng(6)
    p_k, p_meta = rng.integers(1, 256, (PAGES, PAGE), dtype=np.uint8), rng.integers(1, 256, (4, 64), dtype=np.uint8)
    d_k, d_meta = np.zeros_like(p_k), np.zeros_like(p_meta)
    config = SessionConfig(gpu_fast_path=False, warm_timeout=0.5 if outcome == "past warm_timeout" else 20.0)
    server = BootstrapServer("127.0.0.1")
    prefill = PrefillManager(_kvargs(p_k, p_meta), "memory", bootstrap=server.address, config=config)
    decode = DecodeManager(_kvargs(d_k, d_meta), "memory", config=config)
    try:
        started = time.monotonic()
        recv = Receiver(decode, 7, bootstrap=server.address)
        recv.init(page_indices=[10, 11, 40], metadata_row=2)
        send = Sender(prefill, 7, metadata_row=1)
        if outcome == "prepared":
            assert send.wait(Poll.WAITING_FOR_INPUT, 1.0) < Poll.WAITING_FOR_INPUT  # held while the lane prepares
            assert got and recv.poll() < Poll.TRANSFERRING
            release.set()
        assert send.wait(Poll.WAITING_FOR_INPUT, 30) == Poll.WAITING_FOR_INPUT, send.failure()
        if outcome == "past warm_timeout":
            assert time.monotonic() - started >= 0.5 and not release.is_set()
        assert [peer for peer, _ in got] == [decode.peer_id]
        assert got[0][1] and sum(len(b) for b in got[0][1]) >= 256  # pages of every run length, nothing written yet
        assert not d_k.any()
        send.send([0, 1, 5], last=True)
        assert recv.wait(Poll.SUCCESS, 30) == Poll.SUCCESS, recv.failure()
        np.testing.assert_array_equal(d_k[[10, 11, 40]], p_k[[0, 1, 5]])
        np.testing.assert_array_equal(d_meta[2], p_meta[1])
        assert not np.delete(d_k, [10, 11, 40], axis=0).any()
        said = {"prepared": None, "past warm_timeout": "while its lanes still prepare for it (0.5 s: SessionConfig.warm_timeout)",
                "failed": "preparing the lanes for decode peer"}[outcome]
        if said is not None:
            assert any(said in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        release.set()
        for obj in (decode, prefill, server):
            obj.close()
