"""The sampling conventions everything shares: a temperature softmax in float32 (greedy = one-hot)
and the inverse-CDF draw from one uniform per row. The drafters sample their proposals with these,
the engine and the verifier sample target tokens with them, and the Triton kernels replicate them
(``dspark.kernels.sample_step`` is tested against ``sample_from``): keep them stable."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["greedy_tokens", "probs_from_logits", "sample_from"]


def probs_from_logits(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / T) over the last dim in float32; T == 0 gives the one-hot argmax."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    if temperature == 0:
        # Greedy is the degenerate distribution: verification then reproduces the argmax chain.
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.softmax(logits / temperature, dim=-1)


def greedy_tokens(logits: Tensor, chunks: int = 64) -> Tensor:
    """``logits.argmax(-1)`` (ties to the lowest index), in two stages: each of ``chunks`` slices of
    the vocabulary to its max and first index, then the first slice holding the overall max. One
    argmax row is one program of a compiled reduction: a drafter's row of 49 k logits took 12 µs a
    position on the H200 at one row; the slices give the reduction ``chunks`` programs a row."""
    v = logits.shape[-1]
    c = math.gcd(v, chunks)
    if c == 1:
        return logits.argmax(-1)
    best, at = logits.unflatten(-1, (c, v // c)).max(-1)
    chunk = best.argmax(-1, keepdim=True)  # the first slice whose max is the overall max
    return (chunk * (v // c) + at.gather(-1, chunk)).squeeze(-1)


def sample_from(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sample per row: first index where cumsum(p) > u * sum(p).

    ``probs`` is [..., V] (non-negative, need not be normalised), ``u`` is [...] in [0, 1).
    Returns a long tensor of shape [...]. The result is clamped to the last index with
    non-zero mass, so round-off in the cumsum can never yield a zero-probability token.
    """
    if probs.dim() < 1 or probs.shape[-1] < 1:
        raise ValueError(f"probs must have a non-empty last dim, got shape {tuple(probs.shape)}")
    if u.shape != probs.shape[:-1]:
        raise ValueError(f"u must have shape {tuple(probs.shape[:-1])}, got {tuple(u.shape)}")
    dtype = torch.promote_types(probs.dtype, torch.float32)
    cdf = probs.to(dtype).cumsum(dim=-1).contiguous()
    # Use the cumsum's own last element as the total so the threshold is consistent with the cdf.
    target = (u.to(dtype) * cdf[..., -1]).unsqueeze(-1).contiguous()
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Last index with mass (V-1 for an all-zero row, which callers must not pass anyway).
    v = probs.shape[-1]
    last_nz = (v - 1) - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(idx, last_nz).long()
