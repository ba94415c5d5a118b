"""The control-plane fuzzer's sample (``kvbridge.testing.fuzz``); the 100,000-message run is a command.

``python -m kvbridge.testing.fuzz --messages 100000`` runs the full run (docs/security.md).
"""

from __future__ import annotations

from kvbridge.testing.fuzz import KINDS, run


def test_hostile_control_messages_leave_both_ranks_serving_byte_exact_and_bounded():
    result = run(2000, seed=13, verbose=False)
    assert result["caught_up"], "the prefill rank did not answer after the fuzz"
    assert result["errors_logged"] == [], result["errors_logged"]  # no exception escaped a handler
    assert result["prefill_serves"] and result["decode_serves"]
    grew = result["grew"]
    assert grew["threads"] <= 2 and grew["fds"] <= 16 and grew["rss"] < 64 << 20, grew
    for target in ("prefill", "bootstrap", "decode"):
        assert sum(result["sent"][target].values()) > 400, result["sent"]
    sent_kinds = set().union(*(set(s) for s in result["sent"].values()))
    assert sent_kinds == set(KINDS), sent_kinds
    refused = result["rejected"]
    for endpoint in ("prefill", "bootstrap", "decode"):
        for reason in ("unauthenticated", "forged", "replayed", "malformed"):
            assert refused.get(endpoint, {}).get(reason, 0) > result["rejected_before"].get(endpoint, {}).get(reason, 0), (endpoint, reason, refused)
