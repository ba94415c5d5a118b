"""The chaos soak, briefly (``python -m kvbridge.testing.soak`` runs it as long as asked).

On two backends, 15 s each: rooms flow from a prefill process that is killed and replaced,
frozen and resumed, whose bootstrap server is restarted, and which is sent hostile frames,
one fault every 3 s. No SUCCESS may be wrong, no byte may land in a FAILED room once it was
fenced, every room must end, a killed prefill's rooms must fail on decode within 2 s and its
replacement serve within the restart bound, and the soak process must not keep threads or file
descriptors.
"""

from __future__ import annotations

import pytest

from kvbridge.core.plugins import get_registry
from kvbridge.testing.soak import KINDS, soak, table


@pytest.mark.parametrize("backend", ["memory", "nixl"])
def test_the_soak_with_kills_freezes_bootstrap_restarts_and_hostile_frames(backend: str) -> None:
    if not get_registry().backend_available(backend):
        pytest.fail(f"backend {backend!r} is not installed here (scripts/setup.sh installs it)")
    report = soak(backend, 15.0, concurrency=8, every=3.0)
    text = table([report])
    assert report.error is None, text
    assert report.unfinished == 0, text
    for kind, stats in report.kinds.items():
        assert stats.wrong_successes == 0 and stats.late_writes == 0, text
        if kind in KINDS:
            assert stats.faults >= 1, text
    kill, freeze = report.kinds["prefill-kill"], report.kinds["prefill-freeze"]
    assert kill.to_failed_s and max(kill.to_failed_s) <= 2.0, text
    assert kill.to_success_s and max(kill.to_success_s) <= 5.0, text
    # heartbeat_timeout (1 s) + fence_timeout (transfer 2 s + heartbeat 1 s), with margin
    assert freeze.to_failed_s and max(freeze.to_failed_s) <= 6.0, text
    assert report.kinds["none"].succeeded > 0 and report.kinds["hostile"].succeeded > 0, text
    start, end = report.resources_start, report.resources_end
    assert end["threads"] <= start["threads"] + 4 and end["fds"] <= start["fds"] + 16, text
