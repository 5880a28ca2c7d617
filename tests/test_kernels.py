"""Kernels (``dspark.kernels``) against their PyTorch references.

Three tiers:
  * in-process CPU tests of the PyTorch paths (fused loss vs materialised, gradcheck, the
    local sampling / verification references vs ``dspark.decoding.verify``);
  * ``test_interp_*``: the Triton kernels on CPU under Triton's interpreter at small shapes.
    ``@triton.jit`` decides between compiling and interpreting when a kernel module is
    imported, from ``TRITON_INTERPRET``, so the variable cannot be flipped inside this pytest
    process without leaking into other tests (anything importing triton later would be
    interpreted). ``test_triton_kernels_under_interpreter`` therefore re-runs this file's
    ``test_interp_*`` tests in a child pytest with ``TRITON_INTERPRET=1``; in the parent they
    skip with a pointer to it. Without triton they all skip, with the reason.
  * ``@pytest.mark.gpu``: the compiled kernels at realistic shapes (V=49152, 512 anchors x 7
    rows, d=576, r=256) on CUDA; deselected by default (``-m gpu`` runs them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.bench.common import kernel_fallbacks
from dspark.kernels import (
    RowWeights,
    cache_attention,
    cache_attention_reference,
    fused_draft_loss,
    materialized_draft_loss,
    rejection_verify,
    rejection_verify_reference,
    sample_from_reference,
    sample_step,
    sample_step_reference,
    triton_available,
    triton_interpreting,
)
from dspark.kernels import fused_loss as fused_loss_module
from dspark.kernels.bias_argmax import BLOCK_V as BIAS_BLOCK_V
from dspark.kernels.bias_argmax import bias_argmax, bias_argmax_reference, bias_argmax_self_check, near_greedy
from dspark.kernels.cache_attention import choose_splits
from dspark.kernels.fused_loss import _accumulates_f32, _addmm_f32_, _mm_f32, chunk_plan
from dspark.kernels.nucleus import nucleus, nucleus_reference, nucleus_self_check
from dspark.kernels.sample_step import BLOCK, SM_TARGET, TWO_CHUNKS_MAX_ROWS, _chunk_layout, choose_chunks

try:  # the colleague-owned references; tests fall back to the local ones if absent
    from dspark.core.sampling import probs_from_logits, sample_from
    from dspark.decoding.verify import verify
except ImportError:  # pragma: no cover
    verify = sample_from = probs_from_logits = None

INTERPRETING = triton_interpreting()
CHILD_ENV = "DSPARK_KERNELS_INTERP_CHILD"
needs_interpreter = pytest.mark.skipif(
    not (INTERPRETING and os.environ.get(CHILD_ENV) == "1"),
    reason="runs in the TRITON_INTERPRET=1 child started by test_triton_kernels_under_interpreter",
)
needs_cuda_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error (robust to entries near zero)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- loss helpers


def loss_problem(n, d, r, v, *, seed=0, dtype=torch.float32, device="cpu", ignore_every=5):
    """Draft features [n, d + r], a frozen LM head [v, d], a trainable bias block [v, r] (r may be
    0), target hidden states [n, d], labels and random per-row weights of CE, TV and KL."""
    g = torch.Generator().manual_seed(seed)
    # Logit std ~2.5 so distributions are peaked but not one-hot; the target shares most of the
    # draft's structure so TV spans its range instead of sitting at 2.
    x = torch.randn(n, d + r, generator=g)
    lm = torch.randn(v, d, generator=g) * (2.5 / d**0.5)
    bias = torch.randn(v, r, generator=g) * 0.5
    th = 0.7 * x[:, :d] + 0.3 * torch.randn(n, d, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::ignore_every] = -100
    rw = RowWeights(*torch.rand(3, n, generator=g))

    def to(t):
        return t.to(device=device, dtype=dtype)

    return to(x), to(lm), to(bias), to(th), labels.to(device), RowWeights(*(w.to(device) for w in rw))


def reference(x, lm, bias, th, labels, rw, softcap=None):
    """Materialised loss with autograd through torch.cat([lm, bias]): (loss, ce, tv, kl, dx, dbias)."""
    x = x.detach().clone().requires_grad_()
    b = bias.detach().clone().requires_grad_()
    out = materialized_draft_loss(x, torch.cat([lm, b], 1), th, labels, rw, softcap)
    out.loss.backward()
    return out.loss.detach(), out.ce, out.tv, out.kl, x.grad, b.grad


def fused(x, lm, bias, th, labels, rw, softcap=None, **kw):
    x = x.detach().clone().requires_grad_()
    b = bias.detach().clone().requires_grad_()
    trainable = b if b.shape[1] else None
    out = fused_draft_loss(
        x, torch.cat([lm, bias], 1), th, labels, rw, trainable=trainable, softcap=softcap, **kw
    )
    out.loss.backward()
    return (
        out.loss.detach(),
        out.ce,
        out.tv,
        out.kl,
        x.grad,
        b.grad if trainable is not None else torch.zeros_like(b),
    )


def assert_loss_close(got, ref, tol):
    for name, g_, r_ in zip(("loss", "ce", "tv", "kl", "grad_x", "grad_bias"), got, ref):
        assert g_.shape == r_.shape, name
        if r_.numel() == 0:
            continue
        err = rel_err(g_, r_)
        assert err < tol, f"{name}: relative error {err:.3e} >= {tol:.0e}"


# ----------------------------------------------------------------------------- loss, torch


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("chunk_rows", [8, 16, 1000])
@pytest.mark.parametrize("rank", [0, 6])
def test_fused_loss_matches_materialized(softcap, chunk_rows, rank):
    prob = loss_problem(37, 20, rank, 300, seed=1)
    ref = reference(*prob, softcap=softcap)
    got = fused(*prob, softcap=softcap, impl="torch", chunk_rows=chunk_rows)
    assert_loss_close(got, ref, 1e-5)
    _, ce, tv, kl = ref[:4]
    labels = prob[4]
    assert torch.all(ce[labels < 0] == 0) and torch.all(ce[labels >= 0] > 0)
    assert torch.all((tv > 0) & (tv < 2)) and torch.all(kl > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bias_gradient_accumulates_into_its_float32_sum(dtype):
    """The bias gradient's chunks add into one float32 sum (a GEMM that accumulates where the backend
    can, else a product and an add): the same sum either way, the loss's layouts (dz transposed, a
    column slice of the features); the CPU has no 16-bit GEMM into float32, so it keeps the add."""
    g = torch.Generator().manual_seed(3)
    dz = torch.randn(24, 50, generator=g).to(dtype)  # [rows, V]
    x = torch.randn(24, 9, generator=g).to(dtype)[:, 3:]  # the bias block's columns
    acc = torch.randn(50, 6, generator=g)
    want = acc + _mm_f32(dz.T, x).float()
    _addmm_f32_(acc, dz.T, x)
    torch.testing.assert_close(acc, want, rtol=1e-5, atol=1e-5)
    assert not _accumulates_f32(torch.device("cpu"), torch.bfloat16)


def test_fused_loss_gradcheck():
    x, lm, bias, th, labels, rw = loss_problem(5, 4, 3, 13, seed=2, dtype=torch.float64, ignore_every=3)
    x.requires_grad_()
    bias.requires_grad_()
    for softcap in (None, 2.0):

        def f(x_, b_, softcap=softcap):
            weight = torch.cat([lm, b_.detach()], 1)
            return fused_draft_loss(
                x_, weight, th, labels, rw, trainable=b_, softcap=softcap, impl="torch", chunk_rows=2
            ).loss

        assert torch.autograd.gradcheck(f, (x, bias), eps=1e-6, atol=1e-7)


def test_fused_loss_frozen_head_and_no_grad():
    """No gradient reaches the frozen head or the target side; without autograd nothing is built
    and the values are the same; a weight that asks for gradients is refused."""
    x, lm, bias, th, labels, rw = loss_problem(7, 8, 0, 50, seed=4)
    th = th.clone().requires_grad_()
    xx = x.clone().requires_grad_()
    out = fused_draft_loss(xx, lm, th, labels, rw, impl="torch")
    out.loss.backward()
    assert th.grad is None and xx.grad is not None
    with torch.no_grad():
        again = fused_draft_loss(xx, lm, th, labels, rw, impl="torch")
    assert not again.loss.requires_grad and torch.equal(again.tv, out.tv)
    with pytest.raises(ValueError, match="trainable"):
        fused_draft_loss(x, lm.clone().requires_grad_(), th, labels, rw, impl="torch")


def test_loss_dispatch_on_cpu():
    x, lm, _, th, labels, rw = loss_problem(11, 8, 0, 40, seed=5)
    ref = fused_draft_loss(x, lm, th, labels, rw, impl="torch")
    auto = fused_draft_loss(x, lm, th, labels, rw, impl="auto")
    assert torch.equal(auto.ce, ref.ce) and torch.equal(auto.tv, ref.tv)
    with pytest.raises(ValueError, match="impl"):
        fused_draft_loss(x, lm, th, labels, rw, impl="cuda")
    if not INTERPRETING:
        with pytest.raises(RuntimeError):
            fused_draft_loss(x, lm, th, labels, rw, impl="triton")


def shared_targets_problem(groups, rows, targets, d, r, v, *, seed=0, dtype=torch.float32):
    """A loss problem whose ``rows`` per group compare with the group's own ``targets`` target rows
    (a sequence's anchor rows and its positions: each target shared by several rows)."""
    x, lm, bias, _, labels, rw = loss_problem(groups * rows, d, r, v, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    local = torch.randint(0, targets, (groups, rows), generator=g)
    index = (local + targets * torch.arange(groups)[:, None]).reshape(-1)
    noise = torch.randn(groups * targets, d, generator=g).to(dtype)
    th = 0.7 * x[: groups * targets, :d] + 0.3 * noise  # related to the drafts: TV spans its range
    return x, lm, bias, th, labels, rw, index


def test_chunk_plan():
    assert chunk_plan(10, 4) == [(None, None, [(0, 4), (4, 8), (8, 10)])]
    # Groups of 6 rows sharing 2 targets each: as many whole groups as fit a chunk …
    assert chunk_plan(30, 13, 6, 2) == [(0, 4, [(0, 12)]), (4, 8, [(12, 24)]), (8, 10, [(24, 30)])]
    # … or one group over several chunks, its targets' logits shared by them.
    assert chunk_plan(12, 4, 6, 2) == [(0, 2, [(0, 4), (4, 6)]), (2, 4, [(6, 10), (10, 12)])]


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(
    "chunk_rows,shared",
    [(1000, True), (24, True), (8, True), (4, False)],
    ids=["all-groups", "2-groups-a-chunk", "group-over-chunks", "targets-over-a-chunk"],
)
def test_shared_targets_match_per_row_targets(softcap, chunk_rows, shared, monkeypatch):
    """Target logits computed once per shared target (read through the index) give what one per
    row gave (the computation before: each row's target gathered), and the materialised truth."""
    from dspark.kernels import fused_loss

    seen = []
    torch_rows = fused_loss._ROW_PASSES["torch"]

    def spy(zd, zt, *args):
        seen.append((zd.shape[0], zt.shape[0], args[-1] is not None))
        return torch_rows(zd, zt, *args)

    monkeypatch.setitem(fused_loss._ROW_PASSES, "torch", spy)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        x, lm, bias, th, labels, rw, index = shared_targets_problem(5, 12, 5, 20, 6, 300, seed=3, dtype=dtype)
        kw = dict(softcap=softcap, impl="torch", chunk_rows=chunk_rows)
        per_row = fused(x, lm, bias, th[index], labels, rw, **kw)
        seen.clear()
        got = fused(x, lm, bias, th, labels, rw, target_index=index, group_rows=12, **kw)
        assert all(indexed == shared for _, _, indexed in seen)
        assert sum(n for n, _, _ in seen) == 60
        if shared:  # the target logits of at most the chunk's groups, never one per row
            assert all(t <= 5 * -(-n // 12) for n, t, _ in seen)
        assert_loss_close(got, per_row, tol)
        truth = materialized_draft_loss(x, torch.cat([lm, bias], 1), th, labels, rw, softcap, index)
        assert rel_err(got[2], truth.tv) < max(tol, 1e-9)


def test_shared_targets_fall_back_once_where_their_kernel_fails(monkeypatch, caplog):
    """On a GPU where the shared-target row pass fails to build, the loss falls back (once, with a
    warning) to one target per row; elsewhere the error surfaces (here: the CPU, as in tests)."""
    from dspark.kernels import fused_loss

    x, lm, bias, th, labels, rw, index = shared_targets_problem(3, 12, 5, 20, 6, 300, seed=5)
    torch_rows = fused_loss._ROW_PASSES["torch"]
    calls = []

    def broken(zd, zt, *args):
        calls.append(args[-1] is not None)
        if args[-1] is not None:
            raise RuntimeError("no kernel for you")
        return torch_rows(zd, zt, *args)

    monkeypatch.setitem(fused_loss._ROW_PASSES, "torch", broken)
    monkeypatch.setattr(fused_loss, "_SHARED_TARGETS_FAILED", {})
    with pytest.raises(RuntimeError, match="no kernel"):
        fused(x, lm, bias, th, labels, rw, impl="torch", target_index=index, group_rows=12)
    monkeypatch.setattr(fused_loss, "_falls_back", lambda backend, x: True)
    ref = fused(x, lm, bias, th[index], labels, rw, impl="torch")
    calls.clear()
    got = fused(x, lm, bias, th, labels, rw, impl="torch", target_index=index, group_rows=12)
    assert calls[0] and not any(calls[1:]) and "each row gathers its own target" in caplog.text
    assert_loss_close(got, ref, 1e-6)
    calls.clear()
    fused(x, lm, bias, th, labels, rw, impl="torch", target_index=index, group_rows=12)
    assert calls and not any(calls)  # given up for the rest of the run


# ----------------------------------------------------------------------------- sampling helpers


def sampling_rows(r, v, *, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(r, v, generator=g) * 3
    bias = torch.randn(r, v, generator=g)
    base[0, 5:40] = float("-inf")  # masked vocabulary entries
    base[1, 3] = base[1, v - 2] = base[1].max() + 10  # greedy tie across blocks: lowest wins
    bias[1, 3] = bias[1, v - 2] = 0.0
    u = torch.rand(r, generator=g)
    u[2] = 1 - 2**-24  # largest float32 below 1: exercises the clamp to the last mass
    return base.to(device), bias.to(device), u.to(device)


def expected_sample(base, bias, temperature, u):
    """The colleague's convention when available, the local reference otherwise."""
    if probs_from_logits is None:
        return sample_step_reference(base, bias, temperature, u)
    z = base.float() if bias is None else base.float() + bias.float()
    probs = probs_from_logits(z, temperature)
    tokens = probs.argmax(-1) if temperature == 0 else sample_from(probs, u)
    return tokens, probs


def valid_inverse_cdf(dist, u, tokens, eps):
    """Each token is an inverse-CDF answer for a threshold within eps·total of u·total."""
    cdf = dist.double().cumsum(-1)
    total = cdf[:, -1]
    thr = u.double() * total
    at = cdf.gather(1, tokens[:, None]).squeeze(1)
    before = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp_min(0)[:, None]).squeeze(1), 0.0)
    ok = (at > thr - eps * total) & (before <= thr + eps * total)
    return bool(torch.all(ok & (dist.gather(1, tokens[:, None]).squeeze(1) > 0)))


def unambiguous(dist, u, eps):
    """Rows whose inverse-CDF answer is the same for every threshold within eps·total of u·total:
    there two summation orders must draw the same token."""
    cdf = dist.double().cumsum(-1)
    total = cdf[:, -1:]
    thr = u.double()[:, None] * total
    before = torch.cat([torch.zeros_like(cdf[:, :1]), cdf[:, :-1]], 1)
    ok = (cdf > thr - eps * total) & (before <= thr + eps * total) & (dist > 0)
    return ok.sum(-1) == 1


def split_rows(r=8, v=1000, *, seed=0):
    """``sampling_rows`` plus the split path's edges: chunks without mass before the mass, a
    masked tail with u = 1 (u·total is the total: no chunk holds it, the clamp to the last nonzero
    p answers), a single live entry, u = 0 and a greedy tie inside the first chunk."""
    base, bias, u = sampling_rows(r, v, seed=seed)
    base[3, :600] = float("-inf")
    base[4, 300:] = float("-inf")
    base[4, 299], bias[4, 299] = base[4].max() + 4, 0.0
    u[4] = 1.0
    base[5] = float("-inf")
    base[5, 517] = 0.0
    u[6] = 0.0
    base[7, 10] = base[7, 200] = base[7].max() + 10
    bias[7, 10] = bias[7, 200] = 0.0
    return base, bias, u


def assert_split_matches(got, base, bias, temperature, u):
    tokens, probs = expected_sample(base, bias, temperature, u)
    assert got.probs.dtype == torch.float32 and got.tokens.dtype == torch.int64
    assert torch.all(got.probs[probs == 0] == 0)  # masked entries stay exactly 0
    if temperature == 0:
        assert torch.equal(got.tokens, tokens)
        assert torch.equal(got.probs, probs)
        return
    torch.testing.assert_close(got.probs, probs, rtol=0, atol=1e-6)
    # The token is an inverse-CDF draw from the returned probs, with nonzero probability ...
    assert valid_inverse_cdf(got.probs, u, got.tokens, 1e-6)
    # ... and, away from cdf steps, exactly the reference's draw from either distribution.
    sure = unambiguous(probs, u, 1e-5) & unambiguous(got.probs, u, 1e-5)
    assert sure.sum() >= len(u) - 2
    assert torch.equal(got.tokens[sure], tokens[sure])
    assert torch.equal(got.tokens[sure], sample_from_reference(got.probs, u)[sure])


def assert_same_draws(got, ref, dist, u):
    """Inverse-CDF draws from two summation orders: equal except where the threshold sits
    within float32 round-off of a cdf step (at V=49152 and flat rows that is ~1% of draws)."""
    differ = got != ref
    assert differ.float().mean().item() <= 0.02, f"{int(differ.sum())} of {len(got)} draws differ"
    assert valid_inverse_cdf(dist[differ], u[differ], got[differ], 1e-5)


def test_valid_inverse_cdf_checker():
    g = torch.Generator().manual_seed(8)
    dist = torch.rand(32, 100, generator=g)
    u = torch.rand(32, generator=g)
    tokens = sample_from_reference(dist, u)
    assert valid_inverse_cdf(dist, u, tokens, 1e-6)
    assert not valid_inverse_cdf(dist, u, (tokens + 1).clamp_max(99), 1e-6)


def test_sample_from_reference_matches_verify():
    if sample_from is None:
        pytest.skip("dspark.decoding.verify not available")
    g = torch.Generator().manual_seed(6)
    dist = torch.rand(64, 257, generator=g) ** 4
    dist[:8, 200:] = 0  # trailing zeros + u near 1: the clamp decides
    dist[8:16, :50] = 0
    u = torch.rand(64, generator=g)
    u[:8] = 1 - 2**-24
    u[16] = 0.0
    assert torch.equal(sample_from_reference(dist, u), sample_from(dist, u))


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("with_bias", [True, False])
def test_sample_step_reference(temperature, with_bias):
    base, bias, u = sampling_rows(16, 300, seed=7)
    bias = bias if with_bias else None
    got = sample_step(base, bias, temperature, u, impl="auto")
    tokens, probs = expected_sample(base, bias, temperature, u)
    assert torch.equal(got.tokens, tokens)
    torch.testing.assert_close(got.probs, probs, rtol=0, atol=0)
    if temperature == 0:
        assert got.tokens[1] == 3  # tie broken to the lowest index
    assert got.probs.dtype == torch.float32 and got.tokens.dtype == torch.int64


def test_choose_chunks():
    """Few rows split the vocabulary over about SM_TARGET programs; up to TWO_CHUNKS_MAX_ROWS
    rows keep two chunks a row (measured faster at 256 rows), more rows one program per row;
    chunks are whole blocks and never empty."""
    assert choose_chunks(1, 49152) == 49152 // BLOCK > 1
    assert choose_chunks(1, 262144) == 64 and choose_chunks(4, 262144) == 32
    assert choose_chunks(64, 49152) == 2
    for rows in (SM_TARGET, SM_TARGET + 1, TWO_CHUNKS_MAX_ROWS):
        assert choose_chunks(rows, 49152) == 2 and choose_chunks(rows, 262144) == 2
    for rows in (TWO_CHUNKS_MAX_ROWS + 1, 2048):
        assert choose_chunks(rows, 49152) == 1 and choose_chunks(rows, 262144) == 1
    assert choose_chunks(1, 3000) == 1 and choose_chunks(256, 3000) == 1  # under one block
    for v in (1000, 4097, 49152, 262144):
        for want in range(1, 80):
            c, chunk = _chunk_layout(want, v, 128)
            assert 1 <= c <= want and chunk % 128 == 0 and (c - 1) * chunk < v <= c * chunk


def test_sample_step_reference_into_out():
    """``out=`` (one position of a [R, n, V] proposal buffer) receives the reference's
    probabilities in place; its neighbours are untouched; a wrong buffer is refused."""
    base, bias, u = sampling_rows(5, 300, seed=8)
    buf = torch.full((5, 3, 300), -1.0)
    got = sample_step(base, bias, 0.7, u, impl="torch", out=buf[:, 1])
    want = sample_step_reference(base, bias, 0.7, u)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(buf[:, 1], want.probs)
    assert got.probs.data_ptr() == buf[:, 1].data_ptr()
    assert (buf[:, 0] == -1).all() and (buf[:, 2] == -1).all()
    for bad in (buf[:, 1].double(), buf[:, 1, :299], buf[:, 1, ::2]):
        with pytest.raises(ValueError, match="out must be float32"):
            sample_step(base, bias, 0.7, u, out=bad)


def test_sample_step_chunks_argument():
    base, bias, u = sampling_rows(4, 100, seed=3)
    ref = sample_step_reference(base, bias, 0.7, u)
    got = sample_step(base, bias, 0.7, u, impl="torch", chunks=3)  # ignored off Triton
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.probs, ref.probs)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunks"):
            sample_step(base, bias, 0.7, u, chunks=bad)


# ----------------------------------------------------------------------------- verify helpers


def verify_cases(*, seed=0, r=24, g=5, v=200, device="cpu"):
    """Random blocks plus the edge cases of the convention."""
    gen = torch.Generator().manual_seed(seed)
    pt = torch.softmax(torch.randn(r, g + 1, v, generator=gen) * 2, -1)
    # Drafts close to the target for half the rows so long prefixes get accepted too.
    noise = torch.softmax(torch.randn(r, g, v, generator=gen) * 2, -1)
    mix = torch.where(torch.arange(r)[:, None, None] % 2 == 0, 0.9, 0.2)
    pd = mix * pt[:, :g] + (1 - mix) * noise
    tokens = torch.multinomial(pd.reshape(-1, v), 1, generator=gen).reshape(r, g)
    lengths = torch.randint(0, g + 1, (r,), generator=gen)
    lengths[:3] = g
    lengths[3] = 0
    ua = torch.rand(r, g, generator=gen)
    us = torch.rand(r, generator=gen)
    if g >= 5:
        # Row 4: draft token with p_d == 0 (rejected) and p_d == p_t: zero residual -> p_t.
        pd[4, 0] = pt[4, 0]
        pd[4, 0, 7] = 0.0
        pt[4, 0, 7] = 0.0
        tokens[4, 0], lengths[4] = 7, g
        # Row 5: greedy (one-hot) target and draft that agree for two positions, then disagree.
        pt[5] = torch.nn.functional.one_hot(torch.tensor([1, 2, 3, 4, 5] + [6] * (g - 4)), v).float()
        pd[5] = torch.nn.functional.one_hot(torch.tensor([1, 2, 9, 4, 5] + [6] * (g - 5)), v).float()
        tokens[5, :5], lengths[5] = torch.tensor([1, 2, 9, 4, 5]), g
    # Padding tokens past lengths are ignored (even out of range).
    tokens[3] = -1
    us[6] = 1 - 2**-24
    to = lambda t: t.to(device)  # noqa: E731
    return to(pt), to(pd), to(tokens), to(lengths), to(ua), to(us)


def expected_verify(pt, pd, tokens, lengths, ua, us):
    if verify is None:
        return rejection_verify_reference(pt, pd, tokens, lengths, ua, us)
    return verify(pt, pd, tokens, lengths, uniforms=(ua, us))


def test_rejection_reference_matches_verify():
    if verify is None:
        pytest.skip("dspark.decoding.verify not available")
    for seed, g in [(0, 5), (1, 1), (2, 0)]:
        case = verify_cases(seed=seed, g=g)
        got = rejection_verify(*case[:4], uniforms=case[4:], impl="torch")
        ref = verify(*case[:4], uniforms=case[4:])
        assert torch.equal(got.accepted, ref.accepted)
        assert torch.equal(got.next_token, ref.next_token)
        assert torch.equal(got.accept_flags, ref.accept_flags)
    assert case[0].shape[1] == 1  # the g=0 case ran


def vocab_case(case, seed=0):
    """A verify case whose drafts come from a draft vocabulary (half the ids, some drafted tokens
    off it): (the case with V-wide drafts, its drafts' K columns, the index [V])."""
    pt, pd, tokens, lengths, ua, us = case
    v = pt.shape[-1]
    vocab = torch.randperm(v, generator=torch.Generator().manual_seed(seed))[: v // 2].sort().values
    narrow = pd[..., vocab] / pd[..., vocab].sum(-1, keepdim=True).clamp_min(1e-30)
    wide = torch.zeros_like(pd)
    wide[..., vocab] = narrow
    index = torch.full((v,), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return (pt, wide, tokens, lengths, ua, us), narrow, index


def test_rejection_over_a_draft_vocabulary_reads_its_columns_in_place():
    """Drafts [R, G, K] read through the index verify exactly as the same drafts written out over
    V (zeros off the vocabulary), in the reference and in decoding.verify; a token off the
    vocabulary is rejected."""
    drafted_off = False
    for seed, g in [(0, 5), (1, 1), (2, 0)]:
        wide_case, narrow, index = vocab_case(verify_cases(seed=seed, g=g), seed)
        pt, wide, tokens, lengths, ua, us = wide_case
        want = rejection_verify(*wide_case[:4], uniforms=(ua, us), impl="torch")
        got = rejection_verify(
            pt, narrow, tokens, lengths, uniforms=(ua, us), impl="torch", draft_index=index
        )
        assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_token, want.next_token)
        if verify is not None:
            ref = verify(pt, narrow, tokens, lengths, uniforms=(ua, us), draft_index=index)
            assert torch.equal(ref.accepted, want.accepted) and torch.equal(ref.next_token, want.next_token)
        verified = torch.arange(g) < lengths[:, None]
        drafted_off |= bool((verified & (index[tokens.clamp(min=0)] < 0)).any())
    assert drafted_off  # the cases drafted tokens off the vocabulary
    with pytest.raises(ValueError, match="shape mismatch"):
        rejection_verify(pt, narrow, tokens, lengths, uniforms=(ua, us), impl="torch")


def test_rejection_draws_uniforms_like_verify():
    if verify is None:
        pytest.skip("dspark.decoding.verify not available")
    case = verify_cases(seed=3)
    got = rejection_verify(*case[:4], generator=torch.Generator().manual_seed(9))
    ref = verify(*case[:4], generator=torch.Generator().manual_seed(9))
    assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.next_token, ref.next_token)


# ----------------------------------------------------------------------------- cache attention


def cache_case(r=3, w=4, heads=6, kv_heads=2, hd=16, cap=40, rows=5, row0=1, *, seed=0, dtype=torch.float32,
               device="cpu"):  # fmt: skip
    """Random queries and caches; each row's W positions consecutive (a step's tokens), starting
    anywhere that leaves room in the capacity."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(r, w, heads, hd, generator=g)
    k = torch.randn(rows, kv_heads, cap, hd, generator=g)
    v = torch.randn(rows, kv_heads, cap, hd, generator=g)
    start = torch.randint(0, cap - w + 1, (r, 1), generator=g)
    pos = start + torch.arange(w)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)] + [pos.to(device)]


def draft_case(lengths, w, heads=4, kv_heads=2, hd=16, ctx=40, room=None, *, seed=0, dtype=torch.float32,
               device="cpu"):  # fmt: skip
    """The drafter's layout (``DraftCache.block_slots``): row i's context in the first lengths[i] of
    ``ctx`` slots, its block's W keys in the room at tail = ctx (``room`` slots, W + 3 by default);
    every query's position is its row's length - 1. Returns q, k, v, positions, tail."""
    r, room = len(lengths), w + 3 if room is None else room
    q, k, v, _ = cache_case(r, w, heads, kv_heads, hd, ctx + room, r, 0, seed=seed, dtype=dtype,
                            device=device)  # fmt: skip
    last = torch.tensor(lengths, device=device)[:, None].expand(r, w) - 1
    return q, k, v, last, ctx


def hide_unseen_slots(k, v, lengths, tail, w):
    """NaN in every slot the drafter's rule hides: past each row's context, past its block."""
    for i, n in enumerate(lengths):
        for t in (k, v):
            t[i, :, n:tail] = float("nan")
            t[i, :, tail + w :] = float("nan")


def naive_cache_attention(q, k, v, pos, scale, row0, window=None, tail=None):
    """Per query, in float64: softmax over exactly the slots the rule allows."""
    r, w, heads, hd = q.shape
    groups = heads // k.shape[1]
    out = torch.zeros(r, w, heads, hd, dtype=torch.float64)
    for i in range(r):
        for t in range(w):
            p = int(pos[i, t])
            lo = 0 if window is None else max(0, p - window + 1)
            slots = torch.arange(lo, p + 1)
            if tail is not None:
                slots = torch.cat([slots, torch.arange(tail, tail + w)])
            for h in range(heads):
                keys = k[row0 + i, h // groups, slots].double()
                vals = v[row0 + i, h // groups, slots].double()
                att = torch.softmax(keys @ q[i, t, h].double() * scale, dim=0)
                out[i, t, h] = att @ vals
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_cache_attention_reference_is_the_rule(window):
    """SDPA with the folded mask equals attention written out query by query (float64), with
    grouped heads, an offset row range and a sliding window."""
    q, k, v, pos = cache_case(seed=1)
    got = cache_attention_reference(q, k, v, pos, scale=0.25, row0=1, window=window)
    want = naive_cache_attention(q, k, v, pos, 0.25, 1, window)
    assert rel_err(got, want) < 1e-5


def test_cache_attention_reference_is_the_drafter_rule():
    """With ``tail``: each row's context (none, some, all of it) and its whole block in the room."""
    q, k, v, pos, tail = draft_case([0, 7, 40], w=5, seed=1)
    got = cache_attention_reference(q, k, v, pos, scale=0.25, tail=tail)
    want = naive_cache_attention(q, k, v, pos, 0.25, 0, tail=tail)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("tail", [False, True], ids=["target", "drafter"])
def test_cache_attention_self_check_falls_back_with_a_warning(monkeypatch, tail):
    """A kernel the device cannot run (here: Triton on plain CPU tensors, which it refuses) makes
    the self-check say no, once, with a warning naming the fallback; the static target (and the
    draft step: ``tail``) then keeps SDPA instead of failing its run."""
    import importlib

    module = importlib.import_module("dspark.kernels.cache_attention")  # the package's name is the function
    monkeypatch.setattr(importlib.import_module("dspark.kernels._common"), "_SELF_CHECKS", {})
    if INTERPRETING:  # the interpreter runs it on the CPU: make it fail another way
        monkeypatch.setattr(module, "_cache_attention_triton", lambda *a: 1 / 0)
    with pytest.warns(UserWarning, match="SDPA runs instead"):
        assert not module.kernel_self_check(torch.device("cpu"), torch.float32, 16, 2, tail)
    assert not module.kernel_self_check(torch.device("cpu"), torch.float32, 16, 2, tail)  # remembered, silent
    # ... and a benchmark's report says so (bench.common.kernel_fallbacks)
    report = {}
    kernel_fallbacks(report)
    assert report["kernel_checks"] == [
        {"kernel": "cache_attention", "key": ["cpu", "torch.float32", "16", "2", str(tail)], "runs": False}
    ]


def test_cache_attention_refusals():
    q, k, v, pos = cache_case()
    with pytest.raises(ValueError, match="outside the cache"):
        cache_attention(q, k, v, pos, scale=1.0, row0=3)
    with pytest.raises(ValueError, match="positions"):
        cache_attention(q, k, v, pos[:, :2], scale=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        cache_attention(q[..., :8], k, v, pos, scale=1.0)
    with pytest.raises(ValueError, match="tail slots"):
        cache_attention(q, k, v, pos, scale=1.0, tail=k.shape[2] - 3)  # a block of 4 past the end
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="splits"):
            cache_attention(q, k, v, pos, scale=1.0, splits=bad)


def test_choose_splits():
    """The split rule on SmolLM2's shapes (9 heads over 3 KV heads of 64, capacity 640) on a 132-SM
    GPU: R = 1 splits as far as the capacity's key tiles go, 16 rows take the SMs' worth, and from 44
    rows (132 programs) up the single kernel runs; a sliding window bounds S by the slots it reads."""
    smollm2 = dict(heads=9, kv_heads=3, head_dim=64, capacity=640, sms=132)
    assert [choose_splits(r, 1, **smollm2) for r in (1, 16, 32, 43, 44, 256)] == [10, 3, 2, 2, 1, 1]
    assert [choose_splits(r, 8, **smollm2) for r in (1, 16, 22, 43, 44)] == [10, 3, 2, 2, 1]  # 1 query tile
    assert choose_splits(1, 16, 16, 1, 16, 10_000, 132) == 33  # 256 queries: 4 query tiles
    assert choose_splits(1, 1, 4, 1, 256, 4096, 132, window=512) == 18  # ceil((512 + 1 + 32) / 32)
    assert choose_splits(1, 1, 4, 1, 256, 4096, 132) == 128  # the capacity's 32-key tiles
    assert choose_splits(1, 1, 9, 3, 64, 64, 132) == 1  # one key tile: nothing to split
    assert choose_splits(1, 8, 9, 3, 64, 640, 0) == 1  # no SMs (not CUDA)
    for r in (1, 2, 3, 5, 8, 13, 21, 34, 55):  # 1 to 2 programs an SM when the capacity allows
        for w in (1, 4, 8, 16):
            groups_w = 3 * w
            programs = r * 3 * -(-groups_w // min(max(16, 1 << (groups_w - 1).bit_length()), 64))
            s = choose_splits(r, w, 9, 3, 64, 1 << 20, 132)
            assert (s == 1) == (programs >= 132)
            assert s == 1 or 132 <= programs * s < 132 + programs, (r, w, s)


# ----------------------------------------------------------------------------- triton, interpreter


# The interpreter tests run in children (TRITON_INTERPRET is read when triton is imported), one per
# group of kernels, so the suite's workers share them out: in one child they took ~100 s of one worker.
INTERPRETER_GROUPS = {
    "loss-and-sampling": ("test_interp_fused_loss", "test_interp_sample_step", "test_interp_rejection",
                          "test_interp_nucleus", "test_interp_bias_argmax"),
    "attention": ("test_interp_cache_attention", "test_interp_static_forward"),
    "drafting": ("test_interp_draft_step", "test_interp_compiled_draft_step", "test_interp_fast_engine",
                 "test_interp_greedy_draft_step"),
}  # fmt: skip


def test_every_interpreter_test_is_in_one_group():
    names = [n for n in globals() if n.startswith("test_interp_")]
    for name in names:  # as the children's -k selects: a name holding any of a group's prefixes
        groups = [g for g, prefixes in INTERPRETER_GROUPS.items() if any(p in name for p in prefixes)]
        assert len(groups) == 1, f"{name} is in the interpreter groups {groups}: add it to exactly one"


@pytest.mark.parametrize("group", list(INTERPRETER_GROUPS))
def test_triton_kernels_under_interpreter(group):
    if not triton_available():
        pytest.skip("triton is not installed: kernels fall back to their PyTorch references")
    if os.environ.get(CHILD_ENV) == "1":
        pytest.skip("already inside the interpreter child")
    env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: "1"})
    # addopts is reset so the child prints its "N passed" summary (the project's -q silences it).
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-o",
        "addopts=",
        "-m",
        "not gpu and not slow",
        "-q",
        "-k",
        " or ".join(INTERPRETER_GROUPS[group]),
        "-p",
        "no:cacheprovider",
        "-rs",
        "-W",
        "ignore::DeprecationWarning",
    ]
    proc = subprocess.run(
        cmd, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter tests failed:\n{tail}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail


@needs_interpreter
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_interp_fused_loss(softcap):
    # N=37, V=300: neither a multiple of the interpreter's 256-column sweep; 16-row chunks leave a
    # ragged last chunk.
    prob = loss_problem(37, 20, 6, 300, seed=10)
    ref = reference(*prob, softcap=softcap)
    got = fused(*prob, softcap=softcap, impl="triton", chunk_rows=16)
    assert_loss_close(got, ref, 3e-5)


@needs_interpreter
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("rows", ["some", "all"])
def test_interp_fused_loss_rows_without_tv(softcap, rows):
    """Rows whose TV weight is 0 (DFlash's and Eagle3's, padding rows) take their gradient from the
    second sweep and skip the third: the same loss and gradients as the reference, beside rows
    that keep the TV term."""
    x, lm, bias, th, labels, rw = loss_problem(37, 20, 6, 300, seed=13)
    tv = rw.tv.clone()
    tv[:: 3 if rows == "some" else 1] = 0.0
    prob = (x, lm, bias, th, labels, RowWeights(rw.ce, tv, rw.kl))
    assert_loss_close(
        fused(*prob, softcap=softcap, impl="triton", chunk_rows=16), reference(*prob, softcap), 3e-5
    )


@needs_interpreter
@pytest.mark.parametrize("chunk_rows", [24, 8], ids=["2-groups-a-chunk", "group-over-chunks"])
def test_interp_fused_loss_shared_targets(chunk_rows):
    x, lm, bias, th, labels, rw, index = shared_targets_problem(5, 12, 5, 20, 6, 300, seed=12)
    ref = fused(x, lm, bias, th[index], labels, rw, impl="torch", chunk_rows=chunk_rows)
    got = fused(x, lm, bias, th, labels, rw, impl="triton", chunk_rows=chunk_rows, target_index=index,
                group_rows=12)  # fmt: skip
    assert_loss_close(got, ref, 3e-5)


@needs_interpreter
@pytest.mark.parametrize("chunks", [1, None], ids=["single", "auto"])  # auto: 2 chunks here
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("with_bias", [True, False])
def test_interp_sample_step(temperature, with_bias, chunks):
    base, bias, u = sampling_rows(6, 300, seed=11)
    bias = bias if with_bias else None
    got = sample_step(base, bias, temperature, u, impl="triton", chunks=chunks)
    tokens, probs = expected_sample(base, bias, temperature, u)
    torch.testing.assert_close(got.probs, probs, rtol=1e-5, atol=1e-7)
    assert torch.equal(got.tokens, tokens)


@needs_interpreter
@pytest.mark.parametrize("chunks", [2, 3])  # V=1000 in 128-wide blocks: 4+4 and 3+3+2 blocks
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("with_bias", [True, False])
def test_interp_sample_step_split(temperature, with_bias, chunks):
    base, bias, u = split_rows(seed=13)
    bias = bias if with_bias else None
    got = sample_step(base, bias, temperature, u, impl="triton", chunks=chunks)
    assert_split_matches(got, base, bias, temperature, u)
    if temperature == 0:
        assert got.tokens[1] == 3 and got.tokens[7] == 10 and got.tokens[5] == 517  # lowest index
    else:
        assert got.tokens[4] == 299 and got.tokens[5] == 517


@needs_interpreter
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_interp_sample_step_split_one_row(temperature):
    """chunks=None at R=1 takes the split path (4 chunks of 2 blocks at V=1000)."""
    base, bias, u = split_rows(seed=14)
    for i in (3, 4, 7):
        row = (base[i : i + 1], bias[i : i + 1], temperature, u[i : i + 1])
        got = sample_step(*row, impl="triton", chunks=None)
        forced = sample_step(*row, impl="triton", chunks=choose_chunks(1, 1000, 128))
        assert choose_chunks(1, 1000, 128) == 4
        assert torch.equal(got.tokens, forced.tokens) and torch.equal(got.probs, forced.probs)
        assert_split_matches(got, *row)


@needs_interpreter
@pytest.mark.parametrize("chunks", [1, 3], ids=["single", "split"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_interp_sample_step_into_out_with_strided_uniforms(temperature, chunks):
    """The kernels write ``out=`` (one position of a [R, n, V] buffer: row stride n·V) in place and
    read u as a column of [R, γ] (row stride γ) without copies: the same tokens and probabilities
    as contiguous buffers, the neighbouring positions untouched."""
    base, bias, u = sampling_rows(6, 300, seed=31)
    columns = torch.rand(6, 4, generator=torch.Generator().manual_seed(32))
    columns[:, 2] = u
    buf = torch.full((6, 3, 300), -1.0)
    got = sample_step(base, bias, temperature, columns[:, 2], impl="triton", chunks=chunks, out=buf[:, 1])
    want = sample_step(base, bias, temperature, u, impl="triton", chunks=chunks)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(buf[:, 1], want.probs)
    assert got.probs.data_ptr() == buf[:, 1].data_ptr()
    assert (buf[:, 0] == -1).all() and (buf[:, 2] == -1).all()
    if temperature:  # the column read matters: another column draws other tokens
        other = sample_step(base, bias, temperature, columns[:, 0], impl="triton", chunks=chunks)
        assert not torch.equal(other.tokens, got.tokens)


@needs_interpreter
def test_interp_sample_step_split_frequencies():
    """Stratified uniforms over copies of one row: each token is drawn N·p ± 1 times, p being the
    returned probabilities (a deterministic frequency check of the draw)."""
    n, v = 48, 300
    g = torch.Generator().manual_seed(15)
    base = (torch.randn(v, generator=g) * 3).expand(n, v).contiguous()
    u = (torch.arange(n) + 0.5) / n
    got = sample_step(base, None, 1.0, u, impl="triton", chunks=3)
    assert torch.equal(got.probs, got.probs[:1].expand(n, v))
    counts = torch.bincount(got.tokens, minlength=v).double()
    assert (counts - n * got.probs[0].double()).abs().max() < 1 + 1e-6
    assert torch.all(got.probs[0, got.tokens] > 0)


@needs_interpreter
@pytest.mark.parametrize("g", [5, 1])
def test_interp_rejection_over_a_draft_vocabulary(g):
    wide_case, narrow, index = vocab_case(verify_cases(seed=13, r=10, g=g, v=200), seed=4)
    pt, wide, tokens, lengths, ua, us = wide_case
    got = rejection_verify(pt, narrow, tokens, lengths, uniforms=(ua, us), impl="triton", draft_index=index)
    ref = expected_verify(*wide_case)
    assert torch.equal(got.accepted, ref.accepted)
    assert torch.equal(got.accept_flags, ref.accept_flags)
    assert torch.equal(got.next_token, ref.next_token)


@needs_interpreter
@pytest.mark.parametrize("g", [5, 0])
def test_interp_rejection(g):
    case = verify_cases(seed=12, r=10, g=g, v=200)
    got = rejection_verify(*case[:4], uniforms=case[4:], impl="triton")
    ref = expected_verify(*case)
    assert torch.equal(got.accepted, ref.accepted)
    assert torch.equal(got.accept_flags, ref.accept_flags)
    assert torch.equal(got.next_token, ref.next_token)


@needs_interpreter
@pytest.mark.parametrize(
    "shape,window",
    [
        (dict(), None),
        (dict(), 6),
        (dict(r=1, w=1, heads=9, kv_heads=3, hd=64, cap=300, rows=1, row0=0), None),  # a decode step
        (dict(r=2, w=8, heads=9, kv_heads=3, hd=64, cap=200, rows=4, row0=2), None),  # a verify step
        (dict(r=2, w=12, heads=8, kv_heads=1, hd=32, cap=150, rows=2, row0=0), 20),  # two query tiles
    ],
    ids=["small", "window", "decode", "verify", "tiles"],
)
def test_interp_cache_attention(shape, window):
    """The kernel against the reference; the slots past each row's last position hold NaN, so a
    kernel that read past the live context (or attended to it) would fail."""
    q, k, v, pos = cache_case(**shape, seed=2)
    row0, r = shape.get("row0", 1), q.shape[0]
    ref = cache_attention_reference(q, k, v, pos, scale=0.125, row0=row0, window=window)
    for i in range(r):
        k[row0 + i, :, int(pos[i, -1]) + 1 :] = float("nan")
        v[row0 + i, :, int(pos[i, -1]) + 1 :] = float("nan")
    got = cache_attention(q, k, v, pos, scale=0.125, row0=row0, window=window, impl="triton")
    assert got.shape == q.shape and torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("w", [1, 2, 4, 7, 8])
@pytest.mark.parametrize(
    "shape",
    [dict(heads=4, kv_heads=2, hd=16), dict(heads=9, kv_heads=3, hd=64), dict(heads=16, kv_heads=1, hd=16)],
    ids=["tiny", "smollm2", "query-tiles"],  # query-tiles: G·W > 64 from W = 5
)
def test_interp_cache_attention_draft_block(shape, w):
    """The drafter's rule (``tail``) against the reference, for block widths 1..8 and rows whose
    contexts end anywhere: none, inside the first key tile, on a tile's edge, past it, the whole
    context. Every slot the rule hides holds NaN (past each context, past the block), so a kernel
    that read one would fail."""
    lengths = [0, 5, 64, 100, 130]
    q, k, v, pos, tail = draft_case(lengths, w, **shape, ctx=130, seed=4)
    ref = cache_attention_reference(q, k, v, pos, scale=0.125, tail=tail)
    hide_unseen_slots(k, v, lengths, tail, w)
    got = cache_attention(q, k, v, pos, scale=0.125, tail=tail, impl="triton")
    assert got.shape == q.shape and torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("tail", [False, True], ids=["target", "drafter"])
def test_interp_cache_attention_self_check(tail):
    from dspark.kernels.cache_attention import kernel_self_check

    assert kernel_self_check(torch.device("cpu"), torch.float32, 32, 3, tail)


SPLIT_CASES = {  # rows ending short of one key tile, inside, across tiles, at the capacity's end
    "decode": dict(ends=[3, 70, 200, 299], w=1, heads=9, kv_heads=3),
    "verify": dict(ends=[12, 130, 299], w=8, heads=9, kv_heads=3),
    "tiles": dict(ends=[20, 260], w=12, heads=8, kv_heads=1),  # G·W = 96: two query tiles
    "window": dict(ends=[40, 150, 299], w=4, heads=4, kv_heads=2, window=70),
    "drafter": dict(ends=[0, 5, 64, 200, 250], w=7, heads=9, kv_heads=3, tail=True),
}


@needs_interpreter
@pytest.mark.parametrize("case", SPLIT_CASES, ids=list(SPLIT_CASES))
def test_interp_cache_attention_split(case):
    """The split kernel (S chunks of each row's context, then the merge) equals the single kernel
    and the reference, for S = 2, 3 and 8 (S = 8 leaves every row but the longest with empty chunks,
    the shortest with all but one), over rows of different lengths; every slot the rule hides holds
    NaN, so a chunk reading past its row's context would fail."""
    c = dict(SPLIT_CASES[case])
    ends, w, window, tail = c.pop("ends"), c.pop("w"), c.pop("window", None), c.pop("tail", False)
    if tail:  # the drafter: row i's context in its first ends[i] slots, its block at slots 250..256
        q, k, v, pos, tail = draft_case(ends, w, **c, ctx=250, room=w, seed=6)
        ref = cache_attention_reference(q, k, v, pos, scale=0.125, tail=tail)
        hide_unseen_slots(k, v, ends, tail, w)
    else:  # row i's W queries end at position ends[i]
        q, k, v, _ = cache_case(len(ends), w, **c, hd=16, cap=300, rows=len(ends), row0=0, seed=6)
        pos = torch.tensor(ends)[:, None] - w + 1 + torch.arange(w)
        ref = cache_attention_reference(q, k, v, pos, scale=0.125, window=window)
        for i, end in enumerate(ends):
            k[i, :, end + 1 :] = v[i, :, end + 1 :] = float("nan")
        tail = None
    kw = dict(scale=0.125, window=window, tail=tail, impl="triton")
    whole = cache_attention(q, k, v, pos, **kw, splits=1)
    assert rel_err(whole, ref) < 1e-5
    for splits in (2, 3, 8):
        got = cache_attention(q, k, v, pos, **kw, splits=splits)
        assert got.shape == q.shape and torch.isfinite(got).all()
        assert rel_err(got, ref) < 1e-5 and rel_err(got, whole) < 1e-5


@needs_interpreter
def test_interp_static_forward_with_the_cache_kernel(small_target):
    """The target's static-cache forward with the kernel in its decode and verify steps equals
    its SDPA path, step for step (prompts wider than the kernel's widths keep SDPA), for a Llama
    target and a Gemma 3 one with sliding-window layers."""
    from test_fast_engine import _static_steps, tiny_gemma3

    for t in (small_target, tiny_gemma3()):
        fast, ref = _static_steps(t, "triton", "cpu"), _static_steps(t, "torch", "cpu")
        for a, b in zip(fast, ref):
            torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-5)


def draft_attention_calls(monkeypatch) -> list[str]:
    """The impl of every draft layer's call of the cache kernel from now on (impl="triton" runs the
    kernel or raises: it never falls back)."""
    import dspark.drafters.layers as layers

    impls, inner = [], layers.cache_attention

    def spy(*args, **kw):
        impls.append(kw["impl"])
        return inner(*args, **kw)

    monkeypatch.setattr(layers, "cache_attention", spy)
    return impls


def unseen_slots_poisoned(cache):
    """A copy of a static drafter cache with NaN in every context slot past each row's length."""
    from dspark.core.types import DraftCache

    c = cache.k[0].shape[2] - cache.block_slots
    k, v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    for t in k + v:
        for i, n in enumerate(cache.length.tolist()):
            t[i, :, n:c] = float("nan")
    return DraftCache(k=k, v=v, length=cache.length, block_slots=cache.block_slots)


@needs_interpreter
@pytest.mark.parametrize("name,head,slots", [("dspark", "rnn", "masks"), ("dflash", "none", "anchor")])
def test_interp_draft_step_with_the_cache_kernel(small_target, name, head, slots, monkeypatch):
    """The fused draft step attending with the kernel (forced here, the CPU) proposes the SDPA
    path's tokens, probabilities and confidences for every rows count and drafted length, over a
    cache whose slots past each row's context hold NaN (SDPA's mask cannot hide a NaN: the
    reference reads the clean cache); every layer of every step went through the kernel."""
    from test_drafter_fast_paths import assert_same_proposal, drafting_setup, reference_proposal, rows_of

    from dspark.core.types import Shared

    impls = draft_attention_calls(monkeypatch)
    drafter, cache, anchors, u = drafting_setup(small_target, name, head, slots)
    shared = Shared.of(small_target)
    drafter.compile_inference(compiler=None)
    drafter._fused.attention = "triton"
    poisoned = unseen_slots_poisoned(cache)
    steps = 0
    with torch.inference_mode():
        for r in (4, 1, 3):
            for n in sorted({1, drafter.gamma}):
                args = (anchors[:r], cache.length[:r], shared, 1.0)
                kw = dict(uniforms=u[:r], draft_len=n)
                want = reference_proposal(drafter, rows_of(cache, r), *args, **kw)
                got = drafter.propose(rows_of(poisoned, r), *args, **kw)
                assert_same_proposal(got, want, tol=1e-4)  # the online softmax rounds unlike SDPA
                steps += 1
    assert impls == ["triton"] * steps * len(drafter.layers)


@needs_interpreter
def test_interp_compiled_draft_step_with_the_cache_kernel(small_target):
    """The kernel inside the compiled draft step (inductor, ``fullgraph``: the operator is one node
    of the graph): the reference's proposals, in the same two graphs as the SDPA path."""
    from test_drafter_fast_paths import compiled_draft_step_matches

    compiled_draft_step_matches(small_target, "dflash", "none", "anchor", attention="triton")


@needs_interpreter
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_interp_fast_engine_with_the_draft_kernel(small_target, temperature, monkeypatch):
    """The fast engine whose draft steps attend with the kernel (its static cache) gives the plain
    engine's rounds (whose growing cache keeps SDPA): tokens, acceptance and confidences."""
    from test_drafter_fast_paths import build
    from test_engine import prompts_for
    from test_fast_engine import _engines, assert_same_rounds

    from dspark.decoding.engine import Request

    drafter = build(small_target, "dspark", "rnn", layers=2, seed=3)
    drafter.compile_inference(compiler=None)
    drafter._fused.attention = "triton"
    prompts = prompts_for(small_target, 5, seed=12)
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [5, 20, 12, 1, 17])]
    plain, fast = _engines(small_target, drafter, temperature, seed=7)
    want = plain.generate(reqs)
    impls = draft_attention_calls(monkeypatch)
    assert_same_rounds(fast.generate(reqs), want)
    assert impls and set(impls) == {"triton"}


