"""GPU staging kernels (kvbridge.plugins.cuda_ipc.staging): one launch gathers a window into a slice or scatters it back.

The unit table is checked on the CPU against an oracle that slices the pieces
with plain numpy (the table's address arithmetic applied to host buffers);
the kernels themselves run where a CUDA device is (``scripts/gpu_check.sh``,
step ``staging``) and skip elsewhere, naming why.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kvbridge.plugins.cuda_ipc.staging import MAX_UNIT, apply_on_host, gather, scatter, unit_table

SIZES = [4096, 256, 64 << 10, 128, 4096 * 3]


def _window(rng: np.random.Generator, base: int, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of several sizes at scattered, non-overlapping 128-byte-aligned offsets of ``span`` bytes."""
    nbytes = np.array(SIZES * 4, np.int64)
    slots = rng.permutation(span // (64 << 10))[: len(nbytes)] * (64 << 10)
    addr = base + slots.astype(np.int64)
    packed = np.cumsum(nbytes) - nbytes
    return addr, packed, nbytes


def test_the_unit_table_gathers_and_scatters_every_piece_byte_exact_on_the_host() -> None:
    rng = np.random.default_rng(5)
    memory = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    addr, packed, nbytes = _window(rng, 1 << 40, memory.nbytes)
    table = unit_table(addr, packed, nbytes)
    assert table.unit == 128 and table.width == 16 and len(table.far) == nbytes.sum() // 128
    got = np.zeros(int(nbytes.sum()), np.uint8)
    apply_on_host(table, memory, got, 1 << 40, to_slice=True)
    want = np.concatenate([memory[a - (1 << 40):a - (1 << 40) + n] for a, n in zip(addr.tolist(), nbytes.tolist())])
    np.testing.assert_array_equal(got, want)
    back = np.zeros_like(memory)
    apply_on_host(table, back, got, 1 << 40, to_slice=False)
    touched = np.zeros(memory.size, bool)
    for a, n in zip(addr.tolist(), nbytes.tolist()):
        touched[a - (1 << 40):a - (1 << 40) + n] = True
    np.testing.assert_array_equal(back, np.where(touched, memory, 0))


def test_units_never_exceed_max_unit_and_odd_addresses_narrow_the_element() -> None:
    table = unit_table(np.array([3, 1 << 20], np.int64), np.array([0, 1 << 20], np.int64),
                       np.array([1 << 20, 1 << 20], np.int64))
    assert table.unit == MAX_UNIT and table.width == 1 and len(table.far) == 2 * (1 << 20) // MAX_UNIT


def test_a_bad_window_is_refused_naming_the_counts() -> None:
    with pytest.raises(ValueError, match=r"as many addresses \(2\), offsets \(1\) and sizes \(2\)"):
        unit_table(np.zeros(2, np.int64), np.zeros(1, np.int64), np.ones(2, np.int64))


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device with torch and Triton (scripts/gpu_check.sh runs it)")
def test_one_launch_gathers_and_one_scatters_a_window_of_gpu_pieces_byte_exact() -> None:
    import torch

    rng = np.random.default_rng(6)
    memory = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device="cuda")
    addr, packed, nbytes = _window(rng, memory.data_ptr(), memory.numel())
    table = unit_table(addr, packed, nbytes)
    out = torch.zeros(int(nbytes.sum()), dtype=torch.uint8, device="cuda")
    gather(table, out.data_ptr())
    torch.cuda.synchronize()
    host = memory.cpu().numpy()
    offs = (addr - memory.data_ptr()).tolist()
    want = np.concatenate([host[a:a + n] for a, n in zip(offs, nbytes.tolist())])
    np.testing.assert_array_equal(out.cpu().numpy(), want)
    back = torch.zeros_like(memory)
    table_back = unit_table(addr - memory.data_ptr() + back.data_ptr(), packed, nbytes)
    scatter(table_back, out.data_ptr())
    torch.cuda.synchronize()
    got = back.cpu().numpy()
    for a, n in zip(offs, nbytes.tolist()):
        np.testing.assert_array_equal(got[a:a + n], host[a:a + n])


def test_pages_of_one_size_are_their_own_units_and_copy_byte_exact_on_the_host() -> None:
    rng = np.random.default_rng(7)
    memory = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    base = 1 << 40
    addr = base + rng.permutation(memory.nbytes // 4096)[:64].astype(np.int64) * 4096
    nbytes = np.full(64, 4096, np.int64)
    packed = np.cumsum(nbytes) - nbytes
    table = unit_table(addr, packed, nbytes)
    assert table.unit == 4096 and table.width == 16
    np.testing.assert_array_equal(table.far, addr)
    np.testing.assert_array_equal(table.near, packed)
    got = np.zeros(int(nbytes.sum()), np.uint8)
    apply_on_host(table, memory, got, base, to_slice=True)
    want = np.concatenate([memory[a - base:a - base + 4096] for a in addr.tolist()])
    np.testing.assert_array_equal(got, want)
    odd = unit_table(addr + 8, packed, nbytes)  # 8-byte aligned addresses narrow the element, not the unit
    assert odd.unit == 4096 and odd.width == 8
