"""The NIXL adapter on its own, with real agents in two processes on 127.0.0.1.

The destination runs in a spawned process: it registers buffers filled with a
sentinel, sends its metadata and regions through a Pipe, and on request sends
its buffers back. The expected destination is computed with plain numpy
slicing of the source, independently of the planner. Byte-exact writes are checked
through both request paths (``xfer_mode`` ``descs`` and ``prepped``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

pytest.importorskip("nixl_cu12")

from kvbridge.plugins.tcpfence import seal
from kvbridge.core.transfer.backend import BackendConfig, TransferError, TransferTimeout  # noqa: E402
from kvbridge.core.description.layout import Region  # noqa: E402
from kvbridge.core.description.plugins import get_registry  # noqa: E402
from kvbridge.core.description.records import OptionError  # noqa: E402
from kvbridge.core.transfer.pipeline import FENCE_BATCHES_IN_FLIGHT  # noqa: E402
from kvbridge.core.transfer.transport import FENCE_BATCH_BYTES, Transport  # noqa: E402
from kvbridge.testing import pair  # noqa: E402
from kvbridge.testing.pair import SENTINEL, Destination, pattern, pattern_buffers, region, standard_layout  # noqa: E402
from kvbridge.core.planning.plan import TransferPlan, plan_pages  # noqa: E402
from kvbridge.plugins.nixl import CAPABILITIES  # noqa: E402
from kvbridge.plugins.nixl.backend import NixlBackend  # noqa: E402
from kvbridge.plugins.nixl.engine import nixl_errors  # noqa: E402


SRC_PAGES, DST_PAGES = 64, 48
ROW_BYTES, ROWS = 16, 120_000  # a region of small rows, for plans of tens of thousands of descriptors
MODES = ("descs", "prepped")
WAIT = 20.0  # bound on every wait for the other process
SLACK = 0.5  # seconds a write may overrun its deadline (polling, a loaded 2-core box)

Layout = list[tuple[str, int, int, str]]


def config(name: str, **options: str) -> BackendConfig:
    """What core gives the backend: options parsed and defaulted by the registration."""
    parsed = get_registry().backend_spec("nixl").parse_options(options)
    return BackendConfig(host="127.0.0.1", name=name, transfer_timeout=5.0, options=parsed)


def with_batch_bytes(backend: NixlBackend, max_bytes: int) -> Transport:
    """Core's policy around ``backend``, as if it declared ``max_bytes`` per batch."""
    return Transport.of(backend, "nixl", msgspec.structs.replace(CAPABILITIES, max_bytes_per_batch=max_bytes))


BIG_LAYOUT: Layout = [("big", 1 << 20, 64, "kv_page")]  # 64 MiB: more than loopback TCP buffers hold


def start_destination(layout: Layout | None = None) -> Destination:
    return pair.start_destination("nixl", layout or standard_layout(DST_PAGES, ROWS))


@dataclass
class Source:
    backends: dict[str, NixlBackend]  # one agent per xfer_mode, sharing the buffers
    bufs: list[np.ndarray]
    regions: list[Region]


@pytest.fixture(scope="module")
def source():
    bufs, regions = pattern_buffers(standard_layout(SRC_PAGES, ROWS))
    backends = {}
    for mode in MODES:
        backends[mode] = NixlBackend(config(f"prefill-{mode}", xfer_mode=mode))
        backends[mode].register(regions)
    yield Source(backends, bufs, regions)
    for b in backends.values():
        b.close()


@pytest.fixture(scope="module")
def dest_proc(source):
    dest = start_destination()
    for b in source.backends.values():
        b.add_peer("decode", dest.metadata, dest.regions)
    yield dest
    assert dest.stop() == 0, "the destination process did not exit cleanly (UCX_MODULES=^ib missing?)"


@pytest.fixture
def dest(dest_proc):
    assert dest_proc.ask("fill") == "ok"
    return dest_proc


def page_plan(source: Source, dest: Destination, src_idx, dst_idx, which=slice(0, 3)) -> TransferPlan:
    return pair.page_plan(source.regions, dest.regions, src_idx, dst_idx, which)


def expected(source: Source, which: range, src_idx, dst_idx) -> list[np.ndarray]:
    return pair.expected(source.bufs, standard_layout(DST_PAGES, ROWS), which, src_idx, dst_idx)


