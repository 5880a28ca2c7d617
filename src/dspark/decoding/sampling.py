"""The target's sampling distribution p_t: temperature, then top-k, then top-p.

Filtering follows transformers' warpers: top-k keeps the k most likely tokens; top-p then works on
the distribution renormalised over that set, sorted by probability, and keeps a token while the
mass *before* it is < top_p (the most likely token always stays). The result is renormalised.
This filtered distribution is what the engine samples from without a drafter and what it verifies
drafts against, so speculative decoding stays lossless w.r.t. it.

Two implementations of the same rule:
  * ``static=True`` (the fast engine, inside its CUDA graphs): one ``topk(k)``, or for top-p alone
    ``kernels.nucleus`` (on CUDA: the boundary found by bit pattern in ten reads of a row, no
    sort; elsewhere one sort of the full vocabulary per row); static shapes, no host sync.
  * ``static=False`` (the plain engine): without top-k it first tries the 512, then 4096 most
    likely tokens and sorts the full vocabulary only for rows whose nucleus lies outside them
    (exact: a candidate set holding >= top_p of the mass contains the whole nucleus). On one CPU
    core the full sort costs about a SmolLM2 step (0.2 s for 64 rows x 49k), the top 512 a tenth.
Both keep the same tokens with the same values: on the CPU they give the same distribution bit
for bit (tested), unless exactly tied probabilities straddle the nucleus boundary, where the two
sorts may order them differently, as in any sort-based top-p.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.sampling import probs_from_logits
from ..kernels.nucleus import keep_nucleus, nucleus, scatter_renormalised

__all__ = ["filter_probs", "target_probs"]

_CANDIDATES = (512, 4096)


def filter_probs(probs: Tensor, top_k: int = 0, top_p: float = 1.0, *, static: bool = False) -> Tensor:
    """Top-k then top-p filtering of normalised probabilities [..., V]; returns the renormalised
    distribution, same shape. ``top_k=0`` and ``top_p=1`` are no-ops (``probs`` is returned)."""
    v = probs.shape[-1]
    k = top_k if 0 < top_k < v else 0
    if not k and top_p >= 1.0:
        return probs
    if k:  # the top-k set is renormalised before top-p, as transformers does
        vals, ids = probs.topk(k, dim=-1)
        return scatter_renormalised(probs, keep_nucleus(vals, top_p, True) if top_p < 1.0 else vals, ids)
    if static or probs.numel() == 0:  # on CUDA without a sort (kernels.nucleus), else one per row
        return nucleus(probs, top_p)
    return _filter_rows(probs.reshape(-1, v), top_p).reshape(probs.shape)


def _filter_rows(probs: Tensor, top_p: float) -> Tensor:
    """Top-p over rows [n, V], widening the candidate set only for the rows that need it."""
    out = torch.zeros_like(probs)
    todo = torch.arange(probs.shape[0], device=probs.device)
    for w in [c for c in _CANDIDATES if c < probs.shape[-1]] + [probs.shape[-1]]:
        sub = probs[todo]
        vals, ids = sub.topk(w, dim=-1) if w < probs.shape[-1] else sub.sort(dim=-1, descending=True)
        done = vals.sum(-1) >= top_p if w < probs.shape[-1] else torch.ones_like(todo, dtype=torch.bool)
        if bool(done.any()):
            kept = keep_nucleus(vals[done], top_p)
            out[todo[done]] = torch.zeros_like(sub[done]).scatter_(-1, ids[done], kept)
            todo = todo[~done]
        if todo.numel() == 0:
            break
    return out / out.sum(-1, keepdim=True)


def target_probs(
    logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, *, static: bool = False
) -> Tensor:
    """p_t from logits [..., V]: softmax(logits / T) in float32 (one-hot argmax at T = 0, which
    no filter changes), then top-k / top-p."""
    probs = probs_from_logits(logits, temperature)
    if temperature == 0:
        return probs
    return filter_probs(probs, top_k, top_p, static=static)
