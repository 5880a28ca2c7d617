"""Fused sampling step of a sequential drafter head.

    probs  = softmax((base + bias) / T)     (float32; one-hot at argmax when T == 0)
    tokens = inverse-CDF draw with uniforms u: the first index where cumsum(p) > u·total
             (total = the cumsum's last element), clamped to the last index with nonzero mass

This is the convention of ``dspark.decoding.verify.sample_from``; ``sample_from_reference``
below restates it so the kernels never import decoding code (decoding may import kernels).
Greedy ties break to the lowest index, like ``torch.argmax``.

Two Triton paths. With many rows, one program per row streams the row three times (the grid
fills the GPU). With few rows that leaves most SMs idle, so each row's vocabulary is cut into C
chunks handled by C programs (grid R x C, three launches): per-chunk statistics, then p and each
chunk's mass, then one program per row finds the chunk holding u·total and searches it.
``choose_chunks`` picks C (the default); ``chunks=1`` forces the single-program kernel.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, tl, triton, triton_interpreting

__all__ = ["SampleStep", "choose_chunks", "sample_from_reference", "sample_step_reference", "sample_step"]

BLOCK = 4096  # columns per piece on the GPU (the interpreter uses 128)
# Programs the split path aims for: about one per SM (H200: 132).
SM_TARGET = 128
# Up to this many rows the split path keeps at least two chunks a row even where one program per
# row fills the GPU: on the H200 (SmolLM2's 49 152 columns, seven positions) two chunks took
# 0.454 ms against 0.588 for the single-program kernel at 256 rows (engine_sps --draft-parts, three
# sessions alike). Wider batches are unmeasured and keep one program per row.
TWO_CHUNKS_MAX_ROWS = 256


class SampleStep(NamedTuple):
    tokens: Tensor  # [R] int64
    probs: Tensor  # [R, V] float32, the exact distribution the token was drawn from


def sample_from_reference(dist: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw from non-negative, possibly unnormalised rows ``dist [R, V]``.

    The total is the cumsum's own last element, so the threshold is consistent with the cdf it
    is compared against; an all-zero row returns V - 1 (callers must not pass one).
    """
    cdf = torch.cumsum(dist.float(), dim=-1)
    threshold = u.float() * cdf[:, -1]
    # cdf is non-decreasing, so counting entries <= threshold gives the first index above it.
    idx = (cdf <= threshold[:, None]).sum(-1)
    positions = torch.arange(dist.shape[-1], device=dist.device)
    last = torch.where(dist > 0, positions, -1).amax(-1)
    last = torch.where(last < 0, dist.shape[-1] - 1, last)
    return torch.minimum(idx, last)


def _combined_logits(base_logits: Tensor, bias: Tensor | None) -> Tensor:
    z = base_logits.float()
    return z if bias is None else z + bias.float()


def sample_step_reference(
    base_logits: Tensor, bias: Tensor | None, temperature: float, u: Tensor
) -> SampleStep:
    """PyTorch reference: float32 logits (base and bias are each upcast before adding)."""
    z = _combined_logits(base_logits, bias)
    if temperature == 0:
        tokens = z.argmax(-1)
        probs = torch.zeros_like(z)
        probs.scatter_(1, tokens[:, None], 1.0)
        return SampleStep(tokens, probs)
    probs = torch.softmax(z / temperature, dim=-1)
    return SampleStep(sample_from_reference(probs, u), probs)


