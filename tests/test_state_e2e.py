"""The hybrid model's oracle can fail (the end-to-end state tests live in the conformance suite)."""

import msgspec
import numpy as np

from kvbridge.testing.hybrid import Request, Spec, expected


def test_the_oracle_notices_a_page_sent_to_the_wrong_place():
    spec = Spec(backend="none")
    req = Request(room=1, tokens=16, src_pages=[1, 2], dst_pages=[3, 4], src_swa=[0], dst_swa=[0], src_slot=[0],
                  dst_slot=[1], dst_c4_rows=[0, 1], src_meta=0, dst_meta=0)
    wrong = msgspec.structs.replace(req, dst_pages=[4, 3])
    assert not np.array_equal(expected(spec, "kv0.k", None, [req]), expected(spec, "kv0.k", None, [wrong]))
