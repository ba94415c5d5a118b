"""Head slices staged on host memory (core/planning/stage_index.py, core/transfer/staging.py): pieces of one size
at a fixed stride, the heterogeneous-TP case, gathered and scattered by their own size as the unit, without a
search of regions or a gcd per piece where one region holds the window. Every byte is checked against numpy
slicing of the pools (token-major pages: rows x heads x head bytes), the oracle written independently."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core.description.layout import Region
from kvbridge.core.planning.plan import RegionPairs, plan_segments
from kvbridge.core.planning.regions import RegionTable
from kvbridge.core.planning.stage_index import gather_into, pack, put_units, region_pieces, unit_runs
from kvbridge.core.transfer.staging import Staging

ROWS, HEADS, HEAD = 4, 8, 32  # a page: 4 token rows of 8 heads of 32 B
PAGES = 64


def _pool(seed: int, heads: int = HEADS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (PAGES, ROWS, heads, HEAD), dtype=np.uint8)


def _region(pool: np.ndarray, name: str = "k0") -> Region:
    return Region(name=name, addr=pool.ctypes.data, nbytes=pool.nbytes, stride=pool[0].nbytes, role="k",
                  index_space="kv_page")


def _slices(src: np.ndarray, dst: np.ndarray, first: int, src_pages: np.ndarray, dst_pages: np.ndarray):
    """The plan of heads ``first`` .. ``first + dst heads`` of every row of ``src``'s pages into ``dst``'s (TP 1 -> 2)."""
    h = dst.shape[2]
    seg = [(r * HEADS * HEAD + first * HEAD, r * h * HEAD, h * HEAD) for r in range(ROWS)]
    pairs = RegionPairs.of([src.ctypes.data], [dst.ctypes.data], [src[0].nbytes], [dst[0].nbytes])
    return plan_segments(pairs, seg, src_pages, dst_pages)


def test_head_slices_of_one_region_are_gathered_by_their_size_in_their_order() -> None:
    src, dst = _pool(1), np.zeros((PAGES, ROWS, 4, HEAD), np.uint8)
    pages = np.random.default_rng(2).permutation(PAGES)[:40]
    plan = _slices(src, dst, 4, pages, np.arange(40))
    assert len(plan) == 40 * ROWS  # a piece per row: 128 B at a 256 B stride
    staging = Staging([_region(src)], slices=1, slice_bytes=1 << 16)
    staged = staging.stage_to(plan, 1 << 40)
    assert staged is not None and staged.window is plan and staged.rest is None  # all of it, in its order
    held = staging._buf[:plan.total_bytes]
    np.testing.assert_array_equal(held, src[pages][:, :, 4:8, :].ravel())
    # One copy, in units of a piece: no index of regions, no gcd.
    order, copies = pack(plan.src_addr, plan.nbytes, None)
    assert order.tolist() == list(range(len(plan))) and [c.unit for c in copies] == [4 * HEAD]
    staged.release()


def test_head_slices_at_offsets_off_their_size_are_gathered_in_a_smaller_unit() -> None:
    # 3 heads (96 B) from head 1: offsets 32 B off any multiple of 96: the gcd (32 B), three units a piece.
    src = _pool(3)
    addr = (src.ctypes.data + np.arange(PAGES)[:, None] * src[0].nbytes + np.arange(ROWS)[None, :] * HEADS * HEAD
            + HEAD).ravel()
    nbytes = np.full(addr.size, 3 * HEAD, np.int64)
    order, copies = pack(addr, nbytes, None)
    assert [c.unit for c in copies] == [HEAD] and len(order) == addr.size
    out = np.zeros(int(nbytes.sum()), np.uint8)
    gather_into(out, copies)
    np.testing.assert_array_equal(out, src[:, :, 1:4, :].ravel())


def test_a_window_of_two_layers_is_gathered_region_by_region_and_one_outside_every_region_is_not() -> None:
    k, v, dst = _pool(4), _pool(5), np.zeros((PAGES, ROWS, 4, HEAD), np.uint8)
    pages = np.arange(8)
    plan_k, plan_v = _slices(k, dst, 0, pages, pages), _slices(v, dst, 0, pages, pages)
    src = np.concatenate([plan_k.src_addr, plan_v.src_addr])
    window = type(plan_k)(src, np.concatenate([plan_k.dst_addr, plan_v.dst_addr]),
                          np.concatenate([plan_k.nbytes, plan_v.nbytes]))
    staging = Staging([_region(k, "k0"), _region(v, "v0")], slices=1, slice_bytes=1 << 16)
    staged = staging.stage_to(window, 1 << 40)
    assert staged is not None
    # Regions of one unit packed in address order, each one's pieces in their order.
    first, second = sorted([k, v], key=lambda a: a.ctypes.data)
    np.testing.assert_array_equal(staging._buf[:window.total_bytes],
                                  np.concatenate([first[:8, :, 0:4].ravel(), second[:8, :, 0:4].ravel()]))
    assert np.array_equal(staged.window.src_addr[:len(plan_k)], (plan_k if first is k else plan_v).src_addr)
    staged.release()
    # A source past the last region (a plan built elsewhere): not gathered, whichever way it is found.
    past = type(plan_k)(np.append(plan_k.src_addr, k.ctypes.data + k.nbytes), np.append(plan_k.dst_addr, 0),
                        np.append(plan_k.nbytes, 4 * HEAD))
    assert Staging([_region(k)], slices=1, slice_bytes=1 << 16).stage_to(past, 1 << 40) is None
    assert staging.stage_to(past, 1 << 40) is None


def test_head_slices_into_strided_rows_are_said_by_their_size_and_scattered_into_place() -> None:
    # TP 2 -> 1: rank 1's 4 heads land at a 256 B stride in decode's rows of 8 heads, its pages scattered.
    src, dst = _pool(6, 4), np.zeros((PAGES, ROWS, HEADS, HEAD), np.uint8)
    pages = np.random.default_rng(7).permutation(PAGES)[:48]
    addr = (dst.ctypes.data + pages[:, None] * dst[0].nbytes + np.arange(ROWS)[None, :] * HEADS * HEAD
            + 4 * HEAD).ravel()
    nbytes = np.full(addr.size, 4 * HEAD, np.int64)
    regions = [_region(dst)]
    pieces = region_pieces(addr, nbytes, RegionTable(regions))
    assert pieces is not None and [(p.region, p.unit, p.counts) for p in pieces] == [(0, 4 * HEAD, None)]
    put_units(src[:48].ravel(), unit_runs(pieces, regions))
    want = np.zeros_like(dst)
    want[pages, :, 4:8, :] = src[:48]
    np.testing.assert_array_equal(dst, want)


def test_a_run_of_more_units_than_the_slice_holds_is_refused_and_nothing_is_written() -> None:
    # numpy.put repeats the values it is given where there are fewer than indices: the scatter must not.
    src, dst = _pool(8, 4), np.zeros((PAGES, ROWS, HEADS, HEAD), np.uint8)
    addr = (dst.ctypes.data + np.arange(48)[:, None] * dst[0].nbytes + np.arange(ROWS)[None, :] * HEADS * HEAD).ravel()
    regions = [_region(dst)]
    pieces = region_pieces(addr, np.full(addr.size, 4 * HEAD, np.int64), RegionTable(regions))
    assert pieces is not None
    with pytest.raises(ValueError, match="passes the end of a slice"):
        put_units(src[:47].ravel(), unit_runs(pieces, regions))  # a page's worth short
    assert not dst.any()


@pytest.mark.parametrize("where, want", [
    ([(0, 64), (4096 - 64, 64)], 0),   # both ends inside the first region
    ([(8192, 64), (12288 - 1, 1)], 1),  # the second region, to its last byte
    ([(0, 64), (8192, 64)], -1),        # two regions
    ([(4096 - 32, 64)], -1),            # past the first region's end (into the gap)
    ([(20000, 8)], -1),                 # past every region
])
def test_the_one_region_holding_every_range_or_none(where, want) -> None:
    base = 1 << 20
    table = RegionTable([Region(name="b", addr=base + 8192, nbytes=4096, stride=4096, role="k", index_space="kv_page"),
                         Region(name="a", addr=base, nbytes=4096, stride=4096, role="k", index_space="kv_page")])
    addr, nbytes = (np.array(x, np.int64) for x in zip(*where))
    addr += base
    assert table.holding(addr, nbytes) == want
    if len(set(nbytes.tolist())) == 1:
        assert table.holding(addr, nbytes, int(nbytes[0])) == want


def _offer(nbytes: int):
    from kvbridge.core.description.layout import StagingOffer

    slots = Region(name="kvbridge-landing", addr=1 << 40, nbytes=2 * nbytes, stride=nbytes, role="state",
                   index_space="kvbridge_staging")
    return StagingOffer(region=slots, slots=(0, 1), slice_bytes=nbytes)


def test_head_slices_filling_decode_pages_are_said_a_page_a_piece_and_land_byte_exact() -> None:
    # TP 1 -> 2: a decode page holds its rows' 4 heads back to back, so a page's 4 pieces are one run: said as
    # one piece of the page's 512 B (a quarter of the offsets), scattered into place from the gathered slice.
    from kvbridge.core.transfer.relay import RemoteSlots

    src, dst = _pool(8), np.zeros((PAGES, ROWS, 4, HEAD), np.uint8)
    pages = np.arange(40) * 3 % PAGES  # no page follows the one before (runs of pages: below)
    plan = _slices(src, dst, 4, np.arange(40), pages)
    regions = [_region(dst)]
    pieces = RemoteSlots(_offer(1 << 16), regions).pieces(plan)
    assert pieces is not None and [(p.unit, len(p.offsets), p.counts) for p in pieces] == [(dst[0].nbytes, 40, None)]
    assert pieces[0].offsets.tolist() == pages.tolist()
    put_units(np.ascontiguousarray(src[:40, :, 4:8]).ravel(), unit_runs(pieces, regions))
    want = np.zeros_like(dst)
    want[pages] = src[:40, :, 4:8]
    np.testing.assert_array_equal(dst, want)
    # Pages 5, 6 following each other: one piece of two pages, a count a piece.
    (run,) = RemoteSlots(_offer(1 << 16), regions).pieces(_slices(src, dst, 4, np.arange(3), np.array([9, 5, 6]))) or []
    assert (run.unit, run.offsets.tolist(), run.counts.tolist()) == (dst[0].nbytes, [9, 5], [1, 2])


def test_a_run_across_two_adjacent_regions_is_said_piece_by_piece() -> None:
    # One allocation described as two regions (a layer's K then V): pieces running from K's last page into V's
    # first follow each other in memory, but no region holds the run: said per piece instead, in both regions.
    from kvbridge.core.transfer.relay import RemoteSlots

    mem = np.zeros((2, 4, 256), np.uint8)
    k = Region(name="k", addr=mem.ctypes.data, nbytes=1024, stride=256, role="k", index_space="kv_page")
    v = Region(name="v", addr=mem.ctypes.data + 1024, nbytes=1024, stride=256, role="v", index_space="kv_page")
    addr = mem.ctypes.data + np.array([512, 640, 768, 896, 1024, 1152], np.int64)
    window = _plan(addr)
    pieces = RemoteSlots(_offer(1 << 12), [k, v]).pieces(window)
    assert pieces is not None
    assert [(p.region, p.unit, p.offsets.tolist()) for p in pieces] == [(0, 128, [4, 5, 6, 7]), (1, 128, [0, 1])]


def _plan(dst: np.ndarray):
    from kvbridge.core.planning.transferplan import TransferPlan

    return TransferPlan(np.zeros(len(dst), np.int64), dst, np.full(len(dst), 128, np.int64))


def test_head_slices_lying_back_to_back_in_the_source_are_gathered_in_runs_of_any_length() -> None:
    # TP 2 -> 1 on prefill: a page's rows of its 4 heads are back to back; pages 0-2 and 7-11 follow each other.
    # The runs (3 and 5 pages) are copied in the unit of a page, 8 units for 2 runs, which the 32 pieces they
    # stand for allow (at most 4 units a piece).
    src = _pool(10, 4)
    pages = np.array([0, 1, 2, 7, 8, 9, 10, 11])
    addr = (src.ctypes.data + pages[:, None] * src[0].nbytes + np.arange(ROWS)[None, :] * 4 * HEAD).ravel()
    nbytes = np.full(addr.size, 4 * HEAD, np.int64)
    order, copies = pack(addr, nbytes, None)
    assert len(order) == addr.size and [(c.unit, len(c.far)) for c in copies] == [(src[0].nbytes, 8)]
    out = np.zeros(int(nbytes.sum()), np.uint8)
    gather_into(out, copies)
    np.testing.assert_array_equal(out, src[pages].ravel())