FRAGMENTED = {
    # Runs contiguous on both sides (5..8 -> 0..3, 33..34 -> 11..12, 0..2 -> 30..32),
    # contiguous on one side only (20, 33 -> 10, 11), and single pages.
    "hand": ([5, 6, 7, 8, 20, 33, 34, 60, 0, 1, 2, 41, 12], [0, 1, 2, 3, 10, 11, 12, 47, 30, 31, 32, 5, 20]),
    "random": tuple(
        np.random.default_rng(7).choice(n, 40, replace=False).tolist() for n in (SRC_PAGES, DST_PAGES)
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(FRAGMENTED))
def test_fragmented_pages_land_byte_exact_in_every_region(source, dest, case, mode):
    src_idx, dst_idx = FRAGMENTED[case]
    plan = page_plan(source, dest, src_idx, dst_idx)
    source.backends[mode].write("decode", plan, time.monotonic() + 10)
    got = dest.buffers()
    for e, exp in zip(range(3), expected(source, range(3), src_idx, dst_idx)):
        np.testing.assert_array_equal(got[e], exp, err_msg=f"region {e}")
        untouched = np.setdiff1d(np.arange(DST_PAGES), dst_idx)
        assert (got[e].reshape(DST_PAGES, -1)[untouched] == SENTINEL).all(), f"region {e}: stray write"
    assert (got[3] == SENTINEL).all(), "the rows region was not in the plan"


@pytest.mark.parametrize("mode", MODES)
def test_descriptors_that_are_not_whole_pages_land_byte_exact(source, dest, mode):
    # Half pages at odd offsets: the prepared page tables cannot express them,
    # so the prepped path must fall back to per-write descriptor lists.
    s, d = source.regions[0], dest.regions[0]
    half = s.stride // 2
    src_off, dst_off = np.array([0, 3 * half, 10 * s.stride + 4]), np.array([half, 7 * half, 2 * s.stride])
    plan = TransferPlan(s.addr + src_off, d.addr + dst_off, np.full(3, half, np.int64))
    plan.validate(source.regions, dest.regions)
    source.backends[mode].write("decode", plan, time.monotonic() + 10)
    exp = np.full(d.nbytes, SENTINEL, np.uint8)
    for so, do in zip(src_off, dst_off):
        exp[do:do + half] = source.bufs[0][so:so + half]
    np.testing.assert_array_equal(dest.buffers()[0], exp)


@pytest.mark.parametrize("mode", MODES)
def test_a_plan_of_fifty_thousand_descriptors_lands_and_the_peer_stays_usable(source, dest, mode):
    # Every other row on both sides: nothing coalesces, one descriptor per 16-byte row.
    src_idx, dst_idx = np.arange(50_000) * 2, np.arange(50_000) * 2 + 1
    plan = page_plan(source, dest, src_idx, dst_idx, which=slice(3, 4))
    assert len(plan) == 50_000
    source.backends[mode].write("decode", plan, time.monotonic() + 30)
    source.backends[mode].write("decode", page_plan(source, dest, [3], [7]), time.monotonic() + 5)
    got = dest.buffers()
    exp = np.full(ROW_BYTES * ROWS, SENTINEL, np.uint8)
    exp.reshape(-1, ROW_BYTES)[dst_idx] = source.bufs[3].reshape(-1, ROW_BYTES)[src_idx]
    np.testing.assert_array_equal(got[3], exp)
    for e, e_exp in zip(range(3), expected(source, range(3), [3], [7])):
        np.testing.assert_array_equal(got[e], e_exp)


def test_with_ucx_error_handling_off_pages_land_byte_exact(source, dest):
    backend = NixlBackend(config("prefill-errnone", ucx_error_handling_mode="none"))
    try:
        backend.register(source.regions)
        backend.add_peer("decode", dest.metadata, dest.regions)
        src_idx, dst_idx = FRAGMENTED["random"]
        backend.write("decode", page_plan(source, dest, src_idx, dst_idx), time.monotonic() + 10)
        for e, exp in zip(range(3), expected(source, range(3), src_idx, dst_idx)):
            np.testing.assert_array_equal(dest.buffers()[e], exp)
    finally:
        backend.close()


def test_writes_to_two_peers_from_two_threads_both_land(source, dest):
    other = start_destination()
    backend = source.backends["descs"]
    try:
        backend.add_peer("other", other.metadata, other.regions)
        jobs = {"decode": (dest, np.arange(40), np.arange(40) + 8), "other": (other, np.arange(48), np.arange(48)[::-1])}
        errors: list[BaseException] = []

        def run(peer: str) -> None:
            d, s_idx, d_idx = jobs[peer]
            try:
                for _ in range(20):
                    backend.write(peer, page_plan(source, d, s_idx, d_idx), time.monotonic() + 10)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(peer,)) for peer in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for d, s_idx, d_idx in jobs.values():
            got = d.buffers()
            for e, exp in zip(range(3), expected(source, range(3), s_idx, d_idx)):
                np.testing.assert_array_equal(got[e], exp)
    finally:
        backend.remove_peer("other")
        assert other.stop() == 0


