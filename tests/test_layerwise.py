"""Layer-wise sending: core's slicing of a plan by layer, and its policy, over the ``memory`` backend.

What every backend must do with layer-wise chunks (bytes land, SUCCESS waits
for the last layer, a fault mid-way fails both sides) is in the conformance
suite; here is what core decides alone: how a plan is cut into layers (also
the GPU fast path's input), pipeline stages and replicated caches, and the
errors a host gets for announcing layers wrongly.
"""

from __future__ import annotations

import collections
import ctypes
import re
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvbridge.plugins.cuda_ipc import ipc, kernel, split
from kvbridge.core.description.describe import describe
from kvbridge.core.planning.layers import LayerIndex, layer_list
from kvbridge.core.description.layout import KV_PAGE_SPACE, METADATA_SPACE, KVArgs
from kvbridge.core.planning.pairing import pair_layouts
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.sessions.peers import DecodePeer
from kvbridge.core.sessions.prefill import PrefillManager
from kvbridge.core.sessions.session import Poll, Sender
from kvbridge.state_handlers.dsv4_hisparse import C4_SPACE, C128_SPACE, c4_token_indices
from kvbridge.state_handlers.mamba import SLOT_SPACE
from kvbridge.state_handlers.swa import SWA_PAGE_SPACE
from kvbridge.testing import hybrid
from kvbridge.testing.harness import BackendHarness, Child, LocalPrefill, all_succeeded, finished, wait_until


# -- slicing a plan by layer (no processes) ------------------------------------------------------------
def _rank(spec: hybrid.Spec, rank: int, tp: int, side: str) -> tuple[hybrid.Buffers, KVArgs]:
    b = hybrid.Buffers(spec, rank, tp, None, side, zero=side == "decode")
    return b, describe(b.pools, draft_pools=b.draft_pools, dtype="bf16", page_size=hybrid.PAGE, tp_rank=rank, tp_size=tp)


def _plan(src: KVArgs, dst: KVArgs, req: hybrid.Request, spec: hybrid.Spec) -> TransferPlan:
    """One request's KV and state (not the metadata row) from one prefill rank to one decode rank."""
    c4_src = c4_token_indices(req.src_pages, hybrid.PAGE // hybrid.RATIO, req.tokens, hybrid.RATIO)
    c4_dst = c4_token_indices(req.dst_c4_rows, spec.c4_row_tokens, req.tokens, hybrid.RATIO)
    route = pair_layouts(src, dst)
    return route.plan(
        {KV_PAGE_SPACE: req.src_pages, SWA_PAGE_SPACE: req.src_swa, SLOT_SPACE: req.src_slot, C4_SPACE: c4_src,
         C128_SPACE: req.src_slot},
        {KV_PAGE_SPACE: req.dst_pages, SWA_PAGE_SPACE: req.dst_swa, SLOT_SPACE: req.dst_slot, C4_SPACE: c4_dst,
         C128_SPACE: req.dst_slot[:1]},
    )


def test_layer_index_lists_target_layers_then_draft_layers_and_never_the_metadata_row() -> None:
    _, args = _rank(hybrid.Spec(backend="memory", draft=True), 0, 1, "prefill")
    assert LayerIndex(args).keys == ((0, False), (1, False), (2, False), (3, False), (4, False), (100, True))


def test_a_plan_split_by_layer_is_the_same_descriptors_each_in_a_region_of_its_layer() -> None:
    spec = hybrid.Spec(backend="memory", prefill_tp=2, decode_tp=4, layout="nhd", draft=True)
    req = hybrid.requests(spec)[0]
    _, src = _rank(spec, 1, 2, "prefill")
    _, dst = _rank(spec, 3, 4, "decode")
    plan = _plan(src, dst, req, spec)
    index = LayerIndex(src)
    layered = index.split(plan)
    assert sum(len(layered.group(g)) for g in range(len(index.keys) + 1)) == len(plan)
    # Slow oracle: each descriptor's source region found by a scan, in the plan's own order.
    def layer_of(addr: int) -> tuple[int, bool]:
        (r,) = [r for r in src.regions if r.addr <= addr < r.end]
        return (r.layer, r.draft)

    for g, key in enumerate(index.keys):
        part = layered.group(g)
        want = [i for i in range(len(plan)) if layer_of(int(plan.src_addr[i])) == key]
        assert len(want) > 0, f"layer {key} sends nothing in this request: the test would prove nothing"
        for a, b in ((part.src_addr, plan.src_addr), (part.dst_addr, plan.dst_addr), (part.nbytes, plan.nbytes)):
            np.testing.assert_array_equal(a, b[want])  # same descriptors, order kept (coalescing intact)
    assert len(layered.group(index.tail)) == 0  # every hybrid region has a layer
    # Several groups at once: their descriptors in group order.
    both = layered.groups([0, 1])
    np.testing.assert_array_equal(both.src_addr, np.concatenate([layered.group(0).src_addr, layered.group(1).src_addr]))
    apart = layered.groups([len(index.keys) - 1, 0])
    np.testing.assert_array_equal(apart.nbytes, np.concatenate([layered.group(0).nbytes, layered.group(len(index.keys) - 1).nbytes]))


def _region_bytes(r: Any) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * r.nbytes).from_address(r.addr), np.uint8)