@needs_interpreter
def test_interp_fast_engine_greedy_with_the_bias_kernel(small_target, monkeypatch):
    """Greedy rounds of the fast engine whose DSpark-Markov drafter takes each drafted position to
    its token with ``bias_argmax`` (forced here, the CPU; on CUDA the compiled default) give the
    plain engine's rounds with a copy of the drafter on the reference path: tokens, acceptance,
    confidences; the kernel ran for the fast engine's drafts."""
    import copy

    from test_drafter_fast_paths import build
    from test_engine import prompts_for
    from test_fast_engine import FastEngine, assert_same_rounds

    import dspark.drafters.draft_step as draft_step
    from dspark.decoding.engine import Engine, Request

    drafter = build(small_target, "dspark", "markov", layers=2, seed=3)
    reference = copy.deepcopy(drafter)
    for d in (drafter, reference):
        d.compile_inference(compiler=None)
    drafter._fused.greedy_kernel = "triton"
    calls = []
    real = draft_step.bias_argmax
    monkeypatch.setattr(draft_step, "bias_argmax", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts = prompts_for(small_target, 5, seed=12)
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [5, 20, 12, 1, 17])]
    common = dict(temperature=0.0, concurrency=3, eos_token_ids=(), seed=7, refill=1)
    want = Engine(small_target, reference, **common).generate(reqs)
    assert not calls  # the reference path
    fast = FastEngine(small_target, drafter, buckets=(1, 2, 4), deferred_context=8, **common)
    assert_same_rounds(fast.generate(reqs), want)
    assert calls


