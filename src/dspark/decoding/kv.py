"""KV caches for the batched engine.

``RaggedKV`` is the target's cache: one row per request, and row r holds positions 0..length[r]-1
at slots 0..length[r]-1 (slot == position). A forward writes its T new tokens at slots
length[r]..length[r]+T-1 of each row, whatever their ragged real length; ``commit`` then advances
length[r] by the number of tokens that survived verification. Rejected drafts and padding are
never cropped: they sit beyond length[r], are invisible to the causal mask (a query at position p
sees slots <= p, all written in this forward or committed before), and the next forward overwrites
them. So "crop to the committed length" is just setting ``length``.

It plugs into Hugging Face models as a ``Cache`` whose mask we build ourselves (a prepared 4-D mask
is passed through untouched by transformers), so no model code is patched. The buffers have a fixed
capacity that grows by doubling; a CUDA-graph path can keep the same layout with a static capacity.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..core.types import DraftCache

__all__ = ["RaggedKV", "concat_draft_caches", "select_draft_cache"]


class RaggedKV(Cache):
    def __init__(
        self,
        k: list[Tensor],
        v: list[Tensor],
        length: Tensor,
        sliding_window: int | None = None,
        layer_types: list[str] | None = None,
    ):
        super().__init__(layers=[])
        self.k, self.v = k, v  # per layer [R, Hkv, capacity, hd]
        self.length = length  # [R] long: committed tokens per row
        self.sliding_window = sliding_window
        self.layer_types = layer_types
        self._rows: Tensor | None = None  # write plan of the current forward
        self._slots: Tensor | None = None
        self._visible = 0

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def empty(cls, model_config, batch: int, capacity: int, dtype, device) -> RaggedKV:
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        shape = (batch, heads, max(int(capacity), 1), head_dim)
        n = int(cfg.num_hidden_layers)
        types = list(getattr(cfg, "layer_types", None) or []) or None
        window = getattr(cfg, "sliding_window", None) if types and "sliding_attention" in types else None
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
            torch.zeros(batch, dtype=torch.long, device=device),
            sliding_window=window,
            layer_types=types,
        )

    @property
    def batch(self) -> int:
        return int(self.length.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[2])

    def _grow(self, need: int) -> None:
        if need <= self.capacity:
            return
        extra = max(need, 2 * self.capacity) - self.capacity
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                store[i] = torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], dim=2)

    # ---- one forward --------------------------------------------------------------------------
    def plan(self, num_tokens: int, dtype: torch.dtype) -> Tensor | dict:
        """Prepare a forward of ``num_tokens`` tokens per row at positions length[r] + t; returns the
        attention mask to hand to the model (additive, [R, 1, T, S])."""
        r, t = self.batch, int(num_tokens)
        device = self.length.device
        pos = self.length[:, None] + torch.arange(t, device=device)  # [R, T] query positions == slots
        visible = int(pos.max()) + 1 if pos.numel() else t
        self._grow(visible)
        self._rows = torch.arange(r, device=device).repeat_interleave(t)
        self._slots = pos.reshape(-1)
        self._visible = visible
        keys = torch.arange(visible, device=device)
        allowed = keys[None, None, :] <= pos[:, :, None]  # causal over absolute positions
        full = self._additive(allowed, dtype)
        if self.sliding_window:
            local = self._additive(
                allowed & (pos[:, :, None] - keys[None, None, :] < self.sliding_window), dtype
            )
            return {"full_attention": full, "sliding_attention": local}
        return full

    @staticmethod
    def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if self._rows is None:
            raise RuntimeError(
                "RaggedKV.update called without plan(): build the mask with cache.plan(T) first"
            )
        r, h, t, d = key_states.shape
        k, v = self.k[layer_idx], self.v[layer_idx]
        # Advanced indices around a slice put the indexed dim first: k[rows, :, slots] is [R*T, H, hd].
        k[self._rows, :, self._slots] = key_states.transpose(1, 2).reshape(r * t, h, d).to(k.dtype)
        v[self._rows, :, self._slots] = value_states.transpose(1, 2).reshape(r * t, h, d).to(v.dtype)
        return k[:, :, : self._visible], v[:, :, : self._visible]

    def commit(self, counts: Tensor) -> None:
        """Keep the first counts[r] tokens of the last forward in row r (the rest is dropped)."""
        self.length = self.length + counts.to(self.length)
        self._rows = self._slots = None

    # ---- what transformers asks a Cache -------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.length.max()) if self.batch else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._visible or query_length, 0

    @property
    def is_sliding(self) -> list[bool]:
        return (
            [t == "sliding_attention" for t in self.layer_types]
            if self.layer_types
            else [False] * len(self.k)
        )

    @property
    def is_compileable(self) -> bool:
        return False

    # ---- continuous batching ------------------------------------------------------------------
    def select(self, index: Tensor) -> RaggedKV:
        """The rows `index` (a copy), e.g. the requests still running."""
        return RaggedKV(
            [k[index] for k in self.k],
            [v[index] for v in self.v],
            self.length[index],
            self.sliding_window,
            self.layer_types,
        )

    @staticmethod
    def concat(a: RaggedKV | None, b: RaggedKV | None) -> RaggedKV | None:
        """Rows of a, then rows of b (new requests joining a running batch)."""
        if a is None or a.batch == 0:
            return b
        if b is None or b.batch == 0:
            return a
        cap = max(a.capacity, b.capacity)
        for c in (a, b):
            c._grow(cap)
        return RaggedKV(
            [torch.cat([x[..., :cap, :], y[..., :cap, :]]) for x, y in zip(a.k, b.k)],
            [torch.cat([x[..., :cap, :], y[..., :cap, :]]) for x, y in zip(a.v, b.v)],
            torch.cat([a.length, b.length]),
            a.sliding_window,
            a.layer_types,
        )


def concat_draft_caches(a: DraftCache | None, b: DraftCache | None) -> DraftCache | None:
    """Rows of a, then rows of b, padding the context axis to the longer of the two."""
    if a is None or a.length.numel() == 0:
        return b
    if b is None or b.length.numel() == 0:
        return a

    def pad(t: Tensor, c: int) -> Tensor:
        return (
            t if t.shape[2] == c else torch.cat([t, t.new_zeros(*t.shape[:2], c - t.shape[2], t.shape[3])], 2)
        )

    def cat(xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
        out = []
        for x, y in zip(xs, ys):
            c = max(x.shape[2], y.shape[2])
            out.append(torch.cat([pad(x, c), pad(y, c)]))
        return out

    return DraftCache(
        k=cat(a.k, b.k),
        v=cat(a.v, b.v),
        length=torch.cat([a.length, b.length]),
        extra={key: torch.cat([a.extra[key], b.extra[key]]) for key in a.extra},
    )


def select_draft_cache(cache: DraftCache, index: Tensor) -> DraftCache:
    """The cache of a subset of requests (continuous batching)."""
    return DraftCache(
        k=[k[index] for k in cache.k],
        v=[v[index] for v in cache.v],
        length=cache.length[index],
        extra={key: val[index] for key, val in cache.extra.items()},
    )
