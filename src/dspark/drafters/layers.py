"""The draft decoder layer with KV injection: queries come from the draft tokens only; keys and
values are the (projected) target context followed by the draft tokens' own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.cache_attention import cache_attention, fold_mask


@dataclass
class LayerShape:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float = 1e-6


def rope(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables [..., head_dim] for integer positions (half-split rotary layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, hd]; cos/sin [B, T, hd]."""
    return rotate(x, cos[:, None], sin[:, None])


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary rotation of x [..., hd] by cos/sin already broadcastable against it (half-split
    layout): ``apply_rope``'s arithmetic, for callers whose head axis is not dim 1."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with float32 statistics that returns its input's dtype: under bf16 autocast the
    residual stream stays bf16 (``nn.RMSNorm`` runs in, and returns, float32 there)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``RMSNorm``'s arithmetic with the weight given (broadcast against x's last dim, or ahead of
    it: one weight row per layer of a stacked tensor)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype)


def matmul_input(x: Tensor, weight: Tensor) -> Tensor:
    """``x`` as a linear layer's input: unchanged under autocast (which casts for the matmul
    itself, so a float32 copy of a bf16 activation would be wasted), else in the weight's dtype."""
    return x if torch.is_autocast_enabled(x.device.type) else x.to(weight.dtype)


_compiled_flex = None


def flex(q: Tensor, k: Tensor, v: Tensor, block_mask) -> Tensor:
    """Flex attention over a sparse block mask (compiled on CUDA, where it pays; eager elsewhere)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)  # any length, one kernel
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


class FusedProjections(NamedTuple):
    """A draft layer's projections that read the same input, stacked so that one GEMM runs each
    group (the fused inference path): q/k/v [(H + 2·Hkv)·hd, d] and gate/up [2·inner, d]."""

    qkv: Tensor
    gate_up: Tensor


class CacheSpan(NamedTuple):
    """A draft step's mask as ``kernels.cache_attention`` takes it, for a static cache (``tail``):
    each query sees its row's context, slots <= ``last`` [R, Q] (the context length - 1, alike
    along Q), and the whole block in the room at ``tail``; ``impl``: the kernel's dispatch."""

    last: Tensor
    impl: str


