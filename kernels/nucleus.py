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
the masses compared with ``top_p``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, self_check, tl, triton

__all__ = ["nucleus", "nucleus_reference", "nucleus_self_check"]

BLOCK = 1024  # columns per step of a pass



def nucleus_reference(probs: Tensor, top_p: float) -> Tensor:
    """Sort-based top-p of normalised probabilities [..., V] (the rule above), renormalised."""
    vals, ids = probs.sort(dim=-1, descending=True)
    keep = (vals.cumsum(-1) - vals) < top_p
    keep[..., 0] = True
    out = torch.zeros_like(probs).scatter_(-1, ids, vals * keep)
    return out / out.sum(-1, keepdim=True)


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
    _nucleus_kernel[(rows.shape[0],)](rows, out, v, rows.stride(0), float(top_p), BLOCK=BLOCK)
    return out.view(probs.shape)


if HAS_TRITON:

    @triton.jit
    def _nucleus_kernel(p_ptr, out_ptr, V, stride, top_p, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * stride
        cols = tl.arange(0, BLOCK)
        digits = tl.arange(0, 16).to(tl.int64)
        below = tl.zeros((), dtype=tl.int64)  # bits of the largest x found so far with S(x) >= top_p
        top = tl.zeros((), dtype=tl.int64)  # bits of the row's max (always kept)
        for shift in tl.static_range(28, -1, -4):
            tries = below + (digits << shift)  # [16]: the next four bits, 0 (below itself) .. 15
            mass = tl.zeros((16,), dtype=tl.float32)
            for start in range(0, V, BLOCK):
                ok = start + cols < V
                p = tl.load(p_ptr + row + start + cols, mask=ok, other=0.0)
                bits = p.to(tl.int32, bitcast=True).to(tl.int64)
                above = (bits[:, None] > tries[None, :]) & ok[:, None]
                mass += tl.sum(tl.where(above, p[:, None], 0.0), axis=0)
                if shift == 28:
                    top = tl.maximum(top, tl.max(tl.where(ok, bits, 0), axis=0))
            # S falls as x grows and S(below) >= top_p holds: the largest try that keeps it
            below += tl.max(tl.where(mass >= top_p, digits, 0), axis=0) << shift
        kept = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, V, BLOCK):
            ok = start + cols < V
            p = tl.load(p_ptr + row + start + cols, mask=ok, other=0.0)
            bits = p.to(tl.int32, bitcast=True).to(tl.int64)
            kept += tl.where(ok & ((bits > below) | (bits >= top)), p, 0.0)
        total = tl.sum(kept, axis=0)
        for start in range(0, V, BLOCK):
            ok = start + cols < V
            p = tl.load(p_ptr + row + start + cols, mask=ok, other=0.0)
            bits = p.to(tl.int32, bitcast=True).to(tl.int64)
            keep = (bits > below) | (bits >= top)
            tl.store(out_ptr + row + start + cols, tl.where(keep, p / total, 0.0), mask=ok)
