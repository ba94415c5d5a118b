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