def test_layer_slices_run_by_the_gpu_copy_work_split_land_layer_by_layer_byte_exact() -> None:
    # The GPU fast path copies whatever descriptors a write carries with one kernel; here its
    # work split runs on the host (split.execute_on_host), one layer slice after another, from
    # both prefill TP ranks into decode TP rank 1 of 4: after each layer only that layer's
    # destination regions have changed, and in the end every buffer equals the numpy oracle.
    spec = hybrid.Spec(backend="memory", prefill_tp=2, decode_tp=4, layout="nhd", draft=True)
    req = hybrid.requests(spec)[0]
    decode, dst = _rank(spec, 1, 4, "decode")
    sources = [_rank(spec, r, 2, "prefill") for r in range(2)]  # keep the source buffers alive
    splits = [(LayerIndex(src), LayerIndex(src).split(_plan(src, dst, req, spec))) for _, src in sources]
    keys = splits[0][0].keys
    mapped = ipc.GpuPeer(np.zeros(1, np.int64), np.full(1, 1 << 62, np.int64), np.zeros(1, np.int64))  # same process
    done: set[tuple[int, bool]] = set()
    for g, key in enumerate(keys):
        for index, layered in splits:
            part = layered.group(index.keys.index(key))
            split.execute_on_host(part.factors(), mapped)
        done.add(key)
        for r in dst.regions:
            if r.role != "metadata" and (r.layer, r.draft) not in done:
                assert not _region_bytes(r).any(), f"region {r.name!r} changed before its layer {r.layer} was sent"
    for name, got in decode.arrays.items():
        if name != "meta":
            np.testing.assert_array_equal(got, hybrid.expected(spec, name, decode.cuts[name], [req]), err_msg=name)


def test_layer_list_takes_an_id_a_range_or_ids_and_rejects_the_rest() -> None:
    assert layer_list(3) == [3] and layer_list(range(2, 5)) == [2, 3, 4] and layer_list(np.arange(2)) == [0, 1]
    for bad in ("0", [1.0], True, None):
        with pytest.raises(ValueError, match="layer"):
            layer_list(bad)  # type: ignore[arg-type]


# -- the policy, with real processes over the memory backend ------------------------------------------
# -- what a write to a decode peer costs (weighed against waiting for the next layer) ----------------------
def _peer() -> DecodePeer:
    return DecodePeer("decode", route=None, lease=1.0)  # type: ignore[arg-type]  # (no route: costs only)


