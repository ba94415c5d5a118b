"""The Mooncake adapter on its own, with real engines in two processes on 127.0.0.1.

The destination runs in a spawned process: it registers buffers filled with a
sentinel, sends its metadata and regions through a Pipe, and on request sends
its buffers back. The expected destination is computed with plain numpy
slicing of the source, independently of the planner.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from kvbridge.plugins.tcpfence import seal, unseal
from kvbridge.core.transfer.backend import BackendConfig, TransferError, TransferTimeout  # noqa: E402
from kvbridge.core.description.layout import Region  # noqa: E402
from kvbridge.core.description.plugins import get_registry  # noqa: E402
from kvbridge.core.transfer.transport import Transport  # noqa: E402
from kvbridge.testing import pair  # noqa: E402
from kvbridge.testing.pair import ROWS, SENTINEL, Destination, pattern_buffers, standard_layout  # noqa: E402
from kvbridge.core.planning.transferplan import TransferPlan  # noqa: E402
from kvbridge.plugins.mooncake import CAPABILITIES  # noqa: E402
from kvbridge.plugins.mooncake.backend import MooncakeBackend  # noqa: E402


SRC_PAGES, DST_PAGES = 64, 48
WAIT = 20.0  # bound on every wait for the other process


def config(name: str = "prefill", **options: str) -> BackendConfig:
    """What core gives the backend: options parsed and defaulted by the registration."""
    parsed = get_registry().backend_spec("mooncake").parse_options(options)
    return BackendConfig(host="127.0.0.1", name=name, transfer_timeout=5.0, options=parsed)


def start_destination() -> Destination:
    return pair.start_destination("mooncake", standard_layout(DST_PAGES, ROWS))


@dataclass
class Source:
    backend: MooncakeBackend
    bufs: list[np.ndarray]
    regions: list[Region]


@pytest.fixture(scope="module")
def source():
    backend = MooncakeBackend(config())
    bufs, regions = pattern_buffers(standard_layout(SRC_PAGES, ROWS))
    backend.register(regions)
    yield Source(backend, bufs, regions)
    backend.close()


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


@pytest.mark.parametrize("case", sorted(FRAGMENTED))
def test_fragmented_pages_land_byte_exact_in_every_region(source, dest, case):
    src_idx, dst_idx = FRAGMENTED[case]
    plan = page_plan(source, dest, src_idx, dst_idx)
    source.backend.write("decode", plan, time.monotonic() + 10)
    got = dest.buffers()
    for e, exp in zip(range(3), expected(source, range(3), src_idx, dst_idx)):
        np.testing.assert_array_equal(got[e], exp, err_msg=f"region {e}")
        untouched = np.setdiff1d(np.arange(DST_PAGES), dst_idx)
        assert (got[e].reshape(DST_PAGES, -1)[untouched] == SENTINEL).all(), f"region {e}: stray write"
    assert (got[3] == SENTINEL).all(), "the rows region was not in the plan"


def test_plan_beyond_the_in_flight_limit_is_split_by_core_and_the_peer_stays_usable(source, dest):
    # Every other row on both sides: nothing coalesces, 5000 descriptors,
    # more than twice Mooncake's per-peer limit (2048 would be the wedge point).
    src_idx, dst_idx = np.arange(5000) * 2, np.arange(5000) * 2 + 1
    plan = page_plan(source, dest, src_idx, dst_idx, which=slice(3, 4))
    assert len(plan) == 5000 > 2 * CAPABILITIES.max_descriptors_in_flight
    transport = Transport.of(source.backend, "mooncake")
    assert [len(b) for b in transport.batches(plan)] == [1024, 1024, 1024, 1024, 904]
    transport.write("decode", plan, time.monotonic() + 15)
    # Then a small write to the same peer must still work (a wedged peer fails here).
    source.backend.write("decode", page_plan(source, dest, [3], [7]), time.monotonic() + 5)
    got = dest.buffers()
    np.testing.assert_array_equal(got[3], expected(source, range(3, 4), src_idx, dst_idx)[0])
    for e, exp in zip(range(3), expected(source, range(3), [3], [7])):
        np.testing.assert_array_equal(got[e], exp)


def test_write_after_the_deadline_raises_timeout_and_moves_nothing(source, dest):
    plan = page_plan(source, dest, [1, 2], [1, 2])
    with pytest.raises(TransferTimeout, match="deadline"):
        Transport.of(source.backend, "mooncake").write("decode", plan, time.monotonic() - 1)
    assert all((b == SENTINEL).all() for b in dest.buffers())


def test_write_to_an_unknown_peer_raises_naming_it(source):
    plan = TransferPlan(np.array([source.regions[0].addr]), np.array([source.regions[0].addr]), np.array([64]))
    with pytest.raises(TransferError, match="unknown peer 'nobody'"):
        source.backend.write("nobody", plan, time.monotonic() + 5)


def test_removed_peer_is_unknown(source):
    source.backend.add_peer("gone", seal(b"127.0.0.1:1"), [])
    source.backend.remove_peer("gone")
    source.backend.remove_peer("never-added")  # ignored
    with pytest.raises(TransferError, match="unknown peer 'gone'"):
        source.backend.write("gone", TransferPlan.empty(), time.monotonic() + 5)


def test_malformed_peer_metadata_is_rejected(source):
    with pytest.raises(TransferError, match="expected '<host>:<rpc_port>'"):
        source.backend.add_peer("bad", seal(b"not-a-session"), [])


def test_write_to_a_killed_destination_fails_within_seconds(source):
    doomed = start_destination()
    try:
        source.backend.add_peer("doomed", doomed.metadata, doomed.regions)
        plan = page_plan(source, doomed, [0, 1, 2], [4, 5, 6])
        source.backend.write("doomed", plan, time.monotonic() + 5)  # connected and working
        doomed.process.kill()
        doomed.process.join(5)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="peer 'doomed'"):
            source.backend.write("doomed", plan, time.monotonic() + 5)
        assert time.monotonic() - t0 < 3.0
    finally:
        source.backend.remove_peer("doomed")
        doomed.stop()


def test_close_is_idempotent_and_later_writes_fail():
    backend = MooncakeBackend(config("short-lived"))
    assert unseal(backend.metadata())[0].startswith(b"127.0.0.1:")
    backend.close()
    backend.close()
    with pytest.raises(TransferError, match="closed"):
        backend.write("anyone", TransferPlan.empty(), time.monotonic() + 5)


def test_registration_declares_the_backend_class_capabilities():
    from kvbridge.plugins import mooncake

    (spec,) = mooncake.kvbridge_register_backends()
    assert spec.capabilities is MooncakeBackend.capabilities is CAPABILITIES
    assert spec.factory == "kvbridge.plugins.mooncake.backend:MooncakeBackend"
    assert spec.requires == ("mooncake",) and spec.extra == "mooncake"


def test_listing_the_plugin_does_not_import_the_engine():
    code = (
        "import sys, kvbridge.plugins.mooncake as m; m.kvbridge_register_backends(); "
        "print(sorted(k for k in sys.modules if k == 'mooncake' or k.startswith('mooncake.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- the engine's own log lines ---------------------------------------------------------------------
STARTS_ONE = """
import logging, sys
from kvbridge.core.transfer.backend import BackendConfig
from kvbridge.core.description.plugins import get_registry
from kvbridge.plugins.mooncake.backend import MooncakeBackend
if sys.argv[1] != "default":
    logging.basicConfig(level=getattr(logging, sys.argv[1]), format="LOG %(levelname)s %(name)s: %(message)s")
