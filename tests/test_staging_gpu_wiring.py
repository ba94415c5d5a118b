"""GPU staging wired into the write path (core/transfer/device.py, staging.py, landing.py, writing.py), on the CPU.

Pages marked ``vram``, written through a backend that moves GPU memory across hosts, to a
decode rank that lent slots on its GPU, are gathered on prefill into a GPU staging slice,
written as one descriptor into decode's GPU slot and scattered there before ``Done``. Here
the "GPU" is host memory: the KV regions are marked ``vram`` (device 0), the ``memory``
backend is declared to move GPU memory across hosts (``process_vm_writev`` copies any
address), and the device seam is :mod:`kvbridge.testing.host_device` (the kernels' unit
table, applied with numpy). So the decision, the windows, the ``Staged`` announcements, the
scatter under decode's lock and the fence run as they do on a GPU; the kernels themselves
run in ``tests/test_gpu_staging.py`` and ``tests/test_gpu_staging_wired.py`` on a CUDA machine.
Bytes are checked against pages copied with plain numpy indexing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest

from kvbridge.core.control import protocol as P
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import Region
from kvbridge.core.description.records import BackendCapabilities
from kvbridge.core.planning.plan import TransferPlan
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, SessionConfig, Sender
from kvbridge.core.transfer import device, staging
from kvbridge.core.transfer.backend import BackendConfig
from kvbridge.core.transfer.device import OnDevice
from kvbridge.core.transfer.landing import ScatterError
from kvbridge.core.transfer.relay import MAX_PIECE_DEVICE, choose_device
from kvbridge.testing import host_device
from kvbridge.testing.e2e import Pools, Scenario, prefill_pools
from kvbridge.testing.harness import START_WAIT, finished, wait_until
from kvbridge.testing.memory import MemoryBackend, defer_posts

PAGES = 24
SRC = np.arange(PAGES) * 2
DST = (np.arange(PAGES)[::-1] * 3) % 97  # scattered: no two neighbours follow each other
#: The memory backend, declared as an engine lane moving GPU memory (what nixl declares).
GPU_ENGINE = BackendCapabilities(memory_kinds=("dram", "vram"), cross_host=True, inline_writes=True)


def _window(dst: list[int], size: int) -> TransferPlan:
    n = len(dst)
    return TransferPlan(np.arange(n, dtype=np.int64) * size, np.array(dst, np.int64) * size, np.full(n, size, np.int64))


@pytest.mark.parametrize("mode, dst, size, want", [
    ("auto", [0, 5, 2, 9], 4096, "both"),                    # scattered small pages
    ("auto", [0, 1, 2, 3], 64 << 10, "both"),                # contiguous too: one descriptor a window either way
    ("auto", [0, 5, 2, 9], MAX_PIECE_DEVICE * 2, "direct"),  # pieces large enough to post as they are
    ("on", [0, 5, 2, 9], MAX_PIECE_DEVICE * 2, "both"),      # forced
    ("gather", [0, 5, 2, 9], 4096, "direct"),                # the default: GPU pages are written as planned
    ("off", [0, 5, 2, 9], 4096, "direct"),
    ("on", [7], 4096, "direct"),                             # one piece: nothing to merge
])
def test_a_gpu_window_is_staged_on_both_sides_or_written_as_planned(mode, dst, size, want) -> None:
    assert choose_device(_window(dst, size), mode) == want


def _on_gpu(pools: Pools) -> Pools:
    """The pools with their KV regions marked GPU memory (device 0); the metadata region stays on the host."""
    regions = tuple(msgspec.structs.replace(r, mem="vram", device=0) if r.role != "metadata" else r
                    for r in pools.kvargs.regions)
    pools.kvargs = msgspec.structs.replace(pools.kvargs, regions=regions)
    return pools


def config(staging: str, **more: object) -> SessionConfig:
    return SessionConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, transfer_timeout=10.0, staging=staging,
                         **more)  # type: ignore[arg-type]


Made = tuple[Sender, Receiver, Pools, Pools, PrefillManager, DecodeManager]


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Made]]:
    """One room between an in-process prefill and decode manager, KV pages marked ``vram``."""
    monkeypatch.setattr(MemoryBackend, "capabilities", GPU_ENGINE)
    monkeypatch.setattr(device, "DEVICE_MODULE", "kvbridge.testing.host_device")
    host_device.calls.clear()
    made: list[object] = []

    def make(staging: str, send: bool = True, decode_staging: str | None = None, **more: object) -> Made:
        sc = Scenario(backend="memory", prefill_pages=64, decode_pages=128, page_nbytes=4096)
        src, dst = _on_gpu(prefill_pools(sc)), _on_gpu(Pools(sc, sc.decode_pages, meta_rows=2))
        server = BootstrapServer("127.0.0.1")
        made.append(server)
        pm = PrefillManager(src.kvargs, MemoryBackend(BackendConfig(name="p")), bootstrap=server.address,
                            config=config(staging, **more))
        made.append(pm)
        dm = DecodeManager(dst.kvargs, MemoryBackend(BackendConfig(name="d")),
                           config=config(decode_staging or staging, **more))
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
def test_scattered_gpu_pages_are_gathered_and_scattered_by_the_device_seam_byte_exact(pair, staging) -> None:
    sender, recv, src, dst, pm, dm = pair(staging)
    assert recv.poll() == Poll.SUCCESS and sender.poll() == Poll.SUCCESS, recv.failure()
    assert landed(src, dst)
    staged = pm.transport.describe()["device_staging"]
    assert staged["mem"] == "vram" and staged["windows"] > 0 and staged["windows_by_choice"]["both"] == staged["windows"]
    assert staged["posted"] == staged["windows"], "one descriptor a window"
    assert staged["pieces"] == 2 * 2 * PAGES, "every K and V page of both layers went through a window"
    landing = dm.transport.describe()["landing"]
    assert landing["mem"] == "vram" and landing["windows"] == staged["windows"] and landing["dropped"] == 0
    assert host_device.calls["gather_units"] == host_device.calls["scatter_units"] == staged["windows"]
    assert host_device.calls["gather"] == 0, "pages of a pool are gathered by their unit index"
    # Bounded: 2 slots of the one GPU slice size lent to the one prefill rank.
    assert landing["lent"] == 2 and landing["slice_bytes"] == staged["slice_bytes"]
    assert "staging" not in dm.transport.describe() or dm.transport.describe()["landing"]["mem"] == "vram"


@pytest.mark.parametrize("mib, slices, slots", [(32, 4, 8), (64, 2, 4), (128, 2, 2), (256, 2, 2)])
def test_the_gpu_slice_size_is_a_setting_and_both_sides_staging_memory_stays_bounded(pair, mib, slices, slots) -> None:
    sender, recv, src, dst, pm, dm = pair("on", gpu_staging_slice_bytes=mib << 20)
    assert recv.poll() == Poll.SUCCESS and landed(src, dst)
    staged, landing = pm.transport.describe()["device_staging"], dm.transport.describe()["landing"]
    assert staged["windows"] > 0 and landing["windows"] == staged["windows"]
    assert (staged["slices"], staged["slice_bytes"]) == (slices, mib << 20)
    assert (landing["slots"], landing["slice_bytes"]) == (slots, mib << 20)
    # Decode's GPU landing holds at most 256 MiB (8 slots of the default 32 MiB), or one prefill rank's 2 slots.
    assert landing["slots"] * landing["slice_bytes"] == max(staging.DEVICE_SLICE_BYTES * 8, 2 * (mib << 20))
    assert staged["slices"] * staged["slice_bytes"] == max(staging.DEVICE_STAGING_BYTES, 2 * (mib << 20))


@pytest.mark.parametrize("bad", [0, -4096, 4097, 1.5, True])
def test_a_gpu_slice_size_that_is_not_whole_4_kib_pages_is_refused_naming_the_setting(bad) -> None:
    with pytest.raises(ValueError, match="gpu_staging_slice_bytes must be a positive multiple of 4096"):
        SessionConfig(gpu_staging_slice_bytes=bad)


def test_by_default_gpu_pages_are_written_as_planned_and_no_gpu_memory_is_taken(pair) -> None:
    sender, recv, src, dst, pm, dm = pair("gather")
    assert recv.poll() == Poll.SUCCESS and landed(src, dst)
    assert "device_staging" not in pm.transport.describe() and "landing" not in dm.transport.describe()
    assert not host_device.calls, "the device seam is not even loaded"


def test_a_prefill_rank_with_staging_gather_writes_gpu_pages_as_planned_into_a_decode_that_lent_gpu_slots(pair) -> None:
    sender, recv, src, dst, pm, dm = pair("gather", decode_staging="on")
    assert recv.poll() == Poll.SUCCESS and landed(src, dst)
    assert dm.transport.describe()["landing"]["windows"] == 0
    assert pm.transport.windows["both"] == 0


def test_without_the_device_seam_gpu_pages_are_written_as_planned(pair, monkeypatch) -> None:
    monkeypatch.setattr(device, "DEVICE_MODULE", "kvbridge.testing.no_such_module")
    sender, recv, src, dst, pm, dm = pair("on")
    assert recv.poll() == Poll.SUCCESS and landed(src, dst)
    assert "device_staging" not in pm.transport.describe()
    assert dm.transport.describe()["landing"]["mem"] == "dram", "decode lends host slots instead"
    assert pm.transport.windows["both"] == 0


def test_a_room_given_up_on_decode_has_nothing_scattered_into_its_gpu_pages(pair) -> None:
    _sender, recv, _src, dst, _pm, dm = pair("on", send=False)
    recv.abort("given up by the test")
    server = next(iter(dm._servers.values()))
    rank = next(iter(server.ranks.values()))
    landing = dm.transport.landing
    assert landing is not None and landing.region.mem == "vram"
    offer = landing.offer((server.address, rank.key))
    assert offer is not None
    slot = offer.slots[0]
    buf = landing._mem.keep  # the stand-in's "GPU" buffer
    buf[slot * landing.slice_bytes:(slot + 1) * landing.slice_bytes] = 0xAB  # what a late window holds
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
    assert host_device.calls["scatter_units"] == 0
    np.testing.assert_array_equal(page, before)


def test_a_gpu_scatter_outside_the_ranks_gpu_regions_writes_nothing(pair) -> None:
    _sender, recv, _src, dst, _pm, dm = pair("on", send=False)
    landing = dm.transport.landing
    assert landing is not None
    offer = landing.offer("someone")
    assert offer is not None
    meta = [r.role for r in dst.kvargs.regions].index("metadata")  # host memory: not a GPU region of this rank
    msg = P.Staged(rooms=(7,), slot=offer.slots[0], pieces=(P.StagedRegion(region=meta, unit=64,
                                                                           offsets=np.zeros(1, "<u4").tobytes()),))
    with pytest.raises(ScatterError, match=f"names region {meta}, not one of this rank's registered regions on GPU 0"):
        landing.scatter("someone", msg)
    assert host_device.calls["scatter_units"] == 0


def test_a_layerwise_chunk_after_a_staged_one_lands_byte_exact(pair) -> None:
    # The first chunk's GPU windows are staged on both sides; the second is sent layer by layer (its writes
    # wait for the staged windows' scatter before landing, docs/architecture.md "Staging").
    sender, recv, src, dst, pm, dm = pair("on", send=False)
    sender.send(SRC[: PAGES // 2], last=False)
    sender.send(SRC[PAGES // 2:], last=True, layerwise=True)
    sender.layer_ready([0, 1])
    wait_until(finished(recv), 30, "the receiver")
    wait_until(finished(sender), 30, "the sender")
    assert recv.poll() == Poll.SUCCESS and sender.poll() == Poll.SUCCESS, recv.failure()
    assert landed(src, dst)
    assert pm.transport.describe()["device_staging"]["windows"] > 0


def test_many_gpu_windows_two_in_flight_land_byte_exact_within_two_slices(pair, monkeypatch) -> None:
    # 16 KiB GPU slices: each chunk is a dozen windows, two in flight at once through a backend posting
    # asynchronously (copies land only when core waits), as nixl does; never more than two slices and slots.
    peak = defer_posts(monkeypatch, msgspec.structs.replace(GPU_ENGINE, batches_in_flight=4))
    sender, recv, src, dst, pm, dm = pair("on", gpu_staging_slice_bytes=16 << 10)
    assert recv.poll() == Poll.SUCCESS and sender.poll() == Poll.SUCCESS, recv.failure()
    assert landed(src, dst)
    staged = pm.transport.describe()["device_staging"]
    assert staged["windows_by_choice"]["both"] >= 12 and staged["windows_by_choice"]["direct"] == 0
    assert staged["peak_slices"] == 2 and peak[0] >= 2
    assert host_device.calls["gather_units"] == host_device.calls["scatter_units"] == staged["windows"]
    assert host_device.calls["gather"] == 0, "pages of a pool are gathered by their unit index"


def test_a_gpu_gather_of_pages_goes_by_unit_index_and_of_odd_pieces_by_address_byte_exact() -> None:
    # Pages of one pool (one unit each at unit multiples): the seam's indexed copy over rows of the region;
    # pieces of several units (4 KiB and 8 KiB) at 1 KiB offsets: the seam's copy by piece addresses.
    host_device.calls.clear()
    mem = np.random.default_rng(5).integers(0, 256, 64 << 10, dtype=np.uint8)
    region = Region(name="k", addr=mem.ctypes.data, nbytes=mem.nbytes, stride=4096, role="k", index_space="kv_page",
                    mem="vram")
    seam = OnDevice(host_device, 0)  # type: ignore[arg-type]
    stager = staging.Staging([region], slices=2, slice_bytes=32 << 10, device=seam)
    for offsets, sizes, how in (([20, 4, 48, 12], [4] * 4, "gather_units"), ([1, 20, 40], [4, 8, 4], "gather")):
        off, nbytes = np.array(offsets, np.int64) * 1024, np.array(sizes, np.int64) * 1024  # KiB
        window = TransferPlan(region.addr + off, np.arange(len(off), dtype=np.int64), nbytes)
        before = dict(host_device.calls)
        staged_window = stager.stage_to(window, 1 << 40)
        assert staged_window is not None
        assert dict(host_device.calls) == {**before, how: before.get(how, 0) + 1}
        slice_ = stager._mem.keep[staged_window._slot * (32 << 10):]
        want = np.concatenate([mem[o:o + n] for o, n in zip(off.tolist(), nbytes.tolist())])
        np.testing.assert_array_equal(slice_[:want.size], want)
        staged_window.release()
