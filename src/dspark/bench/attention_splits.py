"""The cache-attention kernel alone, split against unsplit (``engine_sps --attention-splits``).

Per row count R and step width W, at the target's attention shapes (heads, KV heads, head size,
dtype) over a context of ``ctx`` slots per row: the single kernel (S = 1), the S that
``kernels.cache_attention.choose_splits`` picks on this GPU, and powers of two up to the capacity's
key tiles, each timed as replays of a captured CUDA graph (what a step pays for it inside its
graph: the split path's second launch included, no launch overhead). The measurement that checks
the rule: where it splits, its S should beat S = 1; where it does not, no S should.
"""

from __future__ import annotations

import torch

from ..decoding.graphs import GraphBank
from .common import median_ms

__all__ = ["attention_splits"]


def attention_splits(
    target, rows: list[int], widths: list[int], ctx: int, capacity: int, warmup: int, repeats: int
) -> list[dict]:
    """One row per (R, W): ``rule_splits``, ``ms`` per S timed (keys: S as text), ``unsplit_ms``
    and ``rule_ms``. CUDA only (the kernel runs nowhere else but under the interpreter): [] on the
    CPU."""
    from ..kernels.cache_attention import cache_attention, choose_splits, device_sms, max_splits

    device = target.device
    if device.type != "cuda":
        print("attention splits: the kernel needs CUDA; skipped", flush=True)
        return []
    h, hkv, hd, dtype = target.num_heads, target.num_kv_heads, target.head_dim, target.dtype
    most = max_splits(capacity, 1, hd)
    bank, out = GraphBank(device), []
    with torch.inference_mode():
        k = torch.randn(max(rows), hkv, capacity, hd, device=device, dtype=dtype)
        v = torch.randn_like(k)
        for r in rows:
            for w in widths:
                q = torch.randn(r, w, h, hd, device=device, dtype=dtype)
                pos = (ctx + torch.arange(w, device=device)).expand(r, w).contiguous()
                rule = choose_splits(r, w, h, hkv, hd, capacity, device_sms(device))
                ms = {}
                for s in sorted({1, rule, *(2**i for i in range(1, most.bit_length()))}):

                    def step(q=q, pos=pos, s=s):
                        return cache_attention(q, k, v, pos, scale=hd**-0.5, impl="triton", splits=s)

                    ms[str(s)] = _replay_ms(bank, (r, w, s), step, device, warmup, repeats)
                row = {"rows": r, "width": w, "rule_splits": rule, "ms": ms}
                row.update(unsplit_ms=ms["1"], rule_ms=ms[str(rule)])
                out.append(row)
                times = "  ".join(f"S={s}: {t * 1e3:.1f}" for s, t in ms.items())
                print(f"attention splits R={r} W={w} (rule S={rule}), µs: {times}", flush=True)
    return out


def _replay_ms(bank: GraphBank, key, step, device, warmup: int, repeats: int) -> float:
    return median_ms(lambda: bank.run(key, step), device, warmup, repeats)
