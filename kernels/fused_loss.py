"""Fused draft loss: per-row CE, total variation and KL against the target, gradient included.

For rows r (draft positions) with draft features x_r [K] and target hidden states h_r [D]:

    z_d = cap(x Wᵀ),   z_t = cap(h W[:, :D]ᵀ),   cap(z) = c·tanh(z/c) (optional)
    ce_r = -log p_d[r, label_r]      (0 where label_r < 0)
    tv_r = ‖p_d[r] - p_t[r]‖₁
    kl_r = KL(p_t[r] ‖ p_d[r])
    loss = Σ_r a_r·ce_r + b_r·tv_r + c_r·kl_r           (row weights a, b, c given up front)

W [V, K] is the output projection: its first D columns are the target's frozen LM head (so the
target logits reuse them) and the last ``r`` columns may be a trainable low-rank bias (DSpark's
W2), passed as ``trainable`` so its gradient can flow; the frozen columns get none.

Because the row weights are known when the loss is computed, the gradient is computed in the
same pass: with s = z_d (capped), σ = sign(p_d - p_t), m = Σ_v σ_v p_d,v,

    ∂loss/∂s = a·(p_d - onehot) + b·p_d·(σ - m) + c·(p_d - p_t),   ∂s/∂z = 1 - (s/c)²

Rows are processed in chunks: per chunk the two logit matrices come from two cuBLAS GEMMs
(16-bit operands, float32 output), one row-wise pass computes the losses and writes dz, and
two more GEMMs turn dz into the gradients of x and of the trainable columns (that one adding
into a float32 sum over the chunks, inside the GEMM where the backend can). Each logit is
computed once, no [N, V] tensor outlives its chunk, and backward only rescales the stored
gradients by the incoming scalar.

Many rows may share one target (a block drafter's anchors overlap: the target distribution at a
position is compared with up to γ rows). Given ``target_index`` (row r's target is
``target_hidden[target_index[r]]``) and ``group_rows`` (rows come in groups, e.g. a sequence's
anchors, whose targets lie in their group's own slice of ``target_hidden``), the target logits are
computed once per target of the chunk's groups and the row pass reads them through the index,
instead of once per row.

``materialized_draft_loss`` is the plain-autograd ground truth. The row-wise pass has a PyTorch
implementation (CPU, and the reference) and a Triton kernel (CUDA; the interpreter on CPU in tests).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, tl, triton, triton_interpreting

log = logging.getLogger(__name__)

__all__ = [
    "DraftLoss",
    "RowWeights",
    "materialized_draft_loss",
    "fused_draft_loss",
    "default_chunk_rows",
    "chunk_plan",
    "shares_targets",
]


class RowWeights(NamedTuple):
    ce: Tensor  # [N] weight of each row's cross-entropy (rows with label < 0 never count)
    tv: Tensor  # [N] weight of ‖p_d - p_t‖₁
    kl: Tensor  # [N] weight of KL(p_t ‖ p_d)


class DraftLoss(NamedTuple):
    loss: Tensor  # scalar Σ a·ce + b·tv + c·kl (differentiable in x and `trainable`)
    ce: Tensor  # [N] float32, 0 on ignored rows (detached)
    tv: Tensor  # [N] float32 in [0, 2] (detached)
    kl: Tensor  # [N] float32 >= 0 (detached)


def _check(
    x, weight, target_hidden, labels, row_weights, trainable, softcap, target_index=None, group_rows=None
):
    if x.dim() != 2 or weight.dim() != 2 or target_hidden.dim() != 2:
        raise ValueError("x, weight and target_hidden must be 2-D")
    n, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    rows = n if target_index is None else target_hidden.shape[0]
    if target_hidden.shape[0] != rows or target_hidden.shape[1] > k:
        raise ValueError(f"target_hidden {tuple(target_hidden.shape)} does not match N={n}, K={k}")
    if target_index is not None and (target_index.shape != (n,) or target_index.dtype.is_floating_point):
        raise ValueError(f"target_index must be an integer tensor of shape ({n},)")
    if group_rows is not None:
        if target_index is None:
            raise ValueError("group_rows needs target_index")
        if group_rows <= 0 or n % group_rows or rows % (n // group_rows):
            raise ValueError(
                f"group_rows={group_rows} must divide N={n} and the groups the {rows} target rows"
            )
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {tuple(labels.shape)}")
    for name, w in zip(RowWeights._fields, row_weights):
        if w.shape != (n,):
            raise ValueError(f"row weight '{name}' must have shape ({n},), got {tuple(w.shape)}")
    if trainable is not None and (trainable.dim() != 2 or trainable.shape[0] != weight.shape[0]):
        raise ValueError(f"trainable {tuple(trainable.shape)} is not a [V, r] slice of weight")
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
    labels: Tensor,
    row_weights: RowWeights,
    softcap: float | None = None,
    target_index: Tensor | None = None,
) -> DraftLoss:
    """Ground truth: full [N, V] logits, plain autograd (float32 math). Gradients flow to ``x`` and
    to ``weight`` as far as autograd reaches it (e.g. the trainable half of a ``torch.cat``).
    ``target_index``: row r's target is target_hidden[target_index[r]] (gathered here, per row)."""
    _check(x, weight, target_hidden, labels, row_weights, None, softcap, target_index)
    if target_index is not None:
        target_hidden = target_hidden.index_select(0, target_index)
    acc = _acc_dtype(x)
    d = target_hidden.shape[1]
    logp_d = torch.log_softmax(_cap((x @ weight.T).to(acc), softcap), dim=-1)
    with torch.no_grad():
        tw = weight[:, :d].detach().to(target_hidden.dtype)
        logp_t = torch.log_softmax(_cap((target_hidden @ tw.T).to(acc), softcap), dim=-1)
        p_t = logp_t.exp()
    valid = labels >= 0
    picked = logp_d.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
    ce = torch.where(valid, -picked, torch.zeros_like(picked))
    tv = (logp_d.exp() - p_t).abs().sum(-1)
    kl = (p_t * (logp_t - logp_d)).sum(-1)
    a, b, c = (w.to(acc) for w in row_weights)
    loss = (torch.where(valid, a, torch.zeros_like(a)) * ce).sum() + (b * tv).sum() + (c * kl).sum()
    return DraftLoss(loss, ce.detach(), tv.detach(), kl.detach())


