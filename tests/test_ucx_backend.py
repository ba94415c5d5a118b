"""The UCX adapter on its own, with real UCXX workers in two processes on 127.0.0.1.

The destination runs in a spawned process: it registers buffers filled with a
sentinel, sends its metadata and regions through a Pipe, and on request sends
its buffers back. The expected destination is computed with plain numpy
slicing of the source, independently of the planner.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest

# Not imported here: collecting this file (every pytest-xdist worker collects every file) loaded UCXX's UCX
# into each worker, beside NIXL's own, and before kvbridge kept UCXX's settings out of the environment
# (test_ucxx_settings_go_to_its_context_not_the_environment) NIXL ran with them on a worker and without alone.
if importlib.util.find_spec("ucxx") is None:
    pytest.skip("ucxx is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from kvbridge.core.transfer.backend import BackendConfig, TransferError, TransferTimeout  # noqa: E402
from kvbridge.core.description.layout import Region  # noqa: E402
from kvbridge.core.planning.plan import PlanError  # noqa: E402
from kvbridge.core.description.plugins import get_registry  # noqa: E402
from kvbridge.core.description.records import OptionError  # noqa: E402
from kvbridge.core.transfer.pipeline import FENCE_BATCHES_IN_FLIGHT  # noqa: E402
from kvbridge.core.transfer.transport import FENCE_BATCH_DESCRIPTORS, Transport  # noqa: E402
from kvbridge.testing import pair  # noqa: E402
from kvbridge.testing.pair import SENTINEL, Destination, pattern_buffers, standard_layout  # noqa: E402
from kvbridge.core.planning.transferplan import TransferPlan  # noqa: E402
from kvbridge.plugins.ucx import CAPABILITIES  # noqa: E402
from kvbridge.plugins.ucx.backend import UcxBackend  # noqa: E402


SRC_PAGES, DST_PAGES = 64, 48
ROW_BYTES, ROWS = 16, 40_000  # a region of small rows, for plans of tens of thousands of descriptors
WAIT = 20.0  # bound on every wait for the other process
SLACK = 1.0  # seconds allowed past a deadline on a loaded 2-core box


def _config(name: str, **options: str) -> BackendConfig:
    """What core gives the backend: options parsed and defaulted by the registration."""
    parsed = get_registry().backend_spec("ucx").parse_options(options)
    return BackendConfig(host="127.0.0.1", name=name, transfer_timeout=5.0, options=parsed)


def start_destination() -> Destination:
    return pair.start_destination("ucx", standard_layout(DST_PAGES, ROWS))


@dataclass
class Source:
    backend: UcxBackend
    bufs: list[np.ndarray]
    regions: list[Region]


def make_source(**options: str) -> Source:
    backend = UcxBackend(_config("prefill", **options))
    bufs, regions = pattern_buffers(standard_layout(SRC_PAGES, ROWS))
    backend.register(regions)
    return Source(backend, bufs, regions)


@pytest.fixture(scope="module")
def source():
    src = make_source()
    yield src
    src.backend.close()


@pytest.fixture(scope="module")
def dest_proc(source):
    dest = start_destination()
    source.backend.add_peer("decode", dest.metadata, dest.regions)
    yield dest
    dest.stop()


@pytest.fixture
def dest(dest_proc):
    assert dest_proc.ask("fill") == "ok"
    return dest_proc


@pytest.fixture
def fresh_dest():
    """A destination of its own, for tests that kill or stop it."""
    dest = start_destination()
    yield dest
    dest.stop()


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just exited
                pass
        if states and all(s == "T" for s in states):
            return
        time.sleep(0.001)
    pytest.fail(f"process {pid} did not stop within {WAIT} s")


def page_plan(source: Source, dest: Destination, src_idx, dst_idx, which=slice(0, 3)) -> TransferPlan:
    return pair.page_plan(source.regions, dest.regions, src_idx, dst_idx, which)


def expected(source: Source, which: range, src_idx, dst_idx) -> list[np.ndarray]:
    return pair.expected(source.bufs, standard_layout(DST_PAGES, ROWS), which, src_idx, dst_idx)


def assert_pages_landed(got: list[np.ndarray], source: Source, src_idx, dst_idx) -> None:
    for e, exp in zip(range(3), expected(source, range(3), src_idx, dst_idx)):
        np.testing.assert_array_equal(got[e], exp, err_msg=f"region {e}")


FRAGMENTED = {
    # Runs contiguous on both sides (5..8 -> 0..3, 33..34 -> 11..12, 0..2 -> 30..32),
    # contiguous on one side only (20, 33 -> 10, 11), and single pages.
    "hand": ([5, 6, 7, 8, 20, 33, 34, 60, 0, 1, 2, 41, 12], [0, 1, 2, 3, 10, 11, 12, 47, 30, 31, 32, 5, 20]),
    "random": tuple(
        np.random.default_rng(7).choice(n, 40, replace=False).tolist() for n in (SRC_PAGES, DST_PAGES)
    ),
}


@pytest.mark.parametrize("case", sorted(FRAGMENTED))
def test_fragmented_pages_land_byte_exact_in_every_region(source, dest, case):
    src_idx, dst_idx = FRAGMENTED[case]
    plan = page_plan(source, dest, src_idx, dst_idx)
    source.backend.write("decode", plan, time.monotonic() + 10)
    got = dest.buffers()
    assert_pages_landed(got, source, src_idx, dst_idx)
    untouched = np.setdiff1d(np.arange(DST_PAGES), dst_idx)
    for e in range(3):
        assert (got[e].reshape(DST_PAGES, -1)[untouched] == SENTINEL).all(), f"region {e}: stray write"
    assert (got[3] == SENTINEL).all(), "the rows region was not in the plan"


def test_a_plan_of_twenty_thousand_descriptors_lands_in_batches_and_the_peer_stays_usable(source, dest):
    # Every other row on both sides: nothing coalesces, one descriptor per row,
    # split by core into batches of at most 4096 puts: ucx keeps one batch in flight, so a batch may be the
    # fence's whole bound (4 x 1024 descriptors), which is also ucx's declared 4096.
    src_idx, dst_idx = np.arange(20_000) * 2, np.arange(20_000) * 2 + 1
    plan = page_plan(source, dest, src_idx, dst_idx, which=slice(3, 4))
    assert len(plan) == 20_000
    transport = Transport.of(source.backend, "ucx")
    bound = FENCE_BATCHES_IN_FLIGHT * FENCE_BATCH_DESCRIPTORS
    assert bound == 4096
    assert [len(b) for b in transport.batches(plan)] == [bound] * 4 + [20_000 - 4 * bound]
    transport.write("decode", plan, time.monotonic() + 15)
    source.backend.write("decode", page_plan(source, dest, [3], [7]), time.monotonic() + 5)
    got = dest.buffers()
    np.testing.assert_array_equal(got[3], expected(source, range(3, 4), src_idx, dst_idx)[0])
    assert_pages_landed(got, source, [3], [7])


def test_write_after_the_deadline_raises_timeout_and_moves_nothing(source, dest):
    plan = page_plan(source, dest, [1, 2], [1, 2])
    with pytest.raises(TransferTimeout, match="deadline"):
        Transport.of(source.backend, "ucx").write("decode", plan, time.monotonic() - 1)
    assert all((b == SENTINEL).all() for b in dest.buffers())


def test_descriptor_outside_the_peers_registered_memory_is_refused_by_core(source, dest_proc):
    # Core bounds-checks every plan against both sides' regions before any write
    # (the backend trusts it and only looks up remote keys): here, on the regions the peer described.
    plan = page_plan(source, dest_proc, [1, 2], [1, 2])  # one run in each of 3 regions
    outside = TransferPlan(plan.src_addr, plan.dst_addr + np.array([0, 0, 1 << 40]), plan.nbytes)
    with pytest.raises(PlanError, match="descriptor 2 .* not inside any registered destination region"):
        outside.validate(source.regions, dest_proc.regions)


def test_write_to_an_unknown_peer_raises_naming_it(source):
    plan = TransferPlan(np.array([source.regions[0].addr]), np.array([source.regions[0].addr]), np.array([64]))
    with pytest.raises(TransferError, match="unknown peer 'nobody'"):
        source.backend.write("nobody", plan, time.monotonic() + 5)


def test_removed_peer_is_unknown(source, dest):
    source.backend.add_peer("gone", dest.metadata, dest.regions)
    source.backend.remove_peer("gone")
    source.backend.remove_peer("never-added")  # ignored
    with pytest.raises(TransferError, match="unknown peer 'gone'"):
        source.backend.write("gone", page_plan(source, dest, [0], [0]), time.monotonic() + 5)


def test_peer_with_foreign_metadata_is_rejected_naming_why(source):
    with pytest.raises(TransferError, match="peer 'foreign' sent metadata .* not a ucx backend's"):
        source.backend.add_peer("foreign", b"127.0.0.1:1", [])
    with pytest.raises(TransferError, match="unknown peer 'foreign'"):
        source.backend.write("foreign", TransferPlan.empty(), time.monotonic() + 5)


def test_peer_describing_memory_it_did_not_register_is_rejected(source, dest):
    extra = Region(name="ghost", addr=1 << 44, nbytes=4096, stride=4096, role="kv", index_space="kv_page", layer=9)
    with pytest.raises(TransferError, match="region 'ghost'.* registered no UCX memory covering it"):
        source.backend.add_peer("liar", dest.metadata, [*dest.regions, extra])


def test_write_to_a_killed_destination_fails_quickly_naming_the_peer(source, fresh_dest):
    source.backend.add_peer("doomed", fresh_dest.metadata, fresh_dest.regions)
    try:
        plan = page_plan(source, fresh_dest, [0, 1, 2], [4, 5, 6])
        source.backend.write("doomed", plan, time.monotonic() + 5)  # connected and working
        fresh_dest.process.kill()
        fresh_dest.process.join(5)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="peer 'doomed'") as info:
            source.backend.write("doomed", plan, time.monotonic() + 5)
        assert not isinstance(info.value, TransferTimeout), info.value
        assert time.monotonic() - t0 < 2.0
    finally:
        source.backend.remove_peer("doomed")


def test_frozen_destination_over_tcp_times_out_within_the_deadline_then_recovers(fresh_dest):
    # Over TCP, UCP emulates puts with messages the destination must progress;
    # a stopped destination never answers and UCX never reports it.
    tcp = make_source(UCX_TLS="tcp")
    try:
        tcp.backend.add_peer("frozen", fresh_dest.metadata, fresh_dest.regions)
        tcp.backend.write("frozen", page_plan(tcp, fresh_dest, [9], [9]), time.monotonic() + 5)
        freeze(fresh_dest.process.pid)
        plan = page_plan(tcp, fresh_dest, [0, 1, 2], [4, 5, 6])
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="peer 'frozen'.*deadline"):
            tcp.backend.write("frozen", plan, t0 + 1.0)
        assert time.monotonic() - t0 < 1.0 + SLACK
        os.kill(fresh_dest.process.pid, signal.SIGCONT)
        tcp.backend.write("frozen", plan, time.monotonic() + 5)
        assert_pages_landed(fresh_dest.buffers(), tcp, [9, 0, 1, 2], [9, 4, 5, 6])
    finally:
        os.kill(fresh_dest.process.pid, signal.SIGCONT)
        tcp.backend.close()


def _socket_buffer_max() -> int:
    """The most bytes the kernel holds for one TCP connection: the sender's buffer plus the receiver's."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as w, open("/proc/sys/net/ipv4/tcp_rmem") as r:
        return int(w.read().split()[2]) + int(r.read().split()[2])


