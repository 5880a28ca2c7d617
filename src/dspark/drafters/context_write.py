"""The static cache's context write as one compiled function (``BlockDrafter.compile_inference``).

The reference, ``BlockDrafter.write_context``'s eager loop, runs ``fc`` and ``hidden_norm``, then
per layer k_proj, k_norm op by op, v_proj, the RoPE tables from arange / pow / cos / sin, the
rotation, and two indexed stores: ~145 kernels per target step for a 5-layer drafter, inside the
target step's CUDA graph. Here (``write_layers``) every layer's keys and values come from one GEMM
against the layers' k/v projection weights concatenated ([2·L·Hkv·hd, d]), k_norm and the rotation
run on all layers at once (cos/sin gathered from a table the reference ``rope`` computed), and one
indexed store writes them into the cache's stacked buffer [2, L, R, Hkv, C, hd] (``empty_cache``):
a handful of kernels, the same numbers to rounding.

One graph for every shape: the entries are flattened to N = R·W, each with one slot index
row·C + position, and only N is dynamic. Dynamo specialises a size of 1, so a lone entry is
written twice (same values, same slot)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.types import DraftCache
from .derived import DerivedWeights
from .draft_step import inference_compiler, mark_dynamic
from .layers import matmul_input, rms_norm, rope, rotate

__all__ = ["ContextWriter", "stacked_kv", "write_layers"]


def stacked_kv(cache: DraftCache) -> Tensor | None:
    """The buffer [2, L, R, Hkv, C, hd] whose slices are ``cache``'s per-layer keys (``[0, l]``) and
    values (``[1, l]``), as ``empty_cache`` allocates them, as a view; None when they are not (a
    cache built otherwise, or grown by ``append_kv``, which replaces its tensors). Read from the
    storage, since views made under inference mode do not record their base."""
    if not cache.k or len(cache.v) != len(cache.k):
        return None
    first = cache.k[0]
    if not first.is_contiguous():
        return None
    n, layers = first.numel(), len(cache.k)
    storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
    for half, tensors in enumerate((cache.k, cache.v)):
        for i, t in enumerate(tensors):
            if (
                t.untyped_storage().data_ptr() != storage
                or t.shape != first.shape
                or t.stride() != first.stride()
                or t.dtype != first.dtype
                or t.storage_offset() != start + (half * layers + i) * n
            ):
                return None
    return first.as_strided((2, layers, *first.shape), (layers * n, n, *first.stride()), start)


def write_layers(
    kv: Tensor,
    taps: Tensor,
    slots: Tensor,
    fc_weight: Tensor,
    norm_weight: Tensor,
    kv_weight: Tensor,
    k_norm_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps_hidden: float,
    eps_k: float,
) -> None:
    """Every layer's context keys/values of ``taps`` [N, m·d] written in place into ``kv``
    [2, L, R, Hkv, C, hd] at ``slots`` [N] (row·C + position). ``kv_weight`` [2·L·Hkv·hd, d]: the
    layers' k_proj then v_proj weights, in layer order; ``k_norm_weight`` [L, hd]; ``cos``/``sin``
    [C, hd]: ``rope`` of positions 0..C-1. The reference's arithmetic, op for op
    (``BlockDrafter.context``, ``Attention.kv``), on all layers at once."""
    _, layers, _, heads, capacity, head_dim = kv.shape
    ctx = rms_norm(F.linear(matmul_input(taps, fc_weight), fc_weight), norm_weight, eps_hidden)
    new = F.linear(ctx, kv_weight).unflatten(-1, (2, layers, heads, head_dim))  # [N, 2, L, Hkv, hd]
    k = rms_norm(new[:, 0], k_norm_weight[:, None, :], eps_k)  # [N, L, Hkv, hd]
    rows, positions = slots // capacity, slots % capacity
    k = rotate(k, cos[positions][:, None, None].to(k.dtype), sin[positions][:, None, None].to(k.dtype))
    # Advanced indices around a slice: kv[:, :, rows, :, positions] is [N, 2, L, Hkv, hd].
    kv[:, :, rows, :, positions] = torch.stack([k, new[:, 1]], dim=1).to(kv.dtype)


class ContextWriter:
    """``write_context`` of a block drafter through ``write_layers``, wrapped by ``compiler``
    (``draft_step.inference_compiler`` by default; None runs it eagerly, for tests). Holds the
    concatenated weights (``DerivedWeights``: rebuilt when a parameter changes) and the RoPE table
    per capacity."""

    def __init__(self, drafter, compiler: Callable | None = inference_compiler):
        self.drafter = drafter
        attn = [layer.attn for layer in drafter.layers]
        eps = {a.k_norm.eps for a in attn}
        if len(eps) != 1 or len({(a.s.head_dim, a.s.rope_theta) for a in attn}) != 1:
            raise ValueError("the fused context write needs one k_norm eps, head_dim and rope_theta")
        self.eps_k = eps.pop()
        self.head_dim, self.theta = attn[0].s.head_dim, attn[0].s.rope_theta
        self.kv_weight = DerivedWeights(
            lambda: (
                [lay.attn.k_proj.weight for lay in drafter.layers]
                + [lay.attn.v_proj.weight for lay in drafter.layers]
            ),
            lambda *w: torch.cat(w),
        )
        self.k_norm_weight = DerivedWeights(
            lambda: [lay.attn.k_norm.weight for lay in drafter.layers], lambda *w: torch.stack(w)
        )
        self.compiled = compiler is not None
        self._write = write_layers if compiler is None else compiler(write_layers)
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}

    def rope_table(self, capacity: int, device) -> tuple[Tensor, Tensor]:
        """cos/sin [C, hd] (float32) of positions 0..C-1, from the reference ``rope``."""
        key = (capacity, torch.device(device))
        if key not in self._tables:
            self._tables[key] = rope(torch.arange(capacity, device=device), self.head_dim, self.theta)
        return self._tables[key]

    def write(self, cache: DraftCache, taps: Tensor, positions: Tensor, rows: Tensor) -> bool:
        """``write_context``'s contract; False (nothing written) when ``cache`` has no stacked buffer."""
        kv = stacked_kv(cache)
        if kv is None:
            return False
        r, w = positions.shape
        capacity = kv.shape[4]
        slots = torch.add(positions, rows[:, None], alpha=capacity).reshape(r * w)
        taps = taps.reshape(r * w, taps.shape[-1])
        if r * w == 1:  # a size of 1 would compile a graph of its own
            slots, taps = slots.repeat(2), taps.repeat(2, 1)
        if self.compiled:
            mark_dynamic(taps, 0)
            mark_dynamic(slots, 0)
        cos, sin = self.rope_table(capacity, taps.device)
        norm = self.drafter.hidden_norm
        weights = (self.drafter.fc.weight, norm.weight, self.kv_weight.get(), self.k_norm_weight.get())
        self._write(kv, taps, slots, *weights, cos, sin, norm.eps, self.eps_k)
        return True