# ----------------------------------------------------------------------------- row pass, torch


def _rows_torch(zd, zt, labels, a, b, c, softcap, want_grad: bool, dz_dtype, zt_index=None):
    """Losses of rows with logits zd [n, V] and zt (float; [n, V], or rows of it picked by
    ``zt_index`` [n]) and, if asked, dloss/dz [n, V]."""
    if zt_index is not None:
        zt = zt.index_select(0, zt_index)
    s_d, s_t = _cap(zd, softcap), _cap(zt, softcap)
    logp_d = torch.log_softmax(s_d, dim=-1)
    logp_t = torch.log_softmax(s_t, dim=-1)
    p_d, p_t = logp_d.exp(), logp_t.exp()
    valid = labels >= 0
    picked = logp_d.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
    ce = torch.where(valid, -picked, torch.zeros_like(picked))
    diff = p_d - p_t
    tv = diff.abs().sum(-1)
    kl = (p_t * (logp_t - logp_d)).sum(-1)
    if not want_grad:
        return ce, tv, kl, None
    a, b, c = (w.to(p_d.dtype) for w in (a, b, c))
    a = torch.where(valid, a, torch.zeros_like(a))[:, None]
    sgn = torch.sign(diff)
    m = (sgn * p_d).sum(-1, keepdim=True)
    dz = a * p_d + b[:, None] * p_d * (sgn - m) + c[:, None] * diff
    dz.scatter_add_(1, labels.clamp_min(0)[:, None], -a)
    if softcap is not None:
        dz = dz * (1.0 - (s_d / softcap) ** 2)
    return ce, tv, kl, dz.to(dz_dtype)


# ----------------------------------------------------------------------------- row pass, triton

