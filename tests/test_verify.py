"""Tests for dspark.decoding.verify: exactness of rejection sampling, greedy, edge cases.

The statistical tests put N copies of a few small-vocabulary requests in one batch, so a single
vectorised verify call yields N samples per request. Seeds are fixed, so each test is
deterministic; the negative controls show the chi-square checks do fail when the math is wrong.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark.core.sampling import greedy_tokens, probs_from_logits, sample_from
from dspark.decoding.verify import VerifyResult, greedy_verify, one_hot_drafts, verify

try:  # scipy is a dev extra; fall back to the same statistic via the incomplete gamma function
    from scipy.stats import chisquare as _scipy_chisquare
except ImportError:  # pragma: no cover - depends on the environment
    _scipy_chisquare = None

N = 20_000  # samples per request
P_MIN = 1e-3  # pass threshold for the goodness-of-fit p-value


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value of observed ``counts`` [V] against ``probs`` [V].

    Observations where probs == 0 fail outright (p = 0); bins with expected count < 5 are pooled
    so the chi-square approximation holds.
    """
    counts = counts.double().cpu()
    probs = probs.double().cpu()
    n = counts.sum()
    if (counts[probs <= 0] > 0).any():
        return 0.0
    expected = probs / probs.sum() * n
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    if obs.numel() < 2:
        return 1.0
    if _scipy_chisquare is not None:
        return float(_scipy_chisquare(obs.numpy(), exp.numpy()).pvalue)
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _counts(x: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(x.reshape(-1), minlength=v)


def _make_case(
    seed: int, r0: int, g: int, v: int, temps=(0.5, 1.0, 2.0), zeros: bool = True, close: bool = False
):
    """r0 base requests with target rows [r0, g+1, v] and draft rows [r0, g, v].

    Each position picks its own temperatures (so p_t rows differ per position); request 1 gets
    mutually exclusive zeros (p_d = 0 where p_t > 0 and vice versa) to hit the edge branches.
    ``close`` makes the draft a noisy copy of the target, so long accepted prefixes are common.
    """
    gen = torch.Generator().manual_seed(seed)
    tt = torch.tensor(temps)
    t_temp = tt[torch.randint(len(temps), (r0, g + 1, 1), generator=gen)]
    d_temp = tt[torch.randint(len(temps), (r0, g, 1), generator=gen)]
    t_logits = torch.randn(r0, g + 1, v, generator=gen) * 1.5
    d_logits = torch.randn(r0, g, v, generator=gen) * 1.5
    if close:
        d_logits = t_logits[:, :g] + 0.5 * d_logits
    p_t = torch.softmax(t_logits / t_temp, dim=-1)
    p_d = torch.softmax(d_logits / d_temp, dim=-1)
    if zeros and r0 > 1:
        p_t[1, :, : v // 3] = 0.0  # target forbids tokens the draft may propose
        p_d[1, :, v - v // 3 :] = 0.0  # draft never proposes tokens the target wants
        p_t[1] /= p_t[1].sum(-1, keepdim=True)
        p_d[1] /= p_d[1].sum(-1, keepdim=True)
    return p_t, p_d


def _replicate(p_t, p_d, lengths0, n, gen):
    """n copies of each base request, drafts sampled independently per position from p_d."""
    r0 = p_t.shape[0]
    idx = torch.arange(r0).repeat_interleave(n)
    pt, pd = p_t[idx], p_d[idx]
    tokens = sample_from(pd, torch.rand(pd.shape[:-1], generator=gen))
    return idx, pt, pd, tokens, lengths0[idx]


def _emitted(res: VerifyResult, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Token at step k of the emitted sequence (accepted drafts, then next_token); -1 if absent."""
    if k < tokens.shape[1]:
        out = torch.where(res.accepted > k, tokens[:, k], res.next_token)
    else:
        out = res.next_token.clone()
    return torch.where(res.accepted >= k, out, -1)


# ----------------------------------------------------------------------------- probs_from_logits


def test_probs_from_logits():
    logits = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(0)).bfloat16()
    p = probs_from_logits(logits, 1.0)
    assert p.dtype == torch.float32
    torch.testing.assert_close(p, torch.softmax(logits.float(), -1))
    torch.testing.assert_close(probs_from_logits(logits, 0.5), torch.softmax(logits.float() * 2, -1))
    g = probs_from_logits(logits, 0.0)
    assert torch.equal(g.argmax(-1), logits.float().argmax(-1))
    assert torch.equal(g.sum(-1), torch.ones(3, 4)) and set(g.unique().tolist()) == {0.0, 1.0}
    with pytest.raises(ValueError, match="temperature"):
        probs_from_logits(logits, -1.0)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_greedy_tokens_is_argmax_ties_included(compiled):
    """The two-stage argmax equals torch's on random rows of several shapes and dtypes, on ties
    inside a slice and across slices (the lowest index wins, as torch.argmax), and on vocabularies
    the slices do not divide (one stage); compiled as the drafter's greedy step is, too."""
    fn = torch.compile(greedy_tokens, backend="inductor", dynamic=True) if compiled else greedy_tokens
    g = torch.Generator().manual_seed(1)
    for shape in [(3, 49152), (2, 5, 256), (4, 1000), (2, 97), (1, 64)]:
        for dtype in (torch.float32, torch.bfloat16):
            z = torch.randn(*shape, generator=g).to(dtype)
            assert torch.equal(fn(z), z.argmax(-1)), (shape, dtype)
    z = torch.randn(4, 4096, generator=g)
    z[0, [3000, 7, 100]] = 9.0  # across slices: 7 wins
    z[1, [70, 65]] = 9.0  # one slice (64 wide): 65 wins
    z[2] = 0.0  # all tied: 0
    z[3, [4095, 4032]] = 9.0  # the last slice
    assert fn(z).tolist() == [7, 65, 0, 4032] == z.argmax(-1).tolist()


# ----------------------------------------------------------------------------------- sample_from


def test_sample_from_matches_multinomial_in_distribution():
    gen = torch.Generator().manual_seed(1)
    v = 8
    probs = torch.softmax(torch.randn(3, v, generator=gen) * 1.5, -1)
    probs[2, 3] = 0.0  # a zero hole in the middle
    scale = torch.tensor([1.0, 7.3, 0.01]).unsqueeze(-1)  # rows 1, 2 unnormalised
    rows = (probs * scale).repeat_interleave(N, 0)
    x = sample_from(rows, torch.rand(rows.shape[0], generator=gen)).view(3, N)
    m = torch.multinomial(probs, N, replacement=True, generator=gen)
    assert x.dtype == torch.long
    for i in range(3):
        cx, cm = _counts(x[i], v), _counts(m[i], v)
        assert _chi2_pvalue(cx, probs[i]) > P_MIN
        assert _chi2_pvalue(cm, probs[i]) > P_MIN
        # Two-sample check: multinomial counts as the reference distribution.
        assert _chi2_pvalue(cx, (cm.double() + 0.5) * (probs[i] > 0)) > P_MIN
    assert (x[2] != 3).all()
    # Negative control: a shifted distribution is rejected.
    assert _chi2_pvalue(_counts(x[0], v), probs[0].roll(1)) < 1e-6


def test_sample_from_edges():
    p = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    # u == 1 (beyond the contract) or round-off past the total still lands on a token with mass.
    assert sample_from(p, torch.ones(3)).tolist() == [1, 2, 3]
    assert sample_from(p, torch.zeros(3)).tolist() == [0, 2, 0]
    assert sample_from(p, torch.tensor([0.2, 0.3, 0.5])).tolist() == [1, 2, 2]  # strict ">"
    # Arbitrary leading dims, V = 1.
    q = torch.rand(2, 3, 5)
    assert sample_from(q, torch.rand(2, 3)).shape == (2, 3)
    assert sample_from(torch.ones(4, 1), torch.rand(4)).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="u must have shape"):
        sample_from(q, torch.rand(3))


# ------------------------------------------------------------------------------- exactness (stat)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_token_is_target_distributed(seed):
    g, v, r0 = 3, 7, 4
    p_t, p_d = _make_case(seed, r0, g, v)
    lengths0 = torch.tensor([g, g, 1, 0])  # ragged, including the no-draft case
    gen = torch.Generator().manual_seed(100 + seed)
    idx, pt, pd, tokens, lengths = _replicate(p_t, p_d, lengths0, N, gen)
    res = verify(pt, pd, tokens, lengths, generator=gen)

    first = _emitted(res, tokens, 0).view(r0, N)
    for i in range(r0):
        p = _chi2_pvalue(_counts(first[i], v), p_t[i, 0])
        assert p > P_MIN, f"request {i} (length {lengths0[i]}): p-value {p:.2e}"

    # Negative control: residual replaced by p_t (the classic bug) must be caught on every request
    # that verifies drafts (p_t and p_d are independent here, so rejections are frequent).
    rejected = res.accepted < lengths
    rows = torch.arange(pt.shape[0])
    wrong_next = torch.where(
        rejected, sample_from(pt[rows, res.accepted], torch.rand(pt.shape[0], generator=gen)), res.next_token
    )
    wrong = VerifyResult(res.accepted, wrong_next, res.accept_flags)
    wrong_first = _emitted(wrong, tokens, 0).view(r0, N)
    wrong_p = [_chi2_pvalue(_counts(wrong_first[i], v), p_t[i, 0]) for i in range(3)]
    assert max(wrong_p) < 1e-4 and min(wrong_p) < 1e-20, wrong_p


def test_negative_control_inverted_ratio():
    """Accepting with min(1, p_d/p_t) instead of min(1, p_t/p_d) must fail the same check."""
    g, v = 1, 6
    p_t, p_d = _make_case(7, 1, g, v, zeros=False)
    gen = torch.Generator().manual_seed(7)
    _, pt, pd, tokens, lengths = _replicate(p_t, p_d, torch.tensor([1]), N, gen)
    u_acc, u_s = torch.rand(N, g, generator=gen), torch.rand(N, generator=gen)
    good = verify(pt, pd, tokens, lengths, uniforms=(u_acc, u_s))
    assert _chi2_pvalue(_counts(_emitted(good, tokens, 0), v), p_t[0, 0]) > P_MIN
    # Swapping p_t and p_d in the acceptance test only: keep the correct residual rule.
    swapped = verify(
        torch.cat([pd, pt[:, 1:]], 1), pt[:, :1], tokens, lengths, uniforms=(u_acc, u_s)
    ).accepted
    rows = torch.arange(N)
    resid = (pt[rows, 0] - pd[rows, 0]).clamp_min(0)
    nxt = torch.where(swapped > 0, sample_from(pt[:, 1], u_s), sample_from(resid, u_s))
    bad_first = torch.where(swapped > 0, tokens[:, 0], nxt)
    assert _chi2_pvalue(_counts(bad_first, v), p_t[0, 0]) < 1e-6


@pytest.mark.parametrize("seed", [3, 4])
def test_later_tokens_conditionally_target_distributed(seed):
    """Given the first k emitted tokens are accepted drafts, emitted token k ~ p_t[k] (incl. bonus)."""
    g, v, r0 = 3, 6, 2
    p_t, p_d = _make_case(seed, r0, g, v, temps=(1.0,), close=True)
    lengths0 = torch.tensor([g, 2])
    gen = torch.Generator().manual_seed(200 + seed)
    idx, pt, pd, tokens, lengths = _replicate(p_t, p_d, lengths0, N, gen)
    res = verify(pt, pd, tokens, lengths, generator=gen)
    checked = 0
    for i in range(r0):
        sel = idx == i
        for k in range(1, int(lengths0[i]) + 1):
            e = _emitted(res, tokens, k)[sel]
            e = e[e >= 0]  # rows whose first k emitted tokens were accepted drafts
            if e.numel() < 2000:
                continue
            p = _chi2_pvalue(_counts(e, v), p_t[i, k])
            assert p > P_MIN, f"request {i}, step {k}: p-value {p:.2e} on {e.numel()} samples"
            checked += 1
            if k == 1:
                # Also conditional on the value of the first token (most frequent one).
                first = tokens[sel, 0][res.accepted[sel] >= 1]
                a = int(first.bincount(minlength=v).argmax())
                e_a = _emitted(res, tokens, 1)[sel][(res.accepted[sel] >= 1) & (tokens[sel, 0] == a)]
                assert _chi2_pvalue(_counts(e_a, v), p_t[i, 1]) > P_MIN
    assert checked >= 4  # the test must actually exercise positions beyond the first

    # Negative control: an off-by-one bonus row (p_t[lengths - 1] instead of p_t[lengths]).
    bonus = res.accepted == lengths
    rows = torch.arange(pt.shape[0])
    off = sample_from(pt[rows, (lengths - 1).clamp_min(0)], torch.rand(pt.shape[0], generator=gen))
    wrong = VerifyResult(res.accepted, torch.where(bonus, off, res.next_token), res.accept_flags)
    e = _emitted(wrong, tokens, g)[idx == 0]
    assert _chi2_pvalue(_counts(e[e >= 0], v), p_t[0, g]) < 1e-6


def test_all_lengths_zero_samples_target():
    g, v, r0 = 2, 8, 3
    p_t, p_d = _make_case(11, r0, g, v)
    gen = torch.Generator().manual_seed(11)
    _, pt, pd, tokens, lengths = _replicate(p_t, p_d, torch.zeros(r0, dtype=torch.long), N, gen)
    tokens[:, :] = -1  # padding beyond lengths is never read
    res = verify(pt, pd, tokens, lengths, generator=gen)
    assert (res.accepted == 0).all() and not res.accept_flags.any()
    nt = res.next_token.view(r0, N)
    for i in range(r0):
        assert _chi2_pvalue(_counts(nt[i], v), p_t[i, 0]) > P_MIN


# ------------------------------------------------------------------------------------- greedy


def test_greedy_reproduces_target_argmax_chain():
    gen = torch.Generator().manual_seed(5)
    r, g, v = 64, 5, 11
    t_logits = torch.randn(r, g + 1, v, generator=gen)
    d_logits = torch.randn(r, g, v, generator=gen)
    # Make the draft agree with the target on a random prefix so all accept counts occur.
    agree = torch.arange(g) < torch.randint(0, g + 1, (r, 1), generator=gen)
    d_logits = torch.where(agree.unsqueeze(-1), t_logits[:, :g], d_logits)
    p_t, p_d = probs_from_logits(t_logits, 0.0), probs_from_logits(d_logits, 0.0)
    tokens = d_logits.argmax(-1)
    lengths = torch.randint(0, g + 1, (r,), generator=gen)
    res = verify(p_t, p_d, tokens, lengths, generator=gen)

    t_arg = t_logits.argmax(-1)
    for i in range(r):  # plain reference loop: fine at this size
        n = 0
        while n < lengths[i] and tokens[i, n] == t_arg[i, n]:
            n += 1
        assert res.accepted[i] == n
        assert res.next_token[i] == t_arg[i, n]
        assert res.accept_flags[i].tolist() == [k < n for k in range(g)]
    assert len(set(res.accepted.tolist())) >= 4


@pytest.mark.parametrize("g", [0, 1, 5])
def test_greedy_verify_is_verify_on_one_hot_distributions(g):
    """The fast engine's T = 0 verification from tokens alone (target argmax [R, G+1], drafts,
    lengths) returns exactly what ``verify`` returns on the one-hot distributions of the same
    tokens, for every accepted count and length 0..G, with any uniforms."""
    gen = torch.Generator().manual_seed(11 + g)
    r, v = 256, 7  # a small vocabulary: chance agreements, ties in the logits
    t_logits = torch.randint(0, 3, (r, g + 1, v), generator=gen).float()
    t_arg = t_logits.argmax(-1)
    agree = torch.arange(g) < torch.randint(0, g + 1, (r, 1), generator=gen)
    drafts = torch.where(agree, t_arg[:, :g], torch.randint(0, v, (r, g), generator=gen))
    lengths = torch.randint(0, g + 1, (r,), generator=gen)
    ref = verify(probs_from_logits(t_logits, 0.0), one_hot_drafts(drafts, v), drafts, lengths, generator=gen)
    got = greedy_verify(t_arg, drafts, lengths)
    assert torch.equal(got.accepted, ref.accepted)
    assert torch.equal(got.next_token, ref.next_token)
    assert torch.equal(got.accept_flags, ref.accept_flags)
    if g:
        assert len(set(got.accepted.tolist())) == g + 1  # every accepted count occurred
    with pytest.raises(ValueError, match=r"target_tokens \[R, G\+1\]"):
        greedy_verify(t_arg[:, :g], drafts, lengths)


def test_one_hot_drafts_marks_each_draft():
    drafts = torch.tensor([[2, 0], [1, 1]])
    out = one_hot_drafts(drafts, 3)
    assert out.dtype == torch.float32 and out.shape == (2, 2, 3)
    assert torch.equal(out.argmax(-1), drafts) and torch.equal(out.sum(-1), torch.ones(2, 2))
    assert one_hot_drafts(torch.zeros(4, 0, dtype=torch.long), 3).shape == (4, 0, 3)


# ------------------------------------------------------------------------------ edges / contract


def test_vocab_of_one():
    r, g = 5, 3
    p_t, p_d = torch.ones(r, g + 1, 1), torch.ones(r, g, 1)
    tokens = torch.zeros(r, g, dtype=torch.long)
    lengths = torch.tensor([0, 1, 2, 3, 3])
    res = verify(p_t, p_d, tokens, lengths, generator=torch.Generator().manual_seed(0))
    assert torch.equal(res.accepted, lengths)
    assert torch.equal(res.next_token, torch.zeros(r, dtype=torch.long))


def test_zero_draft_width():
    p_t = torch.softmax(torch.randn(4, 1, 5), -1)
    res = verify(
        p_t, torch.ones(4, 0, 5), torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    )
    assert res.accepted.tolist() == [0] * 4 and res.accept_flags.shape == (4, 0)


def test_uniform_convention_and_reproducibility():
    p_t, p_d = _make_case(9, 3, 4, 6)
    gen = torch.Generator().manual_seed(9)
    _, pt, pd, tokens, lengths = _replicate(p_t, p_d, torch.tensor([4, 2, 3]), 50, gen)
    r, g = tokens.shape
    # generator path == explicit uniforms drawn as rand(R, G) then rand(R) from the same generator
    a = verify(pt, pd, tokens, lengths, generator=torch.Generator().manual_seed(42))
    g2 = torch.Generator().manual_seed(42)
    u = (torch.rand(r, g, generator=g2), torch.rand(r, generator=g2))
    b = verify(pt, pd, tokens, lengths, uniforms=u)
    c = verify(pt.bfloat16().float(), pd, tokens, lengths, uniforms=u)  # sanity: runs on other input
    for x, y in [(a.accepted, b.accepted), (a.next_token, b.next_token), (a.accept_flags, b.accept_flags)]:
        assert torch.equal(x, y)
    assert c.accepted.shape == (r,)
    again = verify(pt, pd, tokens, lengths, uniforms=u)
    assert torch.equal(again.next_token, b.next_token) and torch.equal(again.accepted, b.accepted)
    # Invariants of the result.
    assert (b.accepted <= lengths).all()
    assert torch.equal(b.accept_flags, torch.arange(g) < b.accepted.unsqueeze(1))
    assert b.accepted.dtype == torch.long and b.next_token.dtype == torch.long


def test_matches_scalar_reference():
    """Row-by-row scalar implementation of the rule agrees exactly given the same uniforms."""
    p_t, p_d = _make_case(13, 4, 3, 6)
    gen = torch.Generator().manual_seed(13)
    _, pt, pd, tokens, lengths = _replicate(p_t, p_d, torch.tensor([3, 3, 2, 1]), 25, gen)
    r, g = tokens.shape
    u_acc, u_s = torch.rand(r, g, generator=gen), torch.rand(r, generator=gen)
    res = verify(pt.half(), pd.half(), tokens.int(), lengths, uniforms=(u_acc, u_s))
    pt, pd = pt.half().float(), pd.half().float()
    for i in range(r):
        n = 0
        while n < lengths[i]:
            x = tokens[i, n]
            if not (pd[i, n, x] > 0 and u_acc[i, n] * pd[i, n, x] < pt[i, n, x]):
                break
            n += 1
        if n < lengths[i]:
            dist = (pt[i, n] - pd[i, n]).clamp_min(0)
            if dist.sum() <= 0:
                dist = pt[i, n]
        else:
            dist = pt[i, n]
        assert res.accepted[i] == n
        assert res.next_token[i] == sample_from(dist, u_s[i])


def test_residual_fallback_and_nan_guard():
    # p_t == p_d: residual is all zero; force a "rejection" via u = 1 (beyond the contract).
    p = torch.tensor([[[0.5, 0.5, 0.0]]])
    res = verify(
        torch.cat([p, p], 1),
        p,
        torch.tensor([[1]]),
        torch.tensor([1]),
        uniforms=(torch.ones(1, 1), torch.tensor([0.9])),
    )
    assert res.accepted.item() == 0 and res.next_token.item() == 1  # fell back to p_t
    # Draft token with p_d = 0 is never accepted, even with u = 0.
    pd = torch.tensor([[[1.0, 0.0, 0.0]]])
    pt = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
    res = verify(pt, pd, torch.tensor([[1]]), torch.tensor([1]), uniforms=(torch.zeros(1, 1), torch.zeros(1)))
    assert res.accepted.item() == 0 and res.next_token.item() == 1
    # NaN in the target rejects instead of accepting, and never yields a NaN-mass token.
    pt_nan = torch.tensor([[[float("nan"), 0.7, 0.3], [1.0, 0.0, 0.0]]])
    pd2 = torch.tensor([[[0.5, 0.5, 0.0]]])
    res = verify(
        pt_nan, pd2, torch.tensor([[0]]), torch.tensor([1]), uniforms=(torch.zeros(1, 1), torch.zeros(1))
    )
    assert res.accepted.item() == 0 and res.next_token.item() == 1


def test_bad_inputs_raise():
    r, g, v = 2, 3, 5
    pt, pd = torch.rand(r, g + 1, v), torch.rand(r, g, v)
    tok, ln = torch.zeros(r, g, dtype=torch.long), torch.tensor([1, 3])
    with pytest.raises(ValueError, match="target_probs"):
        verify(pt[:, :g], pd, tok, ln)
    with pytest.raises(ValueError, match="target_probs"):
        verify(pt[..., :4], pd, tok, ln)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(pt, pd[0], tok, ln)
    with pytest.raises(ValueError, match="tokens"):
        verify(pt, pd, tok[:, :2], ln)
    with pytest.raises(ValueError, match="tokens"):
        verify(pt, pd, tok.float(), ln)
    with pytest.raises(ValueError, match="lengths"):
        verify(pt, pd, tok, ln[:1])
    with pytest.raises(ValueError, match="lengths"):
        verify(pt, pd, tok, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="lengths"):
        verify(pt, pd, tok, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="tokens"):
        verify(pt, pd, torch.full((r, g), v), ln)
    with pytest.raises(ValueError, match="u_accept"):
        verify(pt, pd, tok, ln, uniforms=(torch.rand(r, g + 1), torch.rand(r)))
    with pytest.raises(ValueError, match="u_sample"):
        verify(pt, pd, tok, ln, uniforms=(torch.rand(r, g), torch.rand(r, 1)))
    # Padding outside the verified prefix is allowed to be anything.
    verify(pt, pd, torch.tensor([[0, -1, 99], [0, 1, 2]]), ln)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_matches_cpu():
    p_t, p_d = _make_case(21, 3, 4, 6)
    gen = torch.Generator().manual_seed(21)
    _, pt, pd, tokens, lengths = _replicate(p_t, p_d, torch.tensor([4, 1, 0]), 100, gen)
    u = (torch.rand(tokens.shape, generator=gen), torch.rand(tokens.shape[0], generator=gen))
    a = verify(pt, pd, tokens, lengths, uniforms=u)
    b = verify(pt.cuda(), pd.cuda(), tokens.cuda(), lengths.cuda(), uniforms=(u[0].cuda(), u[1].cuda()))
    assert torch.equal(a.accepted, b.accepted.cpu())
    # The inverse CDF may differ at exact float ties between devices; these are vanishingly rare.
    assert (a.next_token == b.next_token.cpu()).float().mean() > 0.99
    b2 = verify(
        pt.cuda(), pd.cuda(), tokens.cuda(), lengths.cuda(), generator=torch.Generator("cuda").manual_seed(0)
    )
    assert b2.next_token.device.type == "cuda"


def test_math_constant_sanity():
    # Guards the p-value fallback against a silent regression (chi2 with df=1 has sf = erfc(sqrt(x/2))).
    counts = torch.tensor([60.0, 40.0, 0.0])
    probs = torch.tensor([0.5, 0.5, 0.0])
    stat = (10**2 / 50) * 2
    assert math.isclose(_chi2_pvalue(counts, probs), math.erfc(math.sqrt(stat / 2)), rel_tol=1e-6)