class Attention(nn.Module):
    def __init__(self, s: LayerShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, eps=s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, eps=s.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        return x.view(*x.shape[:-1], n, self.s.head_dim).transpose(1, 2)  # [B, n, T, hd]

    def kv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated keys and values [B, Hkv, T, hd] of x at integer positions [B, T]."""
        return self._rotated_kv(self.k_proj(x), self.v_proj(x), positions)

    def _rotated_kv(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (normed, rotated) and values [B, Hkv, T, hd] from their projections [B, T, Hkv·hd]."""
        k = self.k_norm(self._heads(k, self.s.num_kv_heads))
        v = self._heads(v, self.s.num_kv_heads)
        cos, sin = rope(positions, self.s.head_dim, self.s.rope_theta)
        return apply_rope(k, cos.to(k.dtype), sin.to(k.dtype)), v

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        ctx_kv: tuple[Tensor, Tensor] | None,
        mask: Tensor | None,
        tail: int | None = None,
        qkv_weight: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, Q, d] draft tokens; ctx_kv: keys/values [B, Hkv, C, hd] placed before the draft's own;
        mask: bool [B, Q, C + Q] (True = may attend; or already folded, [B, 1, G·Q, C + Q]:
        ``fold_mask``), a flex-attention BlockMask over the same layout, a ``CacheSpan`` (with
        ``tail``: the cache kernel, which reads no slot the mask hides), or None for full
        attention. ``tail`` (a static cache's room for the block, slots tail..tail+Q of ctx_kv's
        buffers): the draft's own keys/values are written there in place and the buffers attended
        as they are (C = tail), instead of concatenated. ``qkv_weight``: the three projections'
        weights stacked (``FusedProjections.qkv``), run as one GEMM.
        Returns the output and the draft tokens' own (k, v)."""
        if qkv_weight is None:
            q, k_new, v_new = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            sizes = (self.s.num_heads * self.s.head_dim, *[self.s.num_kv_heads * self.s.head_dim] * 2)
            q, k_new, v_new = F.linear(x, qkv_weight).split(sizes, dim=-1)
        q = self.q_norm(self._heads(q, self.s.num_heads))
        cos, sin = rope(positions, self.s.head_dim, self.s.rope_theta)
        q = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype))
        k_self, v_self = self._rotated_kv(k_new, v_new, positions)
        k, v = k_self, v_self
        if ctx_kv is not None and tail is not None:
            t = x.shape[-2]
            ctx_kv[0][:, :, tail : tail + t] = k_self.to(ctx_kv[0].dtype)
            ctx_kv[1][:, :, tail : tail + t] = v_self.to(ctx_kv[1].dtype)
            k, v = ctx_kv[0][:, :, : tail + t], ctx_kv[1][:, :, : tail + t]
            if isinstance(mask, CacheSpan):  # q as [B, Q, H, hd] in, the same layout out: no copies
                out = cache_attention(
                    q.transpose(1, 2), ctx_kv[0], ctx_kv[1], mask.last, scale=self.s.head_dim**-0.5,
                    tail=tail, impl=mask.impl,
                )  # fmt: skip
                return self.o_proj(out.flatten(-2)), (k_self, v_self)
        elif ctx_kv is not None:
            k = torch.cat([ctx_kv[0], k_self], dim=2)
            v = torch.cat([ctx_kv[1], v_self], dim=2)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a flex-attention BlockMask
            out = flex(q, k, v, mask).transpose(1, 2).reshape(*x.shape[:-1], -1)
            return self.o_proj(out), (k_self, v_self)
        # Grouped-query attention without repeating keys and values: the G query heads of each KV
        # head are folded into the query axis ([B, Hkv, G·Q, hd]), so each key is read once
        # (repeating them copied the whole context G times per layer: most of a draft step's
        # memory traffic at R = 256).
        b, heads, t, hd = q.shape
        groups = heads // self.s.num_kv_heads
        q = q.reshape(b, self.s.num_kv_heads, groups * t, hd)
        attn_mask = None
        if mask is not None:
            attn_mask = mask if mask.dim() == 4 else fold_mask(mask, groups)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = out.reshape(b, heads, t, hd).transpose(1, 2).reshape(*x.shape[:-1], -1)
        return self.o_proj(out), (k_self, v_self)


class SwiGLU(nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x: Tensor, gate_up_weight: Tensor | None = None) -> Tensor:
        """``gate_up_weight``: the gate and up projections' weights stacked
        (``FusedProjections.gate_up``), run as one GEMM."""
        if gate_up_weight is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DraftLayer(nn.Module):
    """Pre-norm attention (+ q/k RMSNorm) and SwiGLU MLP. The context enters every layer as extra
    keys/values through the same k/v projections; it is never updated by the draft layers."""

    def __init__(self, s: LayerShape):
        super().__init__()
        self.input_norm = RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.attn = Attention(s)
        self.post_norm = RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.mlp = SwiGLU(s.hidden_size, s.intermediate_size)

    def context_kv(self, ctx: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.attn.kv(ctx, positions)

    def forward(
        self, x, positions, ctx_kv, mask, tail: int | None = None, fused: FusedProjections | None = None
    ):
        """``fused``: the layer's projections stacked, for fewer GEMMs (the same numbers to rounding)."""
        qkv, gate_up = (None, None) if fused is None else fused
        h, own_kv = self.attn(self.input_norm(x), positions, ctx_kv, mask, tail, qkv)
        x = x + h
        return x + self.mlp(self.post_norm(x), gate_up), own_kv