if HAS_TRITON:
    from triton.language.extra import libdevice

    # Triton core has no tanh. Compiled kernels use libdevice's (<= 2 ulp); the interpreter has no
    # libdevice, and there 2σ(2y) - 1 in numpy float32 (absolute error ~1e-7) is accurate enough.
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
    def _row_loss_kernel(
        zd_ptr,
        zt_ptr,
        zt_index_ptr,
        labels_ptr,
        a_ptr,
        b_ptr,
        c_ptr,
        ce_ptr,
        tv_ptr,
        kl_ptr,
        dz_ptr,
        softcap,
        V: tl.constexpr,
        HAS_CAP: tl.constexpr,
        WANT_GRAD: tl.constexpr,
        HAS_INDEX: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per row; three sweeps over V: normalisers, then losses, then dz (which needs
        # m = Σ σ·p_d from the second sweep). A row whose TV weight is 0 (every DFlash and Eagle3
        # row, a padding row) needs no m: the second sweep writes its dz and the third is skipped.
        # V is constexpr: fixed per model, and a runtime loop bound breaks the triton 3.6
        # interpreter under numpy >= 2.4.
        row = tl.program_id(0).to(tl.int64)
        zd_row = zd_ptr + row * V
        if HAS_INDEX:  # noqa: SIM108 (a compile-time branch) - the row's target: a zt row it shares
            zt_row = zt_ptr + tl.load(zt_index_ptr + row).to(tl.int64) * V
        else:
            zt_row = zt_ptr + row * V
        cols0 = tl.arange(0, BLOCK)
        m_d = tl.full((), float("-inf"), tl.float32)
        m_t = tl.full((), float("-inf"), tl.float32)
        s_d = tl.zeros((), tl.float32)
        s_t = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK):
            cols = v0 + cols0
            ok = cols < V
            zd = _softcap(tl.load(zd_row + cols, mask=ok, other=0.0).to(tl.float32), softcap, HAS_CAP)
            zt = _softcap(tl.load(zt_row + cols, mask=ok, other=0.0).to(tl.float32), softcap, HAS_CAP)
            zd = tl.where(ok, zd, float("-inf"))
            zt = tl.where(ok, zt, float("-inf"))
            new_d = tl.maximum(m_d, tl.max(zd, 0))
            new_t = tl.maximum(m_t, tl.max(zt, 0))
            s_d = s_d * tl.exp(m_d - new_d) + tl.sum(tl.exp(zd - new_d), 0)
            s_t = s_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(zt - new_t), 0)
            m_d, m_t = new_d, new_t
        lse_d = m_d + tl.log(s_d)
        lse_t = m_t + tl.log(s_t)

        lab = tl.load(labels_ptr + row)
        valid = lab >= 0
        a = tl.where(valid, tl.load(a_ptr + row).to(tl.float32), 0.0)
        b = tl.load(b_ptr + row).to(tl.float32)
        c = tl.load(c_ptr + row).to(tl.float32)
        dz_row = dz_ptr + row * V
        tv = tl.zeros((), tl.float32)
        msum = tl.zeros((), tl.float32)
        cross = tl.zeros((), tl.float32)  # Σ p_t·(z_t - z_d)
        for v0 in range(0, V, BLOCK):
            cols = v0 + cols0
            ok = cols < V
            zd = _softcap(tl.load(zd_row + cols, mask=ok, other=0.0).to(tl.float32), softcap, HAS_CAP)
            zt = _softcap(tl.load(zt_row + cols, mask=ok, other=0.0).to(tl.float32), softcap, HAS_CAP)
            p_d = tl.where(ok, tl.exp(zd - lse_d), 0.0)
            p_t = tl.where(ok, tl.exp(zt - lse_t), 0.0)
            diff = p_d - p_t
            sgn = (diff > 0).to(tl.float32) - (diff < 0).to(tl.float32)
            tv += tl.sum(tl.abs(diff), 0)
            msum += tl.sum(sgn * p_d, 0)
            cross += tl.sum(p_t * (zt - zd), 0)
            if WANT_GRAD:  # noqa: SIM102 - a compile-time branch around a runtime one
                if b == 0.0:  # dz without the TV term: all it needs is here
                    dz = a * p_d + c * diff
                    dz -= tl.where(cols == lab, a, 0.0)
                    if HAS_CAP:
                        t = zd / softcap
                        dz *= 1.0 - t * t
                    tl.store(dz_row + cols, dz.to(dz_ptr.dtype.element_ty), mask=ok)

        z_lab = _softcap(tl.load(zd_row + tl.maximum(lab, 0)).to(tl.float32), softcap, HAS_CAP)
        tl.store(ce_ptr + row, tl.where(valid, lse_d - z_lab, 0.0))
        tl.store(tv_ptr + row, tv)
        tl.store(kl_ptr + row, cross - lse_t + lse_d)

        if WANT_GRAD:  # noqa: SIM102 - a compile-time branch around a runtime one
            if b != 0.0:  # the TV term needs the second sweep's m: a third sweep
                for v0 in range(0, V, BLOCK):
                    cols = v0 + cols0
                    ok = cols < V
                    zd = _softcap(tl.load(zd_row + cols, mask=ok, other=0.0).to(tl.float32), softcap, HAS_CAP)
                    zt = _softcap(tl.load(zt_row + cols, mask=ok, other=0.0).to(tl.float32), softcap, HAS_CAP)
                    p_d = tl.exp(zd - lse_d)
                    p_t = tl.exp(zt - lse_t)
                    diff = p_d - p_t
                    sgn = (diff > 0).to(tl.float32) - (diff < 0).to(tl.float32)
                    dz = a * p_d + b * p_d * (sgn - msum) + c * diff
                    dz -= tl.where(cols == lab, a, 0.0)
                    if HAS_CAP:
                        t = zd / softcap
                        dz *= 1.0 - t * t
                    tl.store(dz_row + cols, dz.to(dz_ptr.dtype.element_ty), mask=ok)