def test_a_timed_out_write_leaves_no_puts_queued_that_land_after_it_returned():
    # Over TCP to a frozen destination most puts are still queued in UCX when the deadline passes.
    # write() must drop them (the contract: nothing left in the engine once it returns): after the
    # destination resumes, only what the kernel had already taken into the socket's buffers lands.
    item, count = 1 << 20, 128
    layout = [("big", item, count, "kv_page")]
    dest = pair.start_destination("ucx", layout)
    tcp = UcxBackend(_config("prefill", UCX_TLS="tcp"))
    try:
        bufs, regions = pattern_buffers(layout)
        tcp.register(regions)
        tcp.add_peer("frozen", dest.metadata, dest.regions)
        plan = pair.page_plan(regions, dest.regions, list(range(count)), list(range(count)), slice(0, 1))
        tcp.write("frozen", pair.page_plan(regions, dest.regions, [0], [0], slice(0, 1)), time.monotonic() + 5)
        freeze(dest.process.pid)
        with pytest.raises(TransferTimeout, match="peer 'frozen'.*deadline"):
            tcp.write("frozen", plan, time.monotonic() + 1.0)
        os.kill(dest.process.pid, signal.SIGCONT)
        # Whatever still arrives does so once the destination runs again: wait until its memory settles.
        landed, stable_since, t0 = -1, time.monotonic(), time.monotonic()
        while time.monotonic() - stable_since < 2.0 and time.monotonic() - t0 < WAIT:
            now = int((dest.buffers()[0] == bufs[0]).sum()) - item  # item 0 landed before the freeze
            if now != landed:
                landed, stable_since = now, time.monotonic()
            time.sleep(0.2)
        assert landed <= _socket_buffer_max(), (
            f"{landed} B of {count * item} landed after the timed-out write returned: puts were left queued in UCX"
        )
        tcp.write("frozen", plan, time.monotonic() + 10)  # a new endpoint: the peer works again
        np.testing.assert_array_equal(dest.buffers()[0], bufs[0])
    finally:
        os.kill(dest.process.pid, signal.SIGCONT)
        tcp.close()
        dest.stop()


