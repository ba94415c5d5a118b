"""The demo's tiny hybrid model, in one process: what makes the demo's token check meaningful.

- every cache is read back as stored, so chunking does not change a single token;
- every state type kvbridge moves changes the tokens (or the draft head's guesses) when damaged,
  so a transfer that dropped or garbled any of them would fail the check;
- the caches are described through kvbridge's own pool classes, every handler, and pair across TP.
"""

import pytest

# Only where scripts/setup.sh ran with KVBRIDGE_TORCH=none: the demo's model is a torch model.
torch = pytest.importorskip("torch", reason="torch is not installed (KVBRIDGE_TORCH=none); the demo's model needs it")

from kvbridge.core.planning.pairing import pair_layouts
from kvbridge.demo.cache import Caches, Sizes
from kvbridge.demo.generate import colocated, generate, prefill_chunks
from kvbridge.demo.model import LAYERS, TP, Model, ModelConfig

CFG = ModelConfig()
NEW = 8
PROMPTS = [list(b"Prefill computes the caches; decode generates from them. " * 6)[:n] for n in (3, 70, 150, 300)]


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return [(o.tokens, o.draft) for o in colocated(CFG, PROMPTS, NEW)]


def run(chunk, damage=None):
    """Prefill in chunks of ``chunk`` tokens with decode's cache geometry, ``damage`` the caches, decode."""
    model = Model(CFG)
    caches = Caches(CFG, TP(), "cpu", "decode", Sizes(pages=40, slots=2))
    out = []
    for i, prompt in enumerate(PROMPTS):
        s = caches.alloc(i, len(prompt) + NEW)
        for _ in prefill_chunks(model, caches, s, prompt, chunk):
            pass
        if damage is not None:
            damage(caches, s)
        o = generate(model, caches, s, s.first, NEW)
        out.append((o.tokens, o.draft))
        caches.free(s)
    return out


@pytest.mark.parametrize("chunk", [16, 64, 7])
def test_chunked_prefill_gives_the_same_tokens_as_one_chunk(reference, chunk):
    assert run(chunk) == reference


