"""The target's sampling distribution (decoding.sampling): top-k / top-p filtering equal to
transformers' warpers in both implementations, and the engine sampling from the filtered
distribution (target-only and speculative), checked by chi-square with fixed seeds."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_engine import BOS, Oracle, assert_matches, chi2_pvalue
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from dspark.decoding.engine import Engine
from dspark.decoding.sampling import filter_probs, target_probs


def reference(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' TopK then TopP warpers on log-probabilities, then softmax."""
    scores = probs.log()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.99), (0, 0.5), (50, 0.8), (1000, 0.95), (20, 1.0)])
def test_static_and_candidate_filtering_match_transformers(top_k, top_p):
    """Peaked rows (nucleus inside the 512 candidates), medium ones (inside 4096) and flat ones
    (a full sort): the static path (one sort per row, the CUDA-graph form) and the candidate path
    keep exactly the warpers' tokens, and agree with each other bit for bit."""
    torch.manual_seed(0)
    logits = torch.cat([torch.randn(3, 8192) * s for s in (8.0, 2.0, 0.1)])
    probs = torch.softmax(logits, -1)
    ref = reference(probs, top_k, top_p)
    static = filter_probs(probs, top_k, top_p, static=True)
    dynamic = filter_probs(probs, top_k, top_p, static=False)
    assert torch.equal(static > 0, ref > 0) and torch.equal(dynamic > 0, ref > 0)
    torch.testing.assert_close(static, ref)
    assert torch.equal(static, dynamic)
    # Rows of a verify step [R, G+1, V] are filtered independently.
    stacked = filter_probs(probs.view(3, 3, -1), top_k, top_p, static=True)
    assert torch.equal(stacked.view(9, -1), static)


def test_no_filter_and_greedy_are_untouched():
    logits = torch.randn(4, 300)
    p = torch.softmax(logits, -1)
    assert filter_probs(p, 0, 1.0) is p and filter_probs(p, 300, 1.0) is p
    greedy = target_probs(logits, 0.0, top_k=5, top_p=0.5, static=True)
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(4))
    torch.testing.assert_close(target_probs(logits, 0.7), torch.softmax(logits / 0.7, -1))


# ----------------------------------------------------------------------------------------------
# the engine samples from the filtered distribution

N = 4000
PROMPT = [BOS, 57, 3, 201, 90]


def exact_pairs(target, top_k, top_p, min_expected=5.0) -> dict:
    """Exact probabilities of the first two tokens under the filtered p_t (T = 1), for every pair
    expected at least ``min_expected`` times among N samples."""
    base = torch.tensor(PROMPT)
    with torch.no_grad():
        p1 = filter_probs(torch.softmax(target(base[None]).logits[0, -1].double(), -1), top_k, top_p)
        x1 = (p1 * N >= min_expected).nonzero().flatten()
        pre = torch.stack([torch.cat([base, t.view(1)]) for t in x1])
        p2 = filter_probs(torch.softmax(target(pre).logits[:, -1].double(), -1), top_k, top_p)
    joint = p2 * p1[x1, None]
    return {(int(x1[a]), b): float(joint[a, b]) for a, b in (joint * N >= min_expected).nonzero().tolist()}


@pytest.mark.parametrize("drafter", ["target", "oracle"])
@pytest.mark.parametrize("top_k,top_p", [(0, 0.7), (12, 0.9)])
def test_engine_samples_the_filtered_distribution(small_target, drafter, top_k, top_p):
    """Target-only sampling follows filtered p_t, and speculative decoding (an oracle drafting
    from a warped, unfiltered copy of the target) stays lossless w.r.t. it. Negative control:
    the same samples against the unfiltered distribution are rejected."""
    t = small_target
    draft = Oracle(t, gamma=3) if drafter == "oracle" else None
    eng = Engine(
        t, draft, temperature=1.0, top_k=top_k, top_p=top_p, concurrency=N, max_new_tokens=2,
        eos_token_ids=(), seed=21, record_rounds=False,
    )  # fmt: skip
    samples = [tuple(g.tokens) for g in eng.generate([PROMPT] * N).generations]
    cells = exact_pairs(t, top_k, top_p)
    assert_matches(samples, cells, N, f"{drafter} top_k={top_k} top_p={top_p}")
    unfiltered = exact_pairs(t, 0, 1.0)
    counts = Counter(samples)
    obs = [counts.get(k, 0) for k in unfiltered] + [N - sum(counts.get(k, 0) for k in unfiltered)]
    exp = [p * N for p in unfiltered.values()] + [(1 - sum(unfiltered.values())) * N]
    assert chi2_pvalue(obs, exp) < 1e-6