def test_write_after_the_deadline_raises_timeout_and_moves_nothing(source, dest):
    plan = page_plan(source, dest, [1, 2], [1, 2])
    with pytest.raises(TransferTimeout, match="deadline"):
        Transport.of(source.backends["descs"], "nixl").write("decode", plan, time.monotonic() - 1)
    assert all((b == SENTINEL).all() for b in dest.buffers())


def test_write_to_an_unknown_peer_raises_naming_it(source):
    plan = TransferPlan(np.array([source.regions[0].addr]), np.array([source.regions[0].addr]), np.array([64]))
    with pytest.raises(TransferError, match="unknown peer 'nobody'"):
        source.backends["descs"].write("nobody", plan, time.monotonic() + 5)


def test_removed_peer_is_unknown(source, dest_proc):
    backend = source.backends["descs"]
    backend.add_peer("gone", dest_proc.metadata, dest_proc.regions)
    backend.remove_peer("gone")
    backend.remove_peer("never-added")  # ignored
    with pytest.raises(TransferError, match="unknown peer 'gone'"):
        backend.write("gone", TransferPlan.empty(), time.monotonic() + 5)


def test_a_second_handshake_from_one_agent_replaces_the_peer_and_removing_an_alias_keeps_it(source, dest):
    backend = source.backends["descs"]
    backend.add_peer("decode", dest.metadata, dest.regions)  # the same decode says Hello again
    backend.add_peer("alias", dest.metadata, dest.regions)  # another id with the same agent metadata
    backend.remove_peer("alias")  # must not unload the agent "decode" still writes to
    backend.write("decode", page_plan(source, dest, [9], [9]), time.monotonic() + 5)
    for e, exp in zip(range(3), expected(source, range(3), [9], [9])):
        np.testing.assert_array_equal(dest.buffers()[e], exp)


def test_metadata_that_is_not_nixl_agent_metadata_is_rejected(source):
    with pytest.raises(TransferError, match="peer 'bad' sent 11 bytes of metadata that NIXL could not load"):
        source.backends["descs"].add_peer("bad", seal(b"127.0.0.1:1"), [])


def test_regions_the_peer_agent_did_not_register_are_rejected(source, dest_proc):
    bare = NixlBackend(config("bare"))  # an agent that registered nothing
    try:
        with pytest.raises(TransferError, match="peer 'liar' .* described 4 regions that its agent metadata does not cover"):
            source.backends["descs"].add_peer("liar", bare.metadata(), dest_proc.regions)
    finally:
        bare.close()


def test_write_to_a_killed_destination_fails_within_seconds(source):
    doomed = start_destination()
    backend = source.backends["descs"]
    try:
        backend.add_peer("doomed", doomed.metadata, doomed.regions)
        plan = page_plan(source, doomed, [0, 1, 2], [4, 5, 6])
        backend.write("doomed", plan, time.monotonic() + 5)  # connected and working
        doomed.process.kill()
        doomed.process.join(5)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="peer 'doomed'") as info:
            for _ in range(100):  # the first writes may still land in the dying process's pages
                backend.write("doomed", plan, time.monotonic() + 5)
                time.sleep(0.01)
        assert not isinstance(info.value, TransferTimeout), info.value
        assert time.monotonic() - t0 < 3.0
    finally:
        backend.remove_peer("doomed")
        doomed.stop()


