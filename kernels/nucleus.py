"""Top-p (nucleus) filtering without sorting the vocabulary.

The rule is transformers': sorted by probability, a token stays while the mass before it is below
``top_p`` (the most likely always stays); the kept mass is renormalised. For distinct probabilities
the mass before a token of probability x is S(x) = Σ_{p > x} p, which does not depend on any order,
and S falls as x grows: the kept tokens are those above the largest x with S(x) >= top_p. The
kernel finds that x by its float32 bit pattern (non-negative floats order as their bit patterns):
eight passes over the row, each trying 15 values of the next four bits at once, then one pass for
the kept mass and one that writes. Ten reads of a row instead of a sort of it: at 1 024 rows of
49 152 the sort took 5.9 ms of an 11.4 ms decoding round on the H200 (data generation's answers).
Exact ties straddling the boundary are kept together here, where a sort keeps some of them (in
whatever order it put them); otherwise the kept set is the sort's, up to the float32 rounding of
the masses compared with ``top_p``. On the H200: 3.45 ms at 1 024 rows (the sort 5.81), 0.56 ms at
64 (the sort 0.49), 2026-12-03. Summing each lane's 16 candidate masses once a pass instead of across
the block at every step was tried and measured slower (3.76-3.86 ms at 1 024 rows, 2026-12-04).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, self_check, tl, triton

__all__ = ["keep_nucleus", "nucleus", "nucleus_reference", "nucleus_self_check", "scatter_renormalised"]

BLOCK = 512  # columns per step of a pass (x 16 candidate masses: 32 values a thread at 8 warps)
WARPS = 8


def keep_nucleus(vals: Tensor, top_p: float, renormalise: bool = False) -> Tensor:
    """The rule on values sorted descending [..., K]: those past the nucleus zeroed (``renormalise``:
    the mass measured over the K given, as top-p after top-k does)."""
    dist = vals / vals.sum(-1, keepdim=True) if renormalise else vals
    keep = (dist.cumsum(-1) - dist) < top_p
    keep[..., 0] = True
    return vals * keep


def scatter_renormalised(like: Tensor, vals: Tensor, ids: Tensor) -> Tensor:
    """``vals`` at columns ``ids`` of a zero tensor shaped ``like``, renormalised per row."""
    out = torch.zeros_like(like).scatter_(-1, ids, vals)
    return out / out.sum(-1, keepdim=True)


def nucleus_reference(probs: Tensor, top_p: float) -> Tensor:
    """Sort-based top-p of normalised probabilities [..., V] (the rule above), renormalised."""
    vals, ids = probs.sort(dim=-1, descending=True)
    return scatter_renormalised(probs, keep_nucleus(vals, top_p), ids)


def nucleus(probs: Tensor, top_p: float, impl: str = "auto") -> Tensor:
    """``nucleus_reference`` through the kernel where ``impl`` resolves to Triton (float32 CUDA
    rows; the CPU under ``TRITON_INTERPRET=1``), else the reference."""
    if probs.dtype != torch.float32 or resolve_impl(impl, probs) == "torch" or probs.numel() == 0:
        return nucleus_reference(probs, top_p)
    if impl == "auto" and not nucleus_self_check(probs.device):
        return nucleus_reference(probs, top_p)
    return _nucleus_triton(probs, top_p)


def nucleus_self_check(device: torch.device) -> bool:
    """Whether the kernel runs here (``self_check``): rows from peaked to flat against the
    reference; the sort otherwise, rather than drawing from a wrong distribution."""

    def check() -> tuple[bool, str]:
        g = torch.Generator(device=device).manual_seed(0)
        scales = torch.tensor([8.0, 2.0, 0.1], device=device).repeat_interleave(3)[:, None]
        probs = torch.softmax(torch.randn(9, 3 * BLOCK + 7, device=device, generator=g) * scales, -1)
        got, want = _nucleus_triton(probs, 0.9), nucleus_reference(probs, 0.9)
        ok = torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=1e-5, atol=1e-8)
        return ok, "its kept tokens or values differ from the sort's"

    return self_check("nucleus", (str(device),), check, "the sort")


def _nucleus_triton(probs: Tensor, top_p: float) -> Tensor:
    v = probs.shape[-1]
    rows = probs.reshape(-1, v).contiguous()
    out = torch.empty_like(rows)
    # top_p <= 0 keeps the most likely token(s): any positive top_p below the smallest mass does.
    top_p = max(float(top_p), 1e-30)
    _nucleus_kernel[(rows.shape[0],)](rows, out, v, rows.stride(0), top_p, BLOCK=BLOCK, num_warps=WARPS)
    return out.view(probs.shape)


if HAS_TRITON:

    @triton.jit
    def _raise_bound(p_ptr, row, V, top_p, below, shift, BLOCK: tl.constexpr):
        """``below`` (bits of an x with S(x) >= top_p) raised by the largest of 15 steps of 2**shift
        that keeps S >= top_p: one read of the row, the 16 candidate masses at once."""
        cols = tl.arange(0, BLOCK)
        digits = tl.arange(0, 16)
        tries = below + (digits << shift)
        mass = tl.zeros((16,), dtype=tl.float32)
        for start in range(0, V, BLOCK):
            ok = start + cols < V
            p = tl.load(p_ptr + row + start + cols, mask=ok, other=0.0)
            above = (p.to(tl.int32, bitcast=True)[:, None] > tries[None, :]) & ok[:, None]
            mass += tl.sum(tl.where(above, p[:, None], 0.0), axis=0)
        return below + (tl.max(tl.where(mass >= top_p, digits, 0), axis=0) << shift)

    @triton.jit
    def _nucleus_kernel(p_ptr, out_ptr, V, stride, top_p, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * stride
        cols = tl.arange(0, BLOCK)
        # Probabilities are <= 1.0 (bits 0x3F800000): bits 27..30 first, four at a time, down to
        # 3..6, then 0..3 (a digit past 7 there would redo bit 3, which the pass before settled).
        # int32 throughout: no try passes 2**31 - 1.
        below = tl.zeros((), dtype=tl.int32)  # S(0) = the row's mass >= top_p
        for i in tl.static_range(7):
            below = _raise_bound(p_ptr, row, V, top_p, below, 27 - 4 * i, BLOCK)
        below = _raise_bound(p_ptr, row, V, top_p, below, 0, BLOCK)
        kept = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, V, BLOCK):  # S falls below top_p past `below`: those stay
            ok = start + cols < V
            p = tl.load(p_ptr + row + start + cols, mask=ok, other=0.0)
            kept += tl.where(ok & (p.to(tl.int32, bitcast=True) > below), p, 0.0)
        total = tl.sum(kept, axis=0)
        for start in range(0, V, BLOCK):
            ok = start + cols < V
            p = tl.load(p_ptr + row + start + cols, mask=ok, other=0.0)
            keep = p.to(tl.int32, bitcast=True) > below
            tl.store(out_ptr + row + start + cols, tl.where(keep, p / total, 0.0), mask=ok)