if HAS_TRITON:

    @triton.jit
    def _load_logits(base_ptr, bias_ptr, r, offs, V, stride_base, stride_bias, HAS_BIAS: tl.constexpr):
        ok = offs < V
        z = tl.load(base_ptr + r * stride_base + offs, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + r * stride_bias + offs, mask=ok, other=0.0).to(tl.float32)
        return z

    @triton.jit
    def _span_argmax(base_ptr, bias_ptr, r, start, V: tl.constexpr, SPAN: tl.constexpr, stride_base,
                     stride_bias, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Max and lowest argmax of z over [start, start + SPAN) ∩ [0, V), BLOCK-wide pieces."""
        lane = tl.arange(0, BLOCK)
        best = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
        best_i = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) + start
        for v0 in range(0, SPAN, BLOCK):
            z = _load_logits(base_ptr, bias_ptr, r, start + v0 + lane, V, stride_base, stride_bias, HAS_BIAS)
            m = tl.max(z, axis=0)
            i = tl.argmax(z, axis=0).to(tl.int64) + start + v0
            take = m > best  # strict: earlier pieces win ties, like torch.argmax
            best_i = tl.where(take, i, best_i)
            best = tl.where(take, m, best)
        return best, best_i

    @triton.jit
    def _span_max_sumexp(base_ptr, bias_ptr, r, start, V: tl.constexpr, SPAN: tl.constexpr, stride_base,
                         stride_bias, temperature, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Online max m and sum of exp(z / T - m) over [start, start + SPAN) ∩ [0, V)."""
        lane = tl.arange(0, BLOCK)
        m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        for v0 in range(0, SPAN, BLOCK):
            y = (
                _load_logits(base_ptr, bias_ptr, r, start + v0 + lane, V, stride_base, stride_bias, HAS_BIAS)
                / temperature
            )
            m_new = tl.maximum(m, tl.max(y, axis=0))
            # Guard -inf - -inf (all-masked pieces) which would give NaN.
            scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            s = s * scale + tl.sum(tl.where(y == float("-inf"), 0.0, tl.exp(y - m_new)), axis=0)
            m = m_new
        return m, s

    @triton.jit
    def _sample_step_kernel(
        base_ptr,
        bias_ptr,
        u_ptr,
        tokens_ptr,
        probs_ptr,
        V: tl.constexpr,
        stride_base,
        stride_bias,
        stride_u,
        stride_probs,
        temperature,
        HAS_BIAS: tl.constexpr,
        GREEDY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per row; every pass streams the row in BLOCK-wide pieces. V is constexpr:
        # fixed per model, and runtime loop bounds break the triton 3.6 interpreter (numpy 2.4).
        r = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BLOCK)
        out_row = probs_ptr + r * stride_probs
        if GREEDY:
            _, best_i = _span_argmax(
                base_ptr, bias_ptr, r, 0, V, V, stride_base, stride_bias, HAS_BIAS, BLOCK
            )
            for v0 in range(0, V, BLOCK):
                offs = v0 + lane
                tl.store(out_row + offs, (offs == best_i).to(tl.float32), mask=offs < V)
            tl.store(tokens_ptr + r, best_i)
        else:
            # Pass 1: online max / sum-exp of z / T.
            m, s = _span_max_sumexp(
                base_ptr, bias_ptr, r, 0, V, V, stride_base, stride_bias, temperature, HAS_BIAS, BLOCK
            )
            # Pass 2: write p; the sampling total is the cdf's last element, built by the same
            # blockwise scan that pass 3 repeats, so threshold and cdf agree exactly.
            carry = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
            last = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) - 1
            for v0 in range(0, V, BLOCK):
                offs = v0 + lane
                y = (
                    _load_logits(base_ptr, bias_ptr, r, offs, V, stride_base, stride_bias, HAS_BIAS)
                    / temperature
                )
                p = tl.where(offs < V, tl.exp(y - m) / s, 0.0)
                tl.store(out_row + offs, p, mask=offs < V)
                carry = tl.max(carry + tl.cumsum(p, axis=0), axis=0)  # non-decreasing: max = end
                last = tl.maximum(last, tl.max(tl.where(p > 0, offs, -1), axis=0).to(tl.int64))
            last = tl.where(last < 0, V - 1, last)
            # Pass 3: recompute p (bit-identical, no read-after-write hazard) and search the cdf.
            threshold = tl.load(u_ptr + r * stride_u).to(tl.float32) * carry
            carry = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
            first = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) + V
            for v0 in range(0, V, BLOCK):
                offs = v0 + lane
                y = (
                    _load_logits(base_ptr, bias_ptr, r, offs, V, stride_base, stride_bias, HAS_BIAS)
                    / temperature
                )
                p = tl.where(offs < V, tl.exp(y - m) / s, 0.0)
                cdf = carry + tl.cumsum(p, axis=0)
                first = tl.minimum(first, tl.min(tl.where(cdf > threshold, offs, V), axis=0).to(tl.int64))
                carry = tl.max(cdf, axis=0)
            tl.store(tokens_ptr + r, tl.minimum(first, last))

    # Split-V path: chunk c of row r covers [c·CHUNK, (c + 1)·CHUNK) ∩ [0, V), CHUNK a multiple of
    # BLOCK, so every loop below has constexpr bounds. Small [R, CHUNKS] arrays carry the chunk
    # statistics between launches (a launch boundary orders one phase's writes before the next).

    @triton.jit
    def _split_stats_kernel(
        base_ptr,
        bias_ptr,
        m_ptr,
        s_ptr,
        arg_ptr,
        V: tl.constexpr,
        stride_base,
        stride_bias,
        temperature,
        HAS_BIAS: tl.constexpr,
        GREEDY: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        CHUNKS: tl.constexpr,
    ):
        # Phase 1: the chunk's max and sum-exp of z / T relative to it (greedy: max and argmax).
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        start = c * CHUNK
        at = r * CHUNKS + c
        if GREEDY:
            best, best_i = _span_argmax(
                base_ptr, bias_ptr, r, start, V, CHUNK, stride_base, stride_bias, HAS_BIAS, BLOCK
            )
            tl.store(m_ptr + at, best)
            tl.store(arg_ptr + at, best_i)
        else:
            m, s = _span_max_sumexp(
                base_ptr, bias_ptr, r, start, V, CHUNK, stride_base, stride_bias, temperature, HAS_BIAS, BLOCK
            )
            tl.store(m_ptr + at, m)
            tl.store(s_ptr + at, s)

    @triton.jit
    def _split_write_kernel(
        base_ptr,
        bias_ptr,
        m_ptr,
        s_ptr,
        arg_ptr,
        mass_ptr,
        tokens_ptr,
        probs_ptr,
        V: tl.constexpr,
        stride_base,
        stride_bias,
        stride_probs,
        temperature,
        HAS_BIAS: tl.constexpr,
        GREEDY: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        CHUNKS: tl.constexpr,
        CHUNKS_P2: tl.constexpr,
    ):
        # Phase 2: every program combines its row's chunk statistics (the same loads and the same
        # reductions in every program, so all chunks of a row use bit-identical max and sum) and
        # writes p over its chunk; sampling also stores the chunk's mass.
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        start = c * CHUNK
        lane = tl.arange(0, BLOCK)
        ci = tl.arange(0, CHUNKS_P2)
        cok = ci < CHUNKS
        cm = tl.load(m_ptr + r * CHUNKS + ci, mask=cok, other=float("-inf"))
        out_row = probs_ptr + r * stride_probs
        if GREEDY:
            carg = tl.load(arg_ptr + r * CHUNKS + ci, mask=cok, other=V)
            best = tl.max(cm, axis=0)
            # Each chunk's argmax is its lowest maximal index, so the lowest among the tied chunks
            # is the row's lowest: torch.argmax's tie break.
            token = tl.min(tl.where(cok & (cm == best), carg, V), axis=0)
            for v0 in range(0, CHUNK, BLOCK):
                offs = start + v0 + lane
                tl.store(out_row + offs, (offs == token).to(tl.float32), mask=offs < V)
            tl.store(tokens_ptr + r, token, mask=c == 0)
        else:
            cs = tl.load(s_ptr + r * CHUNKS + ci, mask=cok, other=0.0)
            m = tl.max(cm, axis=0)
            s = tl.sum(tl.where(cm == float("-inf"), 0.0, cs * tl.exp(cm - m)), axis=0)
            mass = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
            for v0 in range(0, CHUNK, BLOCK):
                offs = start + v0 + lane
                y = (
                    _load_logits(base_ptr, bias_ptr, r, offs, V, stride_base, stride_bias, HAS_BIAS)
                    / temperature
                )
                p = tl.where(offs < V, tl.exp(y - m) / s, 0.0)
                tl.store(out_row + offs, p, mask=offs < V)
                # The same blockwise running cdf, from 0 at the chunk's start, as phase 3's search.
                mass = tl.max(mass + tl.cumsum(p, axis=0), axis=0)
            tl.store(mass_ptr + r * CHUNKS + c, mass)

    @triton.jit
    def _split_search_kernel(
        u_ptr,
        mass_ptr,
        tokens_ptr,
        probs_ptr,
        stride_u,
        stride_probs,
        V: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        CHUNKS: tl.constexpr,
        CHUNKS_P2: tl.constexpr,
    ):
        # Phase 3, one program per row. Consistency of threshold and cdf: the row's cdf is
        # defined as incl[k-1] + local_k, incl being the inclusive cumsum of the chunk masses
        # (computed once, here) and local_k chunk k's running cdf from 0. The total is incl's last
        # element, the chunk is the first whose incl exceeds u·total, so the threshold and the
        # chunk choice come from the same numbers. Inside the chunk the search reads back the
        # returned p (not a recomputation, so the draw is from exactly the p returned) and runs
        # phase 2's scan, whose end is the chunk's mass. The one rounding step left, t - incl[k-1],
        # can put the local threshold at or past the chunk's end when u·total sits within an ulp
        # of incl[k]; the clamp to the chunk's last nonzero p then answers, which is also the
        # reference's clamp when k is the last chunk with mass.
        r = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BLOCK)
        ci = tl.arange(0, CHUNKS_P2)
        cok = ci < CHUNKS
        cmass = tl.load(mass_ptr + r * CHUNKS + ci, mask=cok, other=0.0)
        incl = tl.cumsum(cmass, axis=0)
        total = tl.sum(tl.where(ci == CHUNKS - 1, incl, 0.0), axis=0)  # picking by mask is exact
        threshold = tl.load(u_ptr + r * stride_u).to(tl.float32) * total
        k = tl.min(tl.where(cok & (incl > threshold), ci, CHUNKS), axis=0)
        last_c = tl.max(tl.where(cok & (cmass > 0), ci, -1), axis=0)
        k = tl.minimum(k, tl.where(last_c < 0, CHUNKS - 1, last_c))  # u·total at or past the end
        local = threshold - tl.sum(tl.where(ci == k - 1, incl, 0.0), axis=0)
        start = k.to(tl.int64) * CHUNK
        row = probs_ptr + r * stride_probs
        carry = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        first = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) + V
        last = tl.min(tl.zeros((BLOCK,), tl.int64), axis=0) - 1
        for v0 in range(0, CHUNK, BLOCK):
            offs = start + v0 + lane
            p = tl.load(row + offs, mask=offs < V, other=0.0)
            cdf = carry + tl.cumsum(p, axis=0)
            # p > 0: a scan's rounding can never hand the draw a zero-probability token.
            hit = (cdf > local) & (p > 0)
            first = tl.minimum(first, tl.min(tl.where(hit, offs, V), axis=0).to(tl.int64))
            last = tl.maximum(last, tl.max(tl.where(p > 0, offs, -1), axis=0).to(tl.int64))
            carry = tl.max(cdf, axis=0)
        last = tl.where(last < 0, V - 1, last)  # no mass anywhere (NaN rows): V - 1, as the reference
        tl.store(tokens_ptr + r, tl.minimum(first, last))


