"""A tiny hybrid language model whose caches hold every state type kvbridge moves.

Pure torch, seeded random weights, greedy decoding, real tensor parallelism.
Layers, by global layer id (the ids the pools are described with):

====  ===============================================  ===================================
id    layer                                            its cache (``cache.py``)
====  ===============================================  ===================================
0     full attention, GQA                              ``KVPool``: paged K and V
1     sliding-window attention, GQA                    ``SWAPool``: a ring of window pages
2     Mamba-2 style: causal conv over x|B|C, SSM scan  ``MambaPool``: conv and SSM state per slot
3     sparse attention: an indexer picks top-k tokens  ``KVPool`` + ``NSAPool`` (int8 keys, scales)
4     compressed attention (DeepSeek-V4 style):        ``DSV4HiSparsePool``: window latents,
      window latents + ratio-4 compressed tokens       C4 (a host pool on decode), indexer,
      picked by an indexer + a running summary         C128 summary per slot
100   MTP draft head: sparse attention + MLP           draft ``KVPool`` + ``NSAPool``
====  ===============================================  ===================================

Every layer but the compressed one's latent is **sharded across TP ranks**:
query and KV heads, Mamba heads with their x, B and C channels, MLP columns;
each rank computes its share and the output projections are summed with an
all-reduce. Latents, indexers, embeddings and the LM head are replicated.

Every token's computation reads only what the caches hold for earlier
tokens, rounded to the cache's dtype, so chunked prefill, one-token decode,
any TP size and a transfer in between all compute the same thing. Arithmetic
is float64 so that summing partial products in another order (TP 2 vs TP 1)
moves logits by ~1e-15, far below the gap between two tokens: the greedy
tokens of a disaggregated run must equal a colocated run's exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .cache import Caches, Seq

__all__ = ["ModelConfig", "TP", "Model", "LAYERS", "DRAFT_LAYER"]

F64 = torch.float64
LAYERS = {"full": 0, "swa": 1, "mamba": 2, "sparse": 3, "compressed": 4}
DRAFT_LAYER = 100  # draft (MTP) layer ids live in their own band


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  # bytes: prompts are text
    hidden: int = 64
    heads: int = 8  # query heads
    kv_heads: int = 4  # TP 1, 2 and 4 each hold whole KV heads
    head_dim: int = 32
    mlp: int = 128
    page_size: int = 16  # tokens per KV page
    window: int = 32  # sliding window (layers 1 and 4), a multiple of page_size
    ssm_heads: int = 4
    ssm_head_dim: int = 16
    ssm_state: int = 16
    conv_kernel: int = 4
    index_dim: int = 16
    topk: int = 24  # tokens the sparse layers attend to
    latent: int = 32  # compressed layer's latent (MLA-like, replicated)
    ratio: int = 4  # tokens per compressed (C4) token
    topk_compressed: int = 6
    summary_decay: float = 0.98
    draft: bool = True
    seed: int = 0

    @property
    def ring_pages(self) -> int:
        """Window pages per request: enough that the last ``window`` tokens are never overwritten."""
        return self.window // self.page_size + 1

    @property
    def conv_groups(self) -> tuple[int, int, int]:
        """Global channels of x, B and C: each split across TP on its own."""
        return (self.ssm_heads * self.ssm_head_dim, self.ssm_heads * self.ssm_state, self.ssm_heads * self.ssm_state)


@dataclass(frozen=True)
class TP:
    """This rank's place in the tensor-parallel group; ``group`` is a torch.distributed group."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def part(self, total: int) -> slice:
        """This rank's contiguous share of ``total`` heads or channels (kvbridge's ``Shard`` split)."""
        if total % self.size:
            raise ValueError(f"{total} heads/channels cannot be split across TP {self.size}")
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x


