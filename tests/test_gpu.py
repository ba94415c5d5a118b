"""GPU memory: the fast path's work split (on CPU, always), and VRAM end to end (on a CUDA machine).

The kernel of :mod:`kvbridge.plugins.cuda_ipc` copies ``TILE_BYTES`` pieces of
descriptors, a slice of rows per launch; :func:`~kvbridge.plugins.cuda_ipc.split.execute_on_host` runs the same split
with ``memmove`` on host memory, checked here against plain numpy slicing.
The GPU tests run prefill and decode as separate processes with CUDA
tensors (kvbridge.testing.hybrid, ``device="cuda"``) and skip, naming the
missing device, elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import time

import numpy as np
import pytest

from kvbridge.plugins.cuda_ipc import CAPABILITIES, ipc, kernel, split
from kvbridge.core.description.layout import METADATA_SPACE, IndexSpace, KVArgs, Region, Shard
from kvbridge.core.description.records import BackendCapabilities
from kvbridge.core.planning.pairing import pair_layouts
from kvbridge.core.transfer.backend import Backend, BackendConfig
from kvbridge.core.transfer.lanes import Lane
from kvbridge.core.transfer.transport import Transport
from kvbridge.testing.harness import BackendHarness, Child, all_succeeded
from kvbridge.testing.requirements import requires


# -- the work split, on CPU -------------------------------------------------------------------------
def descriptors(rng: np.random.Generator, src: np.ndarray, dst: np.ndarray, count: int, unit: int, longest: int):
    """``count`` non-overlapping destination ranges (multiples of ``unit``) and their sources."""
    sizes = rng.integers(1, longest // unit + 1, count) * unit
    dst_off = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    order = rng.permutation(count)  # scattered on both sides
    src_off = rng.integers(0, (src.nbytes - longest) // unit, count) * unit
    return src_off, dst_off[order], sizes[order]


# (16 KiB, 64 KiB): whole pieces (TILE_BYTES) of unequal descriptors, the masked-by-piece case.
@pytest.mark.parametrize("unit, longest", [(8, 64 << 10), (2, 256), (1, 33), (4, 20000), (8, 8), (16, 4096), (16 << 10, 64 << 10)])
def test_the_kernels_work_split_and_translation_copy_every_byte_once_to_its_place(unit, longest, monkeypatch):
    monkeypatch.setattr(split, "SLICE_BYTES", 16 * longest)  # several launches, each with its own shape
    # The destination buffer stands for a peer's memory mapped at another address: descriptors carry
    # the peer's addresses (dst_base), the reference translates them through the mapping as the kernel does.
    rng = np.random.default_rng(unit * longest)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    count = 300
    src_off, dst_off, sizes = descriptors(rng, src, np.empty(0), count, unit, longest)
    dst = np.zeros(int(sizes.sum()) + 64, np.uint8)
    dst_base = 1 << 44  # the peer's address of dst[0]
    peer = ipc.GpuPeer(np.array([dst_base], np.int64), np.array([dst_base + dst.nbytes], np.int64),
                       np.array([dst.ctypes.data - dst_base], np.int64))
    split.execute_on_host([split.arrays_part(src.ctypes.data + src_off, dst_base + dst_off, sizes)], peer)
    want = np.zeros_like(dst)
    for s, d, n in zip(src_off, dst_off, sizes):
        want[d:d + n] = src[s:s + n]
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("allocations", [1, 2, 3, 7, 8, 9, 122])
def test_the_kernels_binary_search_finds_the_allocation_holding_each_address(allocations):
    rng = np.random.default_rng(allocations)
    starts = np.sort(rng.choice(1 << 40, allocations, replace=False)).astype(np.int64) * 4096
    ends = starts + 4096
    deltas = rng.integers(-(1 << 30), 1 << 30, allocations).astype(np.int64) * 8
    which = rng.integers(0, allocations, 5000)
    addr = starts[which] + rng.integers(0, 4096, 5000)
    np.testing.assert_array_equal(split.kernel_translate(addr, starts, deltas), addr + deltas[which])
    peer = ipc.GpuPeer(starts, ends, deltas)
    assert peer.inside(addr, np.ones_like(addr)).all()
    assert not peer.inside(starts[which], np.full_like(addr, 4097)).any()  # runs past its allocation's end


def test_the_launch_shape_takes_the_widest_element_that_divides_every_address_and_size():
    a = np.array([0x1000, 0x2000], np.int64)
    # 16 elements of 8 bytes per piece; a 64-byte size is only half a piece: pieces need a mask
    tile = split.TILE_BYTES // 8  # 8-byte elements per program
    assert split.shape(split.arrays_part(a, a + 64, np.array([64, 128]))) == split.Shape(8, 16, 1, tile // 16, True, False)
    assert split.shape(split.arrays_part(a, a + 64, np.array([256, 256]))).even  # equal sizes: whole pieces
    assert split.shape(split.arrays_part(a, a + 4, np.array([64, 128]))).width == 4
    assert split.shape(split.arrays_part(a, a, np.array([6, 128]))).width == 2
    assert split.shape(split.arrays_part(a + 1, a, np.array([64, 128]))).width == 1
    # 131072 elements: pieces of a whole program each
    big = split.shape(split.arrays_part(a, a, np.array([1 << 20, 8])))
    assert (big.chunk, big.pieces, big.rows, big.even) == (tile, (1 << 17) // tile, 1, False)


@pytest.mark.parametrize("cut", ["rows, sizes per row", "rows", "columns"])
def test_slices_cover_every_descriptor_once_in_launches_of_about_slice_bytes(cut, monkeypatch):
    monkeypatch.setattr(split, "SLICE_BYTES", 1 << 15)
    many = np.arange(1000, dtype=np.int64) * 4096
    two = np.array([0, 256], np.int64)
    part = {"rows, sizes per row": split.arrays_part(many, many + 7, np.full(1000, 512, np.int64)),
            "rows": (many, many + 7, two, two, np.array([256, 256], np.int64)),
            "columns": (two, two + 7, many, many, np.full(1000, 256, np.int64))}[cut]  # 2 rows of 256-byte columns
    got = split.slices(part)
    assert [len(p[0 if cut != "columns" else 2]) for p in got] == [64] * 15 + [40]  # 32 KiB of 512-byte rows/columns
    want = {(int(s + sc), int(d + dc), int(nb[i] if split.row_sizes(p) else nb[j]))
            for p in [part] for i, (s, d) in enumerate(zip(p[0], p[1])) for j, (sc, dc) in enumerate(zip(p[2], p[3]))
            for nb in [p[4]]}
    have = [(int(s + sc), int(d + dc), int(nb[i] if split.row_sizes(p) else nb[j]))
            for p in got for i, (s, d) in enumerate(zip(p[0], p[1])) for j, (sc, dc) in enumerate(zip(p[2], p[3]))
            for nb in [p[4]]]
    assert len(have) == len(want) and set(have) == want  # every descriptor once


@pytest.mark.parametrize("cut", ["rows", "columns"])
def test_a_large_part_goes_first_as_a_smaller_slice_then_the_rest(cut, monkeypatch):
    # The rest's table is packed and launched while the first slice copies: 2/5 first, then slices of SLICE_BYTES.
    monkeypatch.setattr(split, "SLICE_BYTES", 1 << 18)
    monkeypatch.setattr(split, "PIPELINE_BYTES", 1 << 19)
    many = np.arange(1000, dtype=np.int64) * 4096
    one = np.zeros(1, np.int64)
    part = ((many, many + 7, one, one, np.full(1000, 1024, np.int64)) if cut == "rows"  # 1000 rows of 1 KiB
            else (one, one + 7, many, many, np.full(1000, 1024, np.int64)))
    got = split.slices(part)
    assert [len(p[0 if cut == "rows" else 2]) for p in got] == [256, 256, 256, 232]  # 400 > 256 a slice: capped
    monkeypatch.setattr(split, "SLICE_BYTES", 1 << 30)
    got = split.slices(part)
    assert [len(p[0 if cut == "rows" else 2]) for p in got] == [400, 600]
    assert np.array_equal(np.concatenate([p[0 if cut == "rows" else 2] for p in got]), many)  # each once, in order
    monkeypatch.setattr(split, "PIPELINE_BYTES", 1 << 20)  # 1000 KiB: below it, one launch
    assert [len(p[0 if cut == "rows" else 2]) for p in split.slices(part)] == [1000]


def outer_plans(src_base: int, dst_base: int):
    """Plans the planner keeps as outer sums: NHD rows of 4 heads into 8-head pages (heterogeneous TP 2 -> 1,
    rank 1), and scattered whole pages; each over 3 regions of 16 items, 4 indices."""
    from kvbridge.core.planning.plan import RegionPairs, plan_pages, plan_segments

    rng = np.random.default_rng(3)
    s_idx, d_idx = rng.choice(16, 4, replace=False), rng.choice(16, 4, replace=False)
    rows, head = 8, 64  # 8 token rows; 4 heads of 64 B at the source, 8 at the destination
    seg = np.array([(t * 4 * head, t * 8 * head + 4 * head, 4 * head) for t in range(rows)], np.int64)
    item_s, item_d = rows * 4 * head, rows * 8 * head
    nhd = plan_segments(RegionPairs.of(src_base + np.arange(3) * 16 * item_s, dst_base + np.arange(3) * 16 * item_d,
                                       [item_s] * 3, [item_d] * 3), seg, s_idx, d_idx)
    pages = plan_pages(src_base + np.arange(3) * 16 * item_s, dst_base + np.arange(3) * 16 * item_s,
                       [item_s] * 3, s_idx, d_idx)
    return {"nhd": nhd, "pages": pages}, 3 * 16 * item_s, 3 * 16 * item_d


@pytest.mark.parametrize("which", ["nhd", "pages"])
def test_the_kernels_split_of_an_unexpanded_plan_moves_what_its_descriptors_say(which):
    # The kernel reads a plan's rows and columns (TransferPlan.factors), never its descriptors; the CPU
    # reference of that split must land exactly what the expanded descriptors say.
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    plans, _, dst_size = outer_plans(src.ctypes.data, 1 << 44)
    plan = plans[which]
    assert len(plan.factors()[0][2]) > 1  # kept as an outer sum, not arrays
    dst = np.zeros(dst_size, np.uint8)
    peer = ipc.GpuPeer(np.array([1 << 44], np.int64), np.array([(1 << 44) + dst_size], np.int64),
                       np.array([dst.ctypes.data - (1 << 44)], np.int64))
    split.execute_on_host(plan.factors(), peer, plan.hints())
    want = np.zeros_like(dst)
    for s, d, n in zip(plan.src_addr - src.ctypes.data, plan.dst_addr - (1 << 44), plan.nbytes):
        want[d:d + n] = src[s:s + n]
    np.testing.assert_array_equal(dst, want)


def test_a_scattered_plans_columns_in_items_are_scaled_where_the_table_is_packed_and_land_byte_exact():
    # A scattered plan keeps its columns in items (TransferPlan.units); the backend hands them over so,
    # and the table, as the kernel reads it, holds the same byte offsets as the plan in bytes would give.
    from kvbridge.core.planning.plan import plan_pages

    item, pages = 256, 1000
    src = np.random.default_rng(2).integers(0, 256, 2 * 4096 * item, dtype=np.uint8)
    rng = np.random.default_rng(4)
    base = src.ctypes.data
    plan = plan_pages([base, base + 4096 * item], [1 << 44, (1 << 44) + 4096 * item], [item, item],
                      rng.permutation(4096)[:pages], rng.permutation(4096)[:pages])
    assert plan.units() == [item]
    (part,), (hint,), (unit,) = plan.factors(in_units=True), plan.hints(), plan.units()
    (in_bytes,) = plan.factors()
    h, want = np.full(8 * pages, -1, np.int64), np.full(8 * pages, -1, np.int64)
    assert kernel._pack(part, split.shape(part, hint, unit), h, 2, unit) == kernel._pack(in_bytes, split.shape(in_bytes), want, 2)
    np.testing.assert_array_equal(h, want)
    dst = np.zeros(2 * 4096 * item, np.uint8)
    peer = ipc.GpuPeer(np.array([1 << 44], np.int64), np.array([(1 << 44) + dst.nbytes], np.int64),
                       np.array([dst.ctypes.data - (1 << 44)], np.int64))
    split.execute_on_host([part], peer, [hint], [unit])
    expected = np.zeros_like(dst)
    for s_, d, n in zip(plan.src_addr - base, plan.dst_addr - (1 << 44), plan.nbytes):
        expected[d:d + n] = src[s_:s_ + n]
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize("sizes", ["uniform", "per column", "per row"])
def test_the_table_is_packed_columns_then_rows_with_sizes_where_they_differ(sizes):
    cols = np.array([0, 4096, 8192], np.int64)
    rows = np.array([1 << 40, 1 << 41], np.int64)
    part = {"uniform": (rows, rows + 8, cols, cols + 16, np.full(3, 4096, np.int64)),
            "per column": (rows, rows + 8, cols, cols + 16, np.array([4096, 512, 4096], np.int64)),
            "per row": split.arrays_part(rows, rows + 8, np.array([64, 128], np.int64))}[sizes]
    h = np.full(64, -1, np.int64)
    kind, r, end = kernel._pack(part, split.shape(part), h, 4)
    src_rows, dst_rows, src_cols, dst_cols, nbytes = part
    want_cols = [src_cols, dst_cols] + ([nbytes] if kind == 2 else [])
    want_rows = [src_rows, dst_rows] + ([nbytes] if kind == 1 else [])
    assert kind == {"uniform": 0, "per column": 2, "per row": 1}[sizes]
    assert r == 4 + len(want_cols) * len(src_cols) and end == r + len(want_rows) * len(src_rows)
    np.testing.assert_array_equal(h[4:end], np.concatenate(want_cols + want_rows))
    assert (h[:4] == -1).all() and (h[end:] == -1).all()  # nothing outside its words


def test_later_slices_tables_are_copied_beside_the_running_slices_and_the_fence_checked_between(monkeypatch):
    # copy()'s host path with the driver, streams and kernel recorded instead of run: the first slice's
    # table goes on the copy's stream, each later one on the side stream with its launch waiting for it
    # (the copy engine moves it while the kernels before it run); the fence check runs between slices
    # (the transport checked before the first); both streams are waited for.
    calls: list[tuple] = []

    class Driver:
        def cuMemcpyHtoDAsync_v2(self, dst, src, n, stream):
            calls.append(("table copy", stream))
            return 0

        def cuEventRecord(self, event, stream):
            calls.append(("event", stream.value))
            return 0

        def cuStreamWaitEvent(self, stream, event, flags):
            calls.append(("wait", stream.value))
            return 0

    class Stream:
        def __init__(self, handle: int) -> None:
            self.cuda_stream = handle

        def synchronize(self) -> None:
            calls.append(("sync", self.cuda_stream))

    host = np.zeros(1 << 16, np.int64)
    monkeypatch.setattr(ipc, "_lib", Driver())
    monkeypatch.setattr(kernel, "_kernel", object())
    monkeypatch.setattr(kernel, "on_device", lambda device: calls.append(("set device", device)))
    monkeypatch.setattr(kernel, "_run", lambda *args: calls.append(("launch", args[-2])))
    monkeypatch.setattr(split, "PIPELINE_BYTES", 1 << 20)
    staging = kernel._Staging()
    buffers = kernel._Buffers(Stream(1), 1, Stream(2), 2, 7, host, host, host.ctypes.data, None, 1 << 40, 0)
    staging.free[0] = [buffers]
    monkeypatch.setattr(kernel, "_staging", staging)
    peer = ipc.GpuPeer(np.zeros(1, np.int64), np.full(1, 1 << 50, np.int64), np.zeros(1, np.int64))
    monkeypatch.setattr(peer, "on_device", lambda device: (0, 0, 0, 1))
    cols = np.arange(1000, dtype=np.int64) * 4096
    part = (np.zeros(1, np.int64), np.zeros(1, np.int64), cols, cols, np.full(1000, 4096, np.int64))
    checks: list[int] = []
    kernel.copy(0, [part], peer, lambda: checks.append(len(calls)))
    assert calls == [("set device", 0), ("table copy", 1), ("launch", 1), ("table copy", 2), ("event", 2), ("wait", 1),
                     ("launch", 1), ("sync", 1), ("sync", 2)]
    assert checks == [3]  # once, between the two slices
    assert staging.free[0] == [buffers]  # given back for the next copy, on any thread


@pytest.mark.parametrize("item", [576, 1024, 4096, 65536])
def test_the_kernels_compiled_at_registration_are_those_one_page_and_run_plans_launch(item):
    # What the backend compiles at registration (warm_shapes) against what copies of planned requests launch: every
    # launch of plans of single pages and of runs up to 64 pages, scattered, finds its compiled kernel
    # (the kernel's key: the shape's constants and the sizes mode; piece counts and sizes are arguments).
    from kvbridge.core.planning.plan import plan_pages
    from kvbridge.plugins.cuda_ipc.backend import warm_shapes

    regions = [Region(name=f"k{i}", addr=(1 << 40) + i * (1 << 30), nbytes=item * 4096, stride=item, role="k",
                      index_space="kv_page", mem="vram") for i in range(3)]
    bases = np.array([r.addr for r in regions], np.int64)

    def key(sh: split.Shape, sizes: int) -> tuple:
        return sh.rows, sh.chunk, sh.width, sh.align16, sh.even, sizes

    warmed = {key(sh, sizes) for sh, sizes in warm_shapes(regions, regions)}
    rng = np.random.default_rng(item)
    for run in (1, 2, 3, 8, 64):
        starts = rng.choice(np.arange(0, 4096 - run, run), 5, replace=False)
        idx = (starts[:, None] + np.arange(run)).ravel()
        plan = plan_pages(bases, bases + (1 << 38), np.full(3, item), idx, rng.permutation(4096)[: idx.size] if run == 1 else idx)
        for part, hint, unit in split.launches(plan.factors(in_units=True), plan.hints(), plan.units()):  # as the backend
            sh = split.shape(part, hint, unit)
            sizes = 0 if sh.uniform else 1 if split.row_sizes(part) else 2
            assert key(sh, sizes) in warmed, (run, sh, sizes)


class _Recorder(Backend):
    """A lane that records what core hands it (warm and write) and moves nothing (the addresses are made up)."""

    def __init__(self) -> None:
        super().__init__(BackendConfig())
        self.warmed: list = []
        self.written: list = []

    def register(self, regions): pass
    def metadata(self): return b""
    def add_peer(self, peer, metadata, regions): pass
    def remove_peer(self, peer): pass
    def close(self): pass

    def write(self, peer, batch, deadline):
        self.written.append(batch)

    def warm(self, peer, batches):
        self.warmed += batches


class _Host(_Recorder):
    warm = Backend.warm  # prepares nothing


#: Models of :func:`_rank`: (KV heads, tokens a page, bytes a head's row, layout); 0 heads: one replicated
#: item a token (MLA's 576 B latent; a tiny 64 B one whose runs keep changing the launch up to 128 pages).
MODELS = {"gqa-nhd": (8, 16, 256, "nhd"), "gqa-hnd": (8, 16, 256, "hnd"), "mla": (0, 1, 576, ""), "tiny": (0, 1, 64, "")}


def _rank(tp: int, rank: int, model: str, base: int) -> KVArgs:
    """A model's K and V pools on a "GPU" (made-up addresses: layers aligned to 2**30, 4 and 8 B, as views of
    one allocation may be) and a metadata buffer in host memory; 3 layers of 512 pages."""
    heads, tokens, row, layout = MODELS[model]
    pages = 512
    if heads:
        item = max(1, heads // tp) * tokens * row
        shard = (Shard(kind="split", outer=tokens, totals=(heads,), unit_nbytes=row) if layout == "nhd"
                 else Shard(kind="split", outer=1, totals=(heads,), unit_nbytes=tokens * row))
    else:
        item, shard = tokens * row, Shard()
    regions = [Region(name=f"{role}{layer}", addr=base + (2 * layer + kv) * (1 << 30) + (0, 4, 8)[layer],
                      nbytes=item * pages, stride=item, role=role, index_space="kv_page", layer=layer, shard=shard,
                      mem="vram")
               for layer in range(3) for kv, role in enumerate("kv")]
    regions.append(Region(name="meta", addr=base + (1 << 36), nbytes=64 * 16, stride=64, role="metadata",
                          index_space=METADATA_SPACE))
    return KVArgs(regions=tuple(regions), index_spaces=(IndexSpace("kv_page", pages, tokens), IndexSpace(METADATA_SPACE, 16)),
                  dtype="bfloat16", page_size=tokens, tp_rank=rank, tp_size=tp)


@pytest.mark.parametrize("model, tp_p, tp_d", [(m, p, d) for m in ("gqa-nhd", "gqa-hnd") for p, d in ((1, 1), (2, 1), (1, 2), (4, 2))]
                         + [(m, p, d) for m in ("mla", "tiny") for p, d in ((1, 1), (2, 1))])
def test_the_kernels_prepared_at_the_handshake_are_every_one_the_peers_requests_launch(model, tp_p, tp_d):
    # Core plans samples from the pairing (runs of pages, layer by layer too) and hands each lane its
    # batches of them (Backend.warm) before the handshake is answered: every batch that requests of that peer
    # then hand the GPU lane (scattered pages, runs, mixed, whole chunks and layer by layer, head-sliced when
    # the TPs differ) needs a kernel among those (a cold one is compiled inside the request: 100-200 ms).
    from kvbridge.core.planning.layers import LayerIndex
    from kvbridge.core.sessions.handshake import warm_plans

    src, dst = _rank(tp_p, 0, model, 1 << 40), _rank(tp_d, 0, model, 1 << 42)
    gpu, host = _Recorder(), _Host()
    t = Transport([Lane("gpu", gpu, CAPABILITIES), Lane("host", host, BackendCapabilities(memory_kinds=("dram", "vram"), host_staging=False))])
    t.register(src.regions)
    t.add_peer("d", {"gpu": b"", "host": b""}, dst.regions)
    assert t.lanes_of("d") == ["gpu", "host"] and t.warms("d")
    route, layers = pair_layouts(src, dst), LayerIndex(src)
    t.warm("d", warm_plans(route, layers))
    assert gpu.warmed and not gpu.written and not host.warmed  # nothing written; the host lane prepares nothing
    prepared = split.plan_shapes(gpu.warmed)
    rng = np.random.default_rng(tp_p * 10 + tp_d)
    requests: list = []
    for pages in (1, 2, 3, 5, 17, 64, 300):
        for pattern in ("scattered", "sorted", "contiguous"):
            if pattern == "contiguous":
                idx = np.arange(pages) + int(rng.integers(0, 512 - pages))
            else:
                idx = rng.permutation(512)[:pages]
                idx = np.sort(idx) if pattern == "sorted" else idx  # sorted: runs where the pages follow each other
            requests.append(idx)
    requests.append(np.r_[0:128, 130:194])  # runs of two lengths, each a multiple of a kernel program's bytes
    for idx in requests:  # the same pages on both sides: runs on one are runs on the other
        plan = route.plan({"kv_page": idx}, {"kv_page": idx})
        for part in (plan, *layers.split(plan).parts):
            if len(part):
                t.write("d", part, time.monotonic() + 10)
    assert gpu.written
    used = split.plan_shapes(gpu.written)
    assert set(used) <= set(prepared), sorted(set(used) - set(prepared))


def test_without_cuda_the_fast_path_stays_off_and_core_still_imports():
    if ipc.available():
        pytest.skip("this machine has CUDA")
    region = Region(name="k", addr=0x10000, nbytes=4096, stride=64, role="k", index_space="kv_page", mem="vram")
    assert ipc.local_metadata([region]) == b""
    assert ipc.open_peer(b"anything", 0) is None


def test_the_copy_kernel_is_a_lane_put_before_one_named_backend_unless_switched_off(monkeypatch):
    from kvbridge.core.description.plugins import Registry
    from kvbridge.core.transfer.transport import lane_names

    monkeypatch.setattr(Registry, "same_host_lanes", lambda self: ["cuda_ipc"])
    assert lane_names("memory", fast_path=True) == ["cuda_ipc", "memory"]
    assert lane_names("memory", fast_path=False) == ["memory"]
    assert lane_names("memory,cuda_ipc") == ["memory", "cuda_ipc"]  # a list: as named
    assert lane_names("cuda_ipc") == ["cuda_ipc"]


# -- VRAM end to end, on a CUDA machine -----------------------------------------------------------------
@pytest.mark.skipif(not ipc.available(), reason="needs a CUDA device visible to torch; this machine has none")
@pytest.mark.parametrize("unit, longest", [(16 << 10, 64 << 10), (8, 64 << 10), (2, 300), (1 << 20, 4 << 20)])
def test_the_kernel_copies_descriptors_of_unequal_length_through_several_allocations(unit, longest, monkeypatch):
    # In one process: the "peer" is three tensors known by fake addresses 2**44 + ..., translated by the
    # kernel's search; unequal descriptor lengths, whole pieces (even) and masked ones; several launches,
    # after the first of each shape through the compiled kernel's own launcher.
    import torch

    monkeypatch.setattr(split, "SLICE_BYTES", 8 * longest)

    rng = np.random.default_rng(unit)
    src = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8, device="cuda")
    count = 40
    sizes = rng.integers(1, longest // unit + 1, count) * unit
    parts = [torch.zeros(int(sizes.sum()) + 4096, dtype=torch.uint8, device="cuda") for _ in range(3)]
    fake = [(1 << 44) + i * (1 << 36) for i in range(3)]
    peer = ipc.GpuPeer(np.array(fake, np.int64), np.array([f + p.numel() for f, p in zip(fake, parts)], np.int64),
                       np.array([p.data_ptr() - f for f, p in zip(fake, parts)], np.int64))
    which = rng.integers(0, 3, count)
    order = rng.permutation(count)  # scattered, and never overlapping: offsets and sizes permuted together
    dst_off, sizes = np.concatenate(([0], np.cumsum(sizes)[:-1]))[order], sizes[order]
    src_off = rng.integers(0, (src.numel() - longest) // unit, count) * unit
    torch.cuda.synchronize()  # the copy runs on its own stream: the sources must be final (Sender.send's contract)
    kernel.copy(0, [split.arrays_part(src.data_ptr() + src_off, np.array(fake, np.int64)[which] + dst_off,
                                 sizes.astype(np.int64))], peer)
    want = [torch.zeros_like(p) for p in parts]
    for w, s, d, n in zip(which, src_off, dst_off, sizes):
        want[w][d:d + n] = src[s:s + n]
    for got, exp in zip(parts, want):
        assert torch.equal(got, exp)


@pytest.mark.skipif(not ipc.available(), reason="needs a CUDA device visible to torch; this machine has none")
@pytest.mark.parametrize("which", ["nhd", "pages"])
def test_the_kernel_copies_an_unexpanded_plan_byte_exact(which):
    import torch

    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    plans, _, dst_size = outer_plans(src.data_ptr(), 1 << 44)
    plan = plans[which]
    dst = torch.zeros(dst_size, dtype=torch.uint8, device="cuda")
    peer = ipc.GpuPeer(np.array([1 << 44], np.int64), np.array([(1 << 44) + dst_size], np.int64),
                       np.array([dst.data_ptr() - (1 << 44)], np.int64))
    torch.cuda.synchronize()  # the copy runs on its own stream: the sources must be final (Sender.send's contract)
    kernel.copy(0, plan.factors(), peer, hints=plan.hints())
    want = torch.zeros_like(dst)
    for s, d, n in zip((plan.src_addr - src.data_ptr()).tolist(), (plan.dst_addr - (1 << 44)).tolist(), plan.nbytes.tolist()):
        want[d:d + n] = src[s:s + n]
    assert torch.equal(dst, want)


class TestGpuEndToEnd(BackendHarness):
    backend = "nixl"

    @requires("vram", "cuda_device")
    @pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "plain-nixl"])
    @pytest.mark.parametrize("prefill_tp, decode_tp, layout", [(1, 1, "hnd"), (2, 1, "nhd"), (1, 2, "nhd")])
    def test_every_state_handler_arrives_byte_exact_in_gpu_memory(
        self, children: Callable[..., Child], fast: bool, prefill_tp: int, decode_tp: int, layout: str
    ) -> None:
        # Device buffers on both sides, except decode's DeepSeek-V4 host rows (GPU -> host through
        # the backend in the same requests), checked against numpy slices of the global tensors.
        spec = self.hybrid_spec(prefill_tp=prefill_tp, decode_tp=decode_tp, layout=layout, draft=True,
                                device="cuda", gpu_fast_path=fast, pages=256, max_request_pages=64, head_dim=64)
        all_succeeded(*self.run_hybrid(children, spec)[:2])

    @requires("vram", "cuda_device")
    @pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "plain-nixl"])
    def test_layerwise_chunks_arrive_byte_exact_in_gpu_memory(self, children: Callable[..., Child], fast: bool) -> None:
        # Each chunk sent with layerwise=True: the fast path's kernel copies one layer slice per write.
        spec = self.hybrid_spec(prefill_tp=2, decode_tp=1, layout="nhd", draft=True, device="cuda", gpu_fast_path=fast,
                                pages=256, max_request_pages=64, head_dim=64, layerwise=True)
        all_succeeded(*self.run_hybrid(children, spec)[:2])


@pytest.mark.skipif(not ipc.available(), reason="needs a CUDA device visible to torch; this machine has none")
def test_layer_ready_with_a_cuda_event_waits_for_the_slow_kernel_before_moving_the_layer():
    # kvbridge bench layerwise --device cuda, small: the source is zeroed before each request, and each
    # layer is a 50 ms GPU sleep then a copy writing the layer's pages, on a side stream; layer_ready gets
    # ready=torch.cuda.Event recorded after them and returns at once. Decode (its own process) checks
    # every byte: a transfer that did not wait for the event would have moved zeros.
    from kvbridge.bench import layerwise
    from kvbridge.testing import available_backends

    backend = next((b for b in ("nixl", "ucx") if b in available_backends()), None)
    if backend is None:
        pytest.skip("needs a backend that moves GPU memory (nixl or ucx)")
    rows = layerwise.run(backend, layerwise.CONFIG, layerwise.Shape(layers=3, pages=4), [50.0], reps=1, device="cuda")
    assert rows[0]["verified"], rows
    assert rows[0]["ttft_layerwise_ms"] >= 3 * 50  # the kernels ran before the transfer finished


@pytest.mark.parametrize("pattern", ["scattered", "runs", "mixed sizes"])
def test_the_planners_hints_give_the_shape_the_columns_would(pattern):
    # The GPU copy trusts TransferPlan.hints() instead of reducing a request's columns: they must
    # describe every column (an alignment dividing all offsets and sizes; the one size when all are one).
    from kvbridge.core.planning.plan import plan_pages

    rng = np.random.default_rng(7)
    item = {"scattered": 16 << 10, "runs": 3 << 12, "mixed sizes": 24}[pattern]
    src = rng.permutation(4096)[:1000]
    dst = np.arange(1000) if pattern == "runs" else rng.permutation(4096)[:1000]
    if pattern == "runs":
        src = np.sort(src)  # some source pages are consecutive: runs of several items coalesce
    plan = plan_pages([0x7f0000000000, 0x7f1000000000], [0x10000000000, 0x11000000000], [item, item], src, dst)
    (part,), (hint,) = plan.factors(), plan.hints()
    align, size = hint
    assert align and all(int(a) % align == 0 for a in (*part[2], *part[3], *part[4]))
    assert size == (item if len(set(part[4].tolist())) == 1 and pattern != "runs" else 0)
    assert split.shape(part, hint) == split.shape(part)  # the same launch, without reducing the columns
