"""``wmix64``, the checksum's hash of host and GPU memory (``kvbridge.core.sessions.wmix``).

Checked against an oracle written from the definition in plain Python integers over the
concatenated bytes (no blocks, no regions, no numpy mixing); numpy's path and torch's path (torch
CPU tensors run the same ops as CUDA) give the same digest bit for bit, however the stream is cut
into ranges, blocks or chunks and whichever side hashes it; swapped pages, shifted ranges and every
single flipped bit change it. The CUDA case runs where a GPU is (skipped here, saying why).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvbridge.core.description.layout import Region
from kvbridge.core.planning.regions import RegionTable
from kvbridge.core.planning.transferplan import TransferPlan
from kvbridge.core.sessions import checksum as C
from kvbridge.core.sessions import wmix

torch = pytest.importorskip("torch", reason="torch (installed by scripts/setup.sh) runs wmix64's device ops")
from kvbridge import checksum_torch  # noqa: E402  (needs torch)

M = (1 << 64) - 1


def oracle(chunks: list[bytes]) -> int:
    """The definition, term by term, over the stream's bytes (independent of blocks and numpy)."""
    stream = b"".join(chunks)
    total = len(stream)
    stream += bytes(-len(stream) % 8)
    acc = 0
    for i in range(len(stream) // 8):
        x = int.from_bytes(stream[8 * i: 8 * i + 8], "little") ^ ((wmix.K0 + i * wmix.K_POS) & M)
        x = (x * wmix.C1) & M
        x ^= x >> 31
        x = (x * wmix.C2) & M
        x ^= x >> 29
        acc = (acc + x) & M
    x = (acc ^ (total * wmix.K_LEN)) & M
    x = ((x ^ (x >> 33)) * wmix.C1) & M
    x = ((x ^ (x >> 29)) * wmix.C2) & M
    return x ^ (x >> 32)


def region(buf: np.ndarray, name: str, mem: str = "dram") -> Region:
    return Region(name=name, addr=buf.ctypes.data, nbytes=buf.nbytes, stride=buf.nbytes, role="k", index_space="pages",
                  mem=mem)  # type: ignore[arg-type]


def pools(n: int, pages: int, page: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, pages * page, dtype=np.uint8) for _ in range(n)]


