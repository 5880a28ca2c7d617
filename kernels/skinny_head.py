"""The LM head of a decode step: logits [M, V] = x [M, K] @ W [V, K]^T for a few rows M.

At one request a step's LM head is a skinny GEMM that reads the whole head for a handful of rows
(SmolLM2-135M: 49 152 x 576 in bf16, 57 MB), so its floor is those bytes: ~12 µs at the H200's
4.8 TB/s. In the kernel table of the draft step at one row (engine_sps, 2026-12-03) the library's
GEMM for the block's 7 rows took 75.8 µs, a fifth of the step. Here each program streams BLOCK_V rows
of W in BLOCK_K steps against all rows of x (at most MAX_ROWS, one tile), accumulating in float32,
and writes the logits in x's dtype, as the library does.

``head_logits`` (impl "auto") runs it on CUDA for at most MAX_ROWS rows where its once-per-device
check found it right *and faster* than the library at that head's shape; ``F.linear`` otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.timing import median_ms
from ._common import HAS_TRITON, resolve_impl, self_check, tl, triton

__all__ = ["MAX_ROWS", "head_logits", "head_logits_reference", "skinny_head_self_check"]

BLOCK_V = 128  # head rows (vocabulary entries) per program
BLOCK_K = 64  # the hidden size, in steps
MAX_ROWS = 16  # rows of x: one tile (tl.dot's smallest)
FASTER = 0.95  # the kernel runs only where it took at most this share of the library's time


def head_logits_reference(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., K] @ weight [V, K]^T -> [..., V] in x's dtype: the library's GEMM (an ``nn.Linear``
    without bias)."""
    return F.linear(x, weight)


def head_logits(x: Tensor, weight: Tensor, impl: str = "auto") -> Tensor:
    """``head_logits_reference`` through the kernel where ``impl`` resolves to Triton and x has at
    most MAX_ROWS rows (under "auto": where ``skinny_head_self_check`` passed on this device)."""
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype:
        given = f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        raise ValueError(f"head_logits: {given} do not fit (x [..., K], weight [V, K], one dtype)")
    rows = x.numel() // k if k else 0
    if rows == 0 or rows > MAX_ROWS or resolve_impl(impl, x, weight) == "torch":
        return head_logits_reference(x, weight)
    if impl == "auto" and not skinny_head_self_check(x.device, x.dtype, tuple(weight.shape)):
        return head_logits_reference(x, weight)
    return _head_logits_triton(x.reshape(rows, k), weight).view(*x.shape[:-1], weight.shape[0])


def skinny_head_self_check(device: torch.device, dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """Whether the kernel serves a head of ``shape`` here (``self_check``, once per process): 8 rows
    against the library's GEMM, the same logits to the output's rounding; on CUDA also faster than
    it (the median of 20 timed calls each), since the library's kernel choice is what it replaces."""

    def check() -> tuple[bool, str]:
        g = torch.Generator(device=device).manual_seed(0)
        weight = (0.05 * torch.randn(*shape, device=device, generator=g)).to(dtype)
        x = torch.randn(8, shape[1], device=device, generator=g).to(dtype)
        got, want = _head_logits_triton(x, weight).float(), head_logits_reference(x, weight).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            return False, "its logits differ from the library's GEMM"
        if device.type != "cuda":
            return True, ""
        mine = median_ms(lambda: _head_logits_triton(x, weight), device, warmup=3, repeats=20)
        theirs = median_ms(lambda: head_logits_reference(x, weight), device, warmup=3, repeats=20)
        return mine <= FASTER * theirs, f"{mine * 1e3:.1f} µs against the library's {theirs * 1e3:.1f} µs"

    return self_check("skinny_head", (str(device), dtype, tuple(shape)), check, "the library's GEMM")


def _head_logits_triton(x: Tensor, weight: Tensor) -> Tensor:
    (m, k), v = x.shape, weight.shape[0]
    x, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight))
    out = torch.empty(m, v, device=x.device, dtype=x.dtype)
    _skinny_head_kernel[(triton.cdiv(v, BLOCK_V),)](
        x, weight, out, m, v, k, x.stride(0), weight.stride(0), out.stride(0),
        IEEE=x.dtype == torch.float32, BLOCK_V=BLOCK_V, BLOCK_M=MAX_ROWS, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


if HAS_TRITON:

    @triton.jit
    def head_tile(
        w_ptr, x_ptr, cols, x_rows, col_ok, row_ok, K, stride_w, stride_x,
        IEEE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """[BLOCK_V, BLOCK_M] float32: the head's rows ``cols`` times x's rows ``x_rows`` (row
        indices, so a caller may gather them), over K in BLOCK_K steps (also ``bias_argmax``'s GEMM)."""
        acc = tl.zeros((BLOCK_V, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            w_at = w_ptr + cols[:, None] * stride_w + kk[None, :]
            w = tl.load(w_at, mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_V, BLOCK_K]
            x_at = x_ptr + x_rows[None, :] * stride_x + kk[:, None]
            xt = tl.load(x_at, mask=row_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_M]
            if IEEE:  # float32 rows: no TF32 rounding of the products
                acc += tl.dot(w, xt, input_precision="ieee")
            else:
                acc += tl.dot(w, xt)
        return acc

    @triton.jit
    def _skinny_head_kernel(
        x_ptr, w_ptr, out_ptr, M, V, K, stride_x, stride_w, stride_out,
        IEEE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)  # head rows: the tile's rows
        rows = tl.arange(0, BLOCK_M)  # x's rows: the tile's columns
        col_ok, row_ok = cols < V, rows < M
        acc = head_tile(w_ptr, x_ptr, cols, rows, col_ok, row_ok, K, stride_w, stride_x,
                        IEEE, BLOCK_V, BLOCK_M, BLOCK_K)  # fmt: skip
        at = out_ptr + rows[None, :] * stride_out + cols[:, None]
        tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])
