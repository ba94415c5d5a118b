"""Every state handler x heterogeneous TP / PP x every installed backend, end to end.

A prefill process (all prefill TP x PP ranks) and a decode process (all decode
ranks) move a tiny hybrid model's requests: full KV, SWA, NSA indexer, Mamba
conv/temporal state, DeepSeek-V4 compressed caches (C4 into decode host rows
of a different geometry), optional draft pools, and metadata rows. Decode
checks every buffer of every rank against the global tensors sliced with
plain numpy (see kvbridge.testing.hybrid).
"""

import json
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from kvbridge.testing import available_backends
from kvbridge.testing.hybrid import Request, Spec, expected

BACKENDS = available_backends()
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]


def run(spec: Spec, timeout: float = 120) -> tuple[dict, dict, str]:
    text = msgspec.json.encode(spec).decode()
    cmd = [sys.executable, "-m", "kvbridge.testing.hybrid"]
    prefill = subprocess.Popen([*cmd, "prefill", "--spec", text], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    decode = None
    try:
        first = prefill.stdout.readline()
        assert first.startswith("BOOTSTRAP "), f"prefill did not start: {first!r}"
        decode = subprocess.Popen([*cmd, "decode", "--spec", text, "--bootstrap", first.split()[1]],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        d_out, d_err = decode.communicate(timeout=timeout)
        p_out, p_err = prefill.communicate(timeout=60)
    finally:
        for proc in (prefill, decode):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert decode.returncode == 0 and prefill.returncode == 0, f"{d_out}\n{d_err[-3000:]}\n{p_out}\n{p_err[-3000:]}"
    return json.loads(p_out.splitlines()[-1]), json.loads(d_out.splitlines()[-1]), p_err + d_err


def assert_all_succeeded(prefill: dict, decode: dict) -> None:
    for side in (prefill, decode):
        for room, states in side["rooms"].items():
            assert all(state == "SUCCESS" for state, _ in states), f"{side['role']} room {room}: {states}"
    assert decode["mismatches"] == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("prefill_tp, decode_tp", TP_PAIRS)
def test_every_handler_arrives_byte_exact_across_tp(backend, prefill_tp, decode_tp, layout):
    spec = Spec(backend=backend, prefill_tp=prefill_tp, decode_tp=decode_tp, layout=layout, draft=True)
    assert_all_succeeded(*run(spec)[:2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 4), (4, 1)])
def test_mla_pages_arrive_once_from_one_prefill_rank(backend, prefill_tp, decode_tp):
    assert_all_succeeded(*run(Spec(backend=backend, prefill_tp=prefill_tp, decode_tp=decode_tp, mla=True, draft=True))[:2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_prefill_pp2_stages_send_their_layers_into_decode_pp1(backend, prefill_tp):
    assert_all_succeeded(*run(Spec(backend=backend, prefill_pp=2, prefill_tp=prefill_tp, decode_tp=1))[:2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_draft_pools_nothing_changes(backend):
    assert_all_succeeded(*run(Spec(backend=backend, draft=False, prefill_tp=2, decode_tp=1))[:2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_tokens", [2, 3])  # 2: host rows line up with device pages; 3: they do not
def test_dsv4_c4_lands_in_host_rows_aligned_or_not(backend, row_tokens):
    assert_all_succeeded(*run(Spec(backend=backend, c4_row_tokens=row_tokens))[:2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_indexed_state_mismatch_is_trimmed_with_a_warning(backend):
    prefill, decode, logs = run(Spec(backend=backend, extra_swa_pages=1, prefill_tp=2, decode_tp=1))
    assert_all_succeeded(prefill, decode)
    assert "room 1000: swa_page index lists differ (prefill" in logs and "sending the first" in logs


@pytest.mark.parametrize("backend", BACKENDS)
def test_strict_makes_a_page_indexed_mismatch_an_error(backend):
    prefill, decode, _ = run(Spec(backend=backend, extra_swa_pages=1, strict=True, requests=2))
    for side in (prefill, decode):
        for states in side["rooms"].values():
            assert states[0][0] == "FAILED" and "strict_index_lengths is set" in states[0][1]
    assert decode["mismatches"] == []  # nothing outside the failed rooms' own items was touched


@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_indexed_mismatch_is_an_error_on_both_sides(backend):
    prefill, decode, _ = run(Spec(backend=backend, extra_slots=1, requests=2, prefill_tp=2, decode_tp=2))
    for side in (prefill, decode):
        for states in side["rooms"].values():
            for state, reason in states:
                assert state == "FAILED" and "'slot' is slot-indexed; they must match" in reason
    assert decode["mismatches"] == []


def test_the_oracle_notices_a_page_sent_to_the_wrong_place():
    spec = Spec(backend="none")
    req = Request(room=1, tokens=16, src_pages=[1, 2], dst_pages=[3, 4], src_swa=[0], dst_swa=[0], src_slot=[0],
                  dst_slot=[1], dst_c4_rows=[0, 1], src_meta=0, dst_meta=0)
    wrong = msgspec.structs.replace(req, dst_pages=[4, 3])
    assert not np.array_equal(expected(spec, "kv0.k", None, [req]), expected(spec, "kv0.k", None, [wrong]))
