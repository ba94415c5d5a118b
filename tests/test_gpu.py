"""GPU memory: the fast path's work split (on CPU, always), and VRAM end to end (on a CUDA machine).

The kernel of :mod:`kvbridge.core.gpu` copies ``TILE``-element pieces of
descriptors; :func:`~kvbridge.core.gpu.execute_on_host` runs the same split
with ``memmove`` on host memory, checked here against plain numpy slicing.
The GPU tests run prefill and decode as separate processes with CUDA
tensors (kvbridge.testing.hybrid, ``device="cuda"``) and skip, naming the
missing device, elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvbridge.core import gpu
from kvbridge.core.layout import Region
from kvbridge.core.transport import Transport
from kvbridge.testing.harness import BackendHarness, Child, all_succeeded
from kvbridge.testing.requirements import requires


# -- the work split, on CPU -------------------------------------------------------------------------
def descriptors(rng: np.random.Generator, src: np.ndarray, dst: np.ndarray, count: int, unit: int, longest: int):
    """``count`` non-overlapping destination ranges (multiples of ``unit``) and their sources."""
    sizes = rng.integers(1, longest // unit + 1, count) * unit
    dst_off = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    order = rng.permutation(count)  # scattered on both sides
    src_off = rng.integers(0, (src.nbytes - longest) // unit, count) * unit
    return src_off, dst_off[order], sizes[order]


@pytest.mark.parametrize("unit, longest", [(8, 64 << 10), (2, 256), (1, 33), (4, 20000), (8, 8)])
def test_the_kernels_work_split_copies_every_byte_once_to_its_place(unit, longest):
    rng = np.random.default_rng(unit * longest)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    count = 300
    src_off, dst_off, sizes = descriptors(rng, src, np.empty(0), count, unit, longest)
    dst = np.zeros(int(sizes.sum()) + 64, np.uint8)
    gpu.execute_on_host(src.ctypes.data + src_off, dst.ctypes.data + dst_off, sizes)
    want = np.zeros_like(dst)
    for s, d, n in zip(src_off, dst_off, sizes):
        want[d:d + n] = src[s:s + n]
    np.testing.assert_array_equal(dst, want)


def test_element_width_is_the_widest_that_divides_every_address_and_size():
    a = np.array([0x1000, 0x2000], np.int64)
    assert gpu.element_width(a, a + 64, np.array([64, 128])) == 8
    assert gpu.element_width(a, a + 4, np.array([64, 128])) == 4
    assert gpu.element_width(a, a, np.array([6, 128])) == 2
    assert gpu.element_width(a + 1, a, np.array([64, 128])) == 1


def test_pieces_of_a_descriptor_are_consecutive_and_cover_it():
    desc, off = gpu.work_items(np.array([5, 1, 12]), 4)
    assert desc.tolist() == [0, 0, 1, 2, 2, 2] and off.tolist() == [0, 4, 0, 0, 4, 8]
    assert gpu.tiling(np.array([3])) == (4, gpu.TILE // 4)
    assert gpu.tiling(np.array([10**6])) == (gpu.TILE, 1)


def test_without_cuda_the_fast_path_stays_off_and_core_still_imports():
    if gpu.available():
        pytest.skip("this machine has CUDA")
    region = Region(name="k", addr=0x10000, nbytes=4096, stride=64, role="k", index_space="kv_page", mem="vram")
    assert gpu.local_metadata([region]) == b""
    assert gpu.open_peer(b"anything") is None


def test_the_fast_path_is_refused_when_switched_off():
    from kvbridge.testing.memory import MemoryBackend

    t = Transport(MemoryBackend.__new__(MemoryBackend), "memory", fast_path=False)
    assert t.local_metadata() == b""


# -- VRAM end to end, on a CUDA machine -----------------------------------------------------------------
class TestGpuEndToEnd(BackendHarness):
    backend = "nixl"

    @requires("vram", "cuda_device")
    @pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "plain-nixl"])
    @pytest.mark.parametrize("prefill_tp, decode_tp, layout", [(1, 1, "hnd"), (2, 1, "nhd"), (1, 2, "nhd")])
    def test_every_state_handler_arrives_byte_exact_in_gpu_memory(
        self, children: Callable[..., Child], fast: bool, prefill_tp: int, decode_tp: int, layout: str
    ) -> None:
        # Device buffers on both sides, except decode's DeepSeek-V4 host rows (GPU -> host through
        # the backend in the same requests), checked against numpy slices of the global tensors.
        spec = self.hybrid_spec(prefill_tp=prefill_tp, decode_tp=decode_tp, layout=layout, draft=True,
                                device="cuda", gpu_fast_path=fast, pages=256, max_request_pages=64, head_dim=64)
        all_succeeded(*self.run_hybrid(children, spec)[:2])

    @requires("vram", "cuda_device")
    @pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "plain-nixl"])
    def test_layerwise_chunks_arrive_byte_exact_in_gpu_memory(self, children: Callable[..., Child], fast: bool) -> None:
        # Each chunk sent with layerwise=True: the fast path's kernel copies one layer slice per write.
        spec = self.hybrid_spec(prefill_tp=2, decode_tp=1, layout="nhd", draft=True, device="cuda", gpu_fast_path=fast,
                                pages=256, max_request_pages=64, head_dim=64, layerwise=True)
        all_succeeded(*self.run_hybrid(children, spec)[:2])