def test_frozen_destination_over_cma_still_receives_the_bytes(source, fresh_dest):
    # CMA writes straight into the stopped process: the write completes and
    # the bytes are there when it resumes.
    source.backend.add_peer("stopped", fresh_dest.metadata, fresh_dest.regions)
    try:
        source.backend.write("stopped", page_plan(source, fresh_dest, [9], [9]), time.monotonic() + 5)
        freeze(fresh_dest.process.pid)
        plan = page_plan(source, fresh_dest, [0, 1, 2], [4, 5, 6])
        t0 = time.monotonic()
        try:
            source.backend.write("stopped", plan, t0 + 2.0)
        except TransferTimeout:  # allowed: UCX may route the puts over TCP on some hosts
            assert time.monotonic() - t0 < 2.0 + SLACK
            pytest.skip("puts did not go over CMA here")
        os.kill(fresh_dest.process.pid, signal.SIGCONT)
        assert_pages_landed(fresh_dest.buffers(), source, [9, 0, 1, 2], [9, 4, 5, 6])
    finally:
        os.kill(fresh_dest.process.pid, signal.SIGCONT)
        source.backend.remove_peer("stopped")


def test_error_handling_off_moves_the_same_bytes(dest):
    # Only a live destination here: with error handling off a put to a dead
    # peer aborts the process (see the backend's module docstring).
    off = make_source(error_handling="off")
    try:
        off.backend.add_peer("decode", dest.metadata, dest.regions)
        src_idx, dst_idx = FRAGMENTED["random"]
        off.backend.write("decode", page_plan(off, dest, src_idx, dst_idx), time.monotonic() + 10)
        assert_pages_landed(dest.buffers(), off, src_idx, dst_idx)
    finally:
        off.backend.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [({"error_handling": "maybe"}, "error_handling='maybe' is not allowed; expected one of on, off"),
     ({"tls": "tcp"}, "no option 'tls'; its options are: error_handling, UCX_\\*")],
)
def test_bad_options_are_rejected_naming_the_valid_ones(options, message):
    with pytest.raises(OptionError, match=message):
        get_registry().backend_spec("ucx").check_options(options)