def test_write_to_a_frozen_destination_raises_timeout_at_its_deadline_and_the_peer_recovers():
    # Between processes on one host UCX puts by CMA, which writes into a stopped
    # process without its help; over TCP the stopped receiver stalls the put.
    frozen = start_destination(BIG_LAYOUT)
    backend = NixlBackend(config("prefill-tcp", ucx_engine_config="TLS=tcp"))
    buf = pattern(0, frozen.regions[0].nbytes)
    try:
        src = region("big", buf, 1 << 20, "kv_page", 0)
        backend.register([src])
        backend.add_peer("frozen", frozen.metadata, frozen.regions)
        plan = plan_pages([src.addr], [frozen.regions[0].addr], [src.stride], np.arange(64), np.arange(64)[::-1])
        backend.write("frozen", plan, time.monotonic() + 10)  # connected and working
        os.kill(frozen.process.pid, signal.SIGSTOP)
        try:
            for budget in (1.0, 0.5):  # the request in flight, then a fresh one
                t0 = time.monotonic()
                with pytest.raises(TransferTimeout, match="peer 'frozen'.*did not complete by its deadline"):
                    backend.write("frozen", plan, t0 + budget)
                elapsed = time.monotonic() - t0
                assert budget <= elapsed < budget + SLACK
        finally:
            os.kill(frozen.process.pid, signal.SIGCONT)
        backend.write("frozen", plan, time.monotonic() + 10)
        exp = buf.reshape(64, -1)[::-1].ravel()
        np.testing.assert_array_equal(frozen.buffers()[0], exp)
    finally:
        backend.close()
        frozen.stop()


def test_core_cuts_descriptors_longer_than_the_batch_bytes_and_they_land_byte_exact(source, dest):
    backend = NixlBackend(config("prefill-small-posts"))
    try:
        backend.register(source.regions)
        backend.add_peer("decode", dest.metadata, dest.regions)
        src_idx, dst_idx = [5, 6, 7, 8, 20], [0, 1, 2, 3, 30]  # a 4-page run: 16 KiB in region 0
        plan = page_plan(source, dest, src_idx, dst_idx)
        transport = with_batch_bytes(backend, 1000)
        batches = transport.batches(plan)
        assert int(plan.nbytes.max()) == 4 * 4096 and all(b.total_bytes <= 1000 for b in batches)
        transport.write("decode", plan, time.monotonic() + 10)
        for e, exp in zip(range(3), expected(source, range(3), src_idx, dst_idx)):
            np.testing.assert_array_equal(dest.buffers()[e], exp)
    finally:
        backend.close()


def test_a_deadline_that_passes_between_requests_stops_the_write_there():
    # A request's CMA copy runs inside NIXL's post and cannot be interrupted, so core
    # sends requests of at most max_bytes_per_batch with the deadline checked between
    # them: 64 requests of 1 MiB cannot all be posted within 1 ms.
    big = start_destination(BIG_LAYOUT)
    backend = NixlBackend(config("prefill-1mib"))
    buf = pattern(0, big.regions[0].nbytes)
    try:
        src = region("big", buf, 1 << 20, "kv_page", 0)
        backend.register([src])
        backend.add_peer("big", big.metadata, big.regions)
        plan = plan_pages([src.addr], [big.regions[0].addr], [64 << 20], [0], [0])  # one 64 MiB descriptor
        transport = with_batch_bytes(backend, 1 << 20)
        t0 = time.monotonic()
        # Either between requests, or (on a loaded machine) inside the first one, which is released.
        between_or_inside = r"passed its deadline after \d+ of 64 batches|did not complete by its deadline"
        with pytest.raises(TransferTimeout, match=between_or_inside):
            transport.write("big", plan, t0 + 0.001)
        assert time.monotonic() - t0 < 0.001 + SLACK
        transport.write("big", plan, time.monotonic() + 10)
        np.testing.assert_array_equal(big.buffers()[0], buf)
    finally:
        backend.close()
        assert big.stop() == 0


def test_a_larger_descriptor_is_cut_into_requests_of_half_core_s_64_mib_fence_bound(source):
    # nixl declares 64 MiB a request and 2 in flight; core keeps 64 MiB in flight to a peer at most
    # (FENCE_BATCHES_IN_FLIGHT x FENCE_BATCH_BYTES), so each request is 32 MiB.
    assert FENCE_BATCHES_IN_FLIGHT * FENCE_BATCH_BYTES == 64 << 20
    transport = Transport.of(source.backends["descs"], "nixl")
    assert transport.lanes[0].in_flight == 2
    one_gib = TransferPlan(np.array([0], np.int64), np.array([1 << 40], np.int64), np.array([1 << 30], np.int64))
    batches = transport.batches(one_gib)  # split only, never written
    assert [b.total_bytes for b in batches] == [32 << 20] * 32
    assert [int(b.src_addr[0]) for b in batches] == [i * (32 << 20) for i in range(32)]