def nucleus_rows(rows: int, v: int, seed: int, device="cpu") -> torch.Tensor:
    """Softmax rows from peaked to flat (a third each), as a temperature-0.7 target gives them."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([8.0, 2.0, 0.1]).repeat_interleave(-(-rows // 3))[:rows, None]
    return torch.softmax(torch.randn(rows, v, generator=g) * scales, -1).to(device)


def assert_nucleus_rule(got: torch.Tensor, probs: torch.Tensor, top_p: float, tol: float) -> None:
    """``got`` keeps what the rule keeps, read in float64 on the mass strictly above each token
    S(x) = Σ_{p > x} p (ties share it): kept where S < top_p - tol, dropped where S >= top_p + tol;
    inside that band float32 sums in any order may decide either way (the kernel's block sums and
    the sort's scan do differ there over 49 152 flat tokens). Its values are the probabilities it
    kept, renormalised."""
    vals, ids = probs.double().sort(-1, descending=True)
    before = vals.cumsum(-1) - vals
    first = torch.searchsorted(-vals, -vals)  # a value's first place in the descending order
    above = before.gather(-1, first)
    kept = got.gather(-1, ids) > 0
    assert kept[above < top_p - tol].all(), "a token the rule keeps was dropped"
    assert not kept[above >= top_p + tol].any(), "a token past the nucleus was kept"
    mass = probs.double() * (got > 0)
    torch.testing.assert_close(got.double(), mass / mass.sum(-1, keepdim=True), rtol=1e-5, atol=1e-9)


def test_nucleus_rule_check_catches_a_shifted_boundary():
    """``assert_nucleus_rule`` fails a filter that keeps one token too many or too few past the band."""
    probs = nucleus_rows(6, 500, seed=1)
    got = nucleus_reference(probs, 0.9)
    assert_nucleus_rule(got, probs, 0.9, tol=1e-6)
    vals, ids = probs.sort(-1, descending=True)
    n = int((got[0] > 0).sum())
    for wrong in (n - 1, n + 1):
        keep = torch.zeros_like(probs[0]).scatter_(0, ids[0, :wrong], vals[0, :wrong])
        bad = got.clone()
        bad[0] = keep / keep.sum()
        with pytest.raises(AssertionError, match="nucleus|keeps"):
            assert_nucleus_rule(bad, probs, 0.9, tol=1e-6)


def test_nucleus_reference_is_the_sampling_rule():
    """The sort-based rule (the kernel's reference, and ``nucleus`` off CUDA): the kept mass is
    renormalised, the most likely token stays even at top_p = 0, and every kept token had less
    than top_p of the mass before it in sorted order while the first dropped one had at least it."""
    probs = nucleus_rows(6, 500, seed=1)
    got = nucleus(probs, 0.9)
    torch.testing.assert_close(got.sum(-1), torch.ones(6))
    vals, ids = probs.sort(-1, descending=True)
    before = vals.cumsum(-1) - vals
    kept = (got.gather(-1, ids) > 0).sum(-1)
    for r, n in enumerate(kept.tolist()):
        assert before[r, n - 1] < 0.9 and (n == 500 or before[r, n] >= 0.9)
    only = nucleus(probs, 0.0)
    assert torch.equal(only.argmax(-1), probs.argmax(-1))
    assert torch.equal((only > 0).sum(-1), torch.ones(6, dtype=torch.long))


@needs_interpreter
@pytest.mark.parametrize("top_p", [0.0, 0.5, 0.9, 0.99])
def test_interp_nucleus(top_p):
    """The kernel keeps the sort's tokens with the same renormalised values, over rows from peaked
    to flat whose width is no multiple of the kernel's block, [R, V] and a verify step's [R, W, V]."""
    probs = nucleus_rows(9, 3000, seed=4)
    for batch in (probs, probs.view(3, 3, -1)):
        got, ref = nucleus(batch, top_p, impl="triton"), nucleus_reference(batch, top_p)
        assert torch.equal(got > 0, ref > 0)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert nucleus_self_check(torch.device("cpu"))


# ----------------------------------------------------------------------------- triton, GPU

GPU_N, GPU_D, GPU_R, GPU_V = 512 * 7, 576, 256, 49152


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_fused_loss(dtype, softcap):
    prob = loss_problem(GPU_N, GPU_D, GPU_R, GPU_V, seed=20, dtype=dtype, device="cuda")
    # Ground truth: float64 for fp32 inputs, float32 math on the same bf16-rounded inputs for bf16.
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    ref = reference(
        *[t.to(ref_dtype) if torch.is_tensor(t) and t.is_floating_point() else t for t in prob],
        softcap=softcap,
    )
    # fp32: the TV gradient has sign(p_d - p_t), which flips on near-ties under any rounding change.
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    for impl in ("triton", "torch"):
        got = fused(*prob, softcap=softcap, impl=impl, chunk_rows=1024)
        assert_loss_close(got, ref, tol)
    del ref
    torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda_triton
def test_gpu_bias_gradient_accumulates_in_the_gemm():
    """On the GPU the bias gradient's chunks accumulate inside one GEMM each (the fast path is the one
    taken), and the loss with it equals the loss with the product and add apart."""
    assert _accumulates_f32(torch.device("cuda"), torch.bfloat16)
    prob = loss_problem(GPU_N, GPU_D, GPU_R, GPU_V, seed=24, dtype=torch.bfloat16, device="cuda")
    got = fused(*prob, impl="triton", chunk_rows=512)
    fused_loss_module.GEMM_ACCUMULATES = False
    try:
        apart = fused(*prob, impl="triton", chunk_rows=512)
    finally:
        fused_loss_module.GEMM_ACCUMULATES = True
    assert_loss_close(got, apart, 1e-3)
    del got, apart
    torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda_triton
def test_gpu_fused_loss_rows_without_tv():
    """The compiled kernel's two-sweep rows (TV weight 0: DFlash's, Eagle3's, padding) beside
    three-sweep ones, against the PyTorch row pass at the training shape."""
    x, lm, bias, th, labels, rw = loss_problem(
        GPU_N, GPU_D, GPU_R, GPU_V, seed=25, dtype=torch.bfloat16, device="cuda"
    )
    tv = rw.tv.clone()
    tv[::2] = 0.0
    prob = (x, lm, bias, th, labels, RowWeights(rw.ce, tv, rw.kl))
    got = fused(*prob, impl="triton", chunk_rows=1024)
    assert_loss_close(got, fused(*prob, impl="torch", chunk_rows=1024), 1e-2)
    del got
    torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda_triton
def test_gpu_fused_loss_shared_targets():
    """The training step's shape: 32 sequences × 128 anchors × 7 rows, 290 positions each."""
    prob = shared_targets_problem(32, 128 * 7, 290, GPU_D, GPU_R, GPU_V, seed=22, dtype=torch.bfloat16)
    x, lm, bias, th, labels, rw, index = (t.cuda() if torch.is_tensor(t) else t for t in prob)
    rw = RowWeights(*(w.cuda() for w in prob[5]))
    ref = fused(x, lm, bias, th[index], labels, rw, impl="torch")
    got = fused(x, lm, bias, th, labels, rw, impl="triton", target_index=index, group_rows=128 * 7)
    assert_loss_close(got, ref, 1e-2)
    del ref, got
    torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("chunks", [1, 12, 5], ids=["single", "split12", "split5"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_sample_step(temperature, chunks):
    base, bias, u = sampling_rows(512, GPU_V, seed=21, device="cuda")
    got = sample_step(base.bfloat16(), bias.bfloat16(), temperature, u, impl="triton", chunks=chunks)
    tokens, probs = expected_sample(base.bfloat16(), bias.bfloat16(), temperature, u)
    torch.testing.assert_close(got.probs, probs, rtol=1e-5, atol=1e-7)
    if temperature == 0:
        assert torch.equal(got.tokens, tokens)
    else:
        assert_same_draws(got.tokens, tokens, probs, u)
        assert valid_inverse_cdf(got.probs, u, got.tokens, 1e-5)  # drawn from the returned probs


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("v", [GPU_V, 262144], ids=["smollm2", "gemma3"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_sample_step_few_rows(temperature, v):
    """The chooser's split path (chunks=None) at the drafter's row counts (R = 1 and 8) against the
    reference: what must pass on the H200 before the split becomes sample_step's default."""
    base, bias, u = split_rows(8, v, seed=23)
    base, bias, u = base.cuda().bfloat16(), bias.cuda().bfloat16(), u.cuda()
    assert choose_chunks(1, v) > 1 and choose_chunks(8, v) > 1
    for rows in (slice(0, 1), slice(3, 4), slice(0, 8)):
        case = (base[rows], bias[rows], temperature, u[rows])
        got = sample_step(*case, impl="triton", chunks=None)
        tokens, probs = expected_sample(*case)
        torch.testing.assert_close(got.probs, probs, rtol=1e-5, atol=1e-7)
        if temperature == 0:
            assert torch.equal(got.tokens, tokens)
        else:
            assert valid_inverse_cdf(got.probs, case[3], got.tokens, 1e-5)
            sure = unambiguous(probs, case[3], 1e-5)
            assert torch.equal(got.tokens[sure], tokens[sure])


@pytest.mark.gpu
@needs_cuda_triton
def test_gpu_rejection():
    case = verify_cases(seed=22, r=512, g=7, v=GPU_V, device="cuda")
    got = rejection_verify(*case[:4], uniforms=case[4:], impl="triton")
    ref = expected_verify(*case)
    assert torch.equal(got.accepted, ref.accepted)
    assert torch.equal(got.accept_flags, ref.accept_flags)
    # The distribution each next token was drawn from: residual at a rejection, else p_t.
    pt, pd, _, lengths, _, us = case
    rows = torch.arange(pt.shape[0], device="cuda")
    dist = pt[rows, ref.accepted]
    resid = (dist - pd[rows, ref.accepted.clamp(max=pd.shape[1] - 1)]).clamp_min(0)
    use = (ref.accepted < lengths) & (resid.sum(-1) > 0)
    assert_same_draws(got.next_token, ref.next_token, torch.where(use[:, None], resid, dist), us)


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize(
    "shape,window",
    [
        (dict(r=1, w=1, heads=9, kv_heads=3, hd=64, cap=650, rows=1, row0=0), None),
        (dict(r=1, w=8, heads=9, kv_heads=3, hd=64, cap=650, rows=1, row0=0), None),
        (dict(r=256, w=8, heads=9, kv_heads=3, hd=64, cap=650, rows=256, row0=0), None),
        (dict(r=32, w=1, heads=4, kv_heads=1, hd=256, cap=1200, rows=64, row0=32), 512),  # Gemma 3
        (dict(r=8, w=16, heads=32, kv_heads=8, hd=128, cap=900, rows=8, row0=0), None),  # Qwen3-8B-like
    ],
    ids=["smollm2-decode", "smollm2-verify", "smollm2-verify-256", "gemma3-sliding", "qwen3-wide"],
)
def test_gpu_cache_attention(shape, window):
    """bf16 on the GPU at the engine's shapes against the reference (SDPA over the capacity)."""
    q, k, v, pos = cache_case(**shape, seed=3, dtype=torch.bfloat16, device="cuda")
    scale = q.shape[-1] ** -0.5
    ref = cache_attention_reference(q, k, v, pos, scale=scale, row0=shape["row0"], window=window)
    got = cache_attention(q, k, v, pos, scale=scale, row0=shape["row0"], window=window, impl="triton")
    assert rel_err(got, ref) < 1e-2


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("r", [1, 4, 256])
def test_gpu_cache_attention_draft_block(r):
    """bf16 at SmolLM2's drafter shapes (9 heads over 3 KV heads of 64, a block of 7) over the
    engine's draft cache (656 context slots, the block's room after them) against the reference,
    with NaN in every slot the rule hides."""
    g = torch.Generator().manual_seed(5)
    lengths = [0, 656, *torch.randint(0, 657, (r,), generator=g).tolist()][:r] if r > 1 else [300]
    q, k, v, pos, tail = draft_case(
        lengths, 7, heads=9, kv_heads=3, hd=64, ctx=656, room=7, seed=3, dtype=torch.bfloat16, device="cuda"
    )
    ref = cache_attention_reference(q, k, v, pos, scale=0.125, tail=tail)
    hide_unseen_slots(k, v, lengths, tail, 7)
    got = cache_attention(q, k, v, pos, scale=0.125, tail=tail, impl="triton")
    assert torch.isfinite(got).all() and rel_err(got, ref) < 1e-2


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("r,w", [(1, 1), (1, 8), (16, 8)])
def test_gpu_cache_attention_split(r, w):
    """bf16 at SmolLM2's shapes where the rule splits (R = 1: S = 10 on an H200, R = 16: 3), rows of
    random lengths: the rule's S, the single kernel, and S = 64 (chunks past every live context:
    empty), against the reference."""
    from dspark.kernels.cache_attention import device_sms

    q, k, v, pos = cache_case(r, w, 9, 3, 64, 650, r, 0, seed=7, dtype=torch.bfloat16, device="cuda")
    assert choose_splits(r, w, 9, 3, 64, 650, device_sms(q.device)) > 1
    ref = cache_attention_reference(q, k, v, pos, scale=0.125)
    for splits in (None, 1, 64):
        got = cache_attention(q, k, v, pos, scale=0.125, impl="triton", splits=splits)
        assert torch.isfinite(got).all() and rel_err(got, ref) < 1e-2, splits


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("drafter", [False, True], ids=["target", "drafter"])
def test_gpu_cache_attention_split_in_cuda_graph(drafter):
    """The kernel at R = 1 (SmolLM2's shapes: the rule splits) captured once in a CUDA graph and
    replayed with the row's context at other lengths (S is fixed by the shapes, the chunks follow the
    positions): each replay equals the reference, from a context of a few slots (all chunks but one
    empty; the drafter's: none) to the whole capacity."""
    from dspark.decoding.graphs import GraphBank

    w, tail = (7, 656) if drafter else (8, None)
    cap = 663 if drafter else 650
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, w, 9, 64, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, 3, cap, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    pos = torch.zeros(1, w, dtype=torch.long, device="cuda")
    bank = GraphBank(torch.device("cuda"))

    def step():
        return cache_attention(q, k, v, pos, scale=0.125, tail=tail, impl="triton")

    # drafter: every query at its row's context length - 1; target: W positions ending at `end`
    for end in (300, 5, 649, 100, 0) if drafter else (300, 7, 649, 100):
        pos.copy_(torch.full((1, w), end - 1) if drafter else end - w + 1 + torch.arange(w)[None])
        got = bank.run("attention", step)
        ref = cache_attention_reference(q, k, v, pos, scale=0.125, tail=tail)
        assert torch.isfinite(got).all() and rel_err(got, ref) < 1e-2, end
    assert len(bank) == 1


# ---- bias_argmax: the greedy drafted token without the bias logits -----------------------------
def bias_argmax_problem(r, v, k, dtype, seed, device="cpu"):
    """Base logits [r, v], W2 [v, k], bias features [r, k] at the scales a trained head gives."""
    g = torch.Generator().manual_seed(seed)
    base = (4 * torch.randn(r, v, generator=g)).to(device, dtype)
    weight = torch.randn(v, k, generator=g).to(device, dtype)
    b = (torch.randn(r, k, generator=g) / k**0.5).to(device, dtype)
    return base, weight, b


def tied_bias_argmax_problem(device="cpu"):
    """Exact ties under a zero W2, and the tokens argmax keeps (the lowest index): across chunks,
    inside one, a whole tied row, in the ragged last chunk."""
    v = 3 * BIAS_BLOCK_V + 5
    base = torch.zeros(4, v)
    base[0, [300, 7, 2 * BIAS_BLOCK_V]] = 9.0
    base[1, [70, 65]] = 9.0
    base[3, [v - 1, v - 3]] = 9.0
    weight, b = torch.zeros(v, 32), torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    return base.to(device), weight.to(device), b.to(device), [7, 65, 0, v - 3]


def test_bias_argmax_reference_and_its_checks():
    """On the CPU ``auto`` runs the reference: argmax of base + W2 b (ties to the lowest index);
    shapes that do not fit are refused naming all three; ``near_greedy`` accepts the argmax and
    refuses a token ranked below it."""
    base, weight, b = bias_argmax_problem(3, 300, 16, torch.float32, seed=0)
    want = (base + b @ weight.t()).argmax(-1)
    assert torch.equal(bias_argmax(base, weight, b), want)
    assert near_greedy(want, base, weight, b) and not near_greedy((want + 1) % 300, base, weight, b)
    *tied, expected = tied_bias_argmax_problem()
    assert bias_argmax(*tied).tolist() == expected
    rows = torch.tensor([2, 0, 2])  # features gathered from a table (a Markov head's W1 at the tokens)
    assert torch.equal(bias_argmax(base, weight, b, rows), (base + b[rows] @ weight.t()).argmax(-1))
    with pytest.raises(ValueError, match=r"base \(3, 300\), weight \(300, 8\), b \(3, 16\)"):
        bias_argmax(base, weight[:, :8], b)
    with pytest.raises(ValueError, match=r"rows \(2,\)"):
        bias_argmax(base, weight, b, rows[:2])


@needs_interpreter
@pytest.mark.parametrize(
    "r,v,k,dtype",
    [
        (1, 300, 64, torch.float32),
        (19, 517, 100, torch.float32),
        (70, 300, 64, torch.float32),
        (5, 1000, 256, torch.float16),
    ],
    ids=["one-row", "wide-tile-ragged-rank", "two-wide-tiles", "fp16"],
)  # bf16 on the GPU only: the interpreter's tl.dot mishandles bf16 (triton 3.6)
def test_interp_bias_argmax(r, v, k, dtype):
    """The kernels against the reference, the features as rows of b and gathered from a table."""
    base, weight, b = bias_argmax_problem(r, v, k, dtype, seed=r)
    got = bias_argmax(base, weight, b, impl="triton")
    assert torch.equal(got, bias_argmax_reference(base, weight, b))
    table = torch.cat([b, b.flip(0)])  # 2r rows; the tokens pick some, out of order, twice
    rows = torch.randint(0, 2 * r, (r,), generator=torch.Generator().manual_seed(3))
    got = bias_argmax(base, weight, table, rows, impl="triton")
    assert torch.equal(got, bias_argmax_reference(base, weight, table, rows))


@needs_interpreter
def test_interp_bias_argmax_ties_and_self_check():
    *tied, expected = tied_bias_argmax_problem()
    assert bias_argmax(*tied, impl="triton").tolist() == expected
    assert bias_argmax_self_check(torch.device("cpu"), torch.float32, 256)


@needs_interpreter
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_interp_greedy_draft_step_with_the_bias_kernel(small_target, head, monkeypatch):
    """The fused draft step at T = 0 taking each position's head features to its token with the
    kernel (forced here, the CPU; on CUDA the compiled default) proposes the reference's tokens and
    confidences for every rows count and drafted length; every drafted position went through it."""
    from test_drafter_fast_paths import assert_same_proposal, drafting_setup, reference_proposal, rows_of

    import dspark.drafters.draft_step as draft_step
    from dspark.core.types import Shared

    calls = []
    real = draft_step.bias_argmax
    monkeypatch.setattr(draft_step, "bias_argmax", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    drafter, cache, anchors, u = drafting_setup(small_target, "dspark", head, "anchor")
    shared = Shared.of(small_target)
    drafter.compile_inference(compiler=None)
    drafter._fused.greedy_kernel = "triton"
    drafted = 0
    with torch.inference_mode():
        for r in (4, 1, 3):
            for n in sorted({1, drafter.gamma}):
                args = (rows_of(cache, r), anchors[:r], cache.length[:r], shared, 0.0)
                kw = dict(uniforms=u[:r], draft_len=n)
                assert_same_proposal(drafter.propose(*args, **kw), reference_proposal(drafter, *args, **kw),
                                     greedy=True)  # fmt: skip
                drafted += n
    assert len(calls) == drafted


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_gpu_bias_argmax(rows, dtype):
    """SmolLM2's vocabulary and a rank-256 head: the reference's tokens (fp32), or tokens that tie
    with them to the bias GEMM's rounding (bf16: ``near_greedy``); ties to the lowest index."""
    base, weight, b = bias_argmax_problem(rows, GPU_V, 256, dtype, seed=rows, device="cuda")
    for index in (None, torch.randint(0, rows, (rows,), device="cuda")):  # features as rows, gathered
        got = bias_argmax(base, weight, b, index, impl="triton")
        if dtype == torch.float32:
            assert torch.equal(got, bias_argmax_reference(base, weight, b, index))
        assert near_greedy(got, base, weight, b, index)
    *tied, expected = tied_bias_argmax_problem("cuda")
    assert bias_argmax(*tied, impl="triton").tolist() == expected
    assert bias_argmax_self_check(torch.device("cuda"), dtype, 256)


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_gpu_nucleus(top_p):
    """Data generation's answers: 1 024 rows of SmolLM2's vocabulary from peaked to flat, the
    kernel against the sort (the same kept tokens, the same values to float32 rounding)."""
    probs = nucleus_rows(1024, GPU_V, seed=6, device="cuda")
    got, ref = nucleus(probs, top_p, impl="triton"), nucleus_reference(probs, top_p)
    # Both against the rule: on the H200 (2026-12-03) they split flat rows' boundary tokens, each within
    # float32 rounding of the mass compared with top_p.
    for filtered in (got, ref):
        assert_nucleus_rule(filtered, probs, top_p, tol=1e-4)
    assert nucleus_self_check(torch.device("cuda"))