def _rows_triton(zd, zt, labels, a, b, c, softcap, want_grad: bool, dz_dtype, zt_index=None):
    n, v = zd.shape
    f32 = dict(device=zd.device, dtype=torch.float32)
    ce, tv, kl = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
    dz = torch.empty((n, v), device=zd.device, dtype=dz_dtype) if want_grad else ce
    block = 256 if triton_interpreting() else 2048
    _row_loss_kernel[(n,)](
        zd,
        zt,
        labels if zt_index is None else zt_index,  # unread without an index
        labels,
        a,
        b,
        c,
        ce,
        tv,
        kl,
        dz,
        float(softcap) if softcap is not None else 1.0,
        V=v,
        HAS_CAP=softcap is not None,
        WANT_GRAD=want_grad,
        HAS_INDEX=zt_index is not None,
        BLOCK=block,
        **({} if triton_interpreting() else dict(num_warps=8)),
    )
    return ce, tv, kl, (dz if want_grad else None)


_ROW_PASSES = {"torch": _rows_torch, "triton": _rows_triton}


# ----------------------------------------------------------------------------- GEMMs

_MM_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


def _writes_f32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(out_dtype=float32)`` runs for 16-bit operands here (probed once)."""
    key = (device.type, dtype)
    if key not in _MM_OUT_DTYPE:
        probe = torch.ones(2, 2, device=device, dtype=dtype)
        try:
            _MM_OUT_DTYPE[key] = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


_ADDMM_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}
GEMM_ACCUMULATES = True  # False: the separate product and add everywhere (bench_fused_loss's A/B)


def _accumulates_f32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=float32, out=acc)`` adds a 16-bit product into a
    float32 ``acc`` in place here: probed once on small integers (exact in any dtype) laid out as the
    loss lays them (a transposed, b a column slice), so a backend that overwrote ``acc`` instead, or
    refused, keeps the separate product and add."""
    key = (device.type, dtype)
    if key not in _ADDMM_OUT_DTYPE:
        acc = torch.arange(6, device=device, dtype=torch.float32).reshape(2, 3)
        a = torch.ones(4, 2, device=device, dtype=dtype).T
        b = torch.ones(4, 5, device=device, dtype=dtype)[:, 2:]
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            want = torch.arange(6, device=device, dtype=torch.float32).reshape(2, 3) + 4
            _ADDMM_OUT_DTYPE[key] = bool(torch.equal(acc, want))
        except (RuntimeError, TypeError, NotImplementedError):
            _ADDMM_OUT_DTYPE[key] = False
    return _ADDMM_OUT_DTYPE[key]


