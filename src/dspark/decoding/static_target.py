"""The target's forward over a preallocated (static) KV cache, for the CUDA-graph engine.

Hugging Face's forward is correct but launch-bound at serving batch sizes (≈21 ms per step on the
H200 for SmolLM2-135M whatever the batch) and allocates as it goes, so it cannot be captured in a
CUDA graph. ``StaticTarget`` re-runs the same decoder from the model's own weights (shared, never
copied) as two pure functions per layer (optionally ``torch.compile``d) over caches whose addresses
never change:

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["SUPPORTED", "StaticTarget", "UnsupportedTarget", "move_rows"]

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedTarget(ValueError):
    pass


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama/Qwen RMSNorm, in the same operation order as transformers (float32 statistics)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def move_rows(tensors: list[Tensor], dst: Tensor, src: Tensor) -> None:
    """In place: rows ``src`` of every tensor copied onto rows ``dst`` (disjoint), keeping
    addresses (captured CUDA graphs read these buffers). Only the rows that change place move:
    a request leaving a 256-row batch costs its successor's row, not the whole cache."""
    for t in tensors:
        t[dst] = t[src]


@dataclass
class LayerWeights:
    """One decoder layer as plain tensors (shared with the model, never copied): the layer
    functions take tensors, not modules, so one compiled graph serves every layer."""

    ln1: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    ln2: Tensor
    gate: Tensor
    up: Tensor
    down: Tensor
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_norm: Tensor | None = None  # qwen3
    k_norm: Tensor | None = None

    @classmethod
    def of(cls, layer) -> LayerWeights:
        a, m = layer.self_attn, layer.mlp
        if any(getattr(p, "bias", None) is not None for p in (m.gate_proj, m.up_proj, m.down_proj)):
            raise UnsupportedTarget("MLP biases are not implemented by the fast engine: use engine=plain")
        return cls(
            ln1=layer.input_layernorm.weight, q=a.q_proj.weight, k=a.k_proj.weight, v=a.v_proj.weight,
            o=a.o_proj.weight, ln2=layer.post_attention_layernorm.weight, gate=m.gate_proj.weight,
            up=m.up_proj.weight, down=m.down_proj.weight, q_bias=a.q_proj.bias, k_bias=a.k_proj.bias,
            v_bias=a.v_proj.bias, o_bias=a.o_proj.bias,
            q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
            k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
        )  # fmt: skip


def attention_inputs(
    x: Tensor, w: LayerWeights, cos: Tensor, sin: Tensor, eps: float, heads: int, kv_heads: int
):
    """Pre-norm, q/k/v projections, (qwen3) per-head q/k norm, RoPE: q [R, H, W, hd], k/v [R, Hkv, W, hd]."""
    r, t, _ = x.shape
    h = _rms(x, w.ln1, eps)
    q = F.linear(h, w.q, w.q_bias).view(r, t, heads, -1).transpose(1, 2)
    k = F.linear(h, w.k, w.k_bias).view(r, t, kv_heads, -1).transpose(1, 2)
    v = F.linear(h, w.v, w.v_bias).view(r, t, kv_heads, -1).transpose(1, 2)
    if w.q_norm is not None:
        q, k = _rms(q, w.q_norm, eps), _rms(k, w.k_norm, eps)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def layer_output(x: Tensor, attn: Tensor, w: LayerWeights, eps: float) -> Tensor:
    """Output projection + residual, then the SwiGLU MLP + residual."""
    x = x + F.linear(attn, w.o, w.o_bias)
    h = _rms(x, w.ln2, eps)
    return x + F.linear(F.silu(F.linear(h, w.gate)) * F.linear(h, w.up), w.down)


