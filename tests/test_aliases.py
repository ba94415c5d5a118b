"""Alias regions (``KVArgs.aliases``): views inside memory a region already registers.

Validation (inside a region of the same memory, overlap still refused between
regions), wire compatibility with a peer that predates the field, registration
of each byte once, and one move through real managers whose expected bytes are
cut from the numpy buffers by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import pytest

from kvbridge import BootstrapServer, DecodeManager, Poll, PrefillManager, Receiver, Sender
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region, Shard

PAGES, PAGE = 8, 64
#: An alias item: 2 units of 8 bytes (split across TP), at byte 16 of each 64-byte page (padded items).
ALIAS_AT, ALIAS_SHARD = 16, Shard(kind="split", outer=1, totals=(2,), unit_nbytes=8)


def describe(buf: np.ndarray, alias_at: int = ALIAS_AT, device: int = 0, extra: Sequence[Region] = ()) -> KVArgs:
    base = buf.ctypes.data
    page = Region(name="kv0", addr=base, nbytes=buf.nbytes, stride=PAGE, role="kv", index_space="kv_page", layer=0)
    alias = Region(name="state1", addr=base + alias_at, nbytes=(PAGES - 1) * PAGE + 16, stride=PAGE, role="state",
                   index_space="state_page", layer=1, state_type="mamba", shard=ALIAS_SHARD,
                   mem="dram", device=device)
    return KVArgs(regions=(page, *extra), aliases=(alias,), dtype="bfloat16", page_size=4,
                  index_spaces=(IndexSpace("kv_page", PAGES, 4), IndexSpace("state_page", PAGES, 1, kind="slot")))


class _PreviousKVArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """KVArgs as a peer running the version before aliases decodes it."""

    regions: tuple[Region, ...]
    index_spaces: tuple[IndexSpace, ...]
    dtype: str
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1


def test_an_alias_inside_its_region_is_paired_but_not_overlap_checked():
    buf = np.zeros((PAGES, PAGE), np.uint8)
    args = describe(buf)
    assert [r.name for r in args.regions] == ["kv0"] and [r.name for r in args.all_regions] == ["kv0", "state1"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(args), type=KVArgs) == args


def test_an_alias_outside_every_region_is_refused_naming_the_nearest():
    buf = np.zeros((PAGES, PAGE), np.uint8)
    with pytest.raises(ValueError, match=r"alias region 'state1' .* lies inside no region of the same memory "
                                         r"\(nearest: 'kv0'"):
        describe(buf, alias_at=PAGE)  # its last item ends past the page region
    with pytest.raises(ValueError, match=r"alias region 'state1' .*\(no region is in dram memory of device 1\)"):
        describe(buf, device=1)


def test_regions_still_may_not_overlap_when_aliases_exist():
    buf = np.zeros((PAGES, PAGE), np.uint8)
    clash = Region(name="v0", addr=buf.ctypes.data + PAGE, nbytes=PAGES * PAGE, stride=PAGE, role="v", index_space="kv_page",
                   layer=2)
    with pytest.raises(ValueError, match="region 'v0' .* overlaps region 'kv0'"):
        describe(buf, extra=(clash,))


def test_a_kvargs_without_aliases_decodes_on_a_previous_peer_and_one_with_aliases_is_refused_there():
    buf = np.zeros((PAGES, PAGE), np.uint8)
    args = describe(buf)
    plain = KVArgs(regions=args.regions, index_spaces=args.index_spaces[:1], dtype="bfloat16", page_size=4)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(plain), type=_PreviousKVArgs)
    assert old.regions == plain.regions and old.tp_size == 1
    with pytest.raises(msgspec.ValidationError, match="unknown field `aliases`"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(args), type=_PreviousKVArgs)


def test_alias_items_move_byte_exact_and_only_regions_are_registered():
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (PAGES, PAGE), dtype=np.uint8)
    dst = np.zeros_like(src)
    server = BootstrapServer("127.0.0.1")
    prefill = PrefillManager(describe(src), "memory", bootstrap=server.address)
    decode = DecodeManager(describe(dst), "memory")
    try:
        for m in (prefill, decode):  # what each lane handed its backend to register: the page region, once
            assert [[r.name for r in lane.regions] for lane in m.transport.lanes] == [["kv0"]]
        recv = Receiver(decode, 7, bootstrap=server.address)
        recv.init([1, 2], {"state_page": [6]})
        send = Sender(prefill, 7)
        assert send.wait(Poll.WAITING_FOR_INPUT, timeout=20) == Poll.WAITING_FOR_INPUT, send.failure()
        send.send([4, 5], {"state_page": [3]}, last=True)
        assert recv.wait(Poll.SUCCESS, timeout=20) == Poll.SUCCESS, recv.failure()
        want = np.zeros_like(src)
        want[[1, 2]] = src[[4, 5]]  # whole pages
        want[6, ALIAS_AT:ALIAS_AT + 16] = src[3, ALIAS_AT:ALIAS_AT + 16]  # the alias item only, not its page
        assert np.array_equal(dst, want)
    finally:
        decode.close()
        prefill.close()
        server.close()