def _addmm_f32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, acc float32 (float64 for float64). One GEMM that accumulates into acc where
    the backend can (cuBLAS's beta = 1): no [V, r] float32 product per chunk to allocate and add (on
    Gemma, 262 144 × 256 and 63 chunks a step: the float32 add was 9.7 % of DSpark's training step's
    device time in h100-gemma3-2026-12-07-d's profile)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif GEMM_ACCUMULATES and _accumulates_f32(a.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += _mm_f32(a, b)


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with a float32 (float64 for float64) result. 16-bit operands keep tensor-core speed
    and accumulate in float32; where the backend can write that accumulator directly
    (``torch.mm(out_dtype=)``) the logits are never rounded to 16 bits."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if _writes_f32(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def default_chunk_rows(vocab_size: int, budget_bytes: int = 1 << 29) -> int:
    """Rows per chunk so one float32 [rows, V] logit matrix stays within ``budget_bytes`` (512 MiB:
    the two logit matrices and dz of a chunk then take ~1.3 GiB at most)."""
    return max(16, budget_bytes // (4 * vocab_size) // 16 * 16)


# ----------------------------------------------------------------------------- autograd


def shares_targets(group_rows: int, group_targets: int, chunk: int) -> bool:
    """Whether groups of ``group_rows`` rows sharing ``group_targets`` target rows compute the
    target logits once per target (fewer targets than rows, and a group's targets fit a chunk)."""
    return group_targets < group_rows and group_targets <= chunk


def chunk_plan(n: int, chunk: int, group_rows: int | None = None, group_targets: int = 0):
    """[(t0, t1, [(r0, r1), …])]: the rows in chunks of at most ``chunk`` rows and, with groups of
    ``group_rows`` rows that share ``group_targets`` target rows each, the slice t0:t1 of target
    rows whose logits a run of chunks shares (whole groups: as many as fit one chunk, else one
    group split into several chunks). Without groups t0 = t1 = None: each row has its own target."""
    if group_rows is None:
        return [(None, None, [(r0, min(n, r0 + chunk)) for r0 in range(0, n, chunk)])]
    groups, per = n // group_rows, max(1, chunk // group_rows)
    plan = []
    for g0 in range(0, groups, per):
        g1 = min(groups, g0 + per)
        end = g1 * group_rows
        spans = [(r0, min(end, r0 + chunk)) for r0 in range(g0 * group_rows, end, chunk)]
        plan.append((g0 * group_targets, g1 * group_targets, spans))
    return plan


class _FusedDraftLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, trainable, weight, th, labels, a, b, c, softcap, plan, target_index, backend, grad_on
    ):
        n, k = x.shape
        d = th.shape[1]
        r = 0 if trainable is None else trainable.shape[1]
        # Grad mode is off inside forward: the caller says whether autograd will want gradients.
        want_x = grad_on and ctx.needs_input_grad[0]
        want_t = grad_on and trainable is not None and ctx.needs_input_grad[1]
        want_grad = want_x or want_t
        md = weight.dtype  # the GEMM dtype
        acc = _acc_dtype(x)
        row_pass = _ROW_PASSES[backend]
        with torch.autocast(x.device.type, enabled=False):
            xm, thm = x.to(md), th.to(md)
            head = weight[:, :d]
            ce, tv, kl = (torch.empty(n, device=x.device, dtype=acc) for _ in range(3))
            grad_x = torch.empty((n, k), device=x.device, dtype=md) if want_x else None
            grad_t = torch.zeros(trainable.shape, device=x.device, dtype=acc) if want_t else None
            for t0, t1, spans in plan:
                # Shared targets: their logits once for the chunks of these groups, read by index.
                shared = None if t0 is None else _mm_f32(thm[t0:t1], head.T)
                for r0, r1 in spans:
                    zd = _mm_f32(xm[r0:r1], weight.T)
                    if shared is None:
                        zt, index = _mm_f32(thm[r0:r1], head.T), None
                    else:
                        zt, index = shared, target_index[r0:r1] - t0
                    ce[r0:r1], tv[r0:r1], kl[r0:r1], dz = row_pass(
                        zd, zt, labels[r0:r1], a[r0:r1], b[r0:r1], c[r0:r1], softcap, want_grad, md, index
                    )
                    del zd, zt
                    if want_x:
                        torch.mm(dz, weight, out=grad_x[r0:r1])
                    if want_t:
                        _addmm_f32_(grad_t, dz.T, xm[r0:r1, k - r :])
                del shared
            valid = labels >= 0
            loss = (torch.where(valid, a, torch.zeros_like(a)).to(acc) * ce).sum()
            loss = loss + (b.to(acc) * tv).sum() + (c.to(acc) * kl).sum()
        ctx.save_for_backward(grad_x, grad_t)
        ctx.x_dtype = x.dtype
        ctx.t_dtype = None if trainable is None else trainable.dtype
        ctx.mark_non_differentiable(ce, tv, kl)
        return loss, ce, tv, kl

    @staticmethod
    def backward(ctx, g_loss, *_):
        grad_x, grad_t = ctx.saved_tensors
        gx = None if grad_x is None else (grad_x * g_loss.to(grad_x.dtype)).to(ctx.x_dtype)
        gt = None if grad_t is None else (grad_t * g_loss.to(grad_t.dtype)).to(ctx.t_dtype)
        return gx, gt, None, None, None, None, None, None, None, None, None, None, None


def fused_draft_loss(
    x: Tensor,
    weight: Tensor,
    target_hidden: Tensor,
    labels: Tensor,
    row_weights: RowWeights,
    *,
    trainable: Tensor | None = None,
    softcap: float | None = None,
    impl: str = "auto",
    chunk_rows: int | None = None,
    target_index: Tensor | None = None,
    group_rows: int | None = None,
) -> DraftLoss:
    """The loss, its per-row terms and (when autograd asks) its gradient, in row chunks.

    ``weight`` [V, K] is a constant; when ``trainable`` [V, r] is given, weight[:, K-r:] must hold
    its values and the gradient of the loss w.r.t. it is returned through autograd. The GEMMs run
    in weight's dtype. ``impl``: ``"triton"`` row kernel (CUDA), ``"torch"``, or ``"auto"``.

    Targets: ``target_hidden`` [N, D], one per row; or [M, D] with ``target_index`` [N] (row r's
    target is target_hidden[target_index[r]]). With ``group_rows`` R as well, the N rows are
    N / R groups of R consecutive rows, and group g's targets lie in its own T = M·R/N rows
    (g·T ≤ target_index < (g+1)·T, not checked: it would cost a host sync): the target logits
    are then computed once per target row, not once per row, whenever T < R and T ≤ the chunk."""
    _check(x, weight, target_hidden, labels, row_weights, trainable, softcap, target_index, group_rows)
    if weight.requires_grad:
        raise ValueError("weight is a constant here: pass its trainable columns as `trainable`")
    backend = resolve_impl(impl, x, weight, target_hidden, labels)
    if backend == "triton" and torch.float64 in (x.dtype, weight.dtype):
        if impl == "triton":
            raise ValueError("the Triton loss kernel takes float32 / bfloat16 / float16 inputs")
        backend = "torch"
    chunk = int(chunk_rows or default_chunk_rows(weight.shape[0]))
    if chunk <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    n = x.shape[0]
    group_targets = target_hidden.shape[0] * group_rows // n if group_rows and n else 0
    shares = bool(group_rows and n) and shares_targets(group_rows, group_targets, chunk)

    def run(plan, targets, index):
        return _FusedDraftLoss.apply(
            x,
            trainable,
            weight.detach().contiguous(),
            targets.detach().contiguous(),
            labels.contiguous(),
            *(w.detach().to(_acc_dtype(x)).contiguous() for w in row_weights),
            None if softcap is None else float(softcap),
            plan,
            None if index is None else index.contiguous(),
            backend,
            torch.is_grad_enabled(),
        )

    if shares and backend not in _SHARED_TARGETS_FAILED:
        plan = chunk_plan(n, chunk, group_rows, group_targets)
        try:
            return DraftLoss(*run(plan, target_hidden, target_index))
        except Exception as err:  # only what _falls_back allows is swallowed
            if not _falls_back(backend, x):
                raise
            _SHARED_TARGETS_FAILED[backend] = f"{type(err).__name__}: {err}"
            log.warning(
                "the fused loss's shared-target %s row pass failed (%s): each row gathers its own target "
                "from now on (the computation before shared targets)",
                backend,
                _SHARED_TARGETS_FAILED[backend][:300],
            )
    if target_index is not None:  # no sharing to exploit: each row its own target, gathered
        target_hidden = target_hidden.index_select(0, target_index)
    return DraftLoss(*run(chunk_plan(n, chunk), target_hidden, None))


# The shared-target path is new where the per-row one has run for long; a kernel that does not
# build on some GPU (a Triton compile error) must not stop a training run: it falls back, once,
# to the per-row computation. Never on the CPU, where the tests must see every error.
_SHARED_TARGETS_FAILED: dict[str, str] = {}


def _falls_back(backend: str, x: Tensor) -> bool:
    return backend == "triton" and x.is_cuda