def _prompt_rows(s, n):
    return s.tensors["pages"][: -(-n // CFG.page_size)]


FULL, SWA, SPARSE = LAYERS["full"], LAYERS["swa"], LAYERS["sparse"]
DAMAGE = {
    "kv (full attention)": lambda c, s: (c.k[FULL][s.pages[0]].zero_(), c.v[FULL][s.pages[0]].zero_()),
    "kv (sparse layer)": lambda c, s: c.v[SPARSE].index_fill_(0, _prompt_rows(s, s.length), 0),
    "swa": lambda c, s: c.k[SWA].index_fill_(0, s.tensors["ring"], 0),
    "mamba conv": lambda c, s: c.conv[s.slot].zero_(),
    "mamba ssm": lambda c, s: c.ssm[s.slot].zero_(),
    "nsa index keys": lambda c, s: c.index_k[SPARSE].index_fill_(0, _prompt_rows(s, s.length), 0),
    "nsa scales": lambda c, s: c.index_scale[SPARSE].index_fill_(0, _prompt_rows(s, s.length), -1.0),
    "dsv4 window latents": lambda c, s: c.latent.index_fill_(0, s.tensors["ring"], 0),
    "dsv4 c4 (host rows)": lambda c, s: c.c4.view(-1, CFG.latent).index_fill_(0, s.tensors["c4"][: s.length // 4], 0),
    "dsv4 c4 index keys": lambda c, s: c.c4_index.view(-1, CFG.index_dim).index_fill_(
        0, s.tensors["c4_index"][: s.length // 4], 0),
    "dsv4 c128 summary": lambda c, s: c.summary[s.slot].zero_(),
    "draft kv": lambda c, s: c.draft_v.index_fill_(0, _prompt_rows(s, s.length), 0),
    "draft index keys": lambda c, s: c.draft_ik.index_fill_(0, _prompt_rows(s, s.length), 0),
}


@pytest.mark.parametrize("what", DAMAGE)
def test_damaging_any_state_type_changes_the_output(reference, what):
    damaged = run(64, DAMAGE[what])
    changed = [i for i, (got, want) in enumerate(zip(damaged, reference)) if got != want]
    # The shortest prompt has no compressed token and fits every sparse selection: not all must change.
    assert len(changed) >= 3, f"damaging {what} changed only requests {changed}"


def test_the_caches_are_described_through_every_state_handler():
    args = Caches(CFG, TP(), "cpu", "prefill", Sizes(pages=8, slots=2)).kvargs()
    assert {r.state_type for r in args.regions} == {"kv", "swa", "mamba", "nsa", "dsv4_c4", "dsv4_indexer",
                                                    "dsv4_c128", "metadata"}
    assert {(r.state_type, r.layer) for r in args.regions if r.draft} == {("kv", 100), ("nsa", 100)}


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 4)])
def test_prefill_and_decode_caches_pair_across_tp(prefill_tp, decode_tp):
    """Every prefill rank pairs with every decode rank: heads and Mamba channels sliced, C4 landing
    in host rows of another geometry."""
    sizes = Sizes(pages=8, slots=2)
    every = {"kv_page", "swa_page", "slot", "c4_token", "c128_slot", "metadata_row"}
    reached: dict[int, set[str]] = {d: set() for d in range(decode_tp)}
    for p in range(prefill_tp):
        src = Caches(CFG, TP(p, prefill_tp), "cpu", "prefill", sizes).kvargs()
        for d in range(decode_tp):
            route = pair_layouts(src, Caches(CFG, TP(d, decode_tp), "cpu", "decode", sizes).kvargs())
            assert set(route.spaces) <= every
            reached[d] |= set(route.spaces)
    # Each decode rank gets every index space from some prefill rank (replicated ones from one).
    assert reached == {d: every for d in range(decode_tp)}


def test_layers_are_announced_as_the_model_writes_them_and_the_chunks_last_only_by_finish():
    """The prefill server's layer-wise send: ``Announcer`` hears each layer from ``prefill_chunks`` once
    that layer's caches hold the chunk, and holds the chunk's last layer back until ``finish()`` (the
    host fills the metadata row in between: kvbridge writes it once every layer is announced)."""
    from kvbridge.demo.model import DRAFT_LAYER
    from kvbridge.demo.server import Announcer

    model = Model(CFG)
    caches = Caches(CFG, TP(), "cpu", "prefill", Sizes(pages=40, slots=2))
    prompt = PROMPTS[2]  # 150 tokens: chunks of 64, 64, 22
    s = caches.alloc(0, len(prompt))
    kv = {FULL: caches.k[FULL], SPARSE: caches.k[SPARSE], DRAFT_LAYER: caches.draft_k}
    end = 0
    calls = []

    class Recorder:  # stands in for a Sender: what was announced, and which KV caches held the chunk then
        layers = tuple((layer, False) for layer in sorted(LAYERS.values())) + ((DRAFT_LAYER, True),)

        def layer_ready(self, layers, draft=False, ready=None):
            slot = int(s.kv_slots(torch.tensor([end - 1]))[0])
            held = {layer for layer, buf in kv.items() if buf[slot // CFG.page_size, :, slot % CFG.page_size].any()}
            calls.append((list(layers) if not isinstance(layers, int) else [layers], draft, held))

    announcer = Announcer(torch.device("cpu"))
    chunks = prefill_chunks(model, caches, s, prompt, 64, on_layer=announcer)
    for start in range(0, len(prompt), 64):
        end = min(len(prompt), start + 64)
        announcer.start(Recorder())
        next(chunks)
        assert [c[0] for c in calls] == [[0], [1], [2], [3], [4]]  # the draft layer, computed, is held back
        announcer.finish()
        assert calls == [([0], False, {FULL}), ([1], False, {FULL}), ([2], False, {FULL}), ([3], False, {FULL, SPARSE}),
                         ([4], False, {FULL, SPARSE}), ([DRAFT_LAYER], True, {FULL, SPARSE, DRAFT_LAYER})]
        calls.clear()
    assert s.first != (-1, -1) and next(chunks, None) is None and calls == []  # nothing announced between chunks