def test_close_is_idempotent_and_later_writes_fail():
    backend = NixlBackend(config("short-lived"))
    assert len(backend.metadata()) > 100
    backend.close()
    backend.close()
    with pytest.raises(TransferError, match="closed"):
        backend.write("anyone", TransferPlan.empty(), time.monotonic() + 5)


def test_an_unknown_option_is_rejected_listing_the_known_ones():
    spec = get_registry().backend_spec("nixl")
    for unknown in ("progress_delay", "max_post_bytes"):  # max_post_bytes is core's max_bytes_per_batch now
        with pytest.raises(OptionError, match=f"no option '{unknown}'; its options are: progress_delay_us, "):
            spec.check_options({unknown: "10"})


@pytest.mark.parametrize("option, value, message", [
    ("progress_delay_us", "-1", "an integer >= 0"),
    ("progress_delay_us", "soon", "an integer >= 0"),
    ("num_workers", "0", "an integer >= 1"),
    ("ucx_error_handling_mode", "always", "one of peer, none"),
    ("xfer_mode", "auto", "one of descs, prepped"),
])
def test_bad_options_are_rejected_naming_the_option(option, value, message):
    with pytest.raises(OptionError, match=f"option {option}='{value}' is not allowed; expected {message}"):
        get_registry().backend_spec("nixl").check_options({option: value})


def test_the_backend_reads_its_options_typed_and_defaulted():
    spec = get_registry().backend_spec("nixl")
    assert spec.parse_options({}) == {"progress_delay_us": 1000, "ucx_error_handling_mode": "peer", "num_workers": 1,
                                      "ucx_engine_config": "", "xfer_mode": "descs"}
    backend = NixlBackend(config("typed", progress_delay_us="250", xfer_mode="prepped"))
    try:
        facts = backend.describe()
        assert (facts["progress_delay_us"], facts["xfer_mode"], facts["ucx_error_handling_mode"]) == (250, "prepped", "peer")
    finally:
        backend.close()


def test_an_idle_agent_does_not_spin_a_core_and_its_process_exits_cleanly():
    # NIXL's own default (pthrDelay=0) costs a full core per agent; the adapter's
    # default progress delay must not. The process must also exit with 0, not SIGSEGV.
    code = (
        "import nixl_cu12  # imported before the backend, as a host might\n"
        "import resource, time\n"
        "from kvbridge.core.transfer.transport import open_transport\n"
        "b = open_transport('nixl', host='127.0.0.1', name='idle', transfer_timeout=5.0, options={})\n"
        "u0 = resource.getrusage(resource.RUSAGE_SELF); time.sleep(2.0)\n"
        "u1 = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print('cpu', (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_MODULES", "NIXL_LOG_LEVEL")}  # the adapter sets both
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, f"exit code {out.returncode}: {out.stderr[-2000:]}"
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpu "), f"NIXL wrote to stdout: {out.stdout!r}"
    assert float(lines[0].split()[1]) < 0.4, lines[0]


def test_registration_declares_the_backend_class_capabilities():
    from kvbridge.plugins import nixl

    (spec,) = nixl.kvbridge_register_backends()
    assert spec.capabilities is NixlBackend.capabilities is CAPABILITIES
    assert spec.factory == "kvbridge.plugins.nixl.backend:NixlBackend"
    assert spec.requires == ("nixl_cu12|nixl_cu13",) and spec.extra == "nixl"


