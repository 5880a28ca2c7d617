"""SPS(B): steps per second of the target's verification step, Hugging Face eager vs the fast path.

    python -m dspark.bench.engine_sps target=smollm2_135m target.device=cuda target.dtype=bfloat16 \\
        [--context 512] [--widths 1,8] [--tokens 1,2,4,...] [--out docs/results/engine_sps.json] \\
        [--cost-table cost_table.json] [--drafter-dir <checkpoint>]

One step = the target forward over R rows x W tokens (B = R·W), each row attending to ``context``
cached positions (random K/V: the values do not change the work), then the probabilities over the
vocabulary, exactly what a verification round asks of the engine:
  * ``hf_eager``: the plain engine's step (Hugging Face forward over ``RaggedKV``);
  * ``static_eager``: the fast engine's step without graphs (static caches only);
  * ``graph``: the fast engine's captured step.
With ``--drafter-dir`` the drafter's step (backbone + sequential head + confidence + sampling, the
fast engine's graph) is timed too, per row count R, over the same context. Prints a table; writes
JSON (and, with --cost-table, the verify curve, plus the draft curve when timed, as a scheduler
cost table for ``python -m dspark.schedule cost_table=...``).
"""

from __future__ import annotations

import argparse
import math

import torch


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.engine_sps", description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--widths", default="1,8", help="tokens per row: 1 = decode, γ+1 = a full block")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--no-hf", action="store_true", help="skip the (slow) Hugging Face column")
    ap.add_argument("--compile", action="store_true", help="torch.compile the fast path's layer functions")
    ap.add_argument("--drafter-dir", default=None, help="also time this drafter's draft step per row count")
    ap.add_argument("--out", default="engine_sps.json")
    ap.add_argument("--cost-table", default=None)
    return ap.parse_known_args(argv)


def main(argv=None) -> dict:
    import sys

    from ..core.provenance import provenance
    from ..decoding.engine import Engine
    from ..decoding.fast_engine import FastEngine
    from ..target import load_target
    from .common import compose_target, publish

    argv = sys.argv[1:] if argv is None else argv
    args, overrides = _parse(argv)
    target = load_target(compose_target(overrides))
    device = target.device
    widths = [int(w) for w in args.widths.split(",")]
    sizes = [int(b) for b in args.tokens.split(",")]
    ctx = int(args.context)
    rows_all = sorted({b // w for w in widths for b in sizes if b % w == 0 and 0 < b // w <= args.max_rows})
    cap = 128 * math.ceil((ctx + max(widths) + 1) / 128)
    fast = FastEngine(
        target,
        None,
        concurrency=max(rows_all),
        buckets=rows_all,
        capacity=cap,
        max_width=max(widths),
        compile=args.compile,
    )
    fast._allocate(cap)  # the static caches
    plain = Engine(target, None)
    results = []
    with torch.inference_mode():
        for buf in fast.static.k + fast.static.v:
            buf.normal_()  # not zeros: power (and clocks) depend on the data
        fast.static.lengths.fill_(ctx)
        for w in widths:
            for b in sizes:
                if b % w or not 0 < b // w <= args.max_rows:
                    continue
                row = _measure(plain, fast, target, b // w, w, ctx, args)
                results.append(row)
                nan = float("nan")
                print(
                    f"B={b:5d} R={b // w:4d} W={w}  hf={row.get('hf_eager_ms', nan):8.3f} ms  "
                    f"static={row['static_eager_ms']:8.3f} ms  graph={row.get('graph_ms', nan):8.3f} ms",
                    flush=True,
                )
    draft_ms = _draft_times(target, args.drafter_dir, rows_all, ctx, cap, args) if args.drafter_dir else None
    report = {
        **provenance("dspark.bench.engine_sps", argv, device),
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "context": ctx,
        "compiled": args.compile,
        "drafter": args.drafter_dir,
        "draft_ms": draft_ms,
        "rows": results,
    }
    nan = float("nan")
    publish(
        args.out,
        report,
        ["B", "R x W", "HF eager ms", "static ms", "graph ms", "SPS", "vs HF"],
        [
            [f"{r['tokens']}", f"{r['rows']} x {r['width']}", f"{r.get('hf_eager_ms', nan):.3f}",
             f"{r['static_eager_ms']:.3f}", f"{r.get('graph_ms', nan):.3f}", f"{r['sps']:.0f}",
             f"{r.get('speedup_vs_hf', nan):.1f}x"]
            for r in results
        ],
    )  # fmt: skip
    if args.cost_table:
        from ..scheduling.cost import CostModel

        # Verification rows are γ+1 wide where B allows, single tokens below; the scheduler
        # needs a non-decreasing curve, so noise dips are lifted to the running maximum.
        w = max(widths)
        best = {r["tokens"]: r.get("graph_ms", r["static_eager_ms"]) for r in results if r["width"] == 1}
        best.update(
            {r["tokens"]: r.get("graph_ms", r["static_eager_ms"]) for r in results if r["width"] == w}
        )
        curve, top = {}, 0.0
        for b in sorted(best):
            top = max(top, best[b])
            curve[b] = top
        CostModel(
            curve,
            draft_ms=draft_ms,
            context_len=ctx,
            meta={
                **{k: v for k, v in report.items() if k != "rows"},
                "source": "python -m dspark.bench.engine_sps (running max)",
            },
        ).save(args.cost_table)
    return report


def _draft_times(target, drafter_dir: str, rows_all: list[int], ctx: int, cap: int, args) -> dict[int, float]:
    """Draft-step time (ms) per row count R: the fast engine's captured step where CUDA is used."""
    from ..checkpoints import load_drafter
    from ..decoding.fast_engine import FastEngine
    from .common import median_ms

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
            step = lambda a=anchors, p=pos, x=u: eng._draft_step(a, p, x)  # noqa: E731
            out[r] = median_ms(step, device, args.warmup, args.repeats)
            print(f"draft R={r:4d}: {out[r]:8.3f} ms", flush=True)
    return out


def _measure(plain, fast, target, r: int, w: int, ctx: int, args) -> dict:
    """One shape: R rows x W tokens at positions ctx.. (no commit: every repeat redoes the same slots)."""
    from ..decoding.kv import RaggedKV
    from .common import median_ms

    device = target.device
    ids = torch.randint(0, target.vocab_size, (r, w), device=device)
    pos = ctx + torch.arange(w, device=device).expand(r, -1)
    row = {"tokens": r * w, "rows": r, "width": w, "context": ctx}
    if not args.no_hf:
        plain._kv = RaggedKV.empty(target.model.config, r, ctx + w, target.dtype, device)
        for buf in plain._kv.k + plain._kv.v:
            buf.normal_()
        plain._kv.length.fill_(ctx)
        row["hf_eager_ms"] = median_ms(
            lambda: plain._target_step(ids, pos), device, args.warmup, args.repeats
        )
        plain._kv = None
    bank, fast.bank, fast.use_graphs = fast.bank, None, False
    row["static_eager_ms"] = median_ms(lambda: fast._target_step(ids, pos), device, 2, args.repeats)
    fast.bank, fast.use_graphs = bank, bank is not None
    if bank is not None:
        row["graph_ms"] = median_ms(lambda: fast._target_step(ids, pos), device, args.warmup, args.repeats)
    best = row.get("graph_ms", row["static_eager_ms"])
    row["sps"] = 1e3 / best
    if "hf_eager_ms" in row:
        row["speedup_vs_hf"] = row["hf_eager_ms"] / best
    return row


if __name__ == "__main__":
    main()
