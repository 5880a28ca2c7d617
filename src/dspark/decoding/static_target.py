"""The target's forward over a preallocated (static) KV cache, for the CUDA-graph engine.

Hugging Face's forward is correct but launch-bound at serving batch sizes (≈21 ms per step on the
H200 for SmolLM2-135M whatever the batch) and allocates as it goes, so it cannot be captured in a
CUDA graph. ``StaticTarget`` re-runs the same decoder with the model's own modules (the weights are
shared, never copied) over caches whose addresses never change:

* K/V per layer are ``[rows, Hkv, capacity, hd]``; row r holds request r's positions at slot ==
  position, like ``RaggedKV``. A forward writes every one of its tokens at its position; the
  caller's ``lengths`` say which slots are committed, and a query at position p sees slots <= p
  only, so rejected drafts and padding are invisible and overwritten later ("crop" = set length).
* grouped-query attention runs without repeating the cache: the G query heads of each KV head are
  folded into the query axis ([R, Hkv, G·W, hd]), so SDPA reads each cached key once.
* RoPE comes from the model's own rotary module, tabulated once for positions 0..capacity-1.

Llama-family decoders (llama, mistral without sliding window, qwen2, qwen3) are supported; other
architectures are refused with a message pointing at the plain engine. ``tests/test_fast_engine``
holds this forward equal to the Hugging Face one through ``dspark.target.Target``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["SUPPORTED", "StaticTarget", "UnsupportedTarget"]

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedTarget(ValueError):
    pass


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class StaticTarget:
    """Forward of ``target`` (a ``dspark.target.Target``) over static caches of ``rows`` requests
    and ``capacity`` positions each."""

    def __init__(self, target, rows: int, capacity: int):
        model = target.model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        kind = getattr(cfg, "model_type", "?")
        if kind not in SUPPORTED:
            raise UnsupportedTarget(
                f"the fast engine runs Llama-family targets ({', '.join(SUPPORTED)}); target "
                f"{target.name} is '{kind}': evaluate it with engine=plain"
            )
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            raise UnsupportedTarget(
                f"target {target.name} uses sliding-window attention, which the fast engine does not "
                f"implement: evaluate it with engine=plain"
            )
        self.target = target
        self.base = model.base_model
        self.layers = list(self.base.layers)
        self.rows, self.capacity = int(rows), int(capacity)
        self.num_heads = target.num_heads
        self.num_kv_heads = target.num_kv_heads
        self.head_dim = target.head_dim
        self.groups = self.num_heads // self.num_kv_heads
        self.scale = float(getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.taps = target.layer_ids
        device, dtype = target.device, target.dtype
        shape = (self.rows, self.num_kv_heads, self.capacity, self.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.lengths = torch.zeros(self.rows, dtype=torch.long, device=device)  # committed per row
        pos = torch.arange(self.capacity, device=device)[None]
        probe = torch.zeros(1, 1, self.head_dim, device=device, dtype=dtype)
        cos, sin = self.base.rotary_emb(probe, position_ids=pos)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, hd]
        self.slots = torch.arange(self.capacity, device=device)

    # ---------------------------------------------------------------------------------------
    def forward(self, ids: Tensor, positions: Tensor, start: int = 0) -> tuple[Tensor, Tensor]:
        """Tokens ``ids`` [R, W] at ``positions`` [R, W] for cache rows start..start+R-1.
        Returns (final normed hidden [R, W, d], concatenated tap features [R, W, m·d]). Writes the
        K/V of every token; does not touch ``lengths``. Shapes only: no host synchronisation."""
        r, w = ids.shape
        rows = slice(start, start + r)
        x = self.base.embed_tokens(ids)
        taps = {-1: x} if -1 in self.taps else {}
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [R, 1, W, hd]
        # query (r, head, t) may read slot s <= its position; heads folded as [R, Hkv, G·W].
        visible = self.slots[None, None, :] <= positions[:, :, None]  # [R, W, C]
        mask = visible[:, None, None].expand(r, 1, self.groups, w, self.capacity)
        mask = mask.reshape(r, 1, self.groups * w, self.capacity)
        row_index = torch.arange(start, start + r, device=ids.device)[:, None].expand(r, w)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(
                layer, layer.input_layernorm(x), cos, sin, mask, row_index, positions, i, rows
            )
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.taps:
                taps[i] = x
        hidden = self.base.norm(x)
        return hidden, torch.cat([taps[i] for i in self.taps], dim=-1)

    def _attention(self, layer, x, cos, sin, mask, row_index, positions, i, rows) -> Tensor:
        attn = layer.self_attn
        r, w, _ = x.shape
        q = attn.q_proj(x).view(r, w, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(r, w, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(r, w, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Advanced indices around a slice: cache[rows, :, slots] is [R, W, Hkv, hd].
        self.k[i][row_index, :, positions] = k.transpose(1, 2).to(self.k[i].dtype)
        self.v[i][row_index, :, positions] = v.transpose(1, 2).to(self.v[i].dtype)
        q = q.reshape(r, self.num_kv_heads, self.groups * w, self.head_dim)
        out = F.scaled_dot_product_attention(
            q, self.k[i][rows], self.v[i][rows], attn_mask=mask, scale=self.scale
        )
        out = out.reshape(r, self.num_heads, w, self.head_dim).transpose(1, 2).reshape(r, w, -1)
        return attn.o_proj(out)

    # ---- rows (continuous batching) -----------------------------------------------------------
    def keep_rows(self, index: Tensor) -> None:
        """Move rows ``index`` (the requests still running, in order) to the front."""
        n = index.numel()
        for store in (self.k, self.v):
            for t in store:
                t[:n] = t[index]
        self.lengths[:n] = self.lengths[index]