def test_listing_the_plugin_does_not_import_the_engine():
    code = (
        "import sys, kvbridge.plugins.nixl as m; m.kvbridge_register_backends(); "
        "print(sorted(k for k in sys.modules if k.startswith('nixl')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("mode", MODES)
def test_regions_of_a_device_other_than_0_register_and_land_byte_exact(dest, mode):
    # A rank on cuda:1 registers its memory as device 1; the page tables prepared for it must name
    # device 1 too, or NIXL finds no registration and registering fails (NIXL_ERR_NOT_FOUND; found by
    # the first run with decode on a second GPU). Host memory with a device id takes the same path here.
    bufs, regions = pattern_buffers(standard_layout(SRC_PAGES, ROWS))
    on_1 = [msgspec.structs.replace(r, device=1) for r in regions]
    backend = NixlBackend(config(f"prefill-device-1-{mode}", xfer_mode=mode))
    try:
        backend.register(on_1)
        backend.add_peer("decode", dest.metadata, dest.regions)
        src_idx, dst_idx = FRAGMENTED["hand"]
        backend.write("decode", pair.page_plan(on_1, dest.regions, src_idx, dst_idx, slice(0, 3)), time.monotonic() + 10)
        got = dest.buffers()
        for e, exp in enumerate(pair.expected(bufs, standard_layout(DST_PAGES, ROWS), range(3), src_idx, dst_idx)):
            np.testing.assert_array_equal(got[e], exp, err_msg=f"region {e}")
    finally:
        backend.close()


def test_an_agent_is_made_without_importing_torch() -> None:
    # torch only tells which NIXL wheel matches its CUDA; importing it cost every process that made
    # an agent 2-3 s of CPU and 230 MB (most of a test driver's start-up on a 2-core machine).
    code = ("import sys; from kvbridge.plugins.nixl.backend import NixlBackend; from kvbridge.core.transfer.backend import "
            "BackendConfig; from kvbridge.core.description.plugins import get_registry; "
            "opts = get_registry().backend_spec('nixl').parse_options({}); "
            "b = NixlBackend(BackendConfig(name='t', host='127.0.0.1', options=opts)); b.close(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("line, cuda, wheel", [("cuda: Optional[str] = '13.0'", "13.0", "nixl_cu13"),
                                               ("cuda = '12.8'", "12.8", "nixl_cu12"),
                                               ("cuda: Optional[str] = None", "", "")])
def test_the_nixl_wheel_follows_the_cuda_that_torch_was_built_for(tmp_path, line: str, cuda: str, wheel: str) -> None:
    # A stand-in torch package whose version.py says ``line``, first on the path of a fresh process.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('this stand-in must not be imported')\n")
    (tmp_path / "torch" / "version.py").write_text(f"from typing import Optional\n__version__ = '9.9'\n{line}\n")
    code = ("import importlib.util as u; from kvbridge.plugins.nixl.engine import engine_module, torch_cuda; "
            "names = [n for n in ('nixl_cu12', 'nixl_cu13') if u.find_spec(n)]; "
            "print(torch_cuda()); print(engine_module()); print(','.join(names))")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got_cuda, module, installed = out.stdout.rstrip("\n").split("\n")[-3:]
    assert got_cuda == cuda
    # The matching wheel when it is installed; otherwise the first installed one.
    assert module == (wheel if wheel in installed.split(",") else installed.split(",")[0])


@pytest.mark.parametrize("mode", MODES)
def test_a_peer_whose_agent_failed_to_load_again_is_loaded_at_its_next_write(source, dest, mode, monkeypatch):
    # After a failed endpoint the backend loads the peer's agent again (NIXL connects as it loads). A
    # peer still stopped then refuses: before, the peer stayed unloaded and every later write failed
    # with NIXL_ERR_NOT_FOUND, also once it had resumed (seen in CI, a SIGSTOPped conformance peer).
    backend = source.backends[mode]
    p = backend._peers["decode"]
    agent = backend._live_agent()
    real = agent.add_remote_agent
    calls = []

    def refuses_once(metadata: bytes) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise nixl_errors()[0]("NIXL_ERR_BACKEND (the peer is stopped)")
        return real(metadata)

    monkeypatch.setattr(agent, "add_remote_agent", refuses_once)
    backend._reload(p)
    assert p.unloaded and len(calls) == 1
    src_idx, dst_idx = FRAGMENTED["hand"]
    plan = page_plan(source, dest, src_idx, dst_idx)
    backend.write("decode", plan, time.monotonic() + 10)
    assert len(calls) == 2 and not p.unloaded
    got = dest.buffers()
    for e, exp in zip(range(3), expected(source, range(3), src_idx, dst_idx)):
        np.testing.assert_array_equal(got[e], exp, err_msg=f"region {e}")