opts = get_registry().backend_spec("mooncake").parse_options({})
MooncakeBackend(BackendConfig(host="127.0.0.1", name="x", options=opts)).close()
"""


def start_engine(level: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in __import__("os").environ.items() if k != "MC_LOG_LEVEL"}  # kvbridge's level decides
    return subprocess.run([sys.executable, "-c", STARTS_ONE, level], capture_output=True, text=True, timeout=60, env=env)


def test_starting_and_closing_the_engine_prints_only_kvbridges_listening_warning_at_the_default_level():
    out = start_engine("default")
    assert out.returncode == 0, out.stderr
    # The engine's own lines stay quiet; kvbridge says once that Mooncake listens on every
    # interface whatever host it is given (docs/security.md).
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "mooncake: the engine listens on every interface (0.0.0.0 and ::)" in lines[0], out.stderr
    assert out.stdout == ""


def test_the_engines_lines_at_start_and_close_go_through_logging_at_kvbridges_level():
    out = start_engine("DEBUG")
    assert out.returncode == 0, out.stderr
    name = "kvbridge.plugins.mooncake.backend"
    # Mooncake's error while it starts is harmless: logged at DEBUG, not ERROR; its INFO lines follow the level.
    assert f"LOG DEBUG {name}: Local segment descriptor not found (transfer_metadata.cpp:" in out.stderr
    assert f"LOG INFO {name}: " in out.stderr and "removeSegmentDesc" in out.stderr  # start-up and close
    assert not [line for line in out.stderr.splitlines() if not line.startswith("LOG ")]  # nothing bypassed logging
