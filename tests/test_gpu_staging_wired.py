"""GPU staging in the write path, on a CUDA machine: scattered GPU pages through NIXL, staged on both sides.

Prefill (this process) and decode (a child process) move pages VRAM -> VRAM through NIXL with the
same-host fast path off and ``SessionConfig.staging="on"``: each window of pages is gathered into a
GPU staging slice by one kernel launch (:mod:`kvbridge.staging_torch`), written as one descriptor
into a slot decode lent on its GPU and scattered there before the room's ``Done``. The decode child
of ``kvbridge bench transfer --device cuda`` checks every destination byte against the source
pattern with torch indexing, after each path's rooms (destination zeroed before them). The CPU
side of the same wiring runs everywhere in ``tests/test_staging_gpu_wiring.py``. Skips, naming
why, without CUDA, Triton or NIXL (``scripts/gpu_check.sh``, step ``gpustage``, runs it; step ``gpuwin`` runs
the ``sweep`` test: ``--slice-mib`` and ``--trace``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import msgspec
import numpy as np
import pytest

from kvbridge.core.transfer.staging import DEVICE_SLICE_BYTES
from kvbridge.testing import available_backends


def _problem() -> str | None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return "needs torch and Triton with a CUDA device (scripts/gpu_check.sh, step gpustage, runs it)"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA device visible to torch; this machine has none"
    if "nixl" not in available_backends():
        return "needs the nixl backend (pip extra kvbridge[nixl]) to move GPU memory between processes"
    return None


PROBLEM = _problem()
needs_gpu = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")


@needs_gpu
@pytest.mark.parametrize("odd", [False, True], ids=["pages-of-one-pool-torch", "odd-offsets-triton"])
def test_the_device_seam_gathers_and_scatters_scattered_pieces_byte_exact(monkeypatch, odd: bool) -> None:
    """Units a whole number of units apart go through torch's indexed copy; others through the Triton kernel."""
    import torch

    from kvbridge import staging_torch

    launches: list[str] = []
    for name in ("gather", "scatter"):
        kernel = getattr(staging_torch.kernels, name)
        monkeypatch.setattr(staging_torch.kernels, name,
                            lambda *a, _k=kernel, _n=name: (launches.append(_n), _k(*a))[1])
    rng = np.random.default_rng(9)
    memory = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, device="cuda")
    nbytes = np.array([4096, 64 << 10, 4096, 8192] * 8, np.int64)
    addr = memory.data_ptr() + rng.permutation((16 << 20) // (64 << 10) - 1)[: len(nbytes)].astype(np.int64) * (64 << 10)
    if odd:
        addr[::2] += 256  # a unit of 4 KiB, half the pieces 256 B off: no one row view holds them
    slice_addr, keep = staging_torch.alloc(int(nbytes.sum()), 0)
    staging_torch.gather(addr, nbytes, slice_addr, 0)  # complete on return: no synchronise here
    host = memory.cpu().numpy()
    offs = (addr - memory.data_ptr()).tolist()
    want = np.concatenate([host[a:a + n] for a, n in zip(offs, nbytes.tolist())])
    np.testing.assert_array_equal(keep.cpu().numpy(), want)
    back = torch.zeros_like(memory)
    staging_torch.scatter(slice_addr, addr - memory.data_ptr() + back.data_ptr(), nbytes, 0)
    got = back.cpu().numpy()
    touched = np.zeros(got.size, bool)
    for a, n in zip(offs, nbytes.tolist()):  # the oracle: plain slicing
        touched[a:a + n] = True
    np.testing.assert_array_equal(got, np.where(touched, host, 0))
    assert launches == (["gather", "scatter"] if odd else [])


@needs_gpu
@pytest.mark.parametrize("apart", [16 << 20, (16 << 20) + 256], ids=["one-view", "a-view-a-region"])
def test_the_device_seam_gathers_and_scatters_unit_runs_of_two_regions_byte_exact(apart: int) -> None:
    """Pages of two regions (K and V of a layer) said as unit offsets, as ``Staged`` says them: one indexed copy over
    a view from the lower region where both lie whole units apart, one a region otherwise."""
    import torch

    from kvbridge import staging_torch
    from kvbridge.core.description.layout import Region
    from kvbridge.core.planning.regions import RegionTable
    from kvbridge.core.planning.stage_index import region_pieces, unit_runs

    memory = torch.randint(0, 256, (apart + (16 << 20),), dtype=torch.uint8, device="cuda")
    regions = [Region(name=name, addr=memory.data_ptr() + at, nbytes=16 << 20, stride=4096, role=name,
                      index_space="kv_page", mem="vram") for name, at in (("k", 0), ("v", apart))]
    pages = np.random.default_rng(4).permutation(4096)[:96].astype(np.int64)
    addr = np.concatenate([regions[0].addr + pages[:48] * 4096, regions[1].addr + pages[48:] * 4096])
    nbytes = np.full(96, 4096, np.int64)
    pieces = region_pieces(addr, nbytes, RegionTable(regions))
    assert pieces is not None and [p.region for p in pieces] == [0, 1]
    slice_addr, keep = staging_torch.alloc(96 * 4096, 0)
    staging_torch.gather_units(unit_runs(pieces, regions), slice_addr, 0)  # complete on return
    host = memory.cpu().numpy()
    offs = (addr - memory.data_ptr()).tolist()
    want = np.concatenate([host[a:a + 4096] for a in offs])
    np.testing.assert_array_equal(keep.cpu().numpy(), want)
    back = torch.zeros_like(memory)
    moved = [msgspec.structs.replace(r, addr=r.addr - memory.data_ptr() + back.data_ptr()) for r in regions]
    staging_torch.scatter_units(slice_addr, unit_runs(pieces, moved), 0)
    touched = np.zeros(host.size, bool)
    for a in offs:  # the oracle: plain slicing
        touched[a:a + 4096] = True
    np.testing.assert_array_equal(back.cpu().numpy(), np.where(touched, host, 0))


@needs_gpu
def test_scattered_4k_and_64k_gpu_pages_through_nixl_staged_on_both_sides_land_byte_exact(monkeypatch) -> None:
    from kvbridge.bench import gpu

    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}.items():  # as the bench sets them
        monkeypatch.setenv(key, os.environ.get(key, value))

    args = argparse.Namespace(page_kib=[4, 64], total_mib=[64], reps=2, decode_gpu=0, transfer_backend="nixl",
                              staging=["on"], slice_mib=None)
    rows = gpu.run(args)
    assert len(rows) == 4  # 4 KiB and 64 KiB pages, scattered and contiguous
    for r in rows:
        case = f"{r['page_bytes'] >> 10} KiB {r['pattern']}"
        assert r["verified_by_path"] == {"fast": True, "plain": True, "plain_on": True}, case
        if r["pattern"] == "scattered":  # 64 MiB in windows of a GPU staging slice, one descriptor each
            assert r["plain_on_windows"] == (64 << 20) // DEVICE_SLICE_BYTES, case


