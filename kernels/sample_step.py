"""Fused sampling step of a sequential drafter head.

    probs  = softmax((base + bias) / T)     (float32; one-hot at argmax when T == 0)
    tokens = inverse-CDF draw with uniforms u: the first index where cumsum(p) > u·total
             (total = the cumsum's last element), clamped to the last index with nonzero mass

This is the convention of ``dspark.decoding.verify.sample_from``; ``sample_from_reference``
below restates it so the kernels never import decoding code (decoding may import kernels).
Greedy ties break to the lowest index, like ``torch.argmax``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, tl, triton, triton_interpreting

__all__ = ["SampleStep", "sample_from_reference", "sample_step_reference", "sample_step"]


class SampleStep(NamedTuple):
    tokens: Tensor  # [R] int64
    probs: Tensor  # [R, V] float32, the exact distribution the token was drawn from


def sample_from_reference(dist: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw from non-negative, possibly unnormalised rows ``dist [R, V]``.

    The total is the cumsum's own last element, so the threshold is consistent with the cdf it
    is compared against; an all-zero row returns V - 1 (callers must not pass one).
    """
    cdf = torch.cumsum(dist.float(), dim=-1)
    threshold = u.float() * cdf[:, -1]
    # cdf is non-decreasing, so counting entries <= threshold gives the first index above it.
    idx = (cdf <= threshold[:, None]).sum(-1)
    positions = torch.arange(dist.shape[-1], device=dist.device)
    last = torch.where(dist > 0, positions, -1).amax(-1)
    last = torch.where(last < 0, dist.shape[-1] - 1, last)
    return torch.minimum(idx, last)


def _combined_logits(base_logits: Tensor, bias: Tensor | None) -> Tensor:
    z = base_logits.float()
    return z if bias is None else z + bias.float()


def sample_step_reference(
    base_logits: Tensor, bias: Tensor | None, temperature: float, u: Tensor
) -> SampleStep:
    """PyTorch reference: float32 logits (base and bias are each upcast before adding)."""
    z = _combined_logits(base_logits, bias)
    if temperature == 0:
        tokens = z.argmax(-1)
        probs = torch.zeros_like(z)
        probs.scatter_(1, tokens[:, None], 1.0)
        return SampleStep(tokens, probs)
    probs = torch.softmax(z / temperature, dim=-1)
    return SampleStep(sample_from_reference(probs, u), probs)


