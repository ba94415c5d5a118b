"""The planner, specified against a slow oracle written independently of it.

The oracle expands every page to its own descriptor, then merges neighbours
that are adjacent on both sides, in plain Python.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvbridge.core.description.layout import Region
from kvbridge.core.planning.plan import PlanError, TransferPlan, coalesce_runs, plan_pages


def oracle_runs(src, dst):
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def oracle_descriptors(src_bases, dst_bases, items, src, dst):
    """One descriptor per page per region, neighbours that continue each other on both sides merged;
    unless every region's item is one size, there are more than 32 pages and on one side at most one in 64
    of them continues the one before it (then nothing is merged: each page is one descriptor)."""
    continuing = min(sum(1 for i in range(1, len(idx)) if idx[i] == idx[i - 1] + 1) for idx in (src, dst))
    merge = not (len(set(items)) == 1 and len(src) > 32 and continuing <= len(src) // 64)
    out = []
    for sb, db, it in zip(src_bases, dst_bases, items):
        per_page = [(sb + s * it, db + d * it, it) for s, d in zip(src, dst)]
        merged = []
        for a, b, n in per_page:
            if merge and merged and merged[-1][0] + merged[-1][2] == a and merged[-1][1] + merged[-1][2] == b:
                merged[-1][2] += n
            else:
                merged.append([a, b, n])
        out.extend(tuple(m) for m in merged)
    return out


@st.composite
def paired_indices(draw, max_len=200):
    n = draw(st.integers(0, max_len))
    space = draw(st.integers(max(n, 1), max(n, 1) * 4))
    style = draw(st.sampled_from(["random", "sorted", "contiguous"]))
    if style == "contiguous":
        s0 = draw(st.integers(0, space))
        d0 = draw(st.integers(0, space))
        return list(range(s0, s0 + n)), list(range(d0, d0 + n))
    src = draw(st.lists(st.integers(0, space), min_size=n, max_size=n))
    dst = draw(st.permutations(range(space)))[:n]
    if style == "sorted":
        src, dst = sorted(src), sorted(dst)
    return src, dst


@given(paired_indices())
@settings(max_examples=300, deadline=None)
def test_coalesce_runs_matches_oracle(pair):
    src, dst = pair
    s, d, n = coalesce_runs(np.array(src, np.int32), np.array(dst, np.int32))
    assert [list(t) for t in zip(s.tolist(), d.tolist(), n.tolist())] == oracle_runs(src, dst)


@given(paired_indices(), st.integers(1, 4), st.data())
@settings(max_examples=300, deadline=None)
def test_plan_pages_matches_oracle(pair, entries, data):
    src, dst = pair
    items = data.draw(st.lists(st.integers(1, 4096), min_size=entries, max_size=entries))
    src_bases = [(1 << 30) * (e + 1) for e in range(entries)]
    dst_bases = [(1 << 40) + (1 << 30) * e for e in range(entries)]
    plan = plan_pages(src_bases, dst_bases, items, np.array(src, np.int32), np.array(dst, np.int32))
    got = list(zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist()))
    assert got == oracle_descriptors(src_bases, dst_bases, items, src, dst)
    assert plan.total_bytes == sum(items) * len(src)
    for arr in (plan.src_addr, plan.dst_addr, plan.nbytes):
        assert arr.dtype == np.int64


def test_empty_input_gives_empty_plan():
    plan = plan_pages([4096], [8192], [64], [], [])
    assert len(plan) == 0 and plan.total_bytes == 0
    assert "empty" in plan.explain()
    assert list(plan.batches(10, 100)) == []


def test_single_page():
    plan = plan_pages([1000], [5000], [10], [3], [7])
    assert (plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist()) == ([1030], [5070], [10])


def test_fully_contiguous_is_one_descriptor_per_region():
    plan = plan_pages([0x1000, 0x9000], [0x100000, 0x200000], [16, 32], np.arange(5, 105), np.arange(100))
    assert plan.nbytes.tolist() == [1600, 3200]
    assert plan.src_addr.tolist() == [0x1000 + 5 * 16, 0x9000 + 5 * 32]


def test_fully_fragmented_is_one_descriptor_per_page_per_region():
    src = np.arange(0, 40, 2)
    dst = np.arange(0, 20)
    plan = plan_pages([0x1000, 0x2000], [0x10000, 0x20000], [8, 8], src, dst)
    assert len(plan) == 2 * 20
    assert set(plan.nbytes.tolist()) == {8}


def test_contiguous_on_one_side_only_is_not_merged():
    s, d, n = coalesce_runs([0, 1, 2], [0, 2, 4])
    assert n.tolist() == [1, 1, 1]


def test_duplicate_destination_indices_are_rejected():
    with pytest.raises(PlanError, match="index 4 more than once"):
        plan_pages([4096], [8192], [8], [0, 1, 2], [4, 9, 4])


def test_unequal_lengths_are_rejected():
    with pytest.raises(PlanError, match="src_idx has 3 indices but dst_idx has 2"):
        coalesce_runs([0, 1, 2], [0, 1])


def test_negative_index_is_rejected_naming_position():
    with pytest.raises(PlanError, match=r"dst_idx\[1\] = -3"):
        coalesce_runs([0, 1], [0, -3])


def test_non_integer_indices_are_rejected():
    with pytest.raises(PlanError, match="integers"):
        coalesce_runs(np.array([0.5]), np.array([1.0]))


def test_per_region_arrays_must_agree():
    with pytest.raises(PlanError, match="per-region arrays differ"):
        plan_pages([1, 2], [3], [8, 8], [0], [0])


def _region(name, addr, nbytes):
    return Region(name=name, addr=addr, nbytes=nbytes, stride=8, role="kv", index_space="p", layer=0)


def test_validate_accepts_descriptors_inside_regions_up_to_their_last_byte():
    plan = TransferPlan(np.array([0x1000, 0x1ff8]), np.array([0x8000, 0x9ff8]), np.array([8, 8]))
    plan.validate([_region("s", 0x1000, 0x1000)], [_region("d", 0x8000, 0x2000)])
    one_past = TransferPlan(np.array([0x1000, 0x1ff9]), np.array([0x8000, 0x9ff8]), np.array([8, 8]))
    with pytest.raises(PlanError):  # the same, one byte further: outside
        one_past.validate([_region("s", 0x1000, 0x1000)], [_region("d", 0x8000, 0x2000)])


@pytest.mark.parametrize(
    "dst, n, what",
    [
        (0x9ff9, 8, "straddles the end"),
        (0x7ff8, 16, "straddles the start"),
        (0x20000, 8, "beyond every region"),
        (0x100, 8, "before every region"),
    ],
)
def test_validate_rejects_descriptor_outside_destination(dst, n, what):
    plan = TransferPlan(np.array([0x1000, 0x1008]), np.array([0x8000, dst]), np.array([8, n]))
    with pytest.raises(PlanError, match=r"descriptor 1 .* destination .* not inside any registered destination region"):
        plan.validate([_region("s", 0x1000, 0x1000)], [_region("d", 0x8000, 0x2000)])


def test_validate_rejects_descriptor_spanning_two_adjacent_regions():
    # Adjacent registrations are separate buffers: one descriptor may not cross them.
    regions = [_region("a", 0x1000, 0x100), _region("b", 0x1100, 0x100)]
    plan = TransferPlan(np.array([0x10f8]), np.array([0x10f8]), np.array([16]))
    with pytest.raises(PlanError, match="descriptor 0"):
        plan.validate(regions, regions)


def test_validate_rejects_source_outside_and_names_nearest_region():
    plan = TransferPlan(np.array([0x5000]), np.array([0x8000]), np.array([8]))
    with pytest.raises(PlanError, match=r"source .*nearest: 's'"):
        plan.validate([_region("s", 0x1000, 0x1000)], [_region("d", 0x8000, 0x2000)])


def test_validate_rejects_non_positive_sizes():
    plan = TransferPlan(np.array([0x1000]), np.array([0x8000]), np.array([0]))
    with pytest.raises(PlanError, match="descriptor 0 has size 0"):
        plan.validate([_region("s", 0x1000, 0x1000)], [_region("d", 0x8000, 0x2000)])


@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=100),
    st.one_of(st.none(), st.integers(1, 20)),
    st.one_of(st.none(), st.integers(1, 3000)),
)
@settings(max_examples=200, deadline=None)
def test_batches_cover_plan_in_order_within_limits(sizes, max_desc, max_bytes):
    n = len(sizes)
    plan = TransferPlan(np.arange(n) * 10**6, np.arange(n) * 10**6 + 7, np.array(sizes, np.int64))
    batches = list(plan.batches(max_desc, max_bytes))
    assert np.array_equal(np.concatenate([b.nbytes for b in batches]), plan.nbytes)
    assert np.array_equal(np.concatenate([b.src_addr for b in batches]), plan.src_addr)
    for b in batches:
        assert len(b) >= 1
        if max_desc is not None:
            assert len(b) <= max_desc
        if max_bytes is not None:
            assert b.total_bytes <= max_bytes or len(b) == 1
        assert np.shares_memory(b.nbytes, plan.nbytes)  # views, not copies
    if max_bytes is not None:
        # Greedy: a batch stops only when the next descriptor would not fit.
        for b, nxt in zip(batches, batches[1:]):
            if max_desc is None or len(b) < max_desc:
                assert b.total_bytes + int(nxt.nbytes[0]) > max_bytes


def test_batches_reject_non_positive_limits():
    plan = TransferPlan(np.array([1]), np.array([2]), np.array([3]))
    with pytest.raises(PlanError, match="max_descriptors"):
        list(plan.batches(0))


def test_explain_lists_counts_and_first_descriptors():
    plan = plan_pages([0x1000], [0x8000], [64], [0, 2, 3], [0, 1, 2])
    text = plan.explain()
    assert "2 descriptors" in text and "192 bytes" in text
    assert "0x1000 -> 0x8000  64 B" in text


@given(
    paired_indices(),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 20)),
    st.one_of(st.none(), st.integers(1, 3000)),
)
@settings(max_examples=200, deadline=None)
def test_unexpanded_plans_batch_exactly_like_their_expanded_arrays(pair, entries, max_desc, max_bytes):
    # plan_pages keeps (region pairs x runs) unexpanded; a concatenation of two such
    # plans and a plain one must batch as the expanded arrays would, across part edges.
    src, dst = pair
    lazy = TransferPlan.concat([
        plan_pages(np.arange(entries) * 10**6 + 10**9, np.arange(entries) * 10**6 + 2 * 10**9, [48] * entries, src, dst),
        TransferPlan(np.array([5, 6]), np.array([7, 8]), np.array([100, 1])),
        plan_pages([3 * 10**9], [4 * 10**9], [16], src, dst),
    ])
    want = oracle_descriptors(np.arange(entries) * 10**6 + 10**9, np.arange(entries) * 10**6 + 2 * 10**9,
                              [48] * entries, src, dst) + [(5, 7, 100), (6, 8, 1)] \
        + oracle_descriptors([3 * 10**9], [4 * 10**9], [16], src, dst)
    assert len(lazy) == len(want) and lazy.total_bytes == sum(n for _, _, n in want)
    expanded = TransferPlan(*(np.array([w[i] for w in want], np.int64) for i in range(3)))
    got = [list(zip(b.src_addr.tolist(), b.dst_addr.tolist(), b.nbytes.tolist())) for b in lazy.batches(max_desc, max_bytes)]
    ref = [list(zip(b.src_addr.tolist(), b.dst_addr.tolist(), b.nbytes.tolist()))
           for b in expanded.batches(max_desc, max_bytes)]
    assert got == ref
    # Read as Python tuples (small plans: a backend's descriptor lists, a metadata row), unexpanded, and each
    # batch too: the same descriptors as the expanded arrays, in order.
    assert lazy.descriptors() == want
    assert [b.descriptors() for b in lazy.batches(max_desc, max_bytes)] == ref
    assert list(zip(lazy.src_addr.tolist(), lazy.dst_addr.tolist(), lazy.nbytes.tolist())) == want
    assert lazy.descriptors() == want and expanded.descriptors() == want


@pytest.mark.parametrize("fragmented", [True, False])
@pytest.mark.parametrize("entries,pages,page_nbytes", [(3, 64, 128), (61, 300, 1152), (160, 40, 65536)])
def test_plan_gives_the_descriptors_of_sglangs_plan_path_in_its_order(entries, pages, page_nbytes, fragmented):
    # The reference in kvbridge.bench.plan reimplements SGLang's group_concurrent_contiguous
    # and its per-layer set_transfer_blocks loop; `kvbridge bench plan` times it against Route.plan.
    from kvbridge.bench.plan import Case, make_inputs, same_descriptors

    for seed in range(3):
        route, src, dst = make_inputs(Case(entries, pages, page_nbytes, fragmented), seed)
        assert same_descriptors(route, src, dst)


def _segments_by_hand(sb, db, ss, ds, seg, s_idx, d_idx):
    """Every (region, index, segment) descriptor in that order, neighbours that continue each other merged."""
    out: list[list[int]] = []
    for e in range(len(sb)):
        for k in range(len(s_idx)):
            for so, do, n in seg:
                s, d = sb[e] + s_idx[k] * ss[e] + so, db[e] + d_idx[k] * ds[e] + do
                if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
                    out[-1][2] += n
                else:
                    out.append([s, d, n])
    return [tuple(x) for x in out]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_partial_item_plans_are_every_segment_of_every_index_with_neighbours_merged(data):
    # NHD heterogeneous TP: token rows (segments) of a page; kept as an outer sum when nothing merges,
    # expanded and merged otherwise. Either way the descriptors are the hand-written ones.
    from kvbridge.core.planning.plan import RegionPairs, plan_segments

    rows = data.draw(st.integers(1, 4))
    item = data.draw(st.sampled_from([64, 128]))
    width = data.draw(st.sampled_from([8, 16, 32, 64]))
    picks = data.draw(st.lists(st.integers(0, item // width - 1), min_size=1, max_size=4, unique=True))
    dst_picks = data.draw(st.permutations(picks)) if data.draw(st.booleans()) else sorted(picks)
    seg = np.array([(p * width, q * width, width) for p, q in zip(sorted(picks), dst_picks)], np.int64)
    n = data.draw(st.integers(1, 6))
    s_idx = np.array(data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n)), np.int64)
    d_idx = np.array(data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n, unique=True)), np.int64)
    sb = (np.arange(rows, dtype=np.int64) * 16 * item) + (1 << 20)
    db = (np.arange(rows, dtype=np.int64) * 16 * item) + (1 << 30)
    ss = ds = np.full(rows, item, np.int64)
    plan = plan_segments(RegionPairs.of(sb, db, ss, ds), seg, s_idx, d_idx)
    got = list(zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist()))
    assert got == _segments_by_hand(sb.tolist(), db.tolist(), ss.tolist(), ds.tolist(), seg.tolist(), s_idx.tolist(),
                                    d_idx.tolist())
    # and batches of it (expanded one at a time when kept as an outer sum) are the same descriptors
    parts = list(plan.batches(max_descriptors=3))
    assert sum((list(zip(b.src_addr.tolist(), b.dst_addr.tolist(), b.nbytes.tolist())) for b in parts), []) == got


def _places(starts, ends, groups):
    """group_of for TransferPlan.split over places [starts[i], ends[i]) of group groups[i]."""
    starts, ends, groups = (np.asarray(a, np.int64) for a in (starts, ends, groups))

    def group_of(addr, nbytes):
        pos = np.searchsorted(starts, addr, side="right") - 1
        ok = pos >= 0
        pos = np.where(ok, pos, 0)
        return groups[pos], ok & (addr + nbytes <= ends[pos])

    return group_of


def test_split_takes_whole_rows_in_plan_order_without_expanding_and_falls_back_per_descriptor():
    # Three regions of 1000 B: rows (region bases) x columns (item offsets); regions 0 and 2 are group 1,
    # region 1 is group 0. A plain array part follows, and a row across two regions.
    group_of = _places([0, 1000, 2000], [1000, 2000, 3000], [1, 0, 1])
    outer = TransferPlan.outer(np.array([0, 1000, 2000]), np.array([10**6, 10**6 + 1000, 10**6 + 2000]),
                               np.array([100, 0, 300]), np.array([0, 200, 400]), np.array([50, 50, 50]), (2, 50))
    arrays = TransferPlan(np.array([1500, 10, 2900]), np.array([7, 8, 9]), np.array([10, 10, 10]))
    across = TransferPlan.outer(np.array([900]), np.array([5 * 10**6]), np.array([0, 150]), np.array([0, 150]),
                                np.array([50, 50]))  # 900-950 in region 0, 1050-1100 in region 1
    plan = TransferPlan.concat([outer, arrays, across])
    parts = plan.split(group_of, 2)
    # The outer part's rows went whole to their groups: still rows x columns, with the planner's hint
    # (read before anything below expands the plans).
    np.testing.assert_array_equal(parts[1].factors()[0][0], [0, 2000])
    assert parts[1].hints()[0] == (2, 50) and parts[0].factors()[0][0].tolist() == [1000]
    want = {g: [d for d in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist())
                if [1, 0, 1][d[0] // 1000] == g] for g in (0, 1)}
    for g in (0, 1):
        got = list(zip(parts[g].src_addr.tolist(), parts[g].dst_addr.tolist(), parts[g].nbytes.tolist()))
        assert got == want[g]
    assert sum(len(p) for p in parts) == len(plan)


def test_split_refuses_a_descriptor_outside_every_place():
    plan = TransferPlan(np.array([10, 5000]), np.array([0, 0]), np.array([10, 10]))
    with pytest.raises(PlanError, match=r"source 0x1388, 10 B\) lies in none of the places"):
        plan.split(_places([0], [1000], [0]), 1)


# -- long lists: the run finder works in blocks, the uniqueness check marks flags instead of sorting ----
def test_runs_across_block_boundaries_match_the_oracle():
    from kvbridge.core.planning.plan import _BLOCK

    n = 2 * _BLOCK + 5
    src = np.arange(n, dtype=np.int64)
    dst = np.arange(n, dtype=np.int64) * 3  # nothing continues on the destination side...
    dst[_BLOCK - 2 : _BLOCK + 3] = dst[_BLOCK - 2] + np.arange(5)  # ...but a run across the first block's end
    dst[2 * _BLOCK :] = dst[2 * _BLOCK] + np.arange(n - 2 * _BLOCK)  # and one starting the last block
    s, d, k = coalesce_runs(src, dst)
    assert [list(t) for t in zip(s.tolist(), d.tolist(), k.tolist())] == oracle_runs(src.tolist(), dst.tolist())
    plan = plan_pages([1 << 30], [1 << 40], [4096], src, dst - dst.min())
    assert plan.total_bytes == int(plan.nbytes.sum()) == 4096 * n


@given(st.lists(st.integers(0, 10_000), min_size=65, max_size=400), st.booleans())
@settings(max_examples=200, deadline=None)
def test_unique_destinations_are_told_apart_from_repeats_like_a_set_would(values, dense):
    from kvbridge.core.planning.indices import check_indices

    arr = np.array(values if not dense else [v % (2 * len(values)) for v in values], np.int64)
    if len(set(arr.tolist())) == len(arr):
        assert check_indices("dst", arr, 10_001, unique=True) is not None
    else:
        first = min(v for v in set(arr.tolist()) if arr.tolist().count(v) > 1)
        with pytest.raises(PlanError, match=f"contains index {first} more than once"):
            check_indices("dst", arr, 10_001, unique=True)


def test_a_scattered_destination_list_with_one_repeat_is_refused_naming_it():
    from kvbridge.core.planning.indices import check_indices

    perm = np.random.default_rng(3).permutation(100_000)
    assert check_indices("dst", perm, 100_000, unique=True) is perm
    perm[77_777] = perm[5]
    with pytest.raises(PlanError, match=f"contains index {perm[5]} more than once"):
        check_indices("dst", perm, 100_000, unique=True)
    sparse = perm.astype(np.int64) * 1000  # values far beyond 8x the length: sorted, not flagged
    with pytest.raises(PlanError, match=f"contains index {perm[5] * 1000} more than once"):
        check_indices("dst", sparse, None, unique=True)


def test_a_scattered_plan_keeps_its_index_lists_as_columns_in_items_and_the_callers_changes_do_not_reach_it():
    # Nothing coalesces: the plan's columns are the index lists in units of an item (no arrays of byte
    # offsets made), read in bytes through factors() and the descriptors as ever; the lists it was given
    # are the caller's, so it holds copies: changing them after planning changes nothing planned.
    rng = np.random.default_rng(5)
    src, dst = rng.permutation(4096)[:1000], rng.permutation(4096)[:1000]
    want = oracle_descriptors([1 << 30, 2 << 30], [1 << 40, 2 << 40], [512, 512], src.tolist(), dst.tolist())
    plan = plan_pages([1 << 30, 2 << 30], [1 << 40, 2 << 40], [512, 512], src, dst)
    src[:] = 10**9
    dst[:] = 0
    assert plan.units() == [512] and plan.hints() == [(512, 512)]
    (_, _, cols_s, cols_d, sizes), = plan.factors(in_units=True)
    (_, _, b_cols_s, b_cols_d, _), = plan.factors()
    np.testing.assert_array_equal(b_cols_s, cols_s * 512)
    np.testing.assert_array_equal(b_cols_d, cols_d * 512)
    assert set(sizes.tolist()) == {512} and len(plan) == 2000
    assert list(zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist())) == want


def test_index_lists_are_kvbridges_own_only_when_made_in_the_check_or_handed_over():
    from kvbridge.core.planning.indices import Indices

    host = np.arange(100, dtype=np.int64)
    assert not Indices.check("src", host, 100).own  # the caller's memory: a plan must copy it
    assert not Indices.check("src", host[10:], 100).own
    assert not Indices.check("src", memoryview(host), 100).own
    assert Indices.check("src", host.tolist(), 100).own  # made from a list
    assert Indices.check("src", host.astype(np.int32), 100).own  # converted: a new array
    assert Indices.check("dst", host, 100, unique=True, own=True).own  # handed over (a peer's decoded list)
    assert Indices.check("dst", host, 100, own=True)[5:].own  # slices of it stay its own


@pytest.mark.parametrize("pattern", ["scattered", "contiguous", "runs"])
def test_a_destination_list_counted_on_arrival_plans_as_one_counted_when_planning(pattern):
    # Prefill counts a decode request's continuing indices as it arrives (Indices.count_continuing), so
    # that planning at send() need not: the plan is the same either way, and the oracle's.
    from kvbridge.bench.plan import SPACE, Case, make_inputs
    from kvbridge.core.planning.indices import Indices

    route, src, dst = make_inputs(Case(2, 1000, 128, pattern == "runs"), 1)
    if pattern == "scattered":
        dst = np.random.default_rng(1).permutation(4000)[:1000].astype(np.int32)
    counted = Indices.check("dst", dst, 4000, unique=True, own=True)
    counted.count_continuing()
    assert counted.continuing == sum(1 for a, b in zip(dst.tolist(), dst.tolist()[1:]) if b == a + 1)
    a, b = route.plan({SPACE: src}, {SPACE: counted}), route.plan({SPACE: src}, {SPACE: dst})
    for x, y in ((a.src_addr, b.src_addr), (a.dst_addr, b.dst_addr), (a.nbytes, b.nbytes)):
        np.testing.assert_array_equal(x, y)
    bases = [r.addr for r in route.src.regions], [r.addr for r in route.dst.regions]
    assert list(zip(a.src_addr.tolist(), a.dst_addr.tolist(), a.nbytes.tolist())) == oracle_descriptors(
        *bases, [128, 128], src.tolist(), dst.tolist())


@pytest.mark.parametrize("items", [[4096], [512, 512], [48, 48, 48]])
def test_a_one_index_plan_is_planned_like_a_scattered_one_and_gives_the_runs_planners_descriptors(items):
    # One index coalesces nothing: its plan's columns are the index lists in items, as a scattered plan's,
    # with no run columns computed (a 1-page request's fast path, #27). It must give the descriptors, bytes
    # and hints the runs planner gives a list of one (its own columns in bytes), and the oracle's.
    src_bases, dst_bases = [(1 << 30) * (e + 1) for e in range(len(items))], [(1 << 40) * (e + 1) for e in range(len(items))]
    plan = plan_pages(src_bases, dst_bases, items, [7], [3])
    it = items[0]
    assert plan.units() == [it] and plan.hints() == [(it & -it, it)]
    (_, _, cols_s, cols_d, sizes), = plan.factors(in_units=True)
    assert (cols_s.tolist(), cols_d.tolist(), sizes.tolist()) == ([7], [3], [it])
    runs_s, runs_d, runs_n = coalesce_runs([7], [3])  # the runs planner's columns, in items
    (_, _, b_cols_s, b_cols_d, b_sizes), = plan.factors()
    assert (b_cols_s.tolist(), b_cols_d.tolist(), b_sizes.tolist()) == (
        (runs_s * it).tolist(), (runs_d * it).tolist(), (runs_n * it).tolist())
    want = oracle_descriptors(src_bases, dst_bases, items, [7], [3])
    assert plan.descriptors() == want and plan.total_bytes == sum(items)
    assert list(zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist())) == want
    with pytest.raises(ValueError):  # the size column is shared by every such plan: nobody may change it
        sizes[0] = 1
