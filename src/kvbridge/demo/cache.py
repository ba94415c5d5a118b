"""The model's memory pools on one rank, the requests' places in them, and how kvbridge sees them.

Every cache is a torch tensor inside a pool class kvbridge knows, so
:meth:`Caches.kvargs` is one call to :func:`kvbridge.core.description.describe.describe`,
which resolves each pool to its state handler:

- ``KVPool``: K and V of the full and the sparse attention layer, head-major
  pages ``[pages, kv_heads_local, page_size, head_dim]`` (bf16);
- ``SWAPool``: the window layer's K and V in their own pages; a request holds
  a ring of ``ring_pages`` of them;
- ``MambaPool``: conv state ``[slots, kernel-1, x|B|C channels_local]`` (bf16)
  and SSM state ``[slots, heads_local, head_dim, state]`` (fp32);
- ``NSAPool``: the sparse layer's int8 index keys and fp32 scales, per KV page;
- ``DSV4HiSparsePool``: the compressed layer's window latents (MLA-like, in the
  window ring), its C4 compressed tokens, their index keys (per KV page) and
  the running summary per slot (C128);
- ``MetadataPool``: one row per request (room, prompt length, first token,
  the draft head's first guess), written last by kvbridge;
- draft pools (MTP head): its own ``KVPool`` and ``NSAPool``.

Prefill and decode allocate the same pools, except C4: prefill keeps it in
device pages next to the KV pages, decode in **host** rows of
``c4_row_tokens`` compressed tokens (as DeepSeek-V4 HiSparse does).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbridge.core.description.describe import describe
from kvbridge.core.description.layout import KVArgs
from kvbridge.core.description.pools import KVPool, MetadataPool
from kvbridge.state_handlers.dsv4_hisparse import C4_SPACE, C128_SPACE, DSV4HiSparsePool, c4_token_indices
from kvbridge.state_handlers.mamba import SLOT_SPACE, MambaPool
from kvbridge.state_handlers.nsa import NSAPool
from kvbridge.state_handlers.swa import SWA_PAGE_SPACE, SWAPool

from .model import DRAFT_LAYER, LAYERS, TP, ModelConfig

__all__ = ["Caches", "Seq", "Sizes", "META"]

#: Metadata row columns (int64; 8 of them: a 64-byte row).
META = {"room": 0, "prompt_len": 1, "first_token": 2, "draft_token": 3}


@dataclass(frozen=True)
class Sizes:
    pages: int = 512  # KV pages of page_size tokens
    slots: int = 16  # requests held at once: state slots, window rings, metadata rows
    c4_row_tokens: int = 3  # decode's host C4 rows (prefill pages hold page_size // ratio)


class Allocator:
    """Lowest indices first, so a request's pages tend to be contiguous (fewer descriptors)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))

    def has(self, n: int) -> bool:
        return n <= len(self.free)

    def take(self, n: int) -> list[int]:
        if not self.has(n):
            raise RuntimeError(f"{n} wanted, {len(self.free)} free")
        return [heapq.heappop(self.free) for _ in range(n)]

    def give(self, items: list[int]) -> None:
        for i in items:
            heapq.heappush(self.free, i)


