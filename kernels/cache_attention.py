"""Attention of a few new tokens per row over a static KV cache (decode, verify and draft steps).

    out[r, w, h] = softmax_s(q[r, w, h] · k[row0 + r, h // G, s] · scale) · v[row0 + r, h // G, s]
                   over the slots s <= positions[r, w]  (and s > positions[r, w] - window)
                   and, with ``tail``, the slots tail..tail+W-1 (every query of the row sees all W)

The target's cache holds each row's tokens at slot == position (``decoding.static_target``), so
the mask is a function of the query's position alone. The drafter's cache holds the context at
slot == position and its block's W keys apart, in the room at ``tail`` (``DraftCache.block_slots``),
and a block's queries see the context and the whole block (bidirectional): it passes its context
length - 1 as every query's position, and ``tail``. ``cache_attention_reference`` builds that mask
and runs SDPA over the whole capacity with the G query heads of each KV head folded into the query
axis (each key read once). The Triton kernel computes the same without a mask tensor: one program
per (row, KV head, tile of its G·W queries) reads keys only up to the row's last query position,
so it never touches the capacity past the live context (at R = 256 most of it), and it reads the
queries and writes the output in the [R, W, H, hd] layout the projections use: no transposed copy
on either side, and one launch where SDPA took five (mask conversion, fills, workspace, kernel).

Split context ("flash-decoding"). At few rows that grid is a handful of programs (R = 1 on
SmolLM2: 3, one per KV head, on a 132-SM GPU), each walking its row's whole context on one SM:
latency-bound. With S > 1 splits each program takes one of S chunks of its row's live key range
(ceil(len / S) rounded up to whole key tiles, found on the device from the row's positions, so a
captured graph serves any context length; a chunk past the live context is empty and writes the
neutral partial m = -inf, l = 0), writes its partial softmax (running max m, sum of exponentials
l, unnormalised accumulator) to float32 scratch, and a second kernel merges the S partials of
each query (log-sum-exp) into the output, same layout. ``choose_splits`` picks S from shapes alone
(rows, width, heads, capacity, the device's SMs): 1, today's single launch without scratch, while
the unsplit grid fills the SMs, else enough splits for one to two programs an SM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import HAS_TRITON, resolve_impl, self_check, tl, triton

__all__ = [
    "cache_attention",
    "cache_attention_reference",
    "choose_splits",
    "device_sms",
    "fold_mask",
    "folded_mask",
    "max_splits",
    "kernel_self_check",
    "triton_fits",
]


def _check(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, row0: int, tail: int | None = None
) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"need q [R, W, H, hd] and caches [rows, Hkv, C, hd] alike, got q {tuple(q.shape)}, "
            f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    r, w, h, hd = q.shape
    rows, hkv, _, chd = k_cache.shape
    if chd != hd or h % hkv:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (head_dim, heads % kv heads)"
        )
    if positions.shape != (r, w):
        raise ValueError(f"positions must be [R, W] = {(r, w)}, got {tuple(positions.shape)}")
    if not 0 <= row0 <= rows - r:
        raise ValueError(f"rows {row0}..{row0 + r - 1} are outside the cache's {rows} rows")
    cap = k_cache.shape[2]
    if tail is not None and not 0 <= tail <= cap - w:
        raise ValueError(f"tail slots {tail}..{tail + w - 1} are outside the cache's {cap} slots")


def fold_mask(mask: Tensor, groups: int) -> Tensor:
    """A bool mask [B, Q, K] for grouped-query attention with the G query heads of each KV head
    folded into the query axis (query (b, head, t) is row (b, kv head, g·Q + t)): [B, 1, G·Q, K]."""
    b, t, k = mask.shape
    return mask[:, None, None].expand(b, 1, groups, t, k).reshape(b, 1, groups * t, k)


def folded_mask(
    positions: Tensor, capacity: int, groups: int, window: int | None = None, tail: int | None = None
) -> Tensor:
    """The slots each query may read, [R, 1, G·W, C], folded as the reference folds its queries
    (``fold_mask``). A step builds it once for all layers."""
    slots = torch.arange(capacity, device=positions.device)
    visible = slots[None, None, :] <= positions[:, :, None]  # [R, W, C]
    if window is not None:
        visible = visible & (slots[None, None, :] > positions[:, :, None] - window)
    if tail is not None:
        visible = visible | ((slots >= tail) & (slots < tail + positions.shape[1]))
    return fold_mask(visible, groups)


def cache_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    *,
    scale: float,
    row0: int = 0,
    window: int | None = None,
    mask: Tensor | None = None,
    tail: int | None = None,
) -> Tensor:
    """The rule in the module docstring with a materialised mask (``folded_mask``; pass it when
    several layers share it) and SDPA over the whole capacity."""
    _check(q, k_cache, v_cache, positions, row0, tail)
    r, w, h, hd = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    groups = h // hkv
    if mask is None:
        mask = folded_mask(positions, cap, groups, window, tail)
    qf = q.transpose(1, 2).reshape(r, hkv, groups * w, hd)
    rows = slice(row0, row0 + r)
    out = F.scaled_dot_product_attention(qf, k_cache[rows], v_cache[rows], attn_mask=mask, scale=scale)
    return out.reshape(r, h, w, hd).transpose(1, 2).contiguous()


if HAS_TRITON:

    @triton.jit
    def _attend_tile(q, k_ptr, v_ptr, at, in_range, seen, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
        """One tile of keys into the online softmax (m_i, l_i, acc): only the slots ``in_range``
        are loaded, only the ``seen`` ones weigh."""
        k = tl.load(k_ptr + at, mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptr + at, mask=in_range[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with nothing seen yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _cache_attention_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
        row0, W, S, scale, window, tail,
        stride_qr, stride_qw, stride_qh,
        stride_kr, stride_kh, stride_kc,
        stride_pr,
        stride_or, stride_ow, stride_oh,
        G: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SLIDING: tl.constexpr, TAIL: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)  # row offsets of a large cache pass 2^31 elements
        kvh = tl.program_id(1).to(tl.int64)
        tile, split = tl.program_id(2), 0
        if SPLIT:  # axis 2 is (query tile, split)
            tile, split = tl.program_id(2) // S, tl.program_id(2) % S
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query m = (w, g): w = m // G
        w = m // G
        head = kvh * G + m % G
        live = w < W
        pos = tl.load(pos_ptr + r * stride_pr + w, mask=live, other=0)
        d = tl.arange(0, HD)
        q = tl.load(
            q_ptr + r * stride_qr + w[:, None] * stride_qw + head[:, None] * stride_qh + d[None, :],
            mask=live[:, None], other=0.0,
        )  # fmt: skip
        # Positions ascend along W: the row's last query reads the most slots, its first the fewest.
        hi = tl.load(pos_ptr + r * stride_pr + W - 1) + 1
        lo = 0
        if SLIDING:  # slots below every query's window are never read
            lo = tl.maximum(tl.load(pos_ptr + r * stride_pr) - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        if SPLIT:  # this program's chunk of lo..hi-1, whole key tiles; past the live context: empty
            chunk = tl.cdiv(tl.cdiv(hi - lo, S), BLOCK_N) * BLOCK_N
            lo = lo + split * chunk
            hi = tl.minimum(lo + chunk, hi)
        kv_row = (row0 + r) * stride_kr + kvh * stride_kh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            in_range = n < hi
            seen = (n[None, :] <= pos[:, None]) & in_range[None, :]
            if SLIDING:
                seen = seen & (n[None, :] > pos[:, None] - window)
            at = kv_row + n[:, None] * stride_kc + d[None, :]
            m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, at, in_range, seen, m_i, l_i, acc, scale, PRECISION)
        if TAIL:  # the step's own W keys, apart in the room at `tail`: every query sees them all
            first = tail
            if SPLIT:  # the last split's alone (its chunk is the smallest)
                first = tail + W * (split != S - 1).to(tl.int32)
            for start in range(first, tail + W, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                in_range = n < tail + W
                at = kv_row + n[:, None] * stride_kc + d[None, :]
                m_i, l_i, acc = _attend_tile(
                    q, k_ptr, v_ptr, at, in_range, in_range[None, :], m_i, l_i, acc, scale, PRECISION
                )  # fmt: skip
        if SPLIT:  # the chunk's partial softmax, unnormalised: _combine_splits_kernel merges them
            part = ((r * tl.num_programs(1) + kvh) * S + split) * (G * W) + m
            tl.store(m_ptr + part, m_i, mask=live)
            tl.store(l_ptr + part, l_i, mask=live)
            tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=live[:, None])
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + r * stride_or + w[:, None] * stride_ow + head[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty), mask=live[:, None],
            )  # fmt: skip

    @triton.jit
    def _combine_splits_kernel(
        m_ptr, l_ptr, acc_ptr, out_ptr, W, S,
        stride_or, stride_ow, stride_oh,
        G: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """The S partials of each query merged (log-sum-exp: each rescaled to the largest max) into
        the normalised output. An empty chunk's partial (m = -inf, l = 0) weighs exp(-inf) = 0."""
        r = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        w = m // G
        head = kvh * G + m % G
        live = w < W
        d = tl.arange(0, HD)
        base = (r * tl.num_programs(1) + kvh) * S * (G * W) + m
        m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_all = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        for s in range(0, S):
            part = base + s * (G * W)
            m_s = tl.load(m_ptr + part, mask=live, other=float("-inf"))
            l_s = tl.load(l_ptr + part, mask=live, other=0.0)
            acc_s = tl.load(acc_ptr + part[:, None] * HD + d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m_all, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no -inf - -inf
            alpha, beta = tl.exp(m_all - m_safe), tl.exp(m_s - m_safe)
            l_all = l_all * alpha + l_s * beta
            acc = acc * alpha[:, None] + acc_s * beta[:, None]
            m_all = m_new
        out = acc / tl.where(l_all > 0, l_all, 1.0)[:, None]
        tl.store(
            out_ptr + r * stride_or + w[:, None] * stride_ow + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=live[:, None],
        )  # fmt: skip


def triton_fits(head_dim: int) -> bool:
    """Whether the Triton kernel takes this head size (a power of two, at least 16: ``tl.dot``)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _blocks(groups: int, width: int, head_dim: int) -> tuple[int, int]:
    """The kernel's query tile (G·W queries, a power of two in 16..64) and key tile."""
    block_m = min(max(16, 1 << (groups * width - 1).bit_length()), 64)
    return block_m, 64 if head_dim <= 128 else 32


def choose_splits(
    rows: int, width: int, heads: int, kv_heads: int, head_dim: int, capacity: int, sms: int,
    window: int | None = None,
) -> int:  # fmt: skip
    """The kernel's S for these shapes on a GPU of ``sms`` SMs (the module docstring's rule): 1
    while the unsplit grid's P = rows · kv_heads · query tiles programs fill the SMs (P >= sms),
    else S = min(ceil(sms / P), ceil(span / BLOCK_N)): P·S in [sms, sms + P), 1 to 2 programs an
    SM, and never more chunks than the key tiles a row can read (``max_splits``). Shapes only: a
    captured CUDA graph keeps its S whatever context lengths it is replayed with."""
    groups = heads // kv_heads
    block_m = _blocks(groups, width, head_dim)[0]
    programs = rows * kv_heads * -(-groups * width // block_m)
    if programs >= sms:
        return 1
    return max(1, min(-(-sms // programs), max_splits(capacity, width, head_dim, window)))


def max_splits(capacity: int, width: int, head_dim: int, window: int | None = None) -> int:
    """The most splits worth having: the key tiles a row can read (its capacity, or with a sliding
    ``window`` the window, the step's W and a tile of alignment)."""
    block_n = _blocks(1, width, head_dim)[1]
    span = capacity if window is None else min(capacity, window + width + block_n)
    return max(1, -(-span // block_n))


_SMS: dict[torch.device, int] = {}


def device_sms(device: torch.device) -> int:
    """The SM count of a CUDA device (``choose_splits``' sms), 0 elsewhere (nothing to fill)."""
    if device.type != "cuda":
        return 0
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def kernel_self_check(
    device: torch.device, dtype: torch.dtype, head_dim: int, groups: int, tail: bool = False
) -> bool:
    """Whether the kernel runs here (``self_check``): a small random case at these sizes
    (``tail``: with the drafter's rule), unsplit and split, against the reference; SDPA otherwise."""

    def check() -> tuple[bool, str]:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(2, 3, 2 * groups, head_dim, device=device, generator=g).to(dtype)
        k, v = (torch.randn(2, 2, 140, head_dim, device=device, generator=g).to(dtype) for _ in range(2))
        pos = torch.tensor([[5, 6, 7], [130, 131, 132]], device=device)
        room = None
        if tail:  # each row's context (6 and 131 slots), its block in the room at slots 137..139
            pos, room = pos[:, :1].expand(2, 3), 137
        ref = cache_attention_reference(q, k, v, pos, scale=head_dim**-0.5, tail=room)
        err = 0.0
        for splits in (1, 3):  # the single kernel; the split one (row 2: three chunks) and its merge
            got = cache_attention(q, k, v, pos, scale=head_dim**-0.5, tail=room, impl="triton", splits=splits)
            err = max(err, float((got.float() - ref.float()).norm() / ref.float().norm()))
        return err < 2e-2, f"relative error {err:.2e} against the reference"

    return self_check("cache_attention", (str(device), dtype, head_dim, groups, tail), check, "SDPA")


def _cache_attention_triton(q, k_cache, v_cache, positions, scale, row0, window, tail, splits) -> Tensor:
    r, w, h, hd = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    groups = h // hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    if splits is None:  # off CUDA (the interpreter) there are no SMs to fill: 1
        splits = choose_splits(r, w, h, hkv, hd, cap, device_sms(q.device), window)
    out = torch.empty((r, w, h, hd), device=q.device, dtype=q.dtype)
    block_m, block_n = _blocks(groups, w, hd)
    positions = positions if positions.stride(-1) == 1 else positions.contiguous()
    m_part = l_part = acc_part = out  # unused unless split
    if splits > 1:  # the partials of each (row, KV head, split, query), in float32
        m_part = torch.empty((r, hkv, splits, groups * w), device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((*m_part.shape, hd), device=q.device, dtype=torch.float32)
    tiles = triton.cdiv(groups * w, block_m)
    _cache_attention_kernel[(r, hkv, tiles * splits)](
        q, k_cache, v_cache, positions, out, m_part, l_part, acc_part,
        row0, w, splits, float(scale), int(window or 0), int(tail or 0),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        positions.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        G=groups, HD=hd, BLOCK_M=block_m, BLOCK_N=block_n, SLIDING=window is not None,
        TAIL=tail is not None, SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays float32 (no TF32)
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(r, hkv, tiles)](
            m_part, l_part, acc_part, out, w, splits, out.stride(0), out.stride(1), out.stride(2),
            G=groups, HD=hd, BLOCK_M=block_m,
        )  # fmt: skip
    return out


# The kernel as an operator of its own, so that a torch.compile(fullgraph=True) graph (the drafter's
# fused draft step) calls it as one opaque node instead of tracing into Triton. Defined once per
# process: this file also loads as top-level ``kernels.cache_attention`` (transformers imports any
# ``kernels`` package on the path to read its version), and a second definition would replace the
# first under the callers that hold it.
if HAS_TRITON and not hasattr(torch.ops.dspark, "cache_attention"):

    @torch.library.custom_op("dspark::cache_attention", mutates_args=())
    def _cache_attention_op(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        positions: Tensor,
        scale: float,
        row0: int,
        window: int | None,
        tail: int | None,
        splits: int | None,
    ) -> Tensor:
        return _cache_attention_triton(q, k_cache, v_cache, positions, scale, row0, window, tail, splits)

    @_cache_attention_op.register_fake
    def _(q, k_cache, v_cache, positions, scale, row0, window, tail, splits):
        return torch.empty(q.shape, device=q.device, dtype=q.dtype)


def cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    *,
    scale: float,
    row0: int = 0,
    window: int | None = None,
    mask: Tensor | None = None,
    tail: int | None = None,
    impl: str = "auto",
    splits: int | None = None,
) -> Tensor:
    """q [R, W, H, hd] of rows row0..row0+R-1 at ``positions`` [R, W] over caches
    [rows, Hkv, C, hd] that already hold these tokens' keys/values (at slot == position, or with
    ``tail`` at slots tail..tail+W-1); returns [R, W, H, hd] (the module docstring's rule). Inputs
    are trusted: positions must lie in 0..C-1 (-1..tail-1 with ``tail``: -1 sees no context) and
    ascend along W (a step's tokens are consecutive, a prefill's too). The Triton
    kernel needs a power-of-two head_dim >= 16 and last-dim-contiguous caches; otherwise, and off
    CUDA, the reference runs (``mask``: its ``folded_mask``, when the caller shares one across
    layers). ``splits``: the kernel's S (module docstring), None for ``choose_splits``' (1 off
    CUDA, under the interpreter: no SMs to fill); the reference ignores it."""
    _check(q, k_cache, v_cache, positions, row0, tail)
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be a positive int or None (choose_splits), got {splits!r}")
    hd = q.shape[-1]
    fits = triton_fits(hd) and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    backend = resolve_impl(impl, q, k_cache, v_cache, positions)
    if backend == "triton" and not fits and impl == "triton":
        raise ValueError(
            f"the Triton kernel needs a power-of-two head_dim >= 16 and caches alike with contiguous "
            f"rows, got head_dim {hd}, strides {k_cache.stride()} / {v_cache.stride()}: use impl='auto'"
        )
    if backend == "triton" and fits:
        return torch.ops.dspark.cache_attention(
            q, k_cache, v_cache, positions, float(scale), row0, window, tail, splits
        )
    return cache_attention_reference(
        q, k_cache, v_cache, positions, scale=scale, row0=row0, window=window, mask=mask, tail=tail
    )
