"""Greedy token of a drafted position: base logits plus a sequential head's low-rank bias, argmax.

    token[r] = argmax_v ( float(base[r, v]) + float(round(W2[v, :] · b[r, :])) )   (ties: lowest v)

``round`` is the bias GEMM's output rounding to ``b``'s dtype: the reference computes the bias
logits with ``F.linear`` in that dtype, as ``DSparkDrafter.position_argmax`` does, then upcasts both
terms. The reference writes the [R, V] bias logits, reads them back to add, and reduces them. The
kernel is that GEMM with the rest folded into its epilogue: each program multiplies BLOCK_V rows of
W2 by BLOCK_R rows of b (W2 is read once per row tile, not once per row), adds the base logits and
reduces its tile to each row's (max, first index); a second kernel picks each row's first chunk
holding the overall max (torch.argmax's tie rule). With ``rows`` the first kernel reads the
features from a table (a Markov head's W1 at the previous tokens) itself. So a Markov position is
two launches; at one row on the H200 the reference's pieces (an embedding gather, a GEMV through a
[1, V] round trip, an argmax that ran as one program) took ~25 µs a position in the profiled
kernel table of the 0.48 ms draft step. Each row tile reads all of W2 again, so the kernel is for
the few rows of latency-bound drafting (``MAX_ROWS``: one tile); a GEMM serves more rows better.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, self_check, tl, triton

__all__ = [
    "bias_argmax",
    "bias_argmax_reference",
    "bias_argmax_self_check",
    "near_greedy",
]

BLOCK_V = 128  # vocabulary rows of W2 per program
BLOCK_K = 64  # the rank, in steps
MAX_ROWS = 64  # rows of b per program at most (up to 16: tl.dot's smallest tile, 16)


def _features(b: Tensor, rows: Tensor | None) -> Tensor:
    return b if rows is None else b[rows]


def bias_argmax_reference(base: Tensor, weight: Tensor, b: Tensor, rows: Tensor | None = None) -> Tensor:
    """base [R, V] logits, weight [V, K] (W2), bias features b [R, K] (or, with ``rows`` [R], b's
    rows ``rows``: a Markov head's embedding table W1 and the previous tokens) -> tokens [R] (int64)."""
    b = _features(b, rows)
    bias = F.linear(b, weight.to(b.dtype))
    return (base.float() + bias.float()).argmax(-1)


def near_greedy(tokens: Tensor, base: Tensor, weight: Tensor, b: Tensor, rows: Tensor | None = None) -> bool:
    """Whether every token is the reference's argmax or ties with it to the bias GEMM's rounding:
    the kernel accumulates the products in another order than the reference's GEMM, so in bf16 or
    fp16 a bias logit can round one unit apart and swap a near tie (float32: 1e-4 relative)."""
    b = _features(b, rows)
    z = base.float() + F.linear(b, weight.to(b.dtype)).float()
    top = z.max(-1).values
    picked = z.gather(-1, tokens[:, None].long()).squeeze(-1)
    tol = (1e-4 if b.dtype == torch.float32 else 2**-6) * top.abs().clamp_min(1.0)
    return bool((top - picked <= tol).all())


def bias_argmax(
    base: Tensor, weight: Tensor, b: Tensor, rows: Tensor | None = None, impl: str = "auto"
) -> Tensor:  # fmt: skip
    """``bias_argmax_reference`` through the fused kernels where ``impl`` resolves to Triton
    (CUDA; the CPU under ``TRITON_INTERPRET=1``), else the reference. With ``rows`` the kernel
    gathers the features itself (no [R, K] copy, no launch of its own)."""
    (r, v), k = base.shape, b.shape[-1]
    fits = b.shape == (r, k) if rows is None else rows.shape == (r,)
    if weight.shape != (v, k) or not fits:
        shapes = f"base {tuple(base.shape)}, weight {tuple(weight.shape)}, b {tuple(b.shape)}"
        if rows is not None:
            shapes += f", rows {tuple(rows.shape)}"
        want = "base [R, V], weight [V, K], b [R, K] or rows [R]"
        raise ValueError(f"bias_argmax: {shapes} do not fit ({want})")
    if resolve_impl(impl, base, weight, b) == "torch":
        return bias_argmax_reference(base, weight, b, rows)
    return _bias_argmax_triton(base, weight, b, rows)


def bias_argmax_self_check(device: torch.device, dtype: torch.dtype, rank: int) -> bool:
    """Whether the kernels run here (``self_check``): a small random case at this rank, the features
    as rows and gathered, against the reference; the reference otherwise."""

    def check() -> tuple[bool, str]:
        g = torch.Generator(device=device).manual_seed(0)
        vocab = 3 * BLOCK_V + 5  # a ragged last chunk
        base = (4 * torch.randn(19, vocab, device=device, generator=g)).to(dtype)  # the wider tile
        weight = torch.randn(vocab, rank, device=device, generator=g).to(dtype)
        b = (torch.randn(19, rank, device=device, generator=g) / rank**0.5).to(dtype)
        rows = torch.randint(0, 19, (19,), device=device, generator=g)
        ok = all(
            near_greedy(_bias_argmax_triton(base, weight, b, index), base, weight, b, index)
            for index in (None, rows)
        )  # fmt: skip
        return ok, "tokens the reference ranks below its argmax"

    return self_check("bias_argmax", (str(device), dtype, rank), check, "the reference")


def _bias_argmax_triton(base: Tensor, weight: Tensor, b: Tensor, rows: Tensor | None = None) -> Tensor:
    (r, v), k = base.shape, b.shape[-1]
    weight = weight.to(b.dtype)
    base, weight, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (base, weight, b))
    chunks = triton.cdiv(v, BLOCK_V)
    block_r = 16 if r <= 16 else MAX_ROWS  # one row tile up to MAX_ROWS rows: W2 read once
    best = torch.empty(r, chunks, device=base.device, dtype=torch.float32)
    first = torch.empty(r, chunks, device=base.device, dtype=torch.int32)
    _bias_argmax_kernel[(chunks, triton.cdiv(r, block_r))](
        base, weight, b, b if rows is None else rows, best, first, r, v, k,
        base.stride(0), weight.stride(0), b.stride(0),
        GATHER=rows is not None, IEEE=b.dtype == torch.float32,
        BLOCK_V=BLOCK_V, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    tokens = torch.empty(r, device=base.device, dtype=torch.long)
    _first_chunk_kernel[(r,)](best, first, tokens, chunks, BLOCK_C=triton.next_power_of_2(chunks))
    return tokens


if HAS_TRITON:

    @triton.jit
    def _bias_tile(
        w_ptr, b_ptr, cols, b_rows, col_ok, row_ok, K, stride_w, stride_b,
        IEEE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """[BLOCK_V, BLOCK_R] float32: W2's rows ``cols`` times the features' rows ``b_rows`` (row
        indices, so the caller may gather them), over K in BLOCK_K steps."""
        acc = tl.zeros((BLOCK_V, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            w_at = w_ptr + cols[:, None] * stride_w + kk[None, :]
            w = tl.load(w_at, mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_V, BLOCK_K]
            b_at = b_ptr + b_rows[None, :] * stride_b + kk[:, None]
            bt = tl.load(b_at, mask=row_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
            if IEEE:  # float32 features: no TF32 rounding of the products
                acc += tl.dot(w, bt, input_precision="ieee")
            else:
                acc += tl.dot(w, bt)
        return acc

    @triton.jit
    def _bias_argmax_kernel(
        base_ptr, w_ptr, b_ptr, rows_ptr, best_ptr, first_ptr, R, V, K, stride_base, stride_w, stride_b,
        GATHER: tl.constexpr, IEEE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        chunk = tl.program_id(0)
        cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)  # vocabulary entries: the tile's rows
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # b's rows: the tile's columns
        col_ok, row_ok = cols < V, rows < R
        b_rows = tl.load(rows_ptr + rows, mask=row_ok, other=0) if GATHER else rows  # features' rows
        acc = _bias_tile(w_ptr, b_ptr, cols, b_rows, col_ok, row_ok, K, stride_w, stride_b,
                         IEEE, BLOCK_V, BLOCK_R, BLOCK_K)  # fmt: skip
        bias = acc.to(b_ptr.dtype.element_ty).to(tl.float32)  # the reference GEMM's output rounding
        both = col_ok[:, None] & row_ok[None, :]
        z = tl.load(base_ptr + rows[None, :] * stride_base + cols[:, None], mask=both, other=0.0)
        z = tl.where(col_ok[:, None], z.to(tl.float32) + bias, float("-inf"))
        best = tl.max(z, axis=0)
        first = tl.min(tl.where(z == best[None, :], cols[:, None], V), axis=0)
        chunks = tl.num_programs(0)
        tl.store(best_ptr + rows * chunks + chunk, best, mask=row_ok)
        tl.store(first_ptr + rows * chunks + chunk, first, mask=row_ok)

    @triton.jit
    def _first_chunk_kernel(best_ptr, first_ptr, out_ptr, C, BLOCK_C: tl.constexpr):
        """One row: the first chunk holding its max, and that chunk's first index: the row's token."""
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        best = tl.load(best_ptr + r * C + c, mask=c < C, other=float("-inf"))
        top = tl.max(best, axis=0)
        chunk = tl.min(tl.where((best == top) & (c < C), c, C), axis=0)
        tl.store(out_ptr + r, tl.load(first_ptr + r * C + chunk).to(tl.int64))
