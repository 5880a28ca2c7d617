"""Rejection-sampling verification of ragged draft blocks, one Triton program per request.

Same convention as ``dspark.decoding.verify.verify`` (the reference the tests hold us to):
draft k of request r is accepted, left to right, while ``p_d(x) > 0`` and
``u_accept[r, k]·p_d(x) < p_t(x)``; at the first rejection the next token is drawn from
max(0, p_t - p_d) (p_t itself if that residual is all zero), otherwise a bonus token from
p_t[r, lengths[r]]; draws use the inverse CDF of ``sample_from_reference`` with ``u_sample``.
When uniforms are not given they are drawn as ``u_accept = rand(R, G)`` then ``u_sample =
rand(R)`` from one generator, the reference's order. ``rejection_verify_reference`` restates the
rule here so kernels never import decoding code.

Draft distributions over a draft vocabulary (K of the V tokens, ``core.types.Shared.vocab``) are
read as they are, [R, G, K], through ``draft_index`` [V] (each token's column, -1 off the
vocabulary: probability 0): p_d(x) is one gathered value, and the residual's row reads its K
columns in place, so no [R, G, V] copy of the drafts is ever written.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, tl, triton, triton_interpreting
from .sample_step import sample_from_reference

__all__ = ["RejectionResult", "draft_prob_of", "draft_row", "rejection_verify_reference", "rejection_verify"]


class RejectionResult(NamedTuple):
    accepted: Tensor  # [R] int64, accepted drafts
    next_token: Tensor  # [R] int64, correction (first rejection) or bonus token
    accept_flags: Tensor  # [R, G] bool, True exactly for positions < accepted


def draft_prob_of(draft_probs: Tensor, tokens: Tensor, draft_index: Tensor | None = None) -> Tensor:
    """p_d of each token: draft_probs [R, G, C] at tokens [R, G] (target ids) -> [R, G]; with
    ``draft_index`` the C columns are a draft vocabulary's (0 for a token off it)."""
    if draft_index is None:
        return draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
    col = draft_index[tokens]
    return torch.where(col >= 0, draft_probs.gather(-1, col.clamp(min=0)[..., None]).squeeze(-1), 0.0)


def draft_row(draft_probs: Tensor, draft_index: Tensor | None = None) -> Tensor:
    """Draft distributions [R, C] as [R, V] over the target's vocabulary (as they are without
    ``draft_index``; else each token's column, 0 off the draft vocabulary)."""
    if draft_index is None:
        return draft_probs
    cols = draft_index.clamp(min=0).expand(draft_probs.shape[0], -1)
    return torch.where(draft_index >= 0, draft_probs.gather(-1, cols), 0.0)


def rejection_verify_reference(
    target_probs: Tensor,
    draft_probs: Tensor,
    tokens: Tensor,
    lengths: Tensor,
    u_accept: Tensor,
    u_sample: Tensor,
    draft_index: Tensor | None = None,
) -> RejectionResult:
    """Vectorised PyTorch reference, float32 math."""
    r, g = tokens.shape
    p_t, p_d = target_probs.float(), draft_probs.float()
    lengths = lengths.long()
    pos = torch.arange(g, device=p_d.device)
    active = pos[None, :] < lengths[:, None]
    tok = torch.where(active, tokens.long(), 0)
    pd_x = draft_prob_of(p_d, tok, draft_index)
    pt_x = p_t[:, :g].gather(-1, tok[..., None]).squeeze(-1)
    ok = active & (pd_x > 0) & (u_accept.float() * pd_x < pt_x)
    accepted = ok.long().cumprod(1).sum(1)
    flags = pos[None, :] < accepted[:, None]
    rows = torch.arange(r, device=p_d.device)
    dist = p_t[rows, accepted]
    if g > 0:
        resid = dist - draft_row(p_d[rows, accepted.clamp(max=g - 1)], draft_index)
        resid = torch.where(resid > 0, resid, 0.0)  # also maps NaN to 0
        use_resid = (accepted < lengths) & (resid.sum(-1) > 0)
        dist = torch.where(use_resid[:, None], resid, dist)
    dist = torch.where(dist > 0, dist, 0.0)
    return RejectionResult(accepted, sample_from_reference(dist, u_sample), flags)


