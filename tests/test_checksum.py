"""The optional end-to-end checksum (``SessionConfig.checksum``, ``kvbridge.core.sessions.checksum``).

A corrupting link (``kvbridge.testing.faulty``'s ``FlipsByte``: every batch
written, then one destination byte inverted) must fail the room naming the
checksum, whichever side asked for it; a correct transfer with the checksum
on succeeds over ``memory`` and a real engine; off (the default) nothing is
hashed and nothing extra travels. GPU regions are hashed where they are
(``wmix64``, tests/test_wmix.py); a process that cannot hash them refuses the option.
"""

from __future__ import annotations

import importlib.metadata as md
import zlib
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest

from kvbridge.core.sessions import checksum as C
from kvbridge.core.description import plugins
from kvbridge.core.control import protocol as P
from kvbridge.core.transfer.backend import BackendConfig
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, SessionConfig, Sender
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.testing.e2e import Pools, Scenario, pattern, prefill_pools
from kvbridge.testing.faulty import FlipsByte
from kvbridge.testing.harness import START_WAIT, BackendHarness, Child, finished, wait_until
from kvbridge.testing.memory import MemoryBackend

PAGES = 6


def config(checksum: bool) -> SessionConfig:
    return SessionConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, transfer_timeout=10.0, checksum=checksum)


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Sender, Receiver, Pools, Pools]]]:
    """One room between an in-process prefill and decode over a given backend class and checksum settings."""
    # The faulty backends installed as a plugin in this process (bootstrap accepts installed backends only).
    faulty = md.EntryPoint("faulty", "kvbridge.testing.faulty", "kvbridge")
    monkeypatch.setattr(plugins, "_cached", plugins.build_registry([*plugins._entry_points(), faulty]))
    made: list[object] = []

    def make(backend: type[MemoryBackend], prefill_sum: bool, decode_sum: bool) -> tuple[Sender, Receiver, Pools, Pools]:
        sc = Scenario(backend="memory", prefill_pages=32, decode_pages=32, page_nbytes=4096)
        src, dst = prefill_pools(sc), Pools(sc, sc.decode_pages, meta_rows=2)
        server = BootstrapServer("127.0.0.1")
        made.append(server)
        pm = PrefillManager(src.kvargs, backend(BackendConfig(name="p")), bootstrap=server.address, config=config(prefill_sum))
        made.append(pm)
        dm = DecodeManager(dst.kvargs, backend(BackendConfig(name="d")), config=config(decode_sum))
        made.append(dm)
        sender = Sender(pm, 7, metadata_row=0)
        recv = Receiver(dm, 7, bootstrap=server.address)
        recv.init(np.arange(PAGES)[::-1] * 3, metadata_row=1)  # scattered, reversed
        wait_until(lambda: sender.poll() == Poll.WAITING_FOR_INPUT, START_WAIT, "the request")
        sender.send(np.arange(PAGES) * 2, last=False)
        sender.send([], last=True)
        wait_until(finished(recv), 30, "the receiver")
        wait_until(finished(sender), 30, "the sender")
        return sender, recv, src, dst

    yield make
    for obj in reversed(made):
        obj.close()  # type: ignore[attr-defined]


def landed(src: Pools, dst: Pools) -> bool:
    """Independent oracle: decode page 3*(5-i) holds prefill page 2*i, in every region."""
    return all(np.array_equal(d[np.arange(PAGES)[::-1] * 3], s[np.arange(PAGES) * 2]) for s, d in zip(src.kv, dst.kv))


@pytest.mark.parametrize("prefill_sum, decode_sum", [(True, True), (True, False), (False, True)],
                         ids=["both", "prefill-asks", "decode-asks"])
def test_a_flipped_byte_fails_the_room_naming_the_checksum(pair, prefill_sum, decode_sum) -> None:
    _, recv, src, dst = pair(FlipsByte, prefill_sum, decode_sum)
    assert recv.poll() == Poll.FAILED
    assert "checksum mismatch (" in (recv.failure() or "") and "the bytes changed on the way" in (recv.failure() or "")
    assert not landed(src, dst)  # the fault is real: the room's bytes differ


@pytest.mark.parametrize("prefill_sum, decode_sum", [(True, True), (False, True)], ids=["both", "decode-asks"])
def test_a_correct_transfer_with_the_checksum_succeeds(pair, prefill_sum, decode_sum) -> None:
    sender, recv, src, dst = pair(MemoryBackend, prefill_sum, decode_sum)
    assert recv.poll() == Poll.SUCCESS and sender.poll() == Poll.SUCCESS, recv.failure()
    assert landed(src, dst)


