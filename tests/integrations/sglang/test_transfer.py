"""SGLang's real pools moved through kvbridge's SGLang adapter classes, byte-exact, across heterogeneous TP."""

import itertools

import pytest
import sglang_pd as pd
import sglang_rig as rig

_rooms = itertools.count(1000)

# (kind, prefill TP, decode TP, draft pools, backend)
CASES = [
    *[(kind, p, d, False, "memory") for kind in rig.KINDS for p, d in ((2, 1), (1, 2))],
    *[(kind, p, d, True, "memory") for kind in ("mha", "mla", "dsa") for p, d in ((2, 1), (1, 2))],
    *[(kind, p, d, draft, "nixl") for kind, draft in (("mha", True), ("swa", False), ("dsa", False), ("mamba", False))
      for p, d in ((2, 1), (1, 2))],
    # A third-party backend (examples/kvbridge-zmq, installed by setup.sh), chosen by name like any other.
    ("swa", 2, 1, False, "zmq"),
]


@pytest.mark.parametrize("kind,prefill_tp,decode_tp,draft,backend", CASES,
                         ids=[f"{k}-tp{p}to{d}{'-draft' if dr else ''}-{b}" for k, p, d, dr, b in CASES])
def test_request_lands_byte_exact(kind, prefill_tp, decode_tp, draft, backend, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_SGLANG_BACKEND", backend)
    room = next(_rooms)
    assert pd.transfer(kind, prefill_tp, decode_tp, draft, seed=room, room=room, backend=backend) == []


@pytest.mark.parametrize("kind", rig.KINDS)
def test_the_oracle_reports_a_decode_rank_that_received_nothing(kind):
    g = rig.global_tensors(kind, False, seed=1)
    untouched = rig.make_rank(kind, 0, 1, draft=False, fill=None)
    problems = pd.check_decode(untouched, g)
    assert len(problems) == len(rig.rank_buffers(untouched)) + len(rig.metadata_rows(untouched.metadata))


def test_decode_allocating_more_window_pages_than_prefill_sends_is_trimmed_by_kvbridges_policy(monkeypatch, caplog):
    """Seed 001: a page-indexed state list longer on decode is trimmed to the shorter side, with a warning, on every backend."""
    monkeypatch.setenv("KVBRIDGE_SGLANG_BACKEND", "memory")
    room = next(_rooms)
    with caplog.at_level("WARNING"):
        problems = pd.transfer("swa", 2, 1, False, seed=room, room=room, backend="memory", dst_swa=[*pd.DST_SWA, 0])
    assert problems == []  # the oracle: the window's pages landed, decode's extra page (0) is still zero
    assert any("swa_page" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_abort_fails_both_sides_with_the_reason(side, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_SGLANG_BACKEND", "memory")
    room = next(_rooms)
    texts = pd.transfer("mha", 2, 1, False, seed=room, room=room, backend="memory", abort=side)
    assert len(texts) == 3  # two prefill senders, one decode receiver
    for text in texts:
        assert text.startswith(f"KVTransferError(room={room}): ") and "abort" in text.lower(), text
    assert any(f"aborted by SGLang's {side} scheduler" in t for t in texts)