def _chunk_layout(chunks: int, vocab: int, block: int) -> tuple[int, int]:
    """(C, CHUNK): at most ``chunks`` chunks of whole blocks, none of them empty."""
    blocks = math.ceil(vocab / block)
    per = math.ceil(blocks / max(1, min(chunks, blocks)))
    return math.ceil(blocks / per), per * block


def choose_chunks(rows: int, vocab: int, block: int = BLOCK) -> int:
    """Chunks per row of the split path for ``rows`` rows: enough programs for ~SM_TARGET in all,
    at least two up to TWO_CHUNKS_MAX_ROWS rows, each at least one block wide; 1 (the
    single-program kernel) beyond."""
    floor = 2 if rows <= TWO_CHUNKS_MAX_ROWS else 1
    want = max(1, min(vocab // block, max(floor, SM_TARGET // max(1, rows))))
    return _chunk_layout(want, vocab, block)[0]


def _sample_step_split(base, bias, temperature, u, chunks: int, block: int, probs: Tensor) -> SampleStep:
    r, v = base.shape
    chunks, chunk = _chunk_layout(chunks, v, block)
    device = base.device
    tokens = torch.empty(r, device=device, dtype=torch.int64)
    stats = torch.empty((3, r, chunks), device=device, dtype=torch.float32)  # max, sum-exp, mass
    arg = torch.empty((r, chunks), device=device, dtype=torch.int64)  # greedy: chunk argmax
    bias_arg = base if bias is None else bias
    stride_bias = 0 if bias is None else bias.stride(0)
    greedy = temperature == 0
    shape = {"BLOCK": block, "CHUNK": chunk, "CHUNKS": chunks}
    common = (v, base.stride(0), stride_bias)
    flags = {"HAS_BIAS": bias is not None, "GREEDY": greedy}
    _split_stats_kernel[(r, chunks)](
        base, bias_arg, stats[0], stats[1], arg, *common, float(temperature), **flags, **shape
    )  # fmt: skip
    _split_write_kernel[(r, chunks)](
        base, bias_arg, stats[0], stats[1], arg, stats[2], tokens, probs, *common, probs.stride(0),
        float(temperature), **flags, **shape, CHUNKS_P2=triton.next_power_of_2(chunks),
    )  # fmt: skip
    if not greedy:
        u = u.float()  # a strided u (a column of [R, γ]) is read in place
        _split_search_kernel[(r,)](
            u, stats[2], tokens, probs, u.stride(0), probs.stride(0), v, **shape,
            CHUNKS_P2=triton.next_power_of_2(chunks),
        )  # fmt: skip
    return SampleStep(tokens, probs)


def _sample_step_triton(base_logits, bias, temperature, u, chunks: int | None, out: Tensor | None):
    r, v = base_logits.shape
    base = base_logits if base_logits.stride(-1) == 1 else base_logits.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    block = 128 if triton_interpreting() else min(BLOCK, triton.next_power_of_2(v))
    chunks = choose_chunks(r, v, block) if chunks is None else _chunk_layout(chunks, v, block)[0]
    probs = torch.empty((r, v), device=base.device, dtype=torch.float32) if out is None else out
    if chunks > 1:
        return _sample_step_split(base, bias, temperature, u, chunks, block, probs)
    tokens = torch.empty(r, device=base.device, dtype=torch.int64)
    u = u.float()
    _sample_step_kernel[(r,)](
        base,
        base if bias is None else bias,
        u,
        tokens,
        probs,
        v,
        base.stride(0),
        0 if bias is None else bias.stride(0),
        u.stride(0),
        probs.stride(0),
        float(temperature),
        HAS_BIAS=bias is not None,
        GREEDY=temperature == 0,
        BLOCK=block,
    )
    return SampleStep(tokens, probs)


def sample_step(
    base_logits: Tensor,
    bias: Tensor | None,
    temperature: float,
    u: Tensor,
    *,
    impl: str = "auto",
    chunks: int | None = None,
    out: Tensor | None = None,
) -> SampleStep:
    """Sample one token per row from softmax((base + bias) / T); see the module docstring.

    ``out``: float32 [R, V] (unit column stride, any row stride, e.g. one position of a [R, γ, V]
    proposal) that receives the probabilities in place of a new tensor, and is returned.

    ``chunks`` (Triton only): programs per row; None (the default) lets ``choose_chunks`` split the
    vocabulary when rows are few (one program streaming 49 152 logits took ~75 µs per drafted
    position at R = 1 on the H200), 1 forces the single-program kernel, C > 1 forces C. The PyTorch
    path ignores it."""
    if base_logits.dim() != 2:
        raise ValueError(f"base_logits must be [R, V], got {tuple(base_logits.shape)}")
    if bias is not None and bias.shape != base_logits.shape:
        raise ValueError(f"bias {tuple(bias.shape)} does not match base_logits {tuple(base_logits.shape)}")
    if u.shape != base_logits.shape[:1]:
        raise ValueError(f"u must be [R]={base_logits.shape[0]}, got {tuple(u.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be None or an int >= 1, got {chunks!r}")
    if out is not None and (
        out.shape != base_logits.shape or out.dtype != torch.float32 or out.stride(-1) != 1
    ):
        raise ValueError(
            f"out must be float32 {tuple(base_logits.shape)} with unit column stride, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    tensors = (base_logits, u) if bias is None else (base_logits, bias, u)
    if resolve_impl(impl, *tensors) == "triton":
        return _sample_step_triton(base_logits, bias, temperature, u, chunks, out)
    step = sample_step_reference(base_logits, bias, temperature, u)
    return step if out is None else SampleStep(step.tokens, out.copy_(step.probs))
