"""Heterogeneous TP, PP and layouts, planned by core and checked against numpy slicing.

Each TP rank's pool is a real numpy array; plans are executed in-process with
``ctypes.memmove`` (the transports are tested end to end elsewhere). The
oracle slices a global tensor by heads or channels with plain numpy, written
independently of the segment computation.
"""

import ctypes
import itertools
import time

import numpy as np
import pytest

from kvbridge.core.description.layout import IndexSpace, KVArgs, Region, Shard
from kvbridge.core.planning.pairing import IncompatibleLayoutError, pair_layouts
from kvbridge.core.description.records import BackendCapabilities
from kvbridge.core.transfer.transport import Transport, open_transport

PAGES, TOKENS, HEAD_DIM = 12, 4, 2  # small: every combination runs in milliseconds
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2), (4, 4)]


def execute(plan):
    for s, d, n in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist()):
        ctypes.memmove(d, s, n)


def heads_of(rank, tp, total):
    """Which global heads a rank holds (replicated when tp > total)."""
    per = max(1, total // tp)
    start = rank * total // tp
    return list(range(start, start + per))


def global_kv(layers, total_heads, seed):
    rng = np.random.default_rng(seed)
    # [layer, k/v, page, token, head, dim] as uint16 "bfloat16"
    return rng.integers(0, 2**16, (layers, 2, PAGES, TOKENS, total_heads, HEAD_DIM), dtype=np.uint16)


def rank_pool(g, heads, layout):
    local = g[:, :, :, :, heads, :]  # [L, 2, P, T, h, D]
    if layout == "hnd":
        local = local.transpose(0, 1, 2, 4, 3, 5)  # [L, 2, P, h, T, D]
    return np.ascontiguousarray(local)


def describe(pool, rank, tp, total_heads, layout, *, mla=False):
    layers = pool.shape[0]
    regions = []
    for layer in range(layers):
        for kv, role in enumerate(("k", "v")):
            arr = pool[layer, kv]
            if mla:
                shard = Shard()
            elif layout == "nhd":
                shard = Shard(kind="split", outer=TOKENS, totals=(total_heads,), unit_nbytes=HEAD_DIM * 2)
            else:
                shard = Shard(kind="split", outer=1, totals=(total_heads,), unit_nbytes=TOKENS * HEAD_DIM * 2)
            regions.append(Region(name=f"{role}{layer}", addr=arr.ctypes.data, nbytes=arr.nbytes,
                                  stride=arr.strides[0], role=role, index_space="kv_page", layer=layer, shard=shard))
    return KVArgs(regions=tuple(regions), index_spaces=(IndexSpace("kv_page", PAGES, TOKENS),),
                  dtype="bfloat16", page_size=TOKENS, tp_rank=rank, tp_size=tp)


def transfer_all(src_pools, src_args, dst_args, src_pages, dst_pages):
    """Every prefill rank plans to every decode rank; returns descriptors sent per pair."""
    counts = {}
    for p, sa in enumerate(src_args):
        for d, da in enumerate(dst_args):
            plan = pair_layouts(sa, da).plan({"kv_page": src_pages}, {"kv_page": dst_pages})
            counts[(p, d)] = len(plan)
            execute(plan)
    return counts


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("tp_p, tp_d", TP_PAIRS)
@pytest.mark.parametrize("total_heads", [1, 2, 4, 8])
def test_mha_heads_land_on_the_right_decode_ranks(layout, tp_p, tp_d, total_heads):
    g = global_kv(2, total_heads, seed=tp_p * 10 + tp_d)
    src = [rank_pool(g, heads_of(r, tp_p, total_heads), layout) for r in range(tp_p)]
    dst = [np.zeros_like(rank_pool(g, heads_of(r, tp_d, total_heads), layout)) for r in range(tp_d)]
    src_args = [describe(a, r, tp_p, total_heads, layout) for r, a in enumerate(src)]
    dst_args = [describe(a, r, tp_d, total_heads, layout) for r, a in enumerate(dst)]
    src_pages, dst_pages = np.array([0, 1, 2, 5, 9]), np.array([3, 4, 5, 0, 11])
    transfer_all(src, src_args, dst_args, src_pages, dst_pages)
    for r, got in enumerate(dst):
        want = np.zeros_like(got)
        want[:, :, dst_pages] = rank_pool(g, heads_of(r, tp_d, total_heads), layout)[:, :, src_pages]
        assert np.array_equal(got, want), f"decode rank {r}"


@pytest.mark.parametrize("tp_p, tp_d", TP_PAIRS)
def test_mla_pages_are_sent_once_by_one_prefill_rank(tp_p, tp_d):
    g = global_kv(2, 1, seed=7)
    src = [np.ascontiguousarray(g) for _ in range(tp_p)]  # replicated on every rank
    dst = [np.zeros_like(g) for _ in range(tp_d)]
    src_args = [describe(a, r, tp_p, 1, "nhd", mla=True) for r, a in enumerate(src)]
    dst_args = [describe(a, r, tp_d, 1, "nhd", mla=True) for r, a in enumerate(dst)]
    pages = np.array([1, 2, 3])
    counts = transfer_all(src, src_args, dst_args, pages, pages)
    for d in range(tp_d):
        senders = [p for p in range(tp_p) if counts[(p, d)]]
        assert senders == [d % tp_p]
        assert np.array_equal(dst[d][:, :, pages], g[:, :, pages])


def test_hnd_head_slice_is_one_descriptor_per_page_and_nhd_one_per_token_row():
    total = 4
    g = global_kv(1, total, seed=1)
    counts = {}
    for layout in ("nhd", "hnd"):
        src = [rank_pool(g, heads_of(0, 1, total), layout)]
        dst = [np.zeros_like(rank_pool(g, heads_of(r, 2, total), layout)) for r in range(2)]
        sa = [describe(src[0], 0, 1, total, layout)]
        da = [describe(a, r, 2, total, layout) for r, a in enumerate(dst)]
        counts[layout] = transfer_all(src, sa, da, np.arange(6), np.arange(6))[(0, 0)]
    # 2 regions (K, V) x 6 pages: HND one descriptor per page, NHD one per token row.
    assert counts == {"hnd": 2 * 6, "nhd": 2 * 6 * TOKENS}


def test_equal_tp_coalesces_runs_of_whole_pages():
    g = global_kv(1, 4, seed=2)
    src = [rank_pool(g, heads_of(r, 2, 4), "nhd") for r in range(2)]
    dst = [np.zeros_like(a) for a in src]
    sa = [describe(a, r, 2, 4, "nhd") for r, a in enumerate(src)]
    da = [describe(a, r, 2, 4, "nhd") for r, a in enumerate(dst)]
    counts = transfer_all(src, sa, da, np.arange(8), np.arange(8))
    assert counts == {(0, 0): 2, (0, 1): 0, (1, 0): 0, (1, 1): 2}


def conv_state(tp, rank, groups, rows, g):
    """GDN conv state [rows, local channels of q | k | v] from the global [rows, sum(groups)]."""
    parts, start = [], 0
    for total in groups:
        per = max(1, total // tp)
        lo = start + rank * total // tp
        parts.append(g[:, :, lo:lo + per])
        start += total
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


@pytest.mark.parametrize("tp_p, tp_d", TP_PAIRS)
def test_conv_sub_blocks_are_sliced_each_on_their_own(tp_p, tp_d):
    groups, rows, slots = (8, 8, 16), 3, 6
    g = np.random.default_rng(3).integers(0, 2**16, (slots, rows, sum(groups)), dtype=np.uint16)
    shard = Shard(kind="split", outer=rows, totals=groups, unit_nbytes=2)

    def args(arr, rank, tp):
        return KVArgs(regions=(Region(name="conv0", addr=arr.ctypes.data, nbytes=arr.nbytes, stride=arr.strides[0],
                                      role="conv", index_space="slot", layer=0, state_type="mamba", shard=shard),),
                      index_spaces=(IndexSpace("slot", slots, kind="slot"),), dtype="bfloat16", page_size=TOKENS,
                      tp_rank=rank, tp_size=tp)

    src = [conv_state(tp_p, r, groups, rows, g) for r in range(tp_p)]
    dst = [np.zeros_like(conv_state(tp_d, r, groups, rows, g)) for r in range(tp_d)]
    for p, s in enumerate(src):
        for d, t in enumerate(dst):
            execute(pair_layouts(args(s, p, tp_p), args(t, d, tp_d)).plan({"slot": [4]}, {"slot": [1]}))
    for d, t in enumerate(dst):
        want = np.zeros_like(t)
        want[1] = conv_state(tp_d, d, groups, rows, g)[4]
        assert np.array_equal(t, want)


def test_pp_stages_send_their_layers_into_the_right_decode_layers():
    g = global_kv(4, 2, seed=5)
    full_dst = np.zeros_like(g)
    dst_args = describe(full_dst, 0, 1, 2, "nhd")
    for stage, layers in enumerate(([0, 1], [2, 3])):
        part = np.ascontiguousarray(g[layers])
        regions = [
            Region(name=f"{role}{layer}", addr=part[i, kv].ctypes.data, nbytes=part[i, kv].nbytes,
                   stride=part[i, kv].strides[0], role=role, index_space="kv_page", layer=layer,
                   shard=Shard(kind="split", outer=TOKENS, totals=(2,), unit_nbytes=HEAD_DIM * 2))
            for i, layer in enumerate(layers) for kv, role in enumerate(("k", "v"))
        ]
        src_args = KVArgs(regions=tuple(regions), index_spaces=(IndexSpace("kv_page", PAGES, TOKENS),),
                          dtype="bfloat16", page_size=TOKENS, pp_rank=stage, pp_size=2)
        execute(pair_layouts(src_args, dst_args).plan({"kv_page": [0, 3]}, {"kv_page": [7, 8]}))
    want = np.zeros_like(g)
    want[:, :, [7, 8]] = g[:, :, [0, 3]]
    assert np.array_equal(full_dst, want)


def test_split_and_replicated_layouts_do_not_pair():
    g = global_kv(1, 2, seed=0)
    a = describe(np.ascontiguousarray(g), 0, 1, 2, "nhd")
    b = describe(np.zeros_like(g), 0, 1, 2, "nhd", mla=True)
    with pytest.raises(IncompatibleLayoutError, match="kv/k layer 0 .* layout differs"):
        pair_layouts(a, b)


def test_decode_pp_above_one_is_rejected_at_handshake():
    g = global_kv(1, 2, seed=0)
    a = describe(np.ascontiguousarray(g), 0, 1, 2, "nhd")
    b = KVArgs(regions=a.regions, index_spaces=a.index_spaces, dtype="bfloat16", page_size=TOKENS, pp_rank=0, pp_size=2)
    with pytest.raises(IncompatibleLayoutError, match="decode PP 2 is not supported"):
        pair_layouts(a, b)


# -- host staging (kvbridge.core.transfer.staging): the same oracle, written through Transport over the
#    engine-less memory backend (the conformance suite runs the hybrid model across TP pairs on
#    every backend, in processes) ------------------------------------------------------------------
STAGE_HEADS = 8
SRC_PAGES, DST_PAGES = [3, 4, 5, 9, 0, 1], [0, 1, 2, 10, 6, 7]


def _transports(n, sends):
    out = []
    for r in range(n):
        t = open_transport("memory", host="127.0.0.1", name=f"{'p' if sends else 'd'}{r}", transfer_timeout=5, options={})
        t.staging_mode = "gather"  # opt-in (SessionConfig.staging); these tests are of the gather
        out.append(t)
    return out


def _staged_pair(tp_p, tp_d, *, sends=True, layout="nhd", capabilities=None):
    """Every prefill rank writes to every decode rank through Transport; returns (got, oracle, staging stats)."""
    g = global_kv(2, STAGE_HEADS, seed=tp_p * 10 + tp_d)
    src_pools = [rank_pool(g, heads_of(r, tp_p, STAGE_HEADS), layout) for r in range(tp_p)]
    src_args = [describe(p, r, tp_p, STAGE_HEADS, layout) for r, p in enumerate(src_pools)]
    got = [np.zeros_like(rank_pool(g, heads_of(r, tp_d, STAGE_HEADS), layout)) for r in range(tp_d)]
    want = [np.zeros_like(p) for p in got]
    dst_args = [describe(p, r, tp_d, STAGE_HEADS, layout) for r, p in enumerate(got)]
    want_args = [describe(p, r, tp_d, STAGE_HEADS, layout) for r, p in enumerate(want)]
    src_t, dst_t = _transports(tp_p, True), _transports(tp_d, False)
    if capabilities is not None:  # what a backend declaring them would get from open_transport
        src_t = [Transport.of(t.backend, t.name, capabilities) for t in src_t]
        for t in src_t:
            t.staging_mode = "gather"
    try:
        for t, a in zip(src_t, src_args):
            t.register(a.regions, sends=sends)
        for t, a in zip(dst_t, dst_args):
            t.register(a.regions, sends=False)
        for p in range(tp_p):
            for d in range(tp_d):
                src_t[p].add_peer(f"d{d}", dst_t[d].metadata(), dst_args[d].regions)
                plan = pair_layouts(src_args[p], dst_args[d]).plan({"kv_page": SRC_PAGES}, {"kv_page": DST_PAGES})
                src_t[p].write(f"d{d}", plan, time.monotonic() + 5)
                execute(pair_layouts(src_args[p], want_args[d]).plan({"kv_page": SRC_PAGES}, {"kv_page": DST_PAGES}))
        stats = [t.describe().get("staging") for t in src_t]
    finally:
        for t in src_t + dst_t:
            t.close()
    return got, want, stats


@pytest.mark.parametrize("tp_p, tp_d", [(1, 2), (1, 4), (2, 4), (1, 8)])
def test_token_rows_to_more_decode_ranks_are_staged_and_land_byte_exact(tp_p, tp_d):
    got, want, stats = _staged_pair(tp_p, tp_d)
    for d, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"decode rank {d}")
    assert all(w.any() for w in want)
    for s in stats:
        # 2 layers x K/V x 6 pages x 4 token rows, per decode peer; runs: one per destination run.
        assert s["windows"] == tp_d // tp_p and s["pieces"] == s["windows"] * 2 * 2 * 6 * 4
        assert s["posted"] < s["pieces"] // 4


@pytest.mark.parametrize("tp_p, tp_d", [(2, 1), (4, 1), (4, 2)])
def test_token_rows_to_fewer_decode_ranks_are_written_as_planned(tp_p, tp_d):
    # The destination is strided there: gathering on prefill merges nothing, so nothing is staged.
    got, want, stats = _staged_pair(tp_p, tp_d)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert all(s["windows"] == 0 for s in stats)


def test_head_major_pages_are_gathered_where_destination_pages_follow_each_other():
    # HND: a head slice is one piece per page; destination pages 0, 1, 2 and 6, 7 follow each other, so
    # gathering on prefill merges them (the staging buffer is registered whatever the layout since
    # staging on both sides, core/transfer/relay.py): fewer descriptors posted than pieces, the same bytes.
    got, want, stats = _staged_pair(1, 4, layout="hnd")
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    (s,) = stats
    assert s["windows"] > 0 and s["posted"] < s["pieces"]


def test_a_backend_that_opts_out_gets_every_descriptor_as_planned(monkeypatch):
    from kvbridge.testing.memory import MemoryBackend

    registered = []
    monkeypatch.setattr(MemoryBackend, "register", lambda self, regions: (registered.extend(regions),
                                                                           self._regions.extend((r.addr, r.nbytes) for r in regions)))
    got, want, stats = _staged_pair(1, 2, capabilities=BackendCapabilities(host_staging=False, cross_host=False))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert stats == [None] and not any(r.name == "kvbridge-staging" for r in registered)
