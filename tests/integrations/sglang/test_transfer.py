"""SGLang's real pools moved through kvbridge's SGLang adapter classes, byte-exact, across heterogeneous TP."""

import itertools

import pytest
import sglang_pd as pd
import sglang_rig as rig

_rooms = itertools.count(1000)

# (kind, prefill TP, decode TP, draft pools, backend)
CASES = [
    *[(kind, p, d, False, "memory") for kind in rig.KINDS for p, d in ((2, 1), (1, 2))],
    *[(kind, p, d, True, "memory") for kind in ("mha", "mla") for p, d in ((2, 1), (1, 2))],
    *[(kind, p, d, draft, "nixl") for kind, draft in (("mha", True), ("swa", False), ("dsa", False), ("mamba", False))
      for p, d in ((2, 1), (1, 2))],
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