def test_the_write_cost_is_the_fastest_small_write_whatever_a_slow_one_took() -> None:
    peer = _peer()
    peer.note_write(4096, 20e-3)  # the first write to a peer: a cold one
    peer.note_write(4096, 100e-6)
    assert peer.write_cost is None  # too few writes of that size yet
    peer.note_write(4096, 150e-6)
    peer.note_write(4096, 5e-3)  # a host computing on the same cores
    assert peer.write_cost == 100e-6 and peer.byte_time == 0.0


def test_the_line_between_the_smallest_and_largest_writes_splits_a_writes_cost_from_its_bytes() -> None:
    peer = _peer()
    for seconds in (100e-6, 300e-6, 120e-6):
        peer.note_write(4096, seconds)
    for seconds in (3e-3, 2e-3, 9e-3):
        peer.note_write(4 << 20, seconds)
    per_byte = (2e-3 - 100e-6) / ((4 << 20) - 4096)
    assert peer.byte_time == pytest.approx(per_byte)
    assert peer.write_cost == pytest.approx(100e-6 - 4096 * per_byte)


def test_writes_of_one_large_size_cannot_tell_a_writes_cost_from_its_bytes() -> None:
    peer = _peer()
    for _ in range(5):
        peer.note_write(2 << 20, 1e-3)
    assert peer.write_cost is None  # so layers are never held back waiting for the next one on its account


def test_the_hosts_pace_is_its_fastest_recent_gap_whatever_a_stall_took() -> None:
    # A stall (a garbage collection, a transfer thread holding the GIL) only lengthens a gap: it must not
    # make the workers stop waiting for the next layer, which would slow the host and keep the pace slow.
    from kvbridge.core.sessions.prefill import GAP_WINDOW

    pace = SimpleNamespace(_gaps=collections.deque(maxlen=GAP_WINDOW), layer_gap=None)
    for gap in (60e-6, 50e-6, 2e-3, 70e-6):
        PrefillManager.note_layer_gap(pace, gap)  # type: ignore[arg-type]
    assert pace.layer_gap == 50e-6
    for _ in range(GAP_WINDOW):  # a host that now computes 2 ms per layer: the old pace is forgotten
        PrefillManager.note_layer_gap(pace, 2e-3)  # type: ignore[arg-type]
    assert pace.layer_gap == 2e-3


