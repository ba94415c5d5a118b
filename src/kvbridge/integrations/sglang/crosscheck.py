"""Does kvbridge's description of SGLang's pools agree with SGLang's own ``KVArgs``?

SGLang fills its ``KVArgs`` (``kv_data_ptrs``/``lens``/``item_lens``, the
``aux_*`` lists and one ``state_*`` component per :class:`StateType`) from the
same pools with ``get_kv_transfer_buf_infos`` and ``setup_state_kv_args``.
Every entry there must be exactly one kvbridge region (same address, size and
bytes per item, the right state type, target or draft) in SGLang's order
(per list: K layers, then V layers; conv, then temporal; SGLang's state layer ids where it reports them), and kvbridge must describe nothing
SGLang does not register. The adapter's manager refuses to start otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbridge.core import KVArgs, Region

from .handlers import C128_STATE, DSA_STATE

__all__ = ["STATE_TYPES", "compare"]

#: SGLang ``StateType`` values kvbridge moves, and the kvbridge state type of their regions.
STATE_TYPES = {"swa": "swa", "dsa": DSA_STATE, "mamba": "mamba", C128_STATE: C128_STATE}
#: SGLang's order inside one list: by role (this rank), then by layer. DeepSeek-V4's kv_data lists
#: C4 KV, C4 indexer, C128 KV; its SWA component the window latents, then the C4 state, then the C4 indexer state.
_ROLE_ORDER = {"k": 0, "kv": 0, "indexer": 0, "conv": 0, "c4": 0, "v": 1, "temporal": 1, "c4_indexer": 1,
               "c4_state": 1, "c128": 2, "c4_indexer_state": 2}


def compare(sglang: Any, ours: KVArgs) -> list[str]:
    """Every disagreement between SGLang's KVArgs ``sglang`` and kvbridge's ``ours`` (empty: they agree)."""
    problems: list[str] = []
    by_addr = {r.addr: r for r in ours.regions}
    used: set[str] = set()

    def check(what: str, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int], state_type: str,
              drafts: Sequence[bool], layers: Sequence[int] = ()) -> None:
        hit: list[Region] = []
        for i, (ptr, nbytes, item) in enumerate(zip(ptrs, lens, items)):
            r = by_addr.get(int(ptr))
            if r is None:
                problems.append(f"{what}[{i}] at {int(ptr):#x} ({nbytes} bytes) is not a kvbridge region")
                continue
            used.add(r.name)
            hit.append(r)
            if (r.nbytes, r.stride) != (int(nbytes), int(item)):
                problems.append(f"{what}[{i}]: SGLang registers {nbytes} bytes of {item}-byte items, kvbridge's region "
                                f"{r.name!r} {r.nbytes} bytes of {r.stride}-byte items")
            if (r.state_type, r.draft) != (state_type, drafts[i]):
                problems.append(f"{what}[{i}]: SGLang's entry is {'draft ' if drafts[i] else ''}{state_type}, kvbridge's "
                                f"region {r.name!r} is {'draft ' if r.draft else ''}{r.state_type}")
            if layers and i < len(layers) and int(layers[i]) != r.layer:
                problems.append(f"{what}[{i}]: SGLang's layer id {layers[i]}, kvbridge's region {r.name!r} layer {r.layer}")
        for group in (False, True):
            order = [(_ROLE_ORDER.get(r.role, 2), r.layer) for r in hit if r.draft == group]
            if order != sorted(order):
                names = [r.name for r in hit if r.draft == group]
                problems.append(f"{what}: SGLang's order (K layers, then V layers) is not kvbridge's layer order: {names}")

    n_kv = len(sglang.kv_data_ptrs)
    n_draft = int(getattr(sglang, "num_draft_entries", 0) or 0)
    check("kv_data_ptrs", sglang.kv_data_ptrs, sglang.kv_data_lens, sglang.kv_item_lens, "kv",
          [i >= n_kv - n_draft for i in range(n_kv)])
    check("aux_data_ptrs", sglang.aux_data_ptrs, sglang.aux_data_lens, sglang.aux_item_lens, "metadata",
          [False] * len(sglang.aux_data_ptrs))
    for c, st in enumerate(sglang.state_types):
        value = getattr(st, "value", st)
        if value not in STATE_TYPES:
            problems.append(f"state component {c} is StateType {value!r}, which kvbridge's SGLang integration does not move "
                            f"(it moves: {', '.join(sorted(STATE_TYPES))})")
            continue
        ptrs = sglang.state_data_ptrs[c]
        drafts = [by_addr[p].draft if p in by_addr else False for p in ptrs]  # SGLang appends draft entries to the component
        layer_ids = sglang.state_layer_ids[c] if c < len(getattr(sglang, "state_layer_ids", [])) else []
        check(f"state component {c} ({value})", ptrs, sglang.state_data_lens[c], sglang.state_item_lens[c],
              STATE_TYPES[value], drafts, layer_ids)
    extra = [r.name for r in ours.regions if r.name not in used]
    if extra:
        problems.append(f"kvbridge describes regions SGLang does not register: {extra}")
    return problems
