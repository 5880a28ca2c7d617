"""Fused chunked-vocabulary draft loss: per-row CE and total variation against the target.

For rows r (draft positions) with draft features x_r and target hidden state h_r:

    p_d = softmax(cap(x Wᵀ)),   p_t = softmax(cap(h W_tᵀ)),   cap(z) = c·tanh(z/c) (optional)
    ce_r = -log p_d[r, label_r]   (0 where label_r < 0, e.g. -100)
    tv_r = ‖p_d[r] - p_t[r]‖₁     (defined for every row; the caller masks it)

Gradients flow to ``x`` and ``weight``; the target side is a frozen constant. With
s = cap(z_d), σ = sign(p_d - p_t) and m_r = Σ_v σ_v p_d,v the logit gradient is

    ∂L/∂s = g_ce·(p_d - onehot(label)) + g_tv·p_d·(σ - m),   ∂s/∂z = 1 - (s/c)²

so the backward only needs the per-row scalars lse_d, lse_t and m from the forward.

Three implementations share that math:
  * ``materialized_draft_loss``: plain autograd over full [N, V] logits (ground truth).
  * ``chunked_draft_loss``: autograd.Function that walks V in chunks (two forward passes:
    online log-sum-exp, then TV; one backward pass that recomputes logits per chunk), so the
    peak extra memory is O(N·chunk) instead of several N×V tensors.
  * the Triton path (``fused_draft_loss(impl="triton")``): the forward passes are single
    kernels that compute logit tiles and reduce them in registers (only per-tile row stats
    reach memory); the backward computes dz for one V chunk in a kernel and leaves the two
    gradient GEMMs to cuBLAS. float32 inputs use 3xTF32 dots (near-fp32 accuracy on tensor
    cores; plain TF32 would cost 1e-3), 16-bit inputs plain tensor-core dots, fp32 accumulation.

All return float32 (float64 for float64 inputs) per-row values; the Triton path takes float32,
bfloat16 or float16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, tl, triton, triton_interpreting

__all__ = ["DraftLoss", "materialized_draft_loss", "chunked_draft_loss", "fused_draft_loss"]

class DraftLoss(NamedTuple):
    ce: Tensor  # [N] float32, 0 on ignored rows
    tv: Tensor  # [N] float32, ‖p_d - p_t‖₁ in [0, 2]


def _check(x, weight, target_hidden, target_weight, labels, softcap):
    if x.dim() != 2 or weight.dim() != 2 or target_hidden.dim() != 2 or target_weight.dim() != 2:
        raise ValueError("x, weight, target_hidden, target_weight must be 2-D")
    n, k = x.shape
    v = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if target_hidden.shape[0] != n or target_weight.shape != (v, target_hidden.shape[1]):
        raise ValueError(
            f"target_hidden {tuple(target_hidden.shape)} / target_weight {tuple(target_weight.shape)} "
            f"do not match N={n}, V={v}"
        )
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {tuple(labels.shape)}")
    if x.dtype != weight.dtype or target_hidden.dtype != target_weight.dtype:
        raise ValueError("x/weight and target_hidden/target_weight must share a dtype pairwise")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")


def _acc_dtype(t: Tensor) -> torch.dtype:
    """Loss math runs in float32, or float64 for float64 inputs (so gradcheck works)."""
    return torch.promote_types(t.dtype, torch.float32)


def _cap(z: Tensor, softcap: float | None) -> Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


# ----------------------------------------------------------------------------- reference


def materialized_draft_loss(
    x: Tensor,
    weight: Tensor,
    target_hidden: Tensor,
    target_weight: Tensor,
    labels: Tensor,
    softcap: float | None = None,
) -> DraftLoss:
    """Ground truth: full [N, V] logits, plain autograd (float32 math)."""
    _check(x, weight, target_hidden, target_weight, labels, softcap)
    logp_d = torch.log_softmax(_cap((x @ weight.T).to(_acc_dtype(x)), softcap), dim=-1)
    with torch.no_grad():
        p_t = torch.softmax(_cap((target_hidden @ target_weight.T).to(_acc_dtype(x)), softcap), dim=-1)
    valid = labels >= 0
    picked = logp_d.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
    ce = torch.where(valid, -picked, torch.zeros_like(picked))
    tv = (logp_d.exp() - p_t).abs().sum(-1)
    return DraftLoss(ce, tv)


# ----------------------------------------------------------------------------- torch chunks


def _torch_forward_stats(x, weight, th, tw, labels, softcap, chunk):
    n, v = x.shape[0], weight.shape[0]
    f = dict(device=x.device, dtype=_acc_dtype(x))
    lse_d = torch.full((n,), float("-inf"), **f)
    lse_t = torch.full((n,), float("-inf"), **f)
    label_logit = torch.zeros(n, **f)
    valid = labels >= 0
    for v0 in range(0, v, chunk):
        v1 = min(v, v0 + chunk)
        s_d = _cap((x @ weight[v0:v1].T).to(f["dtype"]), softcap)
        s_t = _cap((th @ tw[v0:v1].T).to(f["dtype"]), softcap)
        lse_d = torch.logaddexp(lse_d, torch.logsumexp(s_d, dim=1))
        lse_t = torch.logaddexp(lse_t, torch.logsumexp(s_t, dim=1))
        # Masked gather instead of nonzero(): no host sync per chunk on GPU.
        here = valid & (labels >= v0) & (labels < v1)
        picked = s_d.gather(1, (labels - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1)
        label_logit = torch.where(here, picked, label_logit)
    # Second pass: TV needs the final normalisers, so the chunk logits are recomputed.
    tv = torch.zeros(n, **f)
    msum = torch.zeros(n, **f)
    for v0 in range(0, v, chunk):
        v1 = min(v, v0 + chunk)
        p_d = torch.exp(_cap((x @ weight[v0:v1].T).to(f["dtype"]), softcap) - lse_d[:, None])
        p_t = torch.exp(_cap((th @ tw[v0:v1].T).to(f["dtype"]), softcap) - lse_t[:, None])
        diff = p_d - p_t
        tv += diff.abs().sum(1)
        msum += (torch.sign(diff) * p_d).sum(1)
    return lse_d, lse_t, label_logit, tv, msum


def _torch_dz(x, w_c, th, tw_c, labels, v0, lse_d, lse_t, msum, g_ce, g_tv, softcap, out_dtype):
    s_d = _cap((x @ w_c.T).to(lse_d.dtype), softcap)
    p_d = torch.exp(s_d - lse_d[:, None])
    p_t = torch.exp(_cap((th @ tw_c.T).to(lse_d.dtype), softcap) - lse_t[:, None])
    dz = p_d * (g_ce[:, None] + g_tv[:, None] * (torch.sign(p_d - p_t) - msum[:, None]))
    cols = torch.arange(v0, v0 + w_c.shape[0], device=x.device)
    dz -= torch.where(labels[:, None] == cols, g_ce[:, None], 0.0)  # ignored rows have g_ce = 0
    if softcap is not None:
        dz *= 1.0 - (s_d / softcap) ** 2
    return dz.to(out_dtype)


# ----------------------------------------------------------------------------- triton

if HAS_TRITON:
    from triton.language.extra import libdevice

    # Triton core has no tanh. Compiled kernels use libdevice's (<= 2 ulp): the softcap scales
    # tanh's absolute error by c (~30), so a formula built on the GPU's approximate exp and
    # division is risky. The interpreter has no libdevice; there 2σ(2y) - 1 in numpy float32
    # (absolute error ~1e-7) is accurate enough at test shapes.
    _LIBDEVICE_TANH = tl.constexpr(not triton_interpreting())

    @triton.jit
    def _softcap(z, softcap, HAS_CAP: tl.constexpr):
        if HAS_CAP:
            if _LIBDEVICE_TANH:
                z = softcap * libdevice.tanh(z / softcap)
            else:
                z = softcap * (2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0)
        return z

    @triton.jit
    def _logit_tile(
        a_ptr,
        b_ptr,
        rows,
        cols,
        n_rows,
        n_cols,
        inner: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
    ):
        # [BLOCK_N, BLOCK_V] tile of a @ bᵀ for row-major a [n_rows, inner], b [n_cols, inner].
        # Loop bounds are constexpr (hidden sizes are fixed per model, so this costs no extra
        # compiles); a runtime bound also breaks the triton 3.6 interpreter under numpy >= 2.4.
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows[:, None] < n_rows
        col_ok = cols[:, None] < n_cols
        for k0 in range(0, inner, BLOCK_K):
            kk = k0 + ks
            k_ok = kk[None, :] < inner
            a = tl.load(a_ptr + rows[:, None] * inner + kk[None, :], mask=row_ok & k_ok, other=0.0)
            b = tl.load(b_ptr + cols[:, None] * inner + kk[None, :], mask=col_ok & k_ok, other=0.0)
            if PREC == "none":  # 16-bit inputs: plain tensor-core dot
                acc = tl.dot(a, tl.trans(b), acc)
            else:  # float32 inputs: never the default TF32 (1e-3 relative)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        return acc

    @triton.jit
    def _loss_stats_kernel(
        x_ptr,
        w_ptr,
        h_ptr,
        tw_ptr,
        labels_ptr,
        max_d_ptr,
        sum_d_ptr,
        max_t_ptr,
        sum_t_ptr,
        label_logit_ptr,
        N,
        V,
        K: tl.constexpr,
        D: tl.constexpr,
        softcap,
        HAS_CAP: tl.constexpr,
        PREC_D: tl.constexpr,
        PREC_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Pass 1: per-(row, V-tile) max and sum-exp of both logit sets, plus the label logit.
        # axis 0 (row tiles) varies fastest so programs sharing a weight tile run together.
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        row_ok = rows < N
        col_ok = cols[None, :] < V
        out = pid_v * N + rows

        s_d = _logit_tile(x_ptr, w_ptr, rows, cols, N, V, K, BLOCK_N, BLOCK_V, BLOCK_K, PREC_D)
        s_d = tl.where(col_ok, _softcap(s_d, softcap, HAS_CAP), float("-inf"))
        m_d = tl.max(s_d, axis=1)
        tl.store(max_d_ptr + out, m_d, mask=row_ok)
        tl.store(sum_d_ptr + out, tl.sum(tl.exp(s_d - m_d[:, None]), axis=1), mask=row_ok)

        lab = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        hit = cols[None, :] == lab[:, None]
        picked = tl.sum(tl.where(hit, s_d, 0.0), axis=1)
        in_tile = row_ok & (lab >= pid_v * BLOCK_V) & (lab < pid_v * BLOCK_V + BLOCK_V)
        tl.store(label_logit_ptr + rows, picked, mask=in_tile)

        s_t = _logit_tile(h_ptr, tw_ptr, rows, cols, N, V, D, BLOCK_N, BLOCK_V, BLOCK_K, PREC_T)
        s_t = tl.where(col_ok, _softcap(s_t, softcap, HAS_CAP), float("-inf"))
        m_t = tl.max(s_t, axis=1)
        tl.store(max_t_ptr + out, m_t, mask=row_ok)
        tl.store(sum_t_ptr + out, tl.sum(tl.exp(s_t - m_t[:, None]), axis=1), mask=row_ok)

    @triton.jit
    def _probs_tile(
        x_ptr,
        w_ptr,
        h_ptr,
        tw_ptr,
        lse_d_ptr,
        lse_t_ptr,
        rows,
        cols,
        row_ok,
        N,
        V,
        K: tl.constexpr,
        D: tl.constexpr,
        softcap,
        HAS_CAP: tl.constexpr,
        PREC_D: tl.constexpr,
        PREC_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Normalised p_d, p_t tiles (0 on padded columns) and the capped draft logits.
        col_ok = cols[None, :] < V
        s_d = _softcap(
            _logit_tile(x_ptr, w_ptr, rows, cols, N, V, K, BLOCK_N, BLOCK_V, BLOCK_K, PREC_D),
            softcap,
            HAS_CAP,
        )
        s_t = _softcap(
            _logit_tile(h_ptr, tw_ptr, rows, cols, N, V, D, BLOCK_N, BLOCK_V, BLOCK_K, PREC_T),
            softcap,
            HAS_CAP,
        )
        lse_d = tl.load(lse_d_ptr + rows, mask=row_ok, other=0.0)
        lse_t = tl.load(lse_t_ptr + rows, mask=row_ok, other=0.0)
        p_d = tl.where(col_ok, tl.exp(s_d - lse_d[:, None]), 0.0)
        p_t = tl.where(col_ok, tl.exp(s_t - lse_t[:, None]), 0.0)
        return p_d, p_t, s_d

    @triton.jit
    def _loss_tv_kernel(
        x_ptr,
        w_ptr,
        h_ptr,
        tw_ptr,
        lse_d_ptr,
        lse_t_ptr,
        tv_ptr,
        m_ptr,
        N,
        V,
        K: tl.constexpr,
        D: tl.constexpr,
        softcap,
        HAS_CAP: tl.constexpr,
        PREC_D: tl.constexpr,
        PREC_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Pass 2: per-(row, V-tile) partial sums of |p_d - p_t| and sign(p_d - p_t)·p_d.
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        row_ok = rows < N
        p_d, p_t, _ = _probs_tile(
            x_ptr,
            w_ptr,
            h_ptr,
            tw_ptr,
            lse_d_ptr,
            lse_t_ptr,
            rows,
            cols,
            row_ok,
            N,
            V,
            K,
            D,
            softcap,
            HAS_CAP,
            PREC_D,
            PREC_T,
            BLOCK_N,
            BLOCK_V,
            BLOCK_K,
        )
        diff = p_d - p_t
        sgn = (diff > 0).to(tl.float32) - (diff < 0).to(tl.float32)
        out = pid_v * N + rows
        tl.store(tv_ptr + out, tl.sum(tl.abs(diff), axis=1), mask=row_ok)
        tl.store(m_ptr + out, tl.sum(sgn * p_d, axis=1), mask=row_ok)

    @triton.jit
    def _loss_dz_kernel(
        x_ptr,
        w_ptr,
        h_ptr,
        tw_ptr,
        lse_d_ptr,
        lse_t_ptr,
        m_ptr,
        labels_ptr,
        g_ce_ptr,
        g_tv_ptr,
        dz_ptr,
        N,
        V,
        K: tl.constexpr,
        D: tl.constexpr,
        v0,
        softcap,
        HAS_CAP: tl.constexpr,
        PREC_D: tl.constexpr,
        PREC_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Backward: dL/dz of one vocabulary chunk into dz [N, V]. Here V is the chunk width and
        # w/tw point at the chunk's first row, so columns are chunk-local; v0 shifts the labels.
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        row_ok = rows < N
        p_d, p_t, s_d = _probs_tile(
            x_ptr,
            w_ptr,
            h_ptr,
            tw_ptr,
            lse_d_ptr,
            lse_t_ptr,
            rows,
            cols,
            row_ok,
            N,
            V,
            K,
            D,
            softcap,
            HAS_CAP,
            PREC_D,
            PREC_T,
            BLOCK_N,
            BLOCK_V,
            BLOCK_K,
        )
        diff = p_d - p_t
        sgn = (diff > 0).to(tl.float32) - (diff < 0).to(tl.float32)
        m = tl.load(m_ptr + rows, mask=row_ok, other=0.0)
        g_ce = tl.load(g_ce_ptr + rows, mask=row_ok, other=0.0)
        g_tv = tl.load(g_tv_ptr + rows, mask=row_ok, other=0.0)
        lab = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - v0
        dz = p_d * (g_ce[:, None] + g_tv[:, None] * (sgn - m[:, None]))
        dz -= tl.where(cols[None, :] == lab[:, None], g_ce[:, None], 0.0)
        if HAS_CAP:
            t = s_d / softcap
            dz *= 1.0 - t * t
        mask = row_ok[:, None] & (cols[None, :] < V)
        tl.store(dz_ptr + rows[:, None] * V + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)


# Tile shapes per dtype for compiled kernels (module-level so the benchmark can sweep them).
GPU_TILES = {
    # fp32 operands take twice the shared memory per stage: half the K depth.
    torch.float32: dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=32, num_warps=8, num_stages=3),
    "half": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3),
}


# Dot precision for float32 inputs: "ieee" runs on CUDA cores (slow); "tf32x3" splits each
# operand into two TF32 parts on the tensor cores, close to fp32 accuracy.
FP32_DOT_PRECISION = "tf32x3"


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return "none"
    return "ieee" if triton_interpreting() else FP32_DOT_PRECISION


def _triton_config(dtype: torch.dtype) -> dict:
    if triton_interpreting():
        # Small tiles keep the numpy interpreter fast; correctness does not depend on them.
        return dict(BLOCK_N=32, BLOCK_V=64, BLOCK_K=16)
    return dict(GPU_TILES.get(dtype, GPU_TILES["half"]))


def _combine_lse(tile_max: Tensor, tile_sum: Tensor) -> Tensor:
    m = tile_max.max(0).values
    return m + torch.log((tile_sum * torch.exp(tile_max - m)).sum(0))


def _triton_forward_stats(x, weight, th, tw, labels, softcap, chunk):
    del chunk  # the forward walks V tile by tile inside one launch
    n, k = x.shape
    v, d = tw.shape
    cfg = _triton_config(x.dtype)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(v, cfg["BLOCK_V"]))
    flags = dict(HAS_CAP=softcap is not None, PREC_D=_dot_precision(x.dtype), PREC_T=_dot_precision(th.dtype))
    cap = float(softcap) if softcap is not None else 1.0
    part = torch.empty((4, grid[1], n), device=x.device, dtype=torch.float32)
    label_logit = torch.zeros(n, device=x.device, dtype=torch.float32)
    _loss_stats_kernel[grid](
        x,
        weight,
        th,
        tw,
        labels,
        part[0],
        part[1],
        part[2],
        part[3],
        label_logit,
        n,
        v,
        k,
        d,
        cap,
        **flags,
        **cfg,
    )
    lse_d = _combine_lse(part[0], part[1])
    lse_t = _combine_lse(part[2], part[3])
    part = torch.empty((2, grid[1], n), device=x.device, dtype=torch.float32)
    _loss_tv_kernel[grid](x, weight, th, tw, lse_d, lse_t, part[0], part[1], n, v, k, d, cap, **flags, **cfg)
    tv, msum = part.sum(1)
    return lse_d, lse_t, label_logit, tv, msum


def _triton_dz(x, w_c, th, tw_c, labels, v0, lse_d, lse_t, msum, g_ce, g_tv, softcap, out_dtype):
    n, k = x.shape
    width, d = tw_c.shape
    cfg = _triton_config(x.dtype)
    dz = torch.empty((n, width), device=x.device, dtype=out_dtype)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(width, cfg["BLOCK_V"]))
    _loss_dz_kernel[grid](
        x,
        w_c,
        th,
        tw_c,
        lse_d,
        lse_t,
        msum,
        labels,
        g_ce,
        g_tv,
        dz,
        n,
        width,
        k,
        d,
        v0,
        float(softcap) if softcap is not None else 1.0,
        HAS_CAP=softcap is not None,
        PREC_D=_dot_precision(x.dtype),
        PREC_T=_dot_precision(th.dtype),
        **cfg,
    )
    return dz


_BACKENDS = {
    "torch": (_torch_forward_stats, _torch_dz),
    "triton": (_triton_forward_stats, _triton_dz),
}


# ----------------------------------------------------------------------------- autograd


class _ChunkedDraftLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, th, tw, labels, softcap, chunk, backend):
        forward_stats, _ = _BACKENDS[backend]
        lse_d, lse_t, label_logit, tv, msum = forward_stats(x, weight, th, tw, labels, softcap, chunk)
        valid = labels >= 0
        ce = torch.where(valid, lse_d - label_logit, torch.zeros_like(lse_d))
        ctx.save_for_backward(x, weight, th, tw, labels, lse_d, lse_t, msum)
        ctx.softcap, ctx.chunk, ctx.backend = softcap, chunk, backend
        return ce, tv

    @staticmethod
    def backward(ctx, g_ce, g_tv):
        x, weight, th, tw, labels, lse_d, lse_t, msum = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, v = x.shape[0], weight.shape[0]
        acc = lse_d.dtype
        # An unused output arrives as None: it contributes nothing.
        g_ce = torch.zeros(n, device=x.device, dtype=acc) if g_ce is None else g_ce.to(acc)
        g_tv = torch.zeros(n, device=x.device, dtype=acc) if g_tv is None else g_tv.to(acc).contiguous()
        g_ce = torch.where(labels >= 0, g_ce, torch.zeros_like(g_ce)).contiguous()
        _, dz_fn = _BACKENDS[ctx.backend]
        grad_x = torch.zeros(x.shape, device=x.device, dtype=acc) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        for v0 in range(0, v, ctx.chunk):
            v1 = min(v, v0 + ctx.chunk)
            w_c = weight[v0:v1]
            dz = dz_fn(
                x, w_c, th, tw[v0:v1], labels, v0, lse_d, lse_t, msum, g_ce, g_tv, ctx.softcap, x.dtype
            )
            if need_x:
                grad_x += (dz @ w_c).to(acc)
            if need_w:
                torch.mm(dz.T, x, out=grad_w[v0:v1])
        if need_x:
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def _run_chunked(x, weight, target_hidden, target_weight, labels, softcap, chunk, backend) -> DraftLoss:
    _check(x, weight, target_hidden, target_weight, labels, softcap)
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    th = target_hidden.detach().contiguous()
    tw = target_weight.detach().contiguous()
    ce, tv = _ChunkedDraftLoss.apply(
        x.contiguous(),
        weight.contiguous(),
        th,
        tw,
        labels.contiguous(),
        None if softcap is None else float(softcap),
        int(chunk),
        backend,
    )
    return DraftLoss(ce, tv)


def chunked_draft_loss(
    x: Tensor,
    weight: Tensor,
    target_hidden: Tensor,
    target_weight: Tensor,
    labels: Tensor,
    softcap: float | None = None,
    *,
    chunk: int = 4096,
) -> DraftLoss:
    """Pure-PyTorch chunked forward/backward: O(N·chunk) extra memory instead of O(N·V)."""
    return _run_chunked(x, weight, target_hidden, target_weight, labels, softcap, chunk, "torch")


def fused_draft_loss(
    x: Tensor,
    weight: Tensor,
    target_hidden: Tensor,
    target_weight: Tensor,
    labels: Tensor,
    softcap: float | None = None,
    *,
    chunk: int = 4096,
    impl: str = "auto",
) -> DraftLoss:
    """Dispatcher: ``"triton"`` kernels (CUDA) or the ``"torch"`` chunked path; ``"auto"`` picks.

    ``chunk`` bounds the backward's [N, chunk] dz buffer (and the torch path's logit chunks).
    """
    backend = resolve_impl(impl, x, weight, target_hidden, target_weight, labels)
    if backend == "triton" and torch.float64 in (x.dtype, target_hidden.dtype):
        if impl == "triton":
            raise ValueError("the Triton loss kernels take float32 / bfloat16 / float16 inputs")
        backend = "torch"
    return _run_chunked(x, weight, target_hidden, target_weight, labels, softcap, chunk, backend)