if HAS_TRITON:

    @triton.jit
    def _load_logits(base_ptr, bias_ptr, r, offs, V, stride_base, stride_bias, HAS_BIAS: tl.constexpr):
        ok = offs < V
        z = tl.load(base_ptr + r * stride_base + offs, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + r * stride_bias + offs, mask=ok, other=0.0).to(tl.float32)
        return z

    @triton.jit
    def _sample_step_kernel(
        base_ptr,
        bias_ptr,
        u_ptr,
        tokens_ptr,
        probs_ptr,
        V: tl.constexpr,
        stride_base,
        stride_bias,
        temperature,
        HAS_BIAS: tl.constexpr,
        GREEDY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per row; every pass streams the row in BLOCK-wide pieces. V is constexpr:
        # fixed per model, and runtime loop bounds break the triton 3.6 interpreter (numpy 2.4).
        r = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BLOCK)
        out_row = probs_ptr + r * V
        if GREEDY:
            best = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
            best_i = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0)
            for v0 in range(0, V, BLOCK):
                z = _load_logits(base_ptr, bias_ptr, r, v0 + lane, V, stride_base, stride_bias, HAS_BIAS)
                m = tl.max(z, axis=0)
                i = tl.argmax(z, axis=0).to(tl.int64) + v0
                take = m > best  # strict: earlier pieces win ties, like torch.argmax
                best_i = tl.where(take, i, best_i)
                best = tl.where(take, m, best)
            for v0 in range(0, V, BLOCK):
                offs = v0 + lane
                tl.store(out_row + offs, (offs == best_i).to(tl.float32), mask=offs < V)
            tl.store(tokens_ptr + r, best_i)
        else:
            # Pass 1: online max / sum-exp of z / T.
            m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
            s = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
            for v0 in range(0, V, BLOCK):
                y = (
                    _load_logits(base_ptr, bias_ptr, r, v0 + lane, V, stride_base, stride_bias, HAS_BIAS)
                    / temperature
                )
                m_new = tl.maximum(m, tl.max(y, axis=0))
                # Guard -inf - -inf (all-masked pieces) which would give NaN.
                scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
                s = s * scale + tl.sum(tl.where(y == float("-inf"), 0.0, tl.exp(y - m_new)), axis=0)
                m = m_new
            # Pass 2: write p; the sampling total is the cdf's last element, built by the same
            # blockwise scan that pass 3 repeats, so threshold and cdf agree exactly.
            carry = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
            last = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) - 1
            for v0 in range(0, V, BLOCK):
                offs = v0 + lane
                y = (
                    _load_logits(base_ptr, bias_ptr, r, offs, V, stride_base, stride_bias, HAS_BIAS)
                    / temperature
                )
                p = tl.where(offs < V, tl.exp(y - m) / s, 0.0)
                tl.store(out_row + offs, p, mask=offs < V)
                carry = tl.max(carry + tl.cumsum(p, axis=0), axis=0)  # non-decreasing: max = end
                last = tl.maximum(last, tl.max(tl.where(p > 0, offs, -1), axis=0).to(tl.int64))
            last = tl.where(last < 0, V - 1, last)
            # Pass 3: recompute p (bit-identical, no read-after-write hazard) and search the cdf.
            threshold = tl.load(u_ptr + r).to(tl.float32) * carry
            carry = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
            first = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) + V
            for v0 in range(0, V, BLOCK):
                offs = v0 + lane
                y = (
                    _load_logits(base_ptr, bias_ptr, r, offs, V, stride_base, stride_bias, HAS_BIAS)
                    / temperature
                )
                p = tl.where(offs < V, tl.exp(y - m) / s, 0.0)
                cdf = carry + tl.cumsum(p, axis=0)
                first = tl.minimum(first, tl.min(tl.where(cdf > threshold, offs, V), axis=0).to(tl.int64))
                carry = tl.max(cdf, axis=0)
            tl.store(tokens_ptr + r, tl.minimum(first, last))


def _sample_step_triton(base_logits, bias, temperature, u) -> SampleStep:
    r, v = base_logits.shape
    base = base_logits if base_logits.stride(-1) == 1 else base_logits.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    tokens = torch.empty(r, device=base.device, dtype=torch.int64)
    probs = torch.empty((r, v), device=base.device, dtype=torch.float32)
    block = 128 if triton_interpreting() else min(4096, triton.next_power_of_2(v))
    _sample_step_kernel[(r,)](
        base,
        base if bias is None else bias,
        u.float().contiguous(),
        tokens,
        probs,
        v,
        base.stride(0),
        0 if bias is None else bias.stride(0),
        float(temperature),
        HAS_BIAS=bias is not None,
        GREEDY=temperature == 0,
        BLOCK=block,
    )
    return SampleStep(tokens, probs)


def sample_step(
    base_logits: Tensor,
    bias: Tensor | None,
    temperature: float,
    u: Tensor,
    *,
    impl: str = "auto",
) -> SampleStep:
    """Sample one token per row from softmax((base + bias) / T); see the module docstring."""
    if base_logits.dim() != 2:
        raise ValueError(f"base_logits must be [R, V], got {tuple(base_logits.shape)}")
    if bias is not None and bias.shape != base_logits.shape:
        raise ValueError(f"bias {tuple(bias.shape)} does not match base_logits {tuple(base_logits.shape)}")
    if u.shape != base_logits.shape[:1]:
        raise ValueError(f"u must be [R]={base_logits.shape[0]}, got {tuple(u.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    tensors = (base_logits, u) if bias is None else (base_logits, bias, u)
    if resolve_impl(impl, *tensors) == "triton":
        return _sample_step_triton(base_logits, bias, temperature, u)
    return sample_step_reference(base_logits, bias, temperature, u)