def test_ucx_settings_reach_the_context_and_error_handling_is_read_typed():
    spec = get_registry().backend_spec("ucx")
    assert spec.parse_options({"UCX_TLS": "tcp"}) == {"error_handling": "on", "UCX_TLS": "tcp"}
    off = UcxBackend(_config("typed", error_handling="off", UCX_TLS="tcp"))
    try:
        assert off.describe()["error_handling"] == "off" and off.error_handling is False
        assert off._context.config["TLS"] == "tcp"
    finally:
        off.close()


def test_close_is_idempotent_and_later_writes_fail():
    backend = UcxBackend(_config("short-lived"))
    assert backend.metadata()
    backend.close()
    backend.close()
    with pytest.raises(TransferError, match="closed"):
        backend.write("anyone", TransferPlan.empty(), time.monotonic() + 5)


def test_registration_declares_the_backend_class_capabilities():
    from kvbridge.plugins import ucx

    (spec,) = ucx.kvbridge_register_backends()
    assert spec.capabilities is UcxBackend.capabilities is CAPABILITIES
    assert spec.factory == "kvbridge.plugins.ucx.backend:UcxBackend"
    assert spec.requires == ("ucxx",) and spec.extra == "ucx"


def test_listing_the_plugin_does_not_import_the_engine():
    code = (
        "import sys, kvbridge.plugins.ucx as m; m.kvbridge_register_backends(); "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('ucxx', 'libucx', 'libucxx')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_collecting_this_file_loads_no_ucx():
    """What pytest runs of this file at collection, in every worker: no UCXX, no UCX library."""
    code = (
        "import importlib.util as u, sys; spec = u.spec_from_file_location('t', sys.argv[1]); "
        "sys.modules['t'] = module = u.module_from_spec(spec); spec.loader.exec_module(module); "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('ucxx', 'libucx', 'libucxx')), "
        "[line.split()[-1] for line in open('/proc/self/maps') if 'libucp' in line][:1])"
    )
    out = subprocess.run([sys.executable, "-c", code, __file__], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] []"