@needs_gpu
def test_sweep_every_slice_size_lands_byte_exact_in_windows_of_that_size_and_is_traced(monkeypatch, tmp_path):
    from kvbridge.bench import gpu

    for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}.items():  # as the bench sets them
        monkeypatch.setenv(key, os.environ.get(key, value))
    args = argparse.Namespace(page_kib=[64], total_mib=[256], reps=1, decode_gpu=0, transfer_backend="nixl",
                              staging=["on"], slice_mib=[32, 128])
    rows = gpu.run(args, str(tmp_path / "decode.json"))
    assert len(rows) == 2  # scattered and contiguous
    for r in rows:
        case = r["pattern"]
        assert r["verified_by_path"] == {"fast": True, "plain": True, "plain_on_32M": True, "plain_on_128M": True}, case
        for mib in (32, 128):
            path = f"plain_on_{mib}M"
            traced = r[f"{path}_trace"]
            if case == "contiguous":  # one descriptor: nothing to stage
                assert r[f"{path}_windows"] == traced["windows"] == 0, path
                continue
            assert r[f"{path}_windows"] == 256 // mib, path  # one window a slice of that size
            assert traced["staged"] == 256 // mib and traced["windows"] == traced["staged"], path
            steps = {s["step"] for s in traced["steps"]}
            assert {"slot taken", "gather <", "Staged sent", "received Staged", "scatter <", "slot freed >"} <= steps