def scattered(bufs: list[np.ndarray], page: int, picks: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ranges of one page each: (buffer, page) in this order."""
    addr = np.array([bufs[b].ctypes.data + p * page for b, p in picks], np.int64)
    return addr, np.full(len(picks), page, np.int64)


def numpy_side(vram: bool) -> wmix.BlockSum:
    return wmix.sum_blocks


def torch_side(vram: bool) -> wmix.BlockSum:
    return checksum_torch.block_sum()


PAGE = 256


@pytest.fixture
def room() -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    bufs = pools(3, 16, PAGE, seed=1)
    rng = np.random.default_rng(2)
    picks = [(int(b), int(p)) for b, p in zip(rng.integers(0, 3, 20), rng.permutation(16 * 3)[:20] % 16)]
    picks = list(dict.fromkeys(picks))  # distinct pages, scattered over three regions, in no address order
    return bufs, picks


def test_numpy_and_torch_agree_with_the_oracle_bit_for_bit(room) -> None:
    bufs, picks = room
    addr, n = scattered(bufs, PAGE, picks)
    table = RegionTable([region(b, f"r{i}") for i, b in enumerate(bufs)])
    expect = oracle([bufs[b][p * PAGE:(p + 1) * PAGE].tobytes() for b, p in picks])
    assert wmix.digest(addr, n, table, numpy_side) == expect
    assert wmix.digest(addr, n, table, torch_side) == expect


@pytest.mark.parametrize("chunk", [1, 3, 32, 512], ids=lambda c: f"chunk{c}")
def test_the_digest_does_not_depend_on_chunks_blocks_or_cuts(room, monkeypatch, chunk: int) -> None:
    bufs, picks = room
    table = RegionTable([region(b, f"r{i}") for i, b in enumerate(bufs)])
    addr, n = scattered(bufs, PAGE, picks)
    whole = wmix.digest(addr, n, table, numpy_side)
    monkeypatch.setattr(wmix, "CHUNK_BLOCKS", chunk)
    monkeypatch.setattr(checksum_torch, "GATHER_BYTES", chunk * 8)
    assert wmix.digest(addr, n, table, numpy_side) == whole
    assert wmix.digest(addr, n, table, torch_side) == whole
    # The same stream cut into 8-, 32- and 64-byte ranges: smaller blocks, same digest.
    for piece in (8, 32, 64):
        cut_addr = (addr[:, None] + np.arange(0, PAGE, piece)[None, :]).ravel()
        assert wmix.digest(cut_addr, np.full(len(cut_addr), piece, np.int64), table, torch_side) == whole


def test_prefill_on_host_and_decode_on_the_other_path_agree_across_layouts() -> None:
    # Prefill's pages scattered in its pools; decode's copy at other pages of other pools: the
    # same stream (destination order) hashed by numpy on one side and torch on the other.
    src = pools(2, 32, 4096, seed=3)
    dst = [np.zeros(64 * 4096, np.uint8)]
    rng = np.random.default_rng(4)
    s_picks = [(int(i % 2), int(p)) for i, p in enumerate(rng.permutation(32)[:24])]
    d_pages = rng.permutation(64)[:24]
    for (b, p), d in zip(s_picks, d_pages):
        dst[0][d * 4096:(d + 1) * 4096] = src[b][p * 4096:(p + 1) * 4096]
    order = np.argsort(d_pages)  # destination order, as summarise sorts
    s_addr, n = scattered(src, 4096, [s_picks[i] for i in order])
    d_addr, _ = scattered(dst, 4096, [(0, int(d_pages[i])) for i in order])
    s_table = RegionTable([region(b, f"s{i}") for i, b in enumerate(src)])
    d_table = RegionTable([region(dst[0], "d0")])
    assert wmix.digest(s_addr, n, s_table, numpy_side) == wmix.digest(d_addr, n, d_table, torch_side)
    assert wmix.digest(s_addr, n, s_table, torch_side) == wmix.digest(d_addr, n, d_table, numpy_side)


def test_swapped_pages_and_shifted_ranges_change_the_digest(room) -> None:
    bufs, picks = room
    table = RegionTable([region(b, f"r{i}") for i, b in enumerate(bufs)])
    addr, n = scattered(bufs, PAGE, picks)
    base = wmix.digest(addr, n, table, numpy_side)
    swapped = addr.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert wmix.digest(swapped, n, table, numpy_side) != base
    assert wmix.digest(swapped, n, table, torch_side) != base
    # The same bytes, but page 0 moved to the end of the stream.
    assert wmix.digest(np.roll(addr, -1), n, table, torch_side) != base
    # A range shifted by 8 bytes (and by 1) inside its page's region.
    for delta in (8, 1):
        shifted = addr.copy()
        shifted[3] += delta if picks[3][1] < 15 else -delta
        assert wmix.digest(shifted, n, table, numpy_side) != base
    # Dropping the last 8 bytes changes the total (and the stream).
    short = n.copy()
    short[-1] -= 8
    assert wmix.digest(addr, short, table, torch_side) != base


def test_every_single_flipped_bit_changes_the_digest(room) -> None:
    bufs, picks = room
    table = RegionTable([region(b, f"r{i}") for i, b in enumerate(bufs)])
    addr, n = scattered(bufs, PAGE, picks)
    base = wmix.digest(addr, n, table, numpy_side)
    b, p = picks[5]
    seen = set()
    for byte in (0, 7, 8, 133, PAGE - 1):  # first, last of a word, a middle one, the page's last
        for bit in range(8):
            at = p * PAGE + byte
            bufs[b][at] ^= 1 << bit
            got = wmix.digest(addr, n, table, torch_side if bit % 2 else numpy_side)
            bufs[b][at] ^= 1 << bit
            assert got != base, (byte, bit)
            seen.add(got)
    assert len(seen) == 40  # and no two flips collide with each other
    assert wmix.digest(addr, n, table, numpy_side) == base  # restored


def test_ranges_not_multiples_of_8_hash_on_host_as_the_definition_says() -> None:
    a = np.frombuffer(bytes(range(256)) * 4, np.uint8).copy()
    table = RegionTable([region(a, "a")])
    addr = np.array([a.ctypes.data + 500, a.ctypes.data + 100, a.ctypes.data + 3], np.int64)
    n = np.array([64, 10, 21], np.int64)
    expect = oracle([a[500:564].tobytes(), a[100:110].tobytes(), a[3:24].tobytes()])
    assert wmix.digest(addr, n, table) == expect
    with pytest.raises(wmix.ChecksumError, match="multiples of 8 bytes"):
        wmix.digest(addr, n, RegionTable([region(a, "a", mem="vram")]))


def test_summarise_and_verify_name_wmix64_and_catch_a_flip() -> None:
    src = pools(1, 8, 512, seed=5)[0]
    dst = np.zeros_like(src)
    s_pages, d_pages = np.array([5, 1, 7]), np.array([0, 6, 3])
    for s, d in zip(s_pages, d_pages):
        dst[d * 512:(d + 1) * 512] = src[s * 512:(s + 1) * 512]
    plan = TransferPlan(src.ctypes.data + s_pages * 512, dst.ctypes.data + d_pages * 512, np.full(3, 512, np.int64))
    summary = C.summarise([plan], C.choose([region(src, "s")], [region(dst, "d", mem="vram")]), 1 << 20,
                          [region(src, "s")])
    assert summary.algorithm == "wmix64"
    assert summary.digest == oracle([src[s * 512:(s + 1) * 512].tobytes() for s in s_pages[np.argsort(d_pages)]])
    assert C.verify(summary, [region(dst, "d")]) is None
    dst[3 * 512 + 77] ^= 0x10
    why = C.verify(summary, [region(dst, "d")])
    assert why is not None and "checksum mismatch (wmix64)" in why
    # Host memory on both sides keeps the faster streaming hash.
    assert C.choose([region(src, "s")], [region(dst, "d")]) == C.default_algorithm() != "wmix64"


@pytest.mark.parametrize("algorithm", ["wmix64", "crc32"])
def test_a_room_over_adjacent_regions_is_hashed_though_its_merged_ranges_cross_them(algorithm: str) -> None:
    # One allocation described as a region per layer: a room's last page of layer 0 and first of
    # layer 1 are one merged range on each side, running from one region into the next.
    src, dst = pools(1, 8, 512, seed=11)[0], np.zeros(8 * 512, np.uint8)
    halves = lambda buf, tag: [Region(name=f"{tag}{i}", addr=buf.ctypes.data + i * 2048, nbytes=2048, stride=512,
                                      role="k", index_space="pages", layer=i) for i in range(2)]
    pages = np.array([2, 3, 4, 5])  # 3 | 4 is the boundary between the two regions
    dst[2 * 512:6 * 512] = src[2 * 512:6 * 512]
    plan = TransferPlan(src.ctypes.data + pages * 512, dst.ctypes.data + pages * 512, np.full(4, 512, np.int64))
    summary = C.summarise([plan], algorithm, 1 << 20, halves(src, "s"))
    assert np.frombuffer(summary.ranges, "<i8").tolist() == [dst.ctypes.data + 1024, 2048]  # one range, two regions
    assert C.verify(summary, halves(dst, "d")) is None
    dst[4 * 512 + 3] ^= 1  # in the second region
    assert "checksum mismatch" in (C.verify(summary, halves(dst, "d")) or "")
    # A range that leaves every region is still refused, naming it.
    why = C.verify(summary, halves(dst, "d")[:1])
    assert why is not None and "not inside one registered region" in why


def test_a_failure_while_hashing_is_a_checksum_error_naming_it(room) -> None:
    # The hashing thread is prefill's worker or decode's I/O thread: an error there (the GPU out
    # of memory, say) must fail the room, not escape as another exception.
    bufs, picks = room
    addr, n = scattered(bufs, PAGE, picks)

    def broken(*args: object) -> int:
        raise RuntimeError("CUDA out of memory (simulated)")

    with pytest.raises(wmix.ChecksumError, match=r"in host memory failed: RuntimeError: CUDA out of memory"):
        wmix.digest(addr, n, RegionTable([region(b, f"r{i}") for i, b in enumerate(bufs)]), lambda vram: broken)


def test_a_gpu_region_without_cuda_here_names_what_is_missing() -> None:
    buf = np.zeros(64, np.uint8)
    why = C.device_problem([region(buf, "k0", mem="vram")], "decode")
    if torch.cuda.is_available():
        assert why is None
    else:
        assert why is not None and "region 'k0' is in GPU memory" in why and "CUDA device visible to torch" in why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (hashes GPU memory in place)")
def test_cuda_digest_equals_numpy_over_the_same_bytes() -> None:
    host = pools(2, 64, 4096, seed=6)
    gpu = [torch.from_numpy(h).cuda() for h in host]
    rng = np.random.default_rng(7)
    picks = [(int(i % 2), int(p)) for i, p in enumerate(rng.permutation(64)[:40])]
    h_addr, n = scattered(host, 4096, picks)
    g_addr = np.array([gpu[b].data_ptr() + p * 4096 for b, p in picks], np.int64)
    g_regions = [Region(name=f"g{i}", addr=g.data_ptr(), nbytes=g.numel(), stride=g.numel(), role="k",
                        index_space="pages", mem="vram", device=g.device.index) for i, g in enumerate(gpu)]
    h_table = RegionTable([region(b, f"h{i}") for i, b in enumerate(host)])
    assert wmix.digest(g_addr, n, RegionTable(g_regions)) == wmix.digest(h_addr, n, h_table)
    b, p = picks[1]
    gpu[b][4096 * p + 9] ^= 4
    assert wmix.digest(g_addr, n, RegionTable(g_regions)) != wmix.digest(h_addr, n, h_table)


def test_gpu_regions_are_hashed_once_per_device_with_the_same_digest(monkeypatch) -> None:
    # Host buffers described as GPU memory on two devices, beside a host region: core's GPU path (every
    # device's blocks in one call, here the torch ops over host addresses) gives numpy's digest.
    bufs = pools(3, 16, 4096, seed=13)
    kinds = [("vram", 0), ("dram", 0), ("vram", 1)]
    table = RegionTable([Region(name=f"r{i}", addr=b.ctypes.data, nbytes=b.nbytes, stride=4096, role="k",
                                index_space="p", mem=mem, device=d)  # type: ignore[arg-type]
                         for i, (b, (mem, d)) in enumerate(zip(bufs, kinds))])
    host = RegionTable([region(b, f"h{i}") for i, b in enumerate(bufs)])
    calls: list[tuple[int, int]] = []
    on_host = checksum_torch.device_sum_on_host(kernel=False)

    def spy(device: int, block: int, blocks: wmix.DeviceBlocks) -> int:
        calls.append((device, len(blocks.rows)))
        return on_host(device, block, blocks)

    monkeypatch.setattr(wmix, "device_sum", lambda devices=(): spy)
    monkeypatch.setattr(wmix, "CHUNK_BLOCKS", 8)  # several chunks: the GPU blocks still go in one call a device
    picks = [(int(i % 3), int(p)) for i, p in enumerate(np.random.default_rng(3).permutation(48)[:30] % 16)]
    picks = list(dict.fromkeys(picks))
    addr, n = scattered(bufs, 4096, picks)
    assert wmix.digest(addr, n, table) == wmix.digest(addr, n, host)
    assert sorted(calls) == [(0, sum(b == 0 for b, _ in picks)), (1, sum(b == 2 for b, _ in picks))]


INTERPRETED = """
import json, numpy as np, torch
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.regions import RegionTable
from kvbridge.core.sessions import wmix
from kvbridge import checksum_torch, checksum_triton
rng = np.random.default_rng(9)
bufs = [rng.integers(0, 256, 64 * 4096, dtype=np.uint8) for _ in range(2)]
table = RegionTable([Region(name=f"r{i}", addr=b.ctypes.data, nbytes=b.nbytes, stride=4096, role="k",
                            index_space="p") for i, b in enumerate(bufs)])
out = {"probe": checksum_triton.probe(torch.device("cpu"))}
# The same buffers described as GPU memory (two devices), hashed by core's GPU path with the kernel.
gpu = RegionTable([Region(name=f"g{i}", addr=b.ctypes.data, nbytes=b.nbytes, stride=4096, role="k",
                          index_space="p", mem="vram", device=i) for i, b in enumerate(bufs)])
wmix.device_sum = lambda devices=(): checksum_torch.device_sum_on_host(kernel=True)
for page in (4096, 512, 64):  # 512 and 4096 words a block: the kernel; 8 words: below MIN_WORDS, the torch ops
    picks = [(int(i % 2), int(p)) for i, p in enumerate(rng.permutation(64 * 4096 // page)[:24])]
    addr = np.array([bufs[b].ctypes.data + p * page for b, p in picks], np.int64)
    n = np.full(len(picks), page, np.int64)
    fused = wmix.digest(addr, n, gpu)
    plain = wmix.digest(addr, n, table)
    b, p = picks[7]
    bufs[b][p * page + 101 % page] ^= 0x20
    flipped = wmix.digest(addr, n, gpu)
    bufs[b][p * page + 101 % page] ^= 0x20
    out[page] = [fused == plain, flipped != plain]
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed here (scripts/setup.sh installs CPU torch only); "
                           "scripts/gpu_check.sh's checksum step runs the kernel compiled, on the GPU")
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a CUDA device is here: the compiled kernel is checked instead (the next test); "
                           "Triton 3.6's interpreter cannot run the kernel's loop over a runtime bound (3.9's can)")
def test_the_triton_kernel_interpreted_gives_numpys_digest_and_sees_a_flip() -> None:
    # TRITON_INTERPRET must be set before Triton is imported: a child process.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"probe": True, "4096": [True, True], "512": [True, True], "64": [True, True]}


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA device and Triton (the fused kernel compiled for it)")
def test_cuda_uses_the_triton_kernel_once_its_probe_matched() -> None:
    assert checksum_torch.path(torch.cuda.current_device(), wait=300) == "triton"


def test_the_torch_module_stays_out_of_core() -> None:
    # Core names it by string only; importing core does not import torch's half.
    code = "import sys, kvbridge.core.sessions.checksum; print('kvbridge.checksum_torch' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]