@dataclass
class Seq:
    """One request's places in the pools of one rank, and how many tokens are cached."""

    room: int
    pages: list[int]
    ring: list[int]
    slot: int
    row: int
    c4_rows: list[int]
    page_size: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    length: int = 0  # tokens whose caches are written
    first: tuple[int, int] = (-1, -1)  # after prefill: the first token and the draft head's guess

    def kv_slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Token position -> flat token index in the KV pages."""
        return self.tensors["pages"][pos // self.page_size] * self.page_size + pos % self.page_size

    def ring_slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Token position -> flat token index in the window pages (a ring)."""
        ring = self.tensors["ring"]
        return ring[(pos // self.page_size) % len(ring)] * self.page_size + pos % self.page_size


class Caches:
    """Every pool of one rank (its TP shard), with allocators for requests."""

    def __init__(self, cfg: ModelConfig, tp: TP, device: str | torch.device, role: str, sizes: Sizes = Sizes()) -> None:
        self.cfg, self.tp, self.role, self.sizes = cfg, tp, role, sizes
        self.device = dev = torch.device(device)
        P, D, bf16 = cfg.page_size, cfg.head_dim, torch.bfloat16
        kv_heads = cfg.kv_heads // tp.size
        ring_total = sizes.slots * cfg.ring_pages

        def zeros(*shape: int, dtype: torch.dtype = bf16, on: torch.device = dev) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=on)

        full, window, sparse = LAYERS["full"], LAYERS["swa"], LAYERS["sparse"]
        self.k = {full: zeros(sizes.pages, kv_heads, P, D), sparse: zeros(sizes.pages, kv_heads, P, D),
                  window: zeros(ring_total, kv_heads, P, D)}
        self.v = {layer: torch.zeros_like(t) for layer, t in self.k.items()}
        self.index_k = {sparse: zeros(sizes.pages, P, cfg.index_dim, dtype=torch.int8)}
        self.index_scale = {sparse: zeros(sizes.pages, P, dtype=torch.float32)}
        channels = sum(cfg.conv_groups) // tp.size
        self.conv = zeros(sizes.slots, cfg.conv_kernel - 1, channels)
        self.ssm = zeros(sizes.slots, cfg.ssm_heads // tp.size, cfg.ssm_head_dim, cfg.ssm_state, dtype=torch.float32)
        self.latent = zeros(ring_total, P, cfg.latent)
        per_page = P // cfg.ratio
        if role == "decode":  # HiSparse: compressed tokens go to host memory, rows of another size
            self.c4_per_item = sizes.c4_row_tokens
            c4_rows = -(-sizes.pages * per_page // sizes.c4_row_tokens)
            self.c4 = zeros(c4_rows, self.c4_per_item, cfg.latent, on=torch.device("cpu"))
            if dev.type == "cuda":
                self.c4 = self.c4.pin_memory()
        else:
            self.c4_per_item = per_page
            self.c4 = zeros(sizes.pages, per_page, cfg.latent)
        self.c4_index = zeros(sizes.pages, per_page, cfg.index_dim)
        self.summary = zeros(sizes.slots, cfg.latent, dtype=torch.float32)
        self.meta = zeros(sizes.slots, 8, dtype=torch.int64, on=torch.device("cpu"))
        self.draft_k = zeros(sizes.pages, kv_heads, P, D)
        self.draft_v = torch.zeros_like(self.draft_k)
        self.draft_ik = zeros(sizes.pages, P, cfg.index_dim, dtype=torch.int8)
        self.draft_is = zeros(sizes.pages, P, dtype=torch.float32)
        self._pages, self._slots = Allocator(sizes.pages), Allocator(sizes.slots)
        self._ring, self._c4 = Allocator(ring_total), Allocator(int(self.c4.shape[0]))

    # -- how kvbridge sees them ----------------------------------------------------------------
    def pools(self) -> tuple[list[Any], list[Any]]:
        """(pools, draft pools) as kvbridge's pool classes, over the tensors above."""
        cfg, P = self.cfg, self.cfg.page_size
        full, window, sparse, compressed = LAYERS["full"], LAYERS["swa"], LAYERS["sparse"], LAYERS["compressed"]
        pools = [
            KVPool(k=[self.k[full], self.k[sparse]], v=[self.v[full], self.v[sparse]], layer_ids=[full, sparse],
                   page_size=P, kv_heads=cfg.kv_heads, layout="hnd"),
            SWAPool(k=[self.k[window]], v=[self.v[window]], layer_ids=[window], page_size=P, kv_heads=cfg.kv_heads,
                    layout="hnd"),
            MambaPool(conv=[self.conv], temporal=[self.ssm], layer_ids=[LAYERS["mamba"]], conv_groups=cfg.conv_groups,
                      temporal_heads=cfg.ssm_heads),
            NSAPool(index_k=[self.index_k[sparse]], scales=[self.index_scale[sparse]], layer_ids=[sparse], page_size=P),
            DSV4HiSparsePool(k=[self.latent], v=None, layer_ids=[compressed], page_size=P, c4=[self.c4],
                             c4_tokens_per_item=self.c4_per_item, indexer=[self.c4_index], c128=[self.summary],
                             compressed_layer_ids=[compressed], ratio=cfg.ratio),
            MetadataPool(buffers=[self.meta]),
        ]
        draft = [
            KVPool(k=[self.draft_k], v=[self.draft_v], layer_ids=[DRAFT_LAYER], page_size=P, kv_heads=cfg.kv_heads,
                   layout="hnd"),
            NSAPool(index_k=[self.draft_ik], scales=[self.draft_is], layer_ids=[DRAFT_LAYER], page_size=P),
        ] if cfg.draft else []
        return pools, draft

    def kvargs(self) -> KVArgs:
        """This rank's memory description: every pool through its state handler."""
        pools, draft = self.pools()
        return describe(pools, draft_pools=draft, dtype="bf16", page_size=self.cfg.page_size,
                        tp_rank=self.tp.rank, tp_size=self.tp.size)

    # -- requests -------------------------------------------------------------------------------
    def alloc(self, room: int, tokens: int) -> Seq | None:
        """Places for a request that will hold ``tokens`` tokens, or None until others are freed."""
        cfg, P = self.cfg, self.cfg.page_size
        n_pages = -(-tokens // P)
        n_c4 = tokens // cfg.ratio
        n_rows = -(-n_c4 // self.c4_per_item) if self.role == "decode" else 0
        if not (self._pages.has(n_pages) and self._ring.has(cfg.ring_pages) and self._slots.has(1)
                and self._c4.has(n_rows)):
            return None
        pages, ring, rows = self._pages.take(n_pages), self._ring.take(cfg.ring_pages), self._c4.take(n_rows)
        slot = self._slots.take(1)[0]
        s = Seq(room=room, pages=pages, ring=ring, slot=slot, row=slot, c4_rows=rows, page_size=P)
        c4_items = rows if self.role == "decode" else pages
        s.tensors = {
            "pages": torch.tensor(pages, device=self.device),
            "ring": torch.tensor(ring, device=self.device),
            "c4": torch.as_tensor(c4_token_indices(c4_items, self.c4_per_item, tokens, cfg.ratio),
                                  device=self.c4.device),
            "c4_index": torch.as_tensor(c4_token_indices(pages, P // cfg.ratio, tokens, cfg.ratio), device=self.device),
        }
        for state in (self.conv, self.ssm, self.summary):  # a new request starts from zero state
            state[slot].zero_()
        return s

    def free(self, s: Seq) -> None:
        self._pages.give(s.pages)
        self._ring.give(s.ring)
        self._slots.give([s.slot])
        self._c4.give(s.c4_rows)

    def transfer_indices(self, s: Seq, prompt_len: int) -> tuple[list[int], dict[str, np.ndarray]]:
        """What kvbridge moves for a prompt of ``prompt_len`` tokens: its KV pages, and the
        state indices (window ring, slot, compressed tokens, summary slot). Both sides call it."""
        cfg = self.cfg
        state = {SWA_PAGE_SPACE: np.asarray(s.ring), SLOT_SPACE: np.asarray([s.slot]), C128_SPACE: np.asarray([s.slot])}
        n_c4 = prompt_len // cfg.ratio
        if n_c4:
            state[C4_SPACE] = s.tensors["c4"][:n_c4].cpu().numpy()
        return s.pages[: -(-prompt_len // cfg.page_size)], state

    # -- access the model uses --------------------------------------------------------------------
    def read_heads(self, buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Tokens ``slots`` (flat token indices) of a head-major paged buffer: ``[T, heads, head_dim]``."""
        P = self.cfg.page_size
        return buf[slots // P, :, slots % P]

    def write_heads(self, buf: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        P = self.cfg.page_size
        buf[slots // P, :, slots % P] = x.to(buf.dtype)

    def write_c4(self, s: Seq, j: int, c4: torch.Tensor, key: torch.Tensor) -> None:
        """Compressed token ``j`` of request ``s`` and its index key."""
        self.c4.view(-1, self.cfg.latent)[s.tensors["c4"][j]] = c4.to(self.c4.device, self.c4.dtype)
        self.c4_index.view(-1, self.cfg.index_dim)[s.tensors["c4_index"][j]] = key.to(self.c4_index.dtype)

    def read_c4(self, s: Seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` compressed tokens of ``s`` (from host memory on decode) and their index keys."""
        c4 = self.c4.view(-1, self.cfg.latent)[s.tensors["c4"][:n]].to(self.device, torch.float64)
        keys = self.c4_index.view(-1, self.cfg.index_dim)[s.tensors["c4_index"][:n]].to(torch.float64)
        return c4, keys