class TestLayerwisePolicy(BackendHarness):
    backend = "memory"

    def test_prefill_pp2_stages_each_announce_their_own_layers(self, children: Callable[..., Child]) -> None:
        spec = self.hybrid_spec(prefill_pp=2, prefill_tp=2, decode_tp=1, draft=True, layerwise=True)
        all_succeeded(*self.run_hybrid(children, spec)[:2])

    def test_replicated_mla_pages_go_layer_by_layer_from_one_prefill_rank(self, children: Callable[..., Child]) -> None:
        spec = self.hybrid_spec(prefill_tp=2, decode_tp=4, mla=True, draft=True, layerwise=True)
        all_succeeded(*self.run_hybrid(children, spec)[:2])

    def _room(self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child], **changes: Any
              ) -> tuple[Child, Sender, Any]:
        _, decode, sender, req = self.waiting_room(
            local_prefill, children, **{"requests": 1, "max_pages": 64, "max_chunks": 1, "concurrency": 1, **changes})
        return decode, sender, req

    def _succeeds(self, decode: Child, sender: Sender) -> None:
        wait_until(finished(sender), self.scaled(10.0), "sender")
        assert sender.poll() == Poll.SUCCESS, sender.failure()
        rc, d = decode.finish()
        assert rc == 0 and d is not None and d["requests"] == 1 and d["mismatched_regions"] == 0, decode.stderr()[-3000:]

    def _fails_on_both_sides(self, decode: Child, sender: Sender, reason: str) -> None:
        wait_until(finished(sender), self.scaled(10.0), "sender")
        assert sender.poll() == Poll.FAILED and re.search(reason, sender.failure() or ""), sender.failure()
        rc, d = decode.finish()
        assert rc == 1 and d is not None and d["requests"] == 0, decode.stderr()[-3000:]
        assert d["failed"][0]["reason"].endswith(sender.failure()), d["failed"]

    def test_a_layer_announced_twice_unknown_or_of_the_wrong_model_is_refused_and_posts_nothing(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        decode, sender, req = self._room(local_prefill, children)
        with pytest.raises(RuntimeError, match="without a chunk sent with send\\(..., layerwise=True\\)"):
            sender.layer_ready(0)
        sender.send(req.src_pages, last=True, layerwise=True)
        sender.layer_ready(0)
        with pytest.raises(ValueError, match=r"layer 0 of chunk 0 was already announced"):
            sender.layer_ready(0)
        with pytest.raises(ValueError, match=r"layer 1 of chunk 0 was already announced"):
            sender.layer_ready([1, 1])
        with pytest.raises(ValueError, match=r"layer 2 is not a layer of this rank \(it holds layers 0-1"):
            sender.layer_ready(range(1, 8))
        with pytest.raises(ValueError, match=r"draft layer 1 is not a layer of this rank \(it holds no draft layers"):
            sender.layer_ready(1, draft=True)
        assert sender.poll() == Poll.TRANSFERRING
        sender.layer_ready(1)
        self._succeeds(decode, sender)
        with pytest.raises(RuntimeError, match="the last chunk's layers were all announced"):
            sender.layer_ready(1)

    def test_the_next_chunk_before_every_layer_was_announced_fails_the_room_on_both_sides(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        decode, sender, req = self._room(local_prefill, children)
        half = len(req.src_pages) // 2
        sender.send(req.src_pages[:half], layerwise=True)
        sender.layer_ready(0)
        with pytest.raises(RuntimeError, match=r"send\(\) of chunk 1 before layer 1 of chunk 0 \(sent layerwise\)"):
            sender.send(req.src_pages[half:], last=True)
        self._fails_on_both_sides(decode, sender, r"before layer 1 of chunk 0 \(sent layerwise\) were announced")

    def test_layers_never_announced_fail_the_room_on_both_sides_after_transfer_timeout(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        decode, sender, req = self._room(local_prefill, children, transfer_timeout=1.0)
        sender.send(req.src_pages, last=True, layerwise=True)
        sender.layer_ready(1)
        self._fails_on_both_sides(
            decode, sender, r"layer 0 of chunk 0 \(sent layerwise\) were not announced with layer_ready\(\) within transfer_timeout=1.0s")

    def test_the_transfer_threads_wait_for_the_ready_handle_before_writing(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        # A GPU host passes a CUDA event recorded after the layer; anything with synchronize() works.
        class Ready:
            def __init__(self) -> None:
                self.released = threading.Event()

            def synchronize(self) -> None:
                assert self.released.wait(30), "never released"

        decode, sender, req = self._room(local_prefill, children)
        ready = Ready()
        sender.send(req.src_pages, last=True, layerwise=True)
        sender.layer_ready([0, 1], ready=ready)
        time.sleep(0.3)  # a sender that did not wait would have finished by now
        assert sender.poll() == Poll.TRANSFERRING
        ready.released.set()
        self._succeeds(decode, sender)

    def test_a_ready_handle_that_raises_fails_the_room_on_both_sides(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        class Broken:
            def synchronize(self) -> None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        decode, sender, req = self._room(local_prefill, children)
        sender.send(req.src_pages, last=True, layerwise=True)
        sender.layer_ready(0, ready=Broken())
        sender.layer_ready(1)
        self._fails_on_both_sides(decode, sender, r"chunk 0 layers? 0(, 1)?: waiting for the layers' source \(ready.synchronize\(\)\) "
                                                  r"failed: CUDA error")

    # -- when layers go, and in how many writes ------------------------------------------------------------
    @staticmethod
    def _record_writes(mgr: PrefillManager) -> list[set[int | str]]:
        """What each write to decode held, in the order they landed: layer ids, ``"row"`` for the metadata row."""
        writes: list[set[int | str]] = []
        write = mgr.transport.write

        def recording(peer: str, plan: TransferPlan, deadline: float, live: Any = None, announce: Any = None) -> None:
            write(peer, plan, deadline, live, announce)  # returns once every byte has landed (and was scattered)
            writes.append({"row" if r.index_space == METADATA_SPACE else r.layer for r in mgr.kvargs.regions
                           if ((plan.src_addr >= r.addr) & (plan.src_addr < r.addr + r.nbytes)).any()})

        mgr.transport.write = recording  # type: ignore[method-assign]
        return writes

    @staticmethod
    def _write_cost(sender: Sender, seconds: float, per_byte: float = 0.0) -> None:
        """Set what the decode peer's writes were measured to cost, and each byte to add (what layer-wise
        sending weighs against waiting for a next layer)."""
        (peer,) = sender.manager.peers()
        peer.write_cost, peer.byte_time = seconds, per_byte

    @pytest.mark.parametrize("inline_row_bytes, after_the_last_layer", [(4096, []), (0, [{"row"}])],
                             ids=["row_in_done", "row_written"])
    def test_the_metadata_row_comes_last_after_the_chunks_last_layer(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child],
        inline_row_bytes: int, after_the_last_layer: list[set[int | str]],
    ) -> None:
        # A small host-memory row travels in Done (no write of its own); else the engine writes it alone, last.
        decode, sender, req = self._room(local_prefill, children, inline_row_bytes=inline_row_bytes)
        writes = self._record_writes(sender.manager)
        self._write_cost(sender, 0.0)  # writes cost nothing: never worth waiting for a next layer
        sender.send(req.src_pages, last=True, layerwise=True)
        sender.layer_ready(0)
        wait_until(lambda: writes == [{0}], self.scaled(10.0), "layer 0 written before layer 1 is announced")
        sender.layer_ready(1)
        self._succeeds(decode, sender)  # decode checks every byte, the row's too
        assert writes == [{0}, {1}, *after_the_last_layer]

    def test_a_layer_still_computing_holds_back_neither_the_layers_before_it_nor_the_others_writes(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        # Layer 1's ready handle says it is still computing (a CUDA event not reached yet): layer 0,
        # whose source is final, goes without waiting for it, although both were announced together.
        class Computing:
            def __init__(self) -> None:
                self.done = threading.Event()

            def query(self) -> bool:
                return self.done.is_set()

            def synchronize(self) -> None:
                assert self.done.wait(30), "never done"

        decode, sender, req = self._room(local_prefill, children)
        writes = self._record_writes(sender.manager)
        self._write_cost(sender, 0.0)
        (peer,) = sender.manager.peers()
        busy = threading.Event()
        peer.worker.submit(lambda: busy.wait(30))  # the worker is busy while both layers are announced
        sender.send(req.src_pages, last=True, layerwise=True)
        layer1 = Computing()
        sender.layer_ready(0)
        sender.layer_ready(1, ready=layer1)
        busy.set()
        wait_until(lambda: writes == [{0}], self.scaled(10.0), "layer 0 written while layer 1 computes")
        assert sender.poll() == Poll.TRANSFERRING
        layer1.done.set()
        self._succeeds(decode, sender)
        assert writes == [{0}, {1}]

    def test_layers_announced_faster_than_a_write_costs_go_in_one_write_byte_exact(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        decode, sender, req = self._room(local_prefill, children)
        writes = self._record_writes(sender.manager)
        self._write_cost(sender, 30.0)  # a write costs far more than the wait for the next layer
        sender.send(req.src_pages, last=True, layerwise=True)
        sender.layer_ready(0)
        time.sleep(0.2)  # layer 0 would have gone alone by now without the wait (see the test above)
        assert writes == []
        sender.layer_ready(1)
        self._succeeds(decode, sender)
        assert writes == [{0, 1}]

    def test_layers_whose_bytes_cost_more_than_a_write_go_without_waiting_for_the_next(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child]
    ) -> None:
        # Writes cost much, but a layer's bytes cost more: waiting for the next would only delay this one.
        decode, sender, req = self._room(local_prefill, children)
        writes = self._record_writes(sender.manager)
        self._write_cost(sender, 30.0, per_byte=1.0)
        sender.send(req.src_pages, last=True, layerwise=True)
        sender.layer_ready(0)
        wait_until(lambda: writes == [{0}], self.scaled(10.0), "layer 0 written before layer 1 is announced")
        sender.layer_ready(1)
        self._succeeds(decode, sender)
        assert writes == [{0}, {1}]

    def test_layers_all_announced_before_the_first_write_go_as_the_chunk_was_planned_without_a_split(
        self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Bandwidth-bound, or a GPU host queueing every layer at once: nothing is left to overlap, so the
        # chunk goes as a per-chunk send writes it, and nobody pays for splitting it by layer.
        decode, sender, req = self._room(local_prefill, children)
        writes = self._record_writes(sender.manager)
        split = LayerIndex.split
        splits: list[TransferPlan] = []

        def counted(index: LayerIndex, plan: TransferPlan) -> Any:
            splits.append(plan)
            return split(index, plan)

        monkeypatch.setattr(LayerIndex, "split", counted)
        (peer,) = sender.manager.peers()
        busy = threading.Event()
        peer.worker.submit(lambda: busy.wait(30))  # the worker is busy while every layer is announced
        sender.send(req.src_pages, last=True, layerwise=True)
        sender.layer_ready(0)
        sender.layer_ready(1)
        busy.set()
        self._succeeds(decode, sender)  # decode checks every byte
        assert writes == [{0, 1}] and splits == []


def test_the_hosts_page_list_is_its_own_again_once_send_returns() -> None:
    # A chunk sent layer-wise is planned at send() and written at layer_ready(): a host that reuses its page
    # list in between (here: overwrites it with other valid pages) changes nothing that lands. Scattered
    # pages, so the plan keeps index lists rather than arrays it made (core.planning.plan._FEW_RUNS).
    from kvbridge import BootstrapServer, DecodeManager, Receiver
    from kvbridge.core.description.pools import KVPool, MetadataPool

    pages, n = 512, 200
    rng = np.random.default_rng(9)

    def kvargs(fill: bool) -> tuple[KVArgs, np.ndarray]:
        k = rng.integers(0, 256, (pages, 4, 1, 16), dtype=np.uint8) if fill else np.zeros((pages, 4, 1, 16), np.uint8)
        pool = KVPool(k=[k], v=[k.copy()], layer_ids=[0], page_size=4)
        return describe([pool, MetadataPool([np.zeros((4, 64), np.uint8)])], dtype="bfloat16", page_size=4), k

    (src_args, src_k), (dst_args, dst_k) = kvargs(True), kvargs(False)
    src, dst = rng.permutation(pages)[:n], rng.permutation(pages)[:n]
    sent = src.copy()
    bootstrap = BootstrapServer("127.0.0.1")
    prefill = PrefillManager(src_args, "memory", bootstrap=bootstrap.address)
    decode = DecodeManager(dst_args, "memory")
    try:
        recv = Receiver(decode, 7, bootstrap=bootstrap.address)
        recv.init(page_indices=dst, metadata_row=0)
        send = Sender(prefill, 7, metadata_row=0)
        assert send.wait(Poll.WAITING_FOR_INPUT, timeout=20) == Poll.WAITING_FOR_INPUT, send.failure()
        send.send(src, last=True, layerwise=True)
        src[:] = src[::-1].copy()  # the host's list, reused before the layer is announced
        send.layer_ready([layer for layer, draft in send.layers if not draft])
        assert recv.wait(Poll.SUCCESS, timeout=20) == Poll.SUCCESS, recv.failure() or send.failure()
        np.testing.assert_array_equal(dst_k[dst], src_k[sent])
    finally:
        for obj in (decode, prefill, bootstrap):
            obj.close()
