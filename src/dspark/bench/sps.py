"""SPS(B) of the verification step: the target forward over R rows x W tokens (B = R·W), each row
attending to ``context`` cached positions (random K/V: the values do not change the work), then the
probabilities over the vocabulary, exactly what a verification round asks of the engine, timed as
  * ``hf_eager``: the plain engine's step (Hugging Face forward over ``RaggedKV``);
  * ``static_eager``: the fast engine's step without graphs (static caches only);
  * ``graph``: the fast engine's captured step (CUDA);
and the drafter's step per row count (backbone + sequential head + confidence + sampling, the fast
engine's graph). ``python -m dspark.bench.engine_sps`` prints and publishes them."""

from __future__ import annotations

import math

import torch

from ..checkpoints import load_drafter
from ..decoding.engine import Engine
from ..decoding.fast_engine import FastEngine
from ..decoding.kv import RaggedKV
from .common import median_ms

__all__ = ["cost_curve", "draft_step_times", "row_counts", "verify_step_times"]


def row_counts(widths: list[int], sizes: list[int], max_rows: int) -> list[int]:
    """Every R = B / W the sweep times (B a multiple of W, R in 1..max_rows)."""
    return sorted({b // w for w in widths for b in sizes if b % w == 0 and 0 < b // w <= max_rows})


def capacity(ctx: int, widths: list[int]) -> int:
    return 128 * math.ceil((ctx + max(widths) + 1) / 128)


def verify_step_times(
    target, widths: list[int], sizes: list[int], ctx: int, *, max_rows: int, warmup: int, repeats: int,
    hf: bool = True, compile: bool = False,
) -> list[dict]:  # fmt: skip
    """One row per shape (B tokens as R x W): its step times in ms, SPS and the gain over HF eager."""
    rows_all = row_counts(widths, sizes, max_rows)
    cap = capacity(ctx, widths)
    fast = FastEngine(
        target, None, concurrency=max(rows_all), buckets=rows_all, capacity=cap, max_width=max(widths),
        compile=compile,
    )  # fmt: skip
    fast._allocate(cap)  # the static caches
    plain = Engine(target, None)
    results = []
    with torch.inference_mode():
        for buf in fast.static.k + fast.static.v:
            buf.normal_()  # not zeros: power (and clocks) depend on the data
        fast.static.lengths.fill_(ctx)
        for w in widths:
            for b in sizes:
                if b % w or not 0 < b // w <= max_rows:
                    continue
                row = _measure(plain, fast, target, b // w, w, ctx, hf, warmup, repeats)
                results.append(row)
                nan = float("nan")
                print(
                    f"B={b:5d} R={b // w:4d} W={w}  hf={row.get('hf_eager_ms', nan):8.3f} ms  "
                    f"static={row['static_eager_ms']:8.3f} ms  graph={row.get('graph_ms', nan):8.3f} ms",
                    flush=True,
                )
    return results


def cost_curve(results: list[dict], widths: list[int]) -> dict[int, float]:
    """The verify curve of a cost table: rows γ+1 wide where B allows, single tokens below; the
    scheduler needs a non-decreasing curve, so noise dips are lifted to the running maximum."""
    w = max(widths)
    best = {r["tokens"]: r.get("graph_ms", r["static_eager_ms"]) for r in results if r["width"] == 1}
    best.update({r["tokens"]: r.get("graph_ms", r["static_eager_ms"]) for r in results if r["width"] == w})
    curve, top = {}, 0.0
    for b in sorted(best):
        top = max(top, best[b])
        curve[b] = top
    return curve


def draft_step_times(
    target, drafter_dir: str, rows_all: list[int], ctx: int, cap: int, warmup: int, repeats: int
) -> dict[int, float]:
    """Draft-step time (ms) per row count R: the fast engine's captured step where CUDA is used."""
    device = target.device
    drafter = load_drafter(drafter_dir, target, device=device)[0].to(target.dtype)
    eng = FastEngine(target, drafter, concurrency=max(rows_all), buckets=rows_all, capacity=cap)
    eng._allocate(cap)
    out = {}
    with torch.inference_mode():
        for buf in eng.dcache.k + eng.dcache.v:
            buf.normal_()
        eng.dcache.length.fill_(ctx)
        for r in rows_all:
            anchors = torch.randint(0, target.vocab_size, (r,), device=device)
            pos = torch.full((r,), ctx, device=device)
            u = torch.rand(r, drafter.gamma, device=device)
            step = lambda a=anchors, p=pos, x=u: eng._draft_step(a, p, x, drafter.gamma)  # noqa: E731
            out[r] = median_ms(step, device, warmup, repeats)
            print(f"draft R={r:4d}: {out[r]:8.3f} ms", flush=True)
    return out


def _measure(plain, fast, target, r: int, w: int, ctx: int, hf: bool, warmup: int, repeats: int) -> dict:
    """One shape: R rows x W tokens at positions ctx.. (no commit: every repeat redoes the same slots)."""
    device = target.device
    ids = torch.randint(0, target.vocab_size, (r, w), device=device)
    pos = ctx + torch.arange(w, device=device).expand(r, -1)
    row = {"tokens": r * w, "rows": r, "width": w, "context": ctx}
    if hf:
        plain._kv = RaggedKV.empty(target.model.config, r, ctx + w, target.dtype, device)
        for buf in plain._kv.k + plain._kv.v:
            buf.normal_()
        plain._kv.length.fill_(ctx)
        row["hf_eager_ms"] = median_ms(lambda: plain._target_step(ids, pos), device, warmup, repeats)
        plain._kv = None
    bank, fast.bank, fast.use_graphs = fast.bank, None, False
    row["static_eager_ms"] = median_ms(lambda: fast._target_step(ids, pos), device, 2, repeats)
    fast.bank, fast.use_graphs = bank, bank is not None
    if bank is not None:
        row["graph_ms"] = median_ms(lambda: fast._target_step(ids, pos), device, warmup, repeats)
    best = row.get("graph_ms", row["static_eager_ms"])
    row["sps"] = 1e3 / best
    if "hf_eager_ms" in row:
        row["speedup_vs_hf"] = row["hf_eager_ms"] / best
    return row
