"""A sample of the fault matrix (``python -m kvbridge.testing.faults`` runs all of it).

Each cell kills or freezes a real victim process and times the survivor in this
process: FAILED with a reason within 5 s, no byte of a FAILED room landing after
FAILED (decode pages compared after a frozen victim resumed), no SUCCESS from a
resumed prefill for a room decode had failed, and the survivor serving a fresh
peer and the resumed one. Decode's room must end *fenced* (``Receiver.fenced``:
at FAILED, or once a frozen prefill resumed and confirmed) with no byte
landing after that. The sample: the two freezes mid-transfer (issue 13,
finding 2) on Mooncake and NIXL, and a resumed prefill re-handshaking between
requests (finding 4). Plus one network-cut cell per backend: prefill and
decode in two network namespaces joined by a veth pair, the link taken down
while a room's pages are being written and brought back after both sides
failed it; no byte may land after that (skipped, saying why, where namespaces
cannot be created).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.core.description.plugins import get_registry
from kvbridge.testing.faults import BOUND, run_cell, table

SAMPLE = [
    ("mooncake", "decode-freeze", "mid-transfer"),
    ("mooncake", "prefill-freeze", "mid-transfer"),
    ("nixl", "decode-freeze", "mid-transfer"),
    ("nixl", "prefill-freeze", "between"),
    # A killed prefill is seen gone (control connection closed, reconnecting refused): FAILED and fenced
    # in about half a second, not at heartbeat_timeout + fence_timeout.
    ("nixl", "prefill-kill", "mid-transfer"),
    # The link cut mid-transfer, one cell per backend: what the engine's TCP connections still held
    # must not land after FAILED (prefill resets them: plugins/tcpfence.py; docs/failures.md).
    ("mooncake", "net-cut", "mid-transfer"),
    ("nixl", "net-cut", "mid-transfer"),
    ("ucx", "net-cut", "mid-transfer"),
]


@pytest.mark.parametrize("backend, fault, phase", SAMPLE, ids=["-".join(c) for c in SAMPLE])
def test_the_survivor_fails_the_room_in_time_and_no_byte_lands_after_failed(
    tmp_path: Path, backend: str, fault: str, phase: str
) -> None:
    if not get_registry().backend_available(backend):
        pytest.fail(f"backend {backend!r} is not installed here (scripts/setup.sh installs it)")
    cell = run_cell(backend, fault, phase, tmp_path)
    if cell.skipped:
        pytest.skip(cell.skipped)
    assert cell.error is None, table([cell])
    assert cell.survivor_failed_s is not None and cell.survivor_failed_s <= BOUND, table([cell])
    # 0, except one batch (docs/failures.md): a prefill frozen inside an engine call finishes it on resume, and
    # a decode that was itself stopped copies in what its kernel had already received.
    assert cell.late_pages is not None and cell.late_pages <= cell.late_allowed, table([cell])
    assert not cell.prefill_success_after_decode_failed, table([cell])
    if fault.startswith("prefill"):  # decode survives: its room ends fenced, and nothing lands after that
        assert cell.fenced_s is not None and cell.late_after_fenced == 0, table([cell])
        # frozen: FAILED before the prefill could confirm; killed: gone, so fenced at FAILED
        assert cell.fenced_at_failed is fault.endswith("kill"), table([cell])
    assert cell.resumed_peer_served or fault.endswith("kill"), table([cell])  # net cells: both sides serve a room over the restored link
    assert cell.served_fresh_peer or fault.startswith("net"), table([cell])  # no fresh process in a net cell
    assert cell.ok, table([cell])
