"""Staging on both sides (core/transfer/relay.py, core/transfer/landing.py, core/planning/stage_index.py), host memory.

A window of small pieces is gathered on prefill, written as one descriptor into a
staging slot decode lent, and scattered there before the room's ``Done``. Rooms run
between an in-process prefill and decode manager over the ``memory`` backend (the
control plane is the real one); the bytes are checked against pages copied with
plain numpy indexing. The same paths run in processes over mooncake, nixl and ucx
in the conformance suite (``staging="on"`` tests) and in ``kvbridge bench transfer``.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest

from kvbridge.core.description import plugins
from kvbridge.core.control import protocol as P
from kvbridge.core.transfer.backend import BackendConfig, TransferCancelled
from kvbridge.core.transfer.transport import Transport
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.transfer.landing import SLOTS_PER_PEER, Landing, ScatterError
from kvbridge.core.description.layout import Region, StagingOffer
from kvbridge.core.description.records import BackendCapabilities
from kvbridge.core.control.metrics import metrics
from kvbridge.core.planning.plan import TransferPlan
from kvbridge.core.transfer.relay import RemoteSlots, choose
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, SessionConfig, Sender
from kvbridge.core.planning.regions import RegionTable
from kvbridge.core.planning.stage_index import MAX_RUNS, gather_into, pack, put_units, region_pieces, unit_copy, unit_runs
from kvbridge.core.transfer import staging as staging_mod
from kvbridge.testing.e2e import Pools, Scenario, prefill_pools
from kvbridge.testing.faulty import FlipsByte
from kvbridge.testing.harness import START_WAIT, finished, wait_until
from kvbridge.testing.memory import MemoryBackend, defer_posts

PAGES = 24
SRC = np.arange(PAGES) * 2
DST = (np.arange(PAGES)[::-1] * 3) % 97  # scattered: no two neighbours follow each other


# -- index logic ------------------------------------------------------------------------------------
def _two_regions() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of several sizes in two arrays at unrelated addresses: (a, b, addr, nbytes, region of each)."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 256, 4096, dtype=np.uint8), rng.integers(0, 256, 3000, dtype=np.uint8)[1:]  # b: odd address
    addr = np.array([a.ctypes.data + 1024, b.ctypes.data + 0, a.ctypes.data + 0, b.ctypes.data + 1536,
                     a.ctypes.data + 2048], np.int64)
    nbytes = np.array([256, 512, 128, 512, 512], np.int64)
    return a, b, addr, nbytes, np.array([0, 1, 0, 1, 0], np.int64)


def test_a_gather_packs_pieces_of_several_sizes_and_regions_back_to_back_region_by_region() -> None:
    # b's unit (512 B) is the larger: its pieces first, then a's (unit 128 B), each region's in their order.
    a, b, addr, nbytes, groups = _two_regions()
    order, copies = pack(addr, nbytes, groups)
    assert order.tolist() == [1, 3, 0, 2, 4]
    out = np.zeros(int(nbytes.sum()), np.uint8)
    gather_into(out, copies)
    want = np.concatenate([b[0:512], b[1536:2048], a[1024:1280], a[0:128], a[2048:2560]])
    np.testing.assert_array_equal(out, want)


def test_a_region_of_odd_pieces_is_left_out_of_the_gather_and_the_others_still_packed() -> None:
    # Region 1's pieces at 3-byte offsets (a unit of 1 byte, 100 units a piece) would make the index outgrow
    # the descriptors: left out, to be written as planned; region 0's 8-byte rows are still gathered, and its
    # offsets in the slice stay on its unit whatever region 1's sizes (issue #29: a chunk's state written with
    # its pages must not keep the pages from being staged).
    rows, odd = np.arange(64, dtype=np.uint8), np.arange(2000, dtype=np.uint32).astype(np.uint8)
    addr = np.array([odd.ctypes.data, rows.ctypes.data, odd.ctypes.data + 3, rows.ctypes.data + 16,
                     rows.ctypes.data + 32], np.int64)
    nbytes = np.array([100, 8, 100, 8, 8], np.int64)
    order, copies = pack(addr, nbytes, np.array([1, 0, 1, 0, 0], np.int64))
    assert order.tolist() == [1, 3, 4]
    out = np.zeros(24, np.uint8)
    gather_into(out, copies)
    np.testing.assert_array_equal(out, np.concatenate([rows[0:8], rows[16:24], rows[32:40]]))


def _regions(*arrays: np.ndarray) -> list[Region]:
    return [Region(name=f"r{i}", addr=x.ctypes.data, nbytes=x.nbytes, stride=x.nbytes, role="state", index_space="s")
            for i, x in enumerate(arrays)]


def test_a_scatter_puts_them_back_where_they_came_from() -> None:
    # Pieces of two regions interleaved in the slice: a run per piece, each in its region's own unit.
    a, b, addr, nbytes, groups = _two_regions()
    packed = np.concatenate([a[1024:1280], b[0:512], a[0:128], b[1536:2048], a[2048:2560]])
    a2, b2 = a.copy(), b.copy()
    a[:] = 0
    b[:] = 0
    regions = _regions(a, b)
    pieces = region_pieces(addr, nbytes, RegionTable(regions))
    assert pieces is not None and [p.region for p in pieces] == groups.tolist()
    put_units(packed, unit_runs(pieces, regions))
    touched_a = np.zeros(a.size, bool)
    touched_a[np.r_[1024:1280, 0:128, 2048:2560]] = True
    touched_b = np.zeros(b.size, bool)
    touched_b[np.r_[0:512, 1536:2048]] = True
    np.testing.assert_array_equal(a, np.where(touched_a, a2, 0))
    np.testing.assert_array_equal(b, np.where(touched_b, b2, 0))


def test_units_lying_back_to_back_in_the_slice_or_not_are_gathered_and_scattered_to_their_places() -> None:
    # Pieces of one unit each lie back to back in a slice (a window as pack() makes it): copied straight
    # between memory and the slice; with gaps between them (another region's pieces in between, as a
    # scatter's interleaved regions), through the index of the slice's units. Both against numpy slicing.
    rng = np.random.default_rng(11)
    mem = rng.integers(0, 256, 16 * 4096, dtype=np.uint8)
    pages = np.array([5, 2, 9, 14], np.int64)
    addr, nbytes = mem.ctypes.data + pages * 4096, np.full(4, 4096, np.int64)
    want = np.concatenate([mem[p * 4096:(p + 1) * 4096] for p in pages.tolist()])
    for gap in (0, 4096):
        packed = np.arange(4, dtype=np.int64) * (4096 + gap)
        copy = unit_copy(addr, packed, nbytes)
        assert copy is not None
        out = np.zeros(4 * (4096 + gap), np.uint8)
        gather_into(out, [copy])
        np.testing.assert_array_equal(out.reshape(4, -1)[:, :4096].ravel(), want)
        assert not out.reshape(4, -1)[:, 4096:].any()  # the gaps untouched
    back = np.zeros_like(mem)
    regions = _regions(back)
    pieces = region_pieces(back.ctypes.data + pages * 4096, nbytes, RegionTable(regions))
    assert pieces is not None
    put_units(want, unit_runs(pieces, regions))
    np.testing.assert_array_equal(back.reshape(16, 4096)[pages], mem.reshape(16, 4096)[pages])
    assert not np.delete(back.reshape(16, 4096), pages, axis=0).any()


def test_pieces_at_odd_offsets_are_not_gathered_by_units() -> None:
    # 3-byte offsets: a unit of 1 byte, 100 units a piece: the index would outgrow the descriptors.
    mem = np.zeros(2000, np.uint8)
    addr = mem.ctypes.data + np.array([0, 3, 1000], np.int64)
    order, copies = pack(addr, np.array([100, 100, 100], np.int64), np.zeros(3, np.int64))
    assert len(order) == 0 and copies == []


def _window(dst: list[int], size: int) -> TransferPlan:
    n = len(dst)
    return TransferPlan(np.arange(n, dtype=np.int64) * size, np.array(dst, np.int64) * size, np.full(n, size, np.int64))


@pytest.mark.parametrize("mode, dst, size, same_host, remote, want", [
    ("auto", list(range(16)), 8192, True, True, "gather"),     # one 128 KiB run: prefill alone
    ("auto", [0, 1, 2, 3], 4096, True, True, "both"),          # a 16 KiB run: both sides
    ("auto", [0, 1, 2, 3], 4096, True, False, "gather"),       # ... unless decode lent no slots
    ("auto", [0, 5, 2, 9], 4096, True, True, "both"),          # scattered small pages, slots lent
    ("auto", [0, 5, 2, 9], 4096, True, False, "direct"),       # scattered, no slots: nothing to gain
    ("auto", [0, 5, 2, 9], 64 << 10, True, True, "direct"),    # 64 KiB pages on one host: posted as planned
    ("auto", [0, 5, 2, 9], 64 << 10, False, True, "both"),     # ... across hosts a descriptor costs more
    ("on", [0, 5, 2, 9], 1 << 20, True, True, "both"),         # forced
    ("off", [0, 5, 2, 9], 4096, True, True, "direct"),
    ("on", [7], 4096, True, True, "direct"),                   # one piece: nothing to merge
])
def test_each_window_is_staged_by_its_own_descriptors(mode, dst, size, same_host, remote, want) -> None:
    assert choose(_window(dst, size), mode, same_host, remote) == want


def _offer(slice_bytes: int = 4096) -> StagingOffer:
    slots = Region(name="kvbridge-landing", addr=1 << 40, nbytes=2 * slice_bytes, stride=slice_bytes, role="state",
                   index_space="kvbridge_staging")
    return StagingOffer(region=slots, slots=(0, 1), slice_bytes=slice_bytes)


def test_staged_pieces_are_unit_offsets_in_the_peers_regions_numbered_as_its_hello_lists_them() -> None:
    # The peer lists v (at the higher address) before k: Staged names regions by that order, not by address.
    k = Region(name="k", addr=1 << 20, nbytes=64 << 10, stride=4096, role="k", index_space="kv_page")
    v = Region(name="v", addr=2 << 20, nbytes=64 << 10, stride=4096, role="v", index_space="kv_page")
    slots = RemoteSlots(_offer(), [v, k])
    pages = TransferPlan(np.zeros(4, np.int64), np.array([k.addr + 5 * 4096, k.addr + 2 * 4096, v.addr + 15 * 4096,
                                                          v.addr], np.int64), np.full(4, 4096, np.int64))
    pieces = slots.pieces(pages)
    assert pieces is not None
    assert [(p.region, p.unit, p.offsets.tolist(), p.counts) for p in pieces] == [(1, 4096, [5, 2], None),
                                                                                  (0, 4096, [15, 0], None)]
    # Pieces of several sizes: the gcd of sizes and offsets as the unit, and a count a piece.
    mixed = TransferPlan(np.zeros(2, np.int64), np.array([k.addr + 1024, k.addr + 8192], np.int64),
                         np.array([3072, 512], np.int64))
    (one,) = slots.pieces(mixed) or []
    assert (one.region, one.unit, one.offsets.tolist(), one.counts.tolist()) == (1, 512, [2, 16], [6, 1])
    # A piece past its region's end, or outside every region: not said (the window is written as planned).
    assert slots.pieces(TransferPlan(np.zeros(1, np.int64), np.array([k.end - 2048], np.int64),
                                     np.array([4096], np.int64))) is None
    assert slots.pieces(TransferPlan(np.zeros(1, np.int64), np.array([3 << 20], np.int64),
                                     np.array([4096], np.int64))) is None


def test_a_window_decode_would_scatter_in_tiny_units_is_not_said_but_one_of_runs_of_pages_is() -> None:
    # 4 KiB pieces 2 bytes off their pages: a 2-byte unit, 2,048 a piece (written as planned); runs of 1 to 16
    # pages: a page's unit, several a piece (said, with a count a piece).
    k = Region(name="k", addr=1 << 20, nbytes=1 << 20, stride=4096, role="k", index_space="kv_page")
    slots = RemoteSlots(_offer(), [k])
    odd = k.addr + np.array([3, 9, 1, 40], np.int64) * 4096 + 2
    assert slots.pieces(TransferPlan(np.zeros(4, np.int64), odd, np.full(4, 4096, np.int64))) is None
    runs = TransferPlan(np.zeros(3, np.int64), k.addr + np.array([0, 100, 20], np.int64) * 4096,
                        np.array([16, 1, 8], np.int64) * 4096)
    (one,) = slots.pieces(runs) or []
    assert (one.unit, one.offsets.tolist(), one.counts.tolist()) == (4096, [0, 100, 20], [16, 1, 8])


def test_a_window_of_more_runs_than_a_staged_message_holds_is_not_said_in_units() -> None:
    regions = [Region(name=f"r{i}", addr=(i + 1) << 20, nbytes=4096, stride=4096, role="state", index_space="s")
               for i in range(2)]
    alternating = np.array([r.addr for r in regions] * (MAX_RUNS // 2 + 1), np.int64)
    nbytes = np.full(len(alternating), 64, np.int64)
    assert region_pieces(alternating, nbytes, RegionTable(regions)) is None
    assert region_pieces(alternating[:MAX_RUNS], nbytes[:MAX_RUNS], RegionTable(regions)) is not None


# -- decode's landing slots -------------------------------------------------------------------------
def _landing() -> tuple[Landing, np.ndarray]:
    """16 pages of 256 B in region 1 of the rank's two (region 0: GPU memory, not this buffer's)."""
    pages = np.zeros((16, 256), np.uint8)
    region = Region(name="k", addr=pages.ctypes.data, nbytes=pages.nbytes, stride=256, role="k", index_space="kv_page")
    gpu = Region(name="g", addr=1 << 44, nbytes=1 << 20, stride=256, role="k", index_space="kv_page", mem="vram")
    return Landing([region, gpu], slots=4, slice_bytes=4096, order=[gpu, region]), pages


def _staged(slot: int, *runs: tuple[int, int, list[int], list[int] | None]) -> P.Staged:
    return P.Staged(rooms=(1,), slot=slot, pieces=tuple(
        P.StagedRegion(region=r, unit=u, offsets=np.array(o, "<u4").tobytes(),
                       counts=b"" if c is None else np.array(c, "<u4").tobytes()) for r, u, o, c in runs))


def test_each_prefill_rank_is_lent_two_slots_and_the_pool_is_bounded() -> None:
    landing, _ = _landing()
    a, b, again = landing.offer("a"), landing.offer("b"), landing.offer("a")
    assert a is not None and b is not None and again == a
    assert len(a.slots) == SLOTS_PER_PEER and not set(a.slots) & set(b.slots)
    assert landing.offer("c") is None, "4 slots: two prefill ranks, then every slot is lent"


def test_a_staged_window_is_scattered_by_unit_offsets_in_the_region_it_names() -> None:
    landing, pages = _landing()
    offer = landing.offer("a")
    assert offer is not None
    slot = offer.slots[1]
    landing._buf[slot * 4096:(slot + 1) * 4096] = np.arange(4096) % 251
    # Pages 9 and 3 of 256 B, then 512 B (two pages) at page 12, then one 128 B half-page at 1.5 pages.
    landing.scatter("a", _staged(slot, (1, 256, [9, 3], None), (1, 256, [12], [2]), (1, 128, [3], None)))
    want = np.zeros_like(pages).ravel()
    packed = np.arange(4096) % 251
    for at, n, off in ((9 * 256, 256, 0), (3 * 256, 256, 256), (12 * 256, 512, 512), (384, 128, 1024)):
        want[at:at + n] = packed[off:off + n]
    np.testing.assert_array_equal(pages.ravel(), want)
    assert landing.stats()["pieces"] == 4 and landing.stats()["bytes"] == 1152


@pytest.mark.parametrize("runs, problem", [
    ([(1, 256, [16], None)], "reaches unit 17 of 256 B in region 'k', past its end"),          # one page past the end
    ([(1, 256, [14], [3])], "reaches unit 17 of 256 B in region 'k', past its end"),           # its count reaches past
    ([(1, 4096, [1], None)], "reaches unit 2 of 4096 B in region 'k', past its end"),          # a unit larger than thought
    ([(1, 256, [0xFFFFFFFF], None)], "past its end"),                                          # the largest offset
    ([(2, 256, [0], None)], "names region 2, not one of this rank's registered host regions"),  # no such region
    ([(-1, 256, [0], None)], "names region -1, not one of"),
    ([(0, 256, [0], None)], "names region 0, not one of this rank's registered host regions"),  # GPU memory
    ([(1, 0, [0], None)], "has unit 0"),
    ([(1, 256, [], None)], "at least one piece"),
    ([(1, 256, [0, 1], [1])], "one count a piece"),
    ([(1, 256, [0], [0])], "a piece of 0 units"),
    ([(1, 256, list(range(16)), None), (1, 256, [0], None)], "from a slot of 4096 B"),         # 17 pages: over the slot
    ([(1, 256, [0] * 17, None)], "from a slot of 4096 B"),                                     # one page 17 times
    ([(1, 1, [0, 0], [4096, 4096])], "from a slot of 4096 B"),                                 # counted before expanded
    ([], "names no pieces"),
])
def test_a_bad_staged_window_is_refused_naming_the_problem_and_nothing_is_written(runs, problem) -> None:
    landing, pages = _landing()
    offer = landing.offer("a")
    assert offer is not None
    landing._buf[:] = 0xAB
    with pytest.raises(ScatterError, match=re.escape(problem)):
        landing.scatter("a", _staged(offer.slots[0], *runs))
    assert not pages.any() and landing.stats()["windows"] == 0


def test_a_scatter_from_a_slot_not_lent_writes_nothing() -> None:
    landing, pages = _landing()
    offer = landing.offer("a")
    assert offer is not None
    landing._buf[:] = 0xAB
    with pytest.raises(ScatterError, match="not one lent to this prefill rank"):
        landing.scatter("b", _staged(offer.slots[0], (1, 256, [0], None)))
    assert not pages.any()


def test_a_staged_message_from_a_peer_of_the_previous_protocol_is_refused_naming_the_versions() -> None:
    old = msgspec.msgpack.encode({"type": "staged", "v": 4, "rooms": [1], "slot": 0, "dst": b"\0" * 8,
                                  "nbytes": b"\0" * 8})
    with pytest.raises(P.ProtocolError, match="protocol version 4 is not supported .this side speaks 5."):
        P.decode(old)
    assert P.MAX_STAGED_RUNS == MAX_RUNS


# -- rooms end to end (in-process managers, the real control plane) ---------------------------------
def config(staging: str, checksum: bool = False) -> SessionConfig:
    return SessionConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, transfer_timeout=10.0, staging=staging,
                         checksum=checksum)


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Sender, Receiver, Pools, Pools, PrefillManager,
                                                                          DecodeManager]]]:
    """One room between an in-process prefill and decode manager (as tests/test_checksum.py's ``pair``)."""
    # The faulty backends installed as a plugin in this process (bootstrap accepts installed backends only).
    faulty = md.EntryPoint("faulty", "kvbridge.testing.faulty", "kvbridge")
    monkeypatch.setattr(plugins, "_cached", plugins.build_registry([*plugins._entry_points(), faulty]))
    made: list[object] = []

    def make(staging: str, backend: type[MemoryBackend] = MemoryBackend, checksum: bool = False, page_nbytes: int = 4096,
             send: bool = True) -> tuple[Sender, Receiver, Pools, Pools, PrefillManager, DecodeManager]:
        sc = Scenario(backend="memory", prefill_pages=64, decode_pages=128, page_nbytes=page_nbytes)
        src, dst = prefill_pools(sc), Pools(sc, sc.decode_pages, meta_rows=2)
        server = BootstrapServer("127.0.0.1")
        made.append(server)
        pm = PrefillManager(src.kvargs, backend(BackendConfig(name="p")), bootstrap=server.address,
                            config=config(staging, checksum))
        made.append(pm)
        dm = DecodeManager(dst.kvargs, backend(BackendConfig(name="d")), config=config(staging, checksum))
        made.append(dm)
        sender = Sender(pm, 7, metadata_row=0)
        recv = Receiver(dm, 7, bootstrap=server.address)
        recv.init(DST, metadata_row=1)
        wait_until(lambda: sender.poll() == Poll.WAITING_FOR_INPUT, START_WAIT, "the request")
        if send:
            sender.send(SRC[: PAGES // 2], last=False)
            sender.send(SRC[PAGES // 2:], last=True)
            wait_until(finished(recv), 30, "the receiver")
            wait_until(finished(sender), 30, "the sender")
        return sender, recv, src, dst, pm, dm

    yield make
    for obj in reversed(made):
        obj.close()  # type: ignore[attr-defined]


def landed(src: Pools, dst: Pools) -> bool:
    """Independent oracle: decode page DST[i] holds prefill page SRC[i], in every region."""
    return all(np.array_equal(d[DST], s[SRC]) for s, d in zip(src.kv, dst.kv))


@pytest.mark.parametrize("staging", ["on", "auto"])
def test_scattered_small_pages_are_staged_on_both_sides_and_land_byte_exact(pair, staging) -> None:
    before = metrics().snapshot()["backends"].get("memory", {}).get("staging_windows", {}).get("both", 0)
    sender, recv, src, dst, pm, dm = pair(staging)
    assert recv.poll() == Poll.SUCCESS and sender.poll() == Poll.SUCCESS, recv.failure()
    assert landed(src, dst)
    both = pm.transport.describe()["staging"]["windows_by_choice"]["both"]
    assert both > 0
    assert metrics().snapshot()["backends"]["memory"]["staging_windows"]["both"] - before == both
    landing = dm.transport.describe()["landing"]
    assert landing["windows"] > 0 and landing["dropped"] == 0
    assert landing["lent"] * landing["slice_bytes"] <= 2 * landing["slice_bytes"], "2 slices for the one prefill rank"


def test_a_window_whose_pieces_cannot_be_said_in_units_is_written_as_planned_and_frees_its_slice_and_slot(
        pair, monkeypatch) -> None:
    # What region_pieces refuses (a piece past 2**32 units, more runs than Staged holds): as planned instead.
    monkeypatch.setattr(RemoteSlots, "pieces", lambda self, window: None)
    sender, recv, src, dst, pm, dm = pair("on")
    assert recv.poll() == Poll.SUCCESS and sender.poll() == Poll.SUCCESS, recv.failure()
    assert landed(src, dst)
    staged = pm.transport.describe()["staging"]
    assert staged["windows_by_choice"]["both"] == 0 and staged["windows_by_choice"]["direct"] > 0
    assert dm.transport.describe()["landing"]["windows"] == 0
    assert all(lane.staging is None or lane.staging.free() == staging_mod.SLICES for lane in pm.transport.lanes)
    assert all(p.slots is None or p.slots.free() == SLOTS_PER_PEER for p in pm.transport._peers.values())


def test_staging_off_writes_every_page_as_planned_and_registers_no_staging_memory(pair) -> None:
    sender, recv, src, dst, pm, dm = pair("off")
    assert recv.poll() == Poll.SUCCESS and landed(src, dst)
    assert "staging" not in pm.transport.describe() and "landing" not in dm.transport.describe()


def test_a_byte_flipped_in_the_landing_slot_is_caught_by_the_checksum_where_it_lands(pair) -> None:
    # FlipsByte inverts a destination byte of every batch: with staging, a byte of decode's slot, which
    # the scatter then copies into a page; decode hashes the pages, so the room fails naming the checksum.
    _sender, recv, src, dst, _pm, _dm = pair("on", FlipsByte, checksum=True)
    assert recv.poll() == Poll.FAILED and "checksum mismatch (" in (recv.failure() or "")
    assert not landed(src, dst)


def test_a_room_given_up_on_decode_has_nothing_scattered_into_its_pages(pair) -> None:
    _sender, recv, _src, dst, _pm, dm = pair("on", send=False)
    recv.abort("given up by the test")
    server = next(iter(dm._servers.values()))
    rank = next(iter(server.ranks.values()))
    landing = dm.transport.landing
    assert landing is not None
    offer = landing.offer((server.address, rank.key))
    assert offer is not None
    slot = offer.slots[0]
    landing._buf[slot * landing.slice_bytes:(slot + 1) * landing.slice_bytes] = 0xAB  # what a late window holds
    page = dst.kv[0][DST[0]]
    before = page.copy()
    region = [r.addr for r in dst.kvargs.regions].index(dst.kv[0].ctypes.data)
    msg = P.Staged(rooms=(7,), slot=slot, pieces=(P.StagedRegion(region=region, unit=page.nbytes,
                                                                 offsets=np.array([DST[0]], "<u4").tobytes()),))
    dm.loop.call(lambda: dm._on_staged(server, rank, msg))
    deadline = time.monotonic() + 10
    while landing.stats()["dropped"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert landing.stats()["dropped"] == 1 and landing.stats()["windows"] == 0
    np.testing.assert_array_equal(page, before)


@pytest.mark.parametrize("staging", ["on", "auto"])
def test_many_windows_staged_on_both_sides_two_in_flight_land_byte_exact_within_two_slices(pair, staging,
                                                                                            monkeypatch) -> None:
    # 16 KiB slices: each chunk is a dozen windows of 4 pages. Two are in flight at once (the next gathered and
    # posted while the last is written, decode scattering one while the next lands), never more than the two
    # prefill slices and the two decode slots of this peer.
    monkeypatch.setattr(staging_mod, "SLICE_BYTES", 16 << 10)
    peak = defer_posts(monkeypatch, BackendCapabilities(memory_kinds=("dram",), cross_host=False, batches_in_flight=4))
    sender, recv, src, dst, pm, dm = pair(staging)
    assert recv.poll() == Poll.SUCCESS and sender.poll() == Poll.SUCCESS, recv.failure()
    assert landed(src, dst)
    stats = pm.transport.describe()["staging"]
    assert stats["windows_by_choice"]["both"] >= 12 and stats["windows_by_choice"]["direct"] == 0
    assert stats["peak_slices"] == 2, "two windows in flight, each in its own slice"
    assert peak[0] >= 2, "the next window was posted before the last landed"
    landing = dm.transport.describe()["landing"]
    assert landing["windows"] == stats["windows"] and landing["dropped"] == 0 and landing["lent"] == 2


def test_a_room_stopped_with_windows_in_flight_gives_their_decode_slots_back_once_they_landed(monkeypatch) -> None:
    # The room dies while two staged windows are in flight: the write stops at its next check, waits for
    # both, and since they landed the decode slots they went to hold nothing the engine may still write:
    # given back, not retired (retired slots are lost to this peer until it handshakes again).
    monkeypatch.setattr(staging_mod, "SLICE_BYTES", 16 << 10)
    defer_posts(monkeypatch, BackendCapabilities(memory_kinds=("dram",), cross_host=False, batches_in_flight=4))
    rng = np.random.default_rng(5)
    src, dst = rng.integers(0, 256, (64, 4096), dtype=np.uint8), np.zeros((64, 4096), np.uint8)
    mine = Region(name="src", addr=src.ctypes.data, nbytes=src.nbytes, stride=4096, role="k", index_space="kv_page")
    theirs = Region(name="dst", addr=dst.ctypes.data, nbytes=dst.nbytes, stride=4096, role="k", index_space="kv_page")
    landing = Landing([theirs], slice_bytes=16 << 10)
    decode = MemoryBackend(BackendConfig(name="d"))
    decode.register([theirs, landing.region])
    transport = Transport.of(MemoryBackend(BackendConfig(name="p")), "memory")
    transport.staging_mode = "on"
    transport.register([mine])
    transport.add_peer("d", decode.metadata(), [theirs], staging_offer=landing.offer("p"))
    order = rng.permutation(64)
    plan = TransferPlan(src.ctypes.data + 4096 * np.arange(64, dtype=np.int64),
                        dst.ctypes.data + 4096 * order.astype(np.int64), np.full(64, 4096, np.int64))
    checks, announced = [0], []

    def live() -> bool:  # dies at the check before the third window's batch
        checks[0] += 1
        return checks[0] <= 2

    with pytest.raises(TransferCancelled):
        transport.write("d", plan, time.monotonic() + 30, live, lambda slot, pieces: announced.append(slot))
    slots = transport._peers["d"].slots
    assert slots is not None and slots.usable() == 2, "no slot retired: every window in flight had landed"
    assert slots.free() == 2 - len(announced), "the slots of the windows in flight are free; announced ones wait for decode"
    transport.close()
    decode.close()
