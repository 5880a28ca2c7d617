"""Lossless speculative-decoding verification (rejection sampling), pure PyTorch.

Draft k of request r is accepted, left to right, while ``u_accept[r, k] * p_d(x) < p_t(x)``
(i.e. ``u < min(1, p_t/p_d)`` without a division). At the first rejection the next token is drawn
from ``norm(max(0, p_t - p_d))``; if every verified draft passes, a bonus token is drawn from the
target row that follows the last draft. The emitted sequence (accepted drafts, then ``next_token``)
is then distributed exactly as sampling from the target. Greedy decoding is the one-hot case.

Randomness convention (a Triton kernel replicates it, so keep it stable):
  * ``u_accept`` is ``[R, G]`` and ``u_sample`` is ``[R]``, both uniform in [0, 1), float32;
  * when drawn here: ``u_accept = torch.rand(R, G)`` first, then ``u_sample = torch.rand(R)``,
    both from the same ``generator``;
  * the residual / bonus token is ``sample_from(dist, u_sample)``: the first index whose
    cumulative mass exceeds ``u_sample * total`` (``total`` = last element of the cumsum).

This module must stay free of training / model imports: it is the reference the engine and the
kernels are tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.sampling import sample_from
from ..kernels.rejection import draft_prob_of, draft_row

__all__ = ["VerifyResult", "greedy_verify", "one_hot_drafts", "verify"]


class VerifyResult:
    """Outcome of one verification step for R requests with up to G drafts each.

    accepted:     [R] long, number of accepted drafts (0 <= accepted <= lengths).
    next_token:   [R] long, the correction token (first rejection) or the bonus token.
    accept_flags: [R, G] bool, True exactly for positions < accepted; built when first read
                  (from ``width`` = G) unless given: the engine never reads it, and inside a
                  decode round each tensor op is a launch.
    """

    __slots__ = ("accepted", "next_token", "_flags", "_width")

    def __init__(
        self,
        accepted: Tensor,
        next_token: Tensor,
        accept_flags: Tensor | None = None,
        *,
        width: int | None = None,
    ):
        if accept_flags is None and width is None:
            raise ValueError("VerifyResult needs accept_flags or the width G to build them from")
        self.accepted, self.next_token, self._flags, self._width = accepted, next_token, accept_flags, width

    @property
    def accept_flags(self) -> Tensor:
        if self._flags is None:
            pos = torch.arange(self._width, device=self.accepted.device)
            self._flags = pos[None, :] < self.accepted[:, None]
        return self._flags


def _check_inputs(
    target_probs: Tensor, draft_probs: Tensor, tokens: Tensor, lengths: Tensor, draft_index: Tensor | None
) -> None:  # fmt: skip
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [R, G+1, V], got shape {tuple(target_probs.shape)}")
    if draft_probs.dim() != 3:
        raise ValueError(f"draft_probs must be [R, G, V], got shape {tuple(draft_probs.shape)}")
    r, g, k = draft_probs.shape
    v = target_probs.shape[-1] if draft_index is not None else k
    if target_probs.shape != (r, g + 1, v):
        raise ValueError(
            f"target_probs must be [R, G+1, V] = {(r, g + 1, v)} to match draft_probs "
            f"{tuple(draft_probs.shape)}, got {tuple(target_probs.shape)}"
        )
    if draft_index is not None and (draft_index.shape != (v,) or draft_index.dtype != torch.long):
        raise ValueError(
            f"draft_index must be [V] = {(v,)} int64 (each token's column in the draft vocabulary, -1 "
            f"off it), got {draft_index.dtype} {tuple(draft_index.shape)}"
        )
    if v < 1:
        raise ValueError("vocabulary size V must be >= 1")
    if tokens.shape != (r, g):
        raise ValueError(f"tokens must be [R, G] = {(r, g)}, got {tuple(tokens.shape)}")
    if lengths.shape != (r,):
        raise ValueError(f"lengths must be [R] = {(r,)}, got {tuple(lengths.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be an integer tensor, got {lengths.dtype}")
    if not target_probs.dtype.is_floating_point or not draft_probs.dtype.is_floating_point:
        raise ValueError(
            f"probabilities must be floating point, got {target_probs.dtype} / {draft_probs.dtype}"
        )


def verify(
    target_probs: Tensor,
    draft_probs: Tensor,
    tokens: Tensor,
    lengths: Tensor,
    *,
    generator: torch.Generator | None = None,
    uniforms: tuple[Tensor, Tensor] | None = None,
    draft_index: Tensor | None = None,
) -> VerifyResult:
    """Rejection-sample R ragged draft blocks against the target.

    target_probs: [R, G+1, V]; row k is the target distribution at draft position k, row
                  lengths[r] supplies the bonus token.
    draft_probs:  [R, G, V]; the distributions the drafts were sampled from ([R, G, K] over a
                  draft vocabulary with ``draft_index``).
    tokens:       [R, G] drafted token ids (entries at k >= lengths[r] are ignored: any padding).
    lengths:      [R], 0 <= lengths[r] <= G: how many drafts of request r to verify.
    generator:    source of the uniforms when ``uniforms`` is None.
    uniforms:     explicit ``(u_accept [R, G], u_sample [R])`` in [0, 1).
    draft_index:  [V] int64, each token's column in ``draft_probs``, -1 off the draft vocabulary
                  (draft probability 0); None: ``draft_probs`` has the target's V columns.

    All math is float32 whatever the input dtype; works on any device.
    """
    _check_inputs(target_probs, draft_probs, tokens, lengths, draft_index)
    r, g, v = target_probs.shape[0], draft_probs.shape[1], target_probs.shape[2]
    device = draft_probs.device
    p_t = target_probs.to(device=device, dtype=torch.float32)
    p_d = draft_probs.float()
    tokens = tokens.to(device=device, dtype=torch.long)
    lengths = lengths.to(device=device, dtype=torch.long)

    # One host sync for all data-dependent checks: an out-of-range gather is a device assert on CUDA.
    pos = torch.arange(g, device=device)
    valid = pos.unsqueeze(0) < lengths.unsqueeze(1)  # [R, G]
    bad_len = (lengths < 0) | (lengths > g)
    bad_tok = valid & ((tokens < 0) | (tokens >= v))
    flags = torch.stack([bad_len.any(), bad_tok.any()]).tolist()
    if flags[0]:
        raise ValueError(f"lengths must satisfy 0 <= lengths[r] <= G={g}, got {lengths.tolist()}")
    if flags[1]:
        raise ValueError(f"tokens at verified positions must lie in [0, V={v})")

    if uniforms is None:
        # Order matters for reproducibility against the kernel: u_accept first, then u_sample.
        u_accept = torch.rand(r, g, generator=generator, device=device)
        u_sample = torch.rand(r, generator=generator, device=device)
    else:
        if len(uniforms) != 2:
            raise ValueError("uniforms must be a pair (u_accept [R, G], u_sample [R])")
        u_accept, u_sample = uniforms
        if u_accept.shape != (r, g):
            raise ValueError(f"u_accept must be [R, G] = {(r, g)}, got {tuple(u_accept.shape)}")
        if u_sample.shape != (r,):
            raise ValueError(f"u_sample must be [R] = {(r,)}, got {tuple(u_sample.shape)}")
        u_accept = u_accept.to(device=device, dtype=torch.float32)
        u_sample = u_sample.to(device=device, dtype=torch.float32)

    # Probabilities of the drafted tokens; padding positions gather index 0 and are masked out.
    tok = torch.where(valid, tokens, 0)
    pt_x = p_t[:, :g].gather(-1, tok[..., None]).squeeze(-1)
    pd_x = draft_prob_of(p_d, tok, draft_index)
    # u * p_d < p_t  <=>  u < p_t / p_d; p_d == 0 rejects, and NaN compares False, i.e. rejects.
    ok = valid & (pd_x > 0) & (u_accept * pd_x < pt_x)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # length of the all-accepted prefix
    accept_flags = pos.unsqueeze(0) < accepted.unsqueeze(1)

    rows = torch.arange(r, device=device)
    pt_row = p_t[rows, accepted]  # target at the first rejection, or the bonus row
    rejected = accepted < lengths
    if g > 0:
        pd_row = draft_row(p_d[rows, accepted.clamp(max=g - 1)], draft_index)
        resid = pt_row - pd_row
        resid = torch.where(resid > 0, resid, 0.0)  # max(0, .) that also maps NaN to 0
        use_resid = rejected & (resid.sum(dim=-1) > 0)  # all-zero residual: fall back to p_t
        dist = torch.where(use_resid.unsqueeze(-1), resid, pt_row)
    else:
        dist = pt_row
    dist = torch.where(dist > 0, dist, 0.0)  # drop negatives / NaN before the inverse CDF
    next_token = sample_from(dist, u_sample)
    return VerifyResult(accepted=accepted, next_token=next_token, accept_flags=accept_flags)


def greedy_verify(target_tokens: Tensor, tokens: Tensor, lengths: Tensor) -> VerifyResult:
    """``verify`` at T = 0 from tokens alone: the target's argmax ``target_tokens`` [R, G+1]
    (position k is the target's choice after the first k drafts) and the drafts ``tokens`` [R, G].
    Draft k is accepted while it equals the target's choice and k < lengths[r]; the next token is
    the target's choice after the accepted prefix. This is ``verify`` on one-hot distributions
    (every draft one-hot at its own token), without building any [R, G, V] tensor or drawing
    uniforms. Inputs are trusted: no host sync, so it runs inside a captured round."""
    r, g = tokens.shape
    if target_tokens.shape != (r, g + 1) or lengths.shape != (r,):
        raise ValueError(
            f"greedy_verify takes target_tokens [R, G+1] = {(r, g + 1)} and lengths [R] = {(r,)}, got "
            f"{tuple(target_tokens.shape)} and {tuple(lengths.shape)}"
        )
    if g == 0:  # a plain round: the target's own token, nothing accepted (lengths are all 0)
        return VerifyResult(lengths, target_tokens[:, 0], width=0)
    # The leading run of drafts the target agrees with, cut at each row's length: the drafts past
    # ℓ_r are padding, and a run that reaches ℓ_r stops there (no mask built for them).
    run = (tokens == target_tokens[:, :g]).long().cumprod(dim=1).sum(dim=1)
    accepted = torch.minimum(run, lengths)
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)
    return VerifyResult(accepted, next_token, width=g)


def one_hot_drafts(tokens: Tensor, vocab: int) -> Tensor:
    """[R, G, V] float32, one-hot at each draft: the distribution a greedy draft was taken from
    ([R, 0, V] for a round that drafted nothing). A scatter: no host check of the tokens."""
    out = torch.zeros(*tokens.shape, vocab, device=tokens.device)
    return out.scatter_(-1, tokens[..., None].long(), 1.0)
