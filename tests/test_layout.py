"""KVArgs and the memory records: validation on construction and on the wire."""

import msgspec
import pytest

from kvbridge.core.description.layout import IndexSpace, KVArgs, Region, Shard


def region(name="k0", addr=0x10000, nbytes=0x1000, stride=0x100, role="k", layer=0, **kw):
    return Region(name=name, addr=addr, nbytes=nbytes, stride=stride, role=role, index_space="kv_page", layer=layer, **kw)


def kvargs(*regions, count=16):
    return KVArgs(regions=regions, index_spaces=(IndexSpace("kv_page", count, 16),), dtype="bfloat16", page_size=16)


def test_valid_description_round_trips_through_msgpack():
    args = kvargs(region(), region("v0", addr=0x20000, role="v"))
    wire = msgspec.msgpack.encode(args)
    assert msgspec.msgpack.decode(wire, type=KVArgs) == args


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"nbytes": 0}, "region 'k0': size must be > 0, got 0"),
        ({"nbytes": -5}, "region 'k0': size must be > 0"),
        ({"stride": 0}, "region 'k0': stride must be > 0"),
        ({"stride": 0x2000}, "region 'k0': stride 8192 is larger than the region"),
        ({"role": "Keys"}, "region 'k0': role 'Keys' is not a lowercase word"),
        ({"role": "k v"}, "region 'k0': role 'k v' is not a lowercase word"),
        ({"addr": 0}, "region 'k0': address must be > 0"),
        ({"mem": "hbm"}, "region 'k0': unknown memory kind 'hbm'"),
    ],
)
def test_bad_region_is_rejected_naming_it(kw, message):
    with pytest.raises(ValueError, match=message):
        region(**kw)


def test_overlapping_regions_are_rejected_naming_both():
    with pytest.raises(ValueError, match="region 'v0' .* overlaps region 'k0'"):
        kvargs(region(), region("v0", addr=0x10800, role="v"))


def test_same_addresses_on_different_devices_do_not_overlap():
    args = kvargs(region(mem="vram", device=0), region("k0b", mem="vram", device=1, layer=1))
    assert [(r.name, r.device) for r in args.regions] == [("k0", 0), ("k0b", 1)]
    with pytest.raises(ValueError, match="region 'k0b' .* overlaps region 'k0'"):  # the same device: they do
        kvargs(region(mem="vram", device=0), region("k0b", mem="vram", device=0, layer=1))


def test_index_space_larger_than_region_is_rejected():
    with pytest.raises(ValueError, match="region 'k0': index space 'kv_page' has 32 items"):
        kvargs(region(), count=32)


def test_undeclared_index_space_is_rejected():
    with pytest.raises(ValueError, match="index space 'slot' is not declared"):
        KVArgs(
            regions=(Region(name="c", addr=4096, nbytes=64, stride=8, role="conv", index_space="slot"),),
            index_spaces=(IndexSpace("kv_page", 4),),
            dtype="f32",
            page_size=1,
        )


def test_duplicate_pairing_key_is_rejected():
    with pytest.raises(ValueError, match="same \\(state_type, role, layer, draft\\)"):
        kvargs(region(), region("k0-again", addr=0x20000))


def test_draft_region_pairs_separately_from_target():
    args = kvargs(region(), region("k0-draft", addr=0x20000, draft=True))
    assert args.regions[0].key != args.regions[1].key


def test_split_shard_must_describe_the_stride():
    # 16 tokens x (8 heads / TP 2) x 4 B = 256 B per page on each rank, not 0x100 + 1.
    shard = Shard(kind="split", outer=16, totals=(8,), unit_nbytes=4)
    KVArgs(regions=(region(shard=shard),), index_spaces=(IndexSpace("kv_page", 16, 16),), dtype="f32",
           page_size=16, tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match="region 'k0': its shard describes 256-byte items on TP rank 0 of 2"):
        KVArgs(regions=(region(stride=0x80, shard=shard),), index_spaces=(IndexSpace("kv_page", 16, 16),),
               dtype="f32", page_size=16, tp_rank=0, tp_size=2)


def test_split_shard_needs_positive_totals():
    with pytest.raises(ValueError, match="positive group totals"):
        Shard(kind="split", outer=1, totals=(4, 0), unit_nbytes=4)


def test_shard_that_cannot_split_across_the_tp_size_is_rejected():
    shard = Shard(kind="split", outer=16, totals=(6,), unit_nbytes=4)
    with pytest.raises(ValueError, match="region 'k0': a group of 6 cannot be split across TP 4"):
        KVArgs(regions=(region(shard=shard),), index_spaces=(IndexSpace("kv_page", 16, 16),), dtype="f32",
               page_size=16, tp_rank=0, tp_size=4)


def test_local_slices_replicate_units_when_tp_exceeds_them():
    shard = Shard(kind="split", outer=1, totals=(2, 8), unit_nbytes=4)
    assert [shard.local(r, 4) for r in range(4)] == [[(0, 1), (0, 2)], [(0, 1), (2, 2)], [(1, 1), (4, 2)], [(1, 1), (6, 2)]]
    assert [shard.owns(r, 4) for r in range(4)] == [[True, True], [False, True], [True, True], [False, True]]


def test_tp_rank_outside_tp_size_is_rejected():
    with pytest.raises(ValueError, match="tp_rank 2 is outside tp_size 2"):
        KVArgs(regions=(), index_spaces=(), dtype="f16", page_size=16, tp_rank=2, tp_size=2)


def test_hostile_wire_message_is_rejected_by_validation():
    # A peer cannot smuggle in a description that construction would refuse.
    good = msgspec.to_builtins(kvargs(region()))
    good["regions"][0]["stride"] = 10**9
    with pytest.raises(msgspec.ValidationError, match="stride"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(good), type=KVArgs)


def test_unknown_fields_on_the_wire_are_rejected():
    data = msgspec.to_builtins(kvargs(region()))
    data["surprise"] = 1
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(data), type=KVArgs)