def _weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every global weight, from one seeded generator in a fixed order (the same in every process)."""
    g = torch.Generator().manual_seed(cfg.seed)
    H, D, L = cfg.hidden, cfg.head_dim, cfg.latent
    mamba, comp = LAYERS["mamba"], LAYERS["compressed"]
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab, H), "lm_head": (H, cfg.vocab)}
    attn = {"wq": (H, cfg.heads * D), "wk": (H, cfg.kv_heads * D), "wv": (H, cfg.kv_heads * D),
            "wo": (cfg.heads * D, H)}
    indexer = {"wiq": (H, cfg.index_dim), "wik": (H, cfg.index_dim)}
    mlp = {"wg": (H, cfg.mlp), "wu": (H, cfg.mlp), "wd": (cfg.mlp, H)}
    for layer in (LAYERS["full"], LAYERS["swa"], LAYERS["sparse"]):
        shapes.update({f"{layer}.{k}": s for k, s in attn.items()})
    shapes.update({f"{LAYERS['sparse']}.{k}": s for k, s in indexer.items()})
    x, b, c = cfg.conv_groups
    shapes.update({f"{mamba}.{k}": s for k, s in {"wz": (H, x), "wx": (H, x), "wB": (H, b), "wC": (H, c),
                                                  "wdt": (H, cfg.ssm_heads), "conv": (x + b + c, cfg.conv_kernel),
                                                  "wo": (x, H)}.items()})
    shapes.update({f"{comp}.{k}": s for k, s in {"wlat": (H, L), "wq": (H, cfg.heads * L), "wo": (cfg.heads * L, H),
                                                 "wc4": (cfg.ratio, L), "wiq": (H, cfg.index_dim),
                                                 "wik": (L, cfg.index_dim), "wsum": (L, H)}.items()})
    for layer in LAYERS.values():
        shapes.update({f"{layer}.{k}": s for k, s in mlp.items()})
    shapes.update({"draft.win": (2 * H, H), **{f"draft.{k}": s for k, s in {**attn, **indexer, **mlp}.items()}})
    out = {}
    for name, shape in shapes.items():  # dict order is fixed: the same numbers in every process
        fan_in = shape[1] if name == f"{mamba}.conv" else shape[0]
        out[name] = torch.randn(shape, generator=g, dtype=F64) / math.sqrt(fan_in)
    out["embed"] *= math.sqrt(H)
    # Slow decays: the SSM state and the summary carry the whole prompt, so losing them shows.
    out[f"{mamba}.A_log"] = torch.log(torch.linspace(0.02, 0.2, cfg.ssm_heads, dtype=F64))
    out[f"{mamba}.D"] = torch.ones(cfg.ssm_heads, dtype=F64)
    out[f"{mamba}.dt_bias"] = torch.full((cfg.ssm_heads,), -1.0, dtype=F64)
    return out


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x`` ``[T, ..., d]``."""
    d = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (torch.arange(d, dtype=F64, device=x.device) / d))
    ang = pos.to(F64)[:, None] * freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    a, b = x[..., :d], x[..., d:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` holds it: every reader sees the same rounding."""
    return x.to(dtype).to(F64)


def top_k_mask(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """``allowed`` keys whose score is among each row's ``k`` best (ties all kept: no order dependence)."""
    scores = scores.masked_fill(~allowed, -math.inf)
    if scores.shape[-1] <= k:
        return allowed
    kth = scores.topk(k, dim=-1).values[..., -1:]
    return allowed & (scores >= kth)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           own: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention. ``q [T, h, d]``; ``k``, ``v`` ``[S, h, d]``, or ``[S, d]`` shared by every head
    (MLA-like); ``mask [T, S]``; ``own [T, d]``: one more key (= value) per query token, if given."""
    shared = k.dim() == 2
    scale = 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("thd,sd->hts" if shared else "thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(~mask[None], -math.inf)
    if own is not None:
        scores = torch.cat([scores, torch.einsum("thd,td->ht", q, own)[..., None] * scale], -1)
    p = torch.softmax(scores, -1)
    out = torch.einsum("hts,sd->thd" if shared else "hts,shd->thd", p[..., : k.shape[0]], v)
    return out if own is None else out + p[..., -1].T[..., None] * own[:, None, :]


class Model:
    """The target model and the draft head, holding this rank's shard of every weight.

    ``forward`` runs a chunk of tokens of one request, writing its caches;
    ``draft`` runs the draft head over the same positions.
    """

    def __init__(self, cfg: ModelConfig, tp: TP = TP(), device: str | torch.device = "cpu") -> None:
        self.cfg, self.tp, self.device = cfg, tp, torch.device(device)
        q, kv, h = tp.part(cfg.heads), tp.part(cfg.kv_heads), tp.part(cfg.ssm_heads)
        self.heads, self.kv_heads, self.ssm_heads = q.stop - q.start, kv.stop - kv.start, h.stop - h.start
        self.w = {name: _shard(name, t, cfg, tp).contiguous().to(self.device) for name, t in _weights(cfg).items()}

    # -- the model ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, c: Caches, s: Seq, tokens: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` (the next ones of request ``s``), write their caches; returns
        (final hidden states ``[T, hidden]``, logits of the last token). ``on_layer(layer id)`` is
        called as each layer's caches are written (a layer-wise sender announces the layer then)."""
        pos = torch.arange(s.length, s.length + len(tokens), device=self.device)
        h = self.w["embed"][tokens]
        mixers: list[tuple[int, Callable[..., torch.Tensor]]] = [
            (LAYERS["full"], self._full), (LAYERS["swa"], self._window), (LAYERS["mamba"], self._mamba),
            (LAYERS["sparse"], self._sparse), (LAYERS["compressed"], self._compressed)]
        for layer, mix in mixers:
            # Parallel residual: mixer and MLP read the same input and share one all-reduce.
            x = rms_norm(h)
            h = h + self.tp.all_reduce(mix(c, s, x, pos, layer) + self._mlp(x, f"{layer}."))
            if on_layer is not None:
                on_layer(layer)
        s.length += len(tokens)
        h = rms_norm(h)
        return h, h[-1] @ self.w["lm_head"]

    @torch.no_grad()
    def draft(self, c: Caches, s: Seq, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The draft head at the positions of ``hidden`` (the target's, just computed), given the
        token that followed each; writes the draft caches; returns the last position's logits
        (its guess at the token after next)."""
        pos = torch.arange(s.length - len(hidden), s.length, device=self.device)
        x = torch.cat([rms_norm(hidden), rms_norm(self.w["embed"][next_tokens])], -1) @ self.w["draft.win"]
        n = rms_norm(x)
        mix = self._attention(c, s, n, pos, "draft.", c.draft_k, c.draft_v, sparse=(c.draft_ik, c.draft_is))
        x = x + self.tp.all_reduce(mix + self._mlp(n, "draft."))
        return rms_norm(x[-1]) @ self.w["lm_head"]

    # -- mixers ---------------------------------------------------------------------------------
    def _full(self, c: Caches, s: Seq, x: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        return self._attention(c, s, x, pos, f"{layer}.", c.k[layer], c.v[layer])

    def _sparse(self, c: Caches, s: Seq, x: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        indexer = (c.index_k[layer], c.index_scale[layer])
        return self._attention(c, s, x, pos, f"{layer}.", c.k[layer], c.v[layer], sparse=indexer)

    def _window(self, c: Caches, s: Seq, x: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        return self._attention(c, s, x, pos, f"{layer}.", c.k[layer], c.v[layer], window=True)

    def _attention(self, c: Caches, s: Seq, x: torch.Tensor, pos: torch.Tensor, p: str, kbuf: torch.Tensor,
                   vbuf: torch.Tensor, window: bool = False,
                   sparse: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """GQA over the paged cache (or the window ring), optionally restricted to the indexer's top-k."""
        cfg, T, D = self.cfg, len(x), self.cfg.head_dim
        q = rope((x @ self.w[p + "wq"]).view(T, self.heads, D), pos)
        k = stored(rope((x @ self.w[p + "wk"]).view(T, self.kv_heads, D), pos), kbuf.dtype)
        v = stored((x @ self.w[p + "wv"]).view(T, self.kv_heads, D), vbuf.dtype)
        start = int(pos[0])
        # Earlier tokens come from the cache, as stored; this chunk's from k and v (rounded alike).
        lo = max(0, start - cfg.window) if window else 0
        old = torch.arange(lo, start, device=self.device)
        slots = s.ring_slots if window else s.kv_slots
        keys = torch.cat([c.read_heads(kbuf, slots(old)).to(F64), k])
        vals = torch.cat([c.read_heads(vbuf, slots(old)).to(F64), v])
        kpos = torch.cat([old, pos])
        mask = kpos[None, :] <= pos[:, None]
        if window:
            mask &= kpos[None, :] > pos[:, None] - cfg.window
            keep = pos[-cfg.window:]  # what later tokens can see; each lands in its own ring slot
            c.write_heads(kbuf, slots(keep), k[-len(keep):])
            c.write_heads(vbuf, slots(keep), v[-len(keep):])
        else:
            c.write_heads(kbuf, slots(pos), k)
            c.write_heads(vbuf, slots(pos), v)
        if sparse is not None:
            mask = top_k_mask(self._index_scores(c, s, x, pos, old, p, *sparse), mask, cfg.topk)
        rep = self.heads // self.kv_heads
        out = attend(q, keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1), mask)
        return out.reshape(T, -1) @ self.w[p + "wo"]

    def _index_scores(self, c: Caches, s: Seq, x: torch.Tensor, pos: torch.Tensor, old: torch.Tensor, p: str,
                      ibuf: torch.Tensor, sbuf: torch.Tensor) -> torch.Tensor:
        """Indexer scores ``[T, old + T]``: int8 keys with a float32 scale per token, as stored."""
        qi = rope(x @ self.w[p + "wiq"], pos)
        ki = rope(x @ self.w[p + "wik"], pos)
        scale = stored(ki.abs().amax(-1).clamp_min(1e-12) / 127, sbuf.dtype)
        ki8 = torch.round(ki / scale[:, None]).clamp(-127, 127)
        flat_i, flat_s = ibuf.view(-1, ibuf.shape[-1]), sbuf.view(-1)
        slots = s.kv_slots(pos)
        flat_i[slots], flat_s[slots] = ki8.to(ibuf.dtype), scale.to(sbuf.dtype)
        prev = s.kv_slots(old)
        keys = torch.cat([flat_i[prev].to(F64) * flat_s[prev].to(F64)[:, None], ki8 * scale[:, None]])
        return qi @ keys.T

    def _mamba(self, c: Caches, s: Seq, x: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        cfg, w, T, p = self.cfg, self.w, len(x), f"{layer}."
        conv_state, ssm_state = c.conv[s.slot], c.ssm[s.slot]
        xbc = stored(torch.cat([x @ w[p + "wx"], x @ w[p + "wB"], x @ w[p + "wC"]], -1), conv_state.dtype)
        seq = torch.cat([conv_state.to(F64), xbc])  # the last kernel-1 inputs, then this chunk's
        conv_state.copy_(seq[-(cfg.conv_kernel - 1):])
        win = seq.unfold(0, cfg.conv_kernel, 1)  # [T, channels, kernel]
        u = F.silu((win * w[p + "conv"][None]).sum(-1))
        nx, nb = self.ssm_heads * cfg.ssm_head_dim, self.ssm_heads * cfg.ssm_state
        xs = u[:, :nx].view(T, self.ssm_heads, cfg.ssm_head_dim)
        B = u[:, nx:nx + nb].view(T, self.ssm_heads, cfg.ssm_state)
        C = u[:, nx + nb:].view(T, self.ssm_heads, cfg.ssm_state)
        dt = F.softplus(x @ w[p + "wdt"] + w[p + "dt_bias"])
        decay = torch.exp(-torch.exp(w[p + "A_log"]) * dt)
        h = ssm_state.to(F64)
        ys = []
        for t in range(T):  # the recurrence, one token at a time, the state stored as the cache holds it
            h = decay[t, :, None, None] * h + dt[t, :, None, None] * xs[t, :, :, None] * B[t, :, None, :]
            h = stored(h, ssm_state.dtype)
            ys.append(torch.einsum("hpn,hn->hp", h, C[t]) + w[p + "D"][:, None] * xs[t])
        ssm_state.copy_(h)
        y = torch.stack(ys).reshape(T, -1) * F.silu(x @ w[p + "wz"])
        return y @ w[p + "wo"]

    def _compressed(self, c: Caches, s: Seq, x: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        cfg, w, T, r, p = self.cfg, self.w, len(x), self.cfg.ratio, f"{layer}."
        ring = c.latent
        lat = stored(x @ w[p + "wlat"], ring.dtype)
        start, end = int(pos[0]), int(pos[-1]) + 1
        old = torch.arange(max(0, start - cfg.window), start, device=self.device)
        lats = torch.cat([ring.view(-1, cfg.latent)[s.ring_slots(old)].to(F64), lat])
        lpos = torch.cat([old, pos])
        keep = pos[-cfg.window:]
        ring.view(-1, cfg.latent)[s.ring_slots(keep)] = lat[-len(keep):].to(ring.dtype)
        # Compressed tokens completed in this chunk: group j is tokens r*j .. r*j+r-1.
        for j in range(start // r, end // r):
            members = lats[(lpos >= r * j) & (lpos < r * j + r)]
            c4 = stored((members * w[p + "wc4"]).sum(0), c.c4.dtype)
            c.write_c4(s, j, c4, stored(c4 @ w[p + "wik"], c.c4_index.dtype))
        c4s, c4_keys = c.read_c4(s, end // r)
        # The running summary (C128 state), token by token.
        summary = c.summary[s.slot]
        state, sums = summary.to(F64), []
        for t in range(T):
            state = stored(cfg.summary_decay * state + (1 - cfg.summary_decay) * lat[t], summary.dtype)
            sums.append(state)
        summary.copy_(state)
        q = (x @ w[p + "wq"]).view(T, self.heads, cfg.latent)
        done = (torch.arange(len(c4s), device=self.device) * r + r - 1)[None, :] <= pos[:, None]
        picked = top_k_mask(rope(x @ w[p + "wiq"], pos) @ c4_keys.T, done, cfg.topk_compressed) if len(c4s) else done
        in_window = (lpos[None, :] <= pos[:, None]) & (lpos[None, :] > pos[:, None] - cfg.window)
        # Keys = values: window latents, picked compressed tokens, and this token's summary.
        keys = torch.cat([lats, c4s])
        mask = torch.cat([in_window, picked], 1)
        sums_t = torch.stack(sums)
        out = attend(q, keys, keys, mask, own=sums_t).reshape(T, -1) @ w[p + "wo"]
        # The summary also feeds the residual directly; it is replicated, so one rank adds it.
        return out + sums_t @ w[p + "wsum"] if self.tp.rank == 0 else out

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return (F.silu(x @ self.w[p + "wg"]) * (x @ self.w[p + "wu"])) @ self.w[p + "wd"]


def _heads(part: slice, dim: int) -> slice:
    return slice(part.start * dim, part.stop * dim)


def _shard(name: str, w: torch.Tensor, cfg: ModelConfig, tp: TP) -> torch.Tensor:
    """This rank's part of global weight ``name``: column-parallel projections keep its heads'
    (or MLP columns') outputs, row-parallel ones its inputs; the rest is replicated."""
    layer, _, kind = name.rpartition(".")
    q, kv, h, mlp = tp.part(cfg.heads), tp.part(cfg.kv_heads), tp.part(cfg.ssm_heads), tp.part(cfg.mlp)
    D, L, P, N = cfg.head_dim, cfg.latent, cfg.ssm_head_dim, cfg.ssm_state
    if layer == str(LAYERS["mamba"]):
        cols = {"wz": _heads(h, P), "wx": _heads(h, P), "wB": _heads(h, N), "wC": _heads(h, N), "wdt": h,
                "wg": mlp, "wu": mlp}
        if kind in cols:
            return w[:, cols[kind]]
        if kind == "conv":  # channels x|B|C, each group split on its own
            x, b, _ = cfg.conv_groups
            return torch.cat([w[:x][_heads(h, P)], w[x:x + b][_heads(h, N)], w[x + b:][_heads(h, N)]])
        rows = {"wo": _heads(h, P), "wd": mlp, "A_log": h, "D": h, "dt_bias": h}
        return w[rows[kind]] if kind in rows else w
    qd = L if layer == str(LAYERS["compressed"]) else D
    cols = {"wq": _heads(q, qd), "wk": _heads(kv, D), "wv": _heads(kv, D), "wg": mlp, "wu": mlp}
    rows = {"wo": _heads(q, qd), "wd": mlp}
    if layer and kind in cols:
        return w[:, cols[kind]]
    if layer and kind in rows:
        return w[rows[kind]]
    return w  # embeddings, LM head, indexers, latent and compression weights