def test_ucxx_settings_go_to_its_context_not_the_environment():
    """Importing UCXX writes UCX settings for its contexts into os.environ (UCX_RNDV_THRESH=8192, ...), which
    NIXL's UCX in the same process and every process started from it read too: NIXL's agent keeps its own
    RNDV_THRESH=inf only where the environment names none. A backend leaves the environment as it was and
    gives them to its own context instead, under a variable set in the environment."""
    code = (
        "import json, os, sys; from kvbridge.core.transfer.backend import BackendConfig; "
        "from kvbridge.core.description.plugins import get_registry; "
        "from kvbridge.plugins.ucx.backend import UcxBackend; "
        "env = lambda: {k: v for k, v in os.environ.items() if k.startswith('UCX_')}; before = env(); "
        "b = UcxBackend(BackendConfig(host='127.0.0.1', name='p', options=get_registry().backend_spec('ucx').parse_options({}))); "
        "config = b._context.config; b.close(); "
        "print(json.dumps([before, env(), {k: config.get(k) for k in ('RNDV_THRESH', 'MAX_RNDV_RAILS')}]))"
    )
    for theirs, rndv in ((None, "intra:8K,inter:8K"), ("16384", "intra:16K,inter:16K")):
        environ = {k: v for k, v in os.environ.items() if k != "UCX_RNDV_THRESH"}
        if theirs is not None:
            environ["UCX_RNDV_THRESH"] = theirs
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=environ)
        assert out.returncode == 0, out.stderr
        before, after, context = json.loads(out.stdout.splitlines()[-1])
        assert after == before, f"the backend changed the environment: {set(after.items()) ^ set(before.items())}"
        assert context == {"RNDV_THRESH": rndv, "MAX_RNDV_RAILS": "1"}, context