class StaticTarget:
    """Forward of ``target`` (a ``dspark.target.Target``) over static caches of ``rows`` requests
    and ``capacity`` positions each."""

    def __init__(self, target, rows: int, capacity: int, compile: bool = False):
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
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedTarget(
                f"target {target.name} uses activation '{cfg.hidden_act}'; the fast engine implements SiLU "
                f"MLPs only: evaluate it with engine=plain"
            )
        self.target = target
        self.base = model.base_model
        self.weights = [LayerWeights.of(layer) for layer in self.base.layers]
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        # torch.compile fuses the norms, RoPE and SiLU·mul around the GEMMs (fewer kernels per
        # step); tensors in, tensors out, so one graph serves every layer. The cache writes and
        # the attention stay eager.
        self._inputs = torch.compile(attention_inputs, dynamic=True) if compile else attention_inputs
        self._output = torch.compile(layer_output, dynamic=True) if compile else layer_output
        self.rows, self.capacity = int(rows), int(capacity)
        self.num_heads = target.num_heads
        self.num_kv_heads = target.num_kv_heads
        self.head_dim = target.head_dim
        self.groups = self.num_heads // self.num_kv_heads
        self.scale = float(getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.taps = target.layer_ids
        device, dtype = target.device, target.dtype
        shape = (self.rows, self.num_kv_heads, self.capacity, self.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.weights]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.weights]
        self.lengths = torch.zeros(self.rows, dtype=torch.long, device=device)  # committed per row
        pos = torch.arange(self.capacity, device=device)[None]
        probe = torch.zeros(1, 1, self.head_dim, device=device, dtype=dtype)
        cos, sin = self.base.rotary_emb(probe, position_ids=pos)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, hd]
        self.slots = torch.arange(self.capacity, device=device)

    # ---------------------------------------------------------------------------------------
    def forward(
        self, ids: Tensor, positions: Tensor, start: int = 0, taps: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """Tokens ``ids`` [R, W] at ``positions`` [R, W] for cache rows start..start+R-1.
        Returns (final normed hidden [R, W, d], concatenated tap features [R, W, m·d], or None
        when ``taps`` is false). Writes the K/V of every token; does not touch ``lengths``.
        Shapes only: no host synchronisation."""
        r, w = ids.shape
        rows = slice(start, start + r)
        x = self.base.embed_tokens(ids)
        tapped = {-1: x} if -1 in self.taps else {}
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [R, 1, W, hd]
        # query (r, head, t) may read slot s <= its position; heads folded as [R, Hkv, G·W].
        visible = self.slots[None, None, :] <= positions[:, :, None]  # [R, W, C]
        mask = visible[:, None, None].expand(r, 1, self.groups, w, self.capacity)
        mask = mask.reshape(r, 1, self.groups * w, self.capacity)
        row_index = torch.arange(start, start + r, device=ids.device)[:, None].expand(r, w)
        for i, weights in enumerate(self.weights):
            q, k, v = self._inputs(x, weights, cos, sin, self.eps, self.num_heads, self.num_kv_heads)
            x = self._output(x, self._attend(q, k, v, mask, row_index, positions, i, rows), weights, self.eps)
            if i in self.taps:
                tapped[i] = x
        hidden = self.base.norm(x)
        return hidden, torch.cat([tapped[i] for i in self.taps], dim=-1) if taps else None

    def _attend(self, q, k, v, mask, row_index, positions, i, rows) -> Tensor:
        """Write this step's keys/values at their positions, attend over the row's cache."""
        r, _, w, _ = q.shape
        # Advanced indices around a slice: cache[rows, :, slots] is [R, W, Hkv, hd].
        self.k[i][row_index, :, positions] = k.transpose(1, 2).to(self.k[i].dtype)
        self.v[i][row_index, :, positions] = v.transpose(1, 2).to(self.v[i].dtype)
        q = q.reshape(r, self.num_kv_heads, self.groups * w, self.head_dim)
        out = F.scaled_dot_product_attention(
            q, self.k[i][rows], self.v[i][rows], attn_mask=mask, scale=self.scale
        )
        return out.reshape(r, self.num_heads, w, self.head_dim).transpose(1, 2).reshape(r, w, -1)

    # ---- rows (continuous batching) -----------------------------------------------------------
    def move_rows(self, dst: Tensor, src: Tensor) -> None:
        """Rows ``src`` (requests still running) onto rows ``dst`` (finished ones)."""
        move_rows([*self.k, *self.v, self.lengths], dst, src)