if HAS_TRITON:

    @triton.jit
    def _verify_kernel(
        pt_ptr,
        pd_ptr,
        idx_ptr,
        tokens_ptr,
        lengths_ptr,
        ua_ptr,
        us_ptr,
        accepted_ptr,
        next_ptr,
        flags_ptr,
        G: tl.constexpr,
        V: tl.constexpr,
        K: tl.constexpr,  # the draft distributions' columns: V, or a draft vocabulary's (HAS_INDEX)
        HAS_INDEX: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # G and V are constexpr: fixed per run, and runtime loop bounds break the triton 3.6
        # interpreter under numpy >= 2.4.
        r = tl.program_id(0).to(tl.int64)
        n = tl.load(lengths_ptr + r).to(tl.int32)
        # Acceptance chain: scalar work per position; `alive` drops to 0 at the first rejection.
        alive = n * 0 + 1
        accepted = n * 0
        for k in range(0, G):
            active = k < n
            x = tl.load(tokens_ptr + r * G + k, mask=active, other=0).to(tl.int64)
            if HAS_INDEX:  # the token's column in the draft vocabulary, -1 off it (p_d = 0)
                col = tl.load(idx_ptr + x, mask=active, other=-1).to(tl.int64)
                pd_x = tl.load(pd_ptr + (r * G + k) * K + col, mask=active & (col >= 0), other=0.0)
            else:
                pd_x = tl.load(pd_ptr + (r * G + k) * K + x, mask=active, other=0.0)
            pd_x = pd_x.to(tl.float32)
            pt_x = tl.load(pt_ptr + (r * (G + 1) + k) * V + x, mask=active, other=0.0).to(tl.float32)
            u = tl.load(ua_ptr + r * G + k, mask=active, other=1.0)
            ok = active & (pd_x > 0) & (u * pd_x < pt_x)
            alive = alive * ok.to(tl.int32)
            accepted += alive
            tl.store(flags_ptr + r * G + k, alive.to(tl.int8))
        rejected = accepted < n
        # The target row at the stop position serves both cases (residual or bonus).
        pt_row = pt_ptr + (r * (G + 1) + accepted) * V
        pd_row = pd_ptr + (r * G + tl.minimum(accepted, G - 1)) * K
        lane = tl.arange(0, BLOCK)
        # Pass 1: cdf totals of both candidate distributions via the blockwise scan pass 2
        # repeats, so the threshold matches the cdf bit for bit.
        tot_res = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        tot_t = tot_res
        for v0 in range(0, V, BLOCK):
            offs = v0 + lane
            ok = offs < V
            pt = tl.load(pt_row + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_INDEX:
                col = tl.load(idx_ptr + offs, mask=ok, other=-1)
                pd = tl.load(pd_row + col, mask=ok & rejected & (col >= 0), other=0.0).to(tl.float32)
            else:
                pd = tl.load(pd_row + offs, mask=ok & rejected, other=0.0).to(tl.float32)
            res = pt - pd
            res = tl.where(res > 0, res, 0.0)
            pt = tl.where(pt > 0, pt, 0.0)
            tot_res = tl.max(tot_res + tl.cumsum(res, axis=0), axis=0)
            tot_t = tl.max(tot_t + tl.cumsum(pt, axis=0), axis=0)
        use_res = rejected & (tot_res > 0)
        threshold = tl.load(us_ptr + r) * tl.where(use_res, tot_res, tot_t)
        # Pass 2: first index whose cdf exceeds the threshold, clamped to the last mass.
        carry = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        first = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) + V
        last = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) - 1
        for v0 in range(0, V, BLOCK):
            offs = v0 + lane
            ok = offs < V
            pt = tl.load(pt_row + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_INDEX:
                col = tl.load(idx_ptr + offs, mask=ok, other=-1)
                pd = tl.load(pd_row + col, mask=ok & use_res & (col >= 0), other=0.0).to(tl.float32)
            else:
                pd = tl.load(pd_row + offs, mask=ok & use_res, other=0.0).to(tl.float32)
            p = pt - pd
            p = tl.where(p > 0, p, 0.0)
            cdf = carry + tl.cumsum(p, axis=0)
            first = tl.minimum(first, tl.min(tl.where(cdf > threshold, offs, V), axis=0).to(tl.int64))
            last = tl.maximum(last, tl.max(tl.where(p > 0, offs, -1), axis=0).to(tl.int64))
            carry = tl.max(cdf, axis=0)
        last = tl.where(last < 0, V - 1, last)
        tl.store(accepted_ptr + r, accepted.to(tl.int64))
        tl.store(next_ptr + r, tl.minimum(first, last))


def _verify_triton(
    target_probs, draft_probs, tokens, lengths, u_accept, u_sample, draft_index=None
) -> RejectionResult:  # fmt: skip
    r, g, k = draft_probs.shape
    v = target_probs.shape[-1]
    dev = draft_probs.device
    accepted = torch.empty(r, device=dev, dtype=torch.int64)
    next_token = torch.empty(r, device=dev, dtype=torch.int64)
    flags = torch.zeros((r, g), device=dev, dtype=torch.int8)
    if r == 0:
        return RejectionResult(accepted, next_token, flags.bool())
    block = 128 if triton_interpreting() else min(4096, triton.next_power_of_2(v))
    _verify_kernel[(r,)](
        target_probs.contiguous(),
        draft_probs.contiguous(),
        tokens if draft_index is None else draft_index.contiguous(),  # unread without an index
        tokens.contiguous(),
        lengths.contiguous(),
        u_accept.float().contiguous(),
        u_sample.float().contiguous(),
        accepted,
        next_token,
        flags,
        g,
        v,
        k,
        draft_index is not None,
        BLOCK=block,
    )
    return RejectionResult(accepted, next_token, flags.bool())


def rejection_verify(
    target_probs: Tensor,
    draft_probs: Tensor,
    tokens: Tensor,
    lengths: Tensor,
    *,
    uniforms: tuple[Tensor, Tensor] | None = None,
    generator: torch.Generator | None = None,
    impl: str = "auto",
    draft_index: Tensor | None = None,
) -> RejectionResult:
    """Verify R ragged draft blocks: target_probs [R, G+1, V], draft_probs [R, G, V] (or [R, G, K]
    over a draft vocabulary, with ``draft_index`` [V]: each token's column, -1 off it), tokens
    [R, G] (ignored at k >= lengths[r]), lengths [R] in [0, G].

    Inputs are trusted (no host sync): out-of-range tokens or lengths are undefined behaviour
    here; ``dspark.decoding.verify.verify`` validates them.
    """
    r, g, k = draft_probs.shape
    v = target_probs.shape[-1]
    columns_fit = k == v if draft_index is None else draft_index.shape == (v,)
    if (
        target_probs.shape != (r, g + 1, v)
        or tokens.shape != (r, g)
        or lengths.shape != (r,)
        or not columns_fit
    ):
        raise ValueError(
            f"shape mismatch: target_probs {tuple(target_probs.shape)}, "
            f"draft_probs {tuple(draft_probs.shape)}, tokens {tuple(tokens.shape)}, "
            f"lengths {tuple(lengths.shape)}"
            + ("" if draft_index is None else f", draft_index {tuple(draft_index.shape)}")
        )
    if uniforms is None:
        u_accept = torch.rand(r, g, generator=generator, device=draft_probs.device)
        u_sample = torch.rand(r, generator=generator, device=draft_probs.device)
    else:
        u_accept, u_sample = uniforms
    if resolve_impl(impl, target_probs, draft_probs, tokens, lengths, u_accept, u_sample) == "triton":
        return _verify_triton(target_probs, draft_probs, tokens, lengths, u_accept, u_sample, draft_index)
    return rejection_verify_reference(
        target_probs, draft_probs, tokens, lengths, u_accept, u_sample, draft_index
    )  # fmt: skip
