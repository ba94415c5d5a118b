"""Greedy generation with the draft head alongside: prefill in chunks, decode one token at a time.

The prefill server, the decode server and the colocated reference all run
these two functions; only where the caches live in between differs.

The draft (MTP) head guesses, at every step, the token after the next one.
Its guesses are recorded and checked like the tokens (they depend on the
draft's own caches, which kvbridge moves too); the tokens themselves are the
target model's greedy choices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .cache import Caches, Seq, Sizes
from .model import DRAFT_LAYER, TP, Model, ModelConfig

__all__ = ["Output", "prefill_chunks", "decode_step", "colocated"]


@dataclass
class Output:
    """A request's generated tokens and the draft head's guesses (guess ``i`` is for token ``i + 1``)."""

    tokens: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)


def prefill_chunks(model: Model, c: Caches, s: Seq, prompt: list[int], chunk: int,
                   on_layer: Callable[[int, bool], None] | None = None) -> Iterator[tuple[int, int]]:
    """Run the prompt ``chunk`` tokens at a time, yielding ``(start, end)`` after each chunk's caches are
    written. After the last, ``s.first`` holds the first generated token and the draft head's guess.
    ``on_layer(layer id, draft)`` is called as each layer of a chunk has written its caches (the draft
    head's layer last, before ``s.first`` is set)."""
    toks = torch.tensor(prompt, device=model.device)
    n = len(prompt)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        hidden, logits = model.forward(c, s, toks[start:end],
                                       None if on_layer is None else lambda layer: on_layer(layer, False))
        if end == n:
            first = int(logits.argmax())
            following = torch.cat([toks[start + 1:end], torch.tensor([first], device=model.device)])
        else:
            following = toks[start + 1:end + 1]
        guess = int(model.draft(c, s, hidden, following).argmax()) if model.cfg.draft else -1
        if on_layer is not None and model.cfg.draft:
            on_layer(DRAFT_LAYER, True)
        if end == n:
            s.first = (first, guess)
        yield start, end


def decode_step(model: Model, c: Caches, s: Seq, token: int) -> tuple[int, int]:
    """Feed ``token``; returns (the next token, the draft head's guess at the one after)."""
    hidden, logits = model.forward(c, s, torch.tensor([token], device=model.device))
    nxt = int(logits.argmax())
    guess = int(model.draft(c, s, hidden, torch.tensor([nxt], device=model.device)).argmax()) if model.cfg.draft else -1
    return nxt, guess


def generate(model: Model, c: Caches, s: Seq, first: tuple[int, int], max_new_tokens: int) -> Output:
    """Decode from the first token and guess prefill produced (a prefill run here, or a transfer)."""
    out = Output([first[0]], [first[1]])
    while len(out.tokens) < max_new_tokens:
        nxt, guess = decode_step(model, c, s, out.tokens[-1])
        out.tokens.append(nxt)
        out.draft.append(guess)
    return out


def colocated(cfg: ModelConfig, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu",
              stop: Callable[[], bool] = lambda: False) -> list[Output]:
    """The reference: the same model, one process, TP 1, each prompt prefilled in one chunk, no transfer.
    ``stop()`` is asked between requests (it ends the run early, with fewer outputs)."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    model = Model(cfg, TP(), device)
    caches = Caches(cfg, TP(), device, "prefill", Sizes(pages=-(-longest // cfg.page_size), slots=1))
    outputs = []
    for i, prompt in enumerate(prompts):
        if stop():
            break
        s = caches.alloc(i, len(prompt) + max_new_tokens)
        assert s is not None
        for _ in prefill_chunks(model, caches, s, prompt, len(prompt)):
            pass
        outputs.append(generate(model, caches, s, s.first, max_new_tokens))
        caches.free(s)
    return outputs