@pytest.mark.parametrize("faulty", [False, True], ids=["correct", "flipped"])
def test_a_room_hashed_with_wmix64_end_to_end(pair, monkeypatch: pytest.MonkeyPatch, faulty: bool) -> None:
    # Prefill names wmix64 for rooms with GPU memory on either side; this machine has none, so
    # prefill's choice is pinned to it here: the same Done, ranges and decode check as on a GPU.
    from kvbridge.core.sessions import writes
    monkeypatch.setattr(writes, "choose", lambda local, peer: "wmix64")
    sender, recv, src, dst = pair(FlipsByte if faulty else MemoryBackend, True, True)
    if faulty:
        assert recv.poll() == Poll.FAILED and "checksum mismatch (wmix64)" in (recv.failure() or "")
        assert not landed(src, dst)
    else:
        assert recv.poll() == Poll.SUCCESS and sender.poll() == Poll.SUCCESS, recv.failure()
        assert landed(src, dst)


def test_off_by_default_nothing_is_hashed_and_a_flipped_byte_goes_unseen(pair) -> None:
    # What the option buys: without it, core trusts the backend (the corruption passes).
    assert SessionConfig().checksum is False and P.TransferRequest(room=1, indices={}, metadata_row=0).checksum is False
    sender, recv, src, dst = pair(FlipsByte, False, False)
    assert recv.poll() == Poll.SUCCESS and not landed(src, dst)
    assert sender._written == {}  # no plans kept, nothing hashed


def test_the_digest_is_the_hash_of_the_source_bytes_in_destination_order() -> None:
    a = np.frombuffer(bytes(range(256)) * 4, np.uint8).copy()
    b = np.zeros_like(a)
    src = np.array([a.ctypes.data + 100, a.ctypes.data + 0, a.ctypes.data + 500], np.int64)
    dst = np.array([b.ctypes.data + 64, b.ctypes.data + 200, b.ctypes.data + 0], np.int64)
    n = np.array([64, 10, 64], np.int64)
    got = C.summarise([TransferPlan(src, dst, n)], "crc32", 1 << 20)
    expect = zlib.crc32(a[500:564].tobytes() + a[100:164].tobytes() + a[0:10].tobytes())
    assert got.digest == expect
    # The ranges at 0 and 64 touch: merged into one; the one at 200 stands alone.
    assert np.frombuffer(got.ranges, "<i8").tolist() == [b.ctypes.data, 128, b.ctypes.data + 200, 10]


def test_decode_refuses_ranges_outside_its_registered_memory() -> None:
    sc = Scenario(backend="memory", decode_pages=4, page_nbytes=64)
    dst = Pools(sc, 4, meta_rows=1)
    outside = np.array([dst.kv[0].ctypes.data + dst.kv[0].nbytes - 8, 64], "<i8").tobytes()
    why = C.verify(P.Checksum(algorithm="crc32", digest=0, ranges=outside), dst.kvargs.regions)
    assert why is not None and "not inside one registered region of this rank" in why


def test_an_unknown_algorithm_says_what_to_install() -> None:
    sc = Scenario(backend="memory", decode_pages=4, page_nbytes=64)
    dst = Pools(sc, 4, meta_rows=1)
    why = C.verify(P.Checksum(algorithm="sha9", digest=0, ranges=b""), dst.kvargs.regions)
    assert why is not None and "'sha9' is not available here" in why and "pip install kvbridge[checksum]" in why


def test_a_gpu_region_where_gpu_memory_cannot_be_hashed_refuses_the_option_naming_it() -> None:
    # GPU memory is hashed in place with torch (wmix64, tests/test_wmix.py); a process whose torch
    # sees no CUDA device (this CPU machine) refuses the option at once, naming the region.
    torch = pytest.importorskip("torch", reason="torch (scripts/setup.sh) is what hashes GPU memory")
    if torch.cuda.is_available():
        pytest.skip("this process can hash GPU memory (a CUDA device is visible): nothing to refuse")
    sc = Scenario(backend="memory", decode_pages=4, page_nbytes=64)
    pools = Pools(sc, 4, meta_rows=1)
    vram = msgspec.structs.replace(pools.kvargs.regions[0], mem="vram")
    kvargs = msgspec.structs.replace(pools.kvargs, regions=(vram, *pools.kvargs.regions[1:]))
    with pytest.raises(ValueError, match=r"checksum=True: .*region 'k0' is in GPU memory \(vram.*CUDA device"):
        DecodeManager(kvargs, "memory", config=config(True))


class TestChecksumOnARealEngine(BackendHarness):
    """Prefill and decode processes with the checksum on: every room succeeds and every byte checks."""

    backend = "nixl"

    def test_rooms_succeed_byte_exact_with_the_checksum_on(self, children: Callable[..., Child]) -> None:
        sc = self.scenario(requests=12, checksum=True, layers=2, page_nbytes=4096, max_pages=64, concurrency=4)
        prefill = children("prefill", sc)
        decode = children("decode", sc, bootstrap=prefill.bootstrap)
        rc, result = decode.finish()
        assert rc == 0 and result is not None, decode.stderr()[-3000:]
        assert result["requests"] == sc.requests and result["failed"] == [] and result["mismatched_regions"] == 0
        assert prefill.finish()[0] == 0
