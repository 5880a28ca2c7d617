"""SPS(B): steps per second of the target's verification step, Hugging Face eager vs the fast path.

    python -m dspark.bench.engine_sps target=smollm2_135m target.device=cuda target.dtype=bfloat16 \\
        [--context 512] [--widths 1,8] [--tokens 1,2,4,...] [--out docs/results/engine_sps.json] \\
        [--cost-table cost_table.json] [--drafter-dir <checkpoint> [--overhead] \\
        [--rounds 1,16,64,256 [--round-context 256]] [--draft-parts 1,16,64,256] [--kernels 1,256]] \\
        [--attention-splits 1,16,256] [--temperature 1] [--no-compile] [--draft-vocab K]

The verification step timed three ways (HF eager, static caches, CUDA graph; dspark.bench.sps) per
token batch B = R x W, and with ``--drafter-dir`` the drafter's step per row count R and drafted
length γ_d = 1..γ, with ``--overhead`` a whole round's cost beyond its steps and what reading its
verify width back costs, with ``--rounds`` whole rounds as the engine runs them per row count and
drafted length γ_d = 0..γ (at ``--round-context``, default ``--context``: the workload's typical
context, since a round's attention reads it), which the draft-aware policies then price, and
target-only decoding's rounds beside them (``target_round_ms``: the floor of a plain round), with
``--draft-parts`` the draft step's parts, with ``--kernels`` each step's kernels (count, device
time, the costliest) from an eager, profiled run, with ``--attention-splits`` the cache-attention
kernel alone per row count and width, unsplit against split (``dspark.bench.attention_splits``).
Every step and round runs at ``--temperature`` (default 1; at 0 the engine's greedy rounds, which
build no distributions: a cost table per temperature); with ``--draft-vocab K`` the drafter drafts
among its K most frequent training-answer tokens. The fast path is compiled on CUDA unless
``--no-compile``. Prints tables; writes JSON (and, with
--cost-table, the verify curve, plus the draft curves and the round overhead when timed, as a
scheduler cost table for ``python -m dspark.schedule cost_table=...``,
``python -m dspark.bench.e2e --cost-table ...``).
"""

from __future__ import annotations

import argparse

from .common import add_draft_vocab_args


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.engine_sps", description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--widths", default="1,8", help="tokens per row: 1 = decode, γ+1 = a full block")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--no-hf", action="store_true", help="skip the (slow) Hugging Face column")
    ap.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the fast path's layer functions (default: on CUDA)",
    )  # fmt: skip
    ap.add_argument("--drafter-dir", default=None, help="also time this drafter's draft step per row count")
    add_draft_vocab_args(ap)
    ap.add_argument(
        "--overhead", action="store_true", help="time a whole round's cost beyond its steps (R = 1)"
    )
    ap.add_argument("--rounds", default="", help="row counts to time whole rounds at, per drafted length")
    ap.add_argument("--round-context", type=int, default=None, help="the rounds' prompt length (--context)")
    ap.add_argument(
        "--round-passes", type=int, default=3, help="passes over the drafted lengths per R, the least kept"
    )
    ap.add_argument("--draft-parts", default="", help="row counts to time the draft step's parts at")
    ap.add_argument(
        "--kernels", default="",
        help="row counts to profile the verify (width 1 and γ+1) and draft steps at, kernel by kernel",
    )  # fmt: skip
    ap.add_argument(
        "--attention-splits", default="",
        help="row counts to time the cache-attention kernel alone at, split (S > 1) against unsplit",
    )  # fmt: skip
    ap.add_argument(
        "--temperature", type=float, default=1.0,
        help="every step and round at this temperature (0: greedy rounds, which build no distributions)",
    )  # fmt: skip
    ap.add_argument("--out", default="engine_sps.json")
    ap.add_argument("--cost-table", default=None)
    return ap.parse_known_args(argv)


def main(argv=None) -> dict:
    from ..core.compiling import RecompileLimitWatch

    with RecompileLimitWatch() as watch:  # its hits go into the report (compile_fallbacks)
        return _main(argv, watch)


def _main(argv, watch) -> dict:
    import sys

    from ..core.io import atomic_write_json
    from ..scheduling.cost import CostModel
    from ..target import load_target
    from .common import (
        compose_target,
        kernel_fallbacks,
        publish,
        report_header,
        say_compile_fallbacks,
        served_draft_vocab,
    )
    from .sps import (
        capacity,
        cost_curve,
        draft_parts,
        draft_step_times,
        load_served_drafter,
        round_overhead_ms,
        round_times,
        row_counts,
        step_kernels,
        verify_step_times,
        width_curves,
    )

    argv = sys.argv[1:] if argv is None else argv
    args, overrides = _parse(argv)
    target = load_target(compose_target(overrides))
    widths = [int(w) for w in args.widths.split(",")]
    sizes = [int(b) for b in args.tokens.split(",")]
    ctx, timing = int(args.context), {"warmup": args.warmup, "repeats": args.repeats}
    temp = {"temperature": args.temperature}
    results = verify_step_times(
        target, widths, sizes, ctx, max_rows=args.max_rows, hf=not args.no_hf, compile=args.compile, **timing,
        **temp,
    )  # fmt: skip
    report = {
        **report_header("dspark.bench.engine_sps", argv, target, args.compile),
        "compile_fallbacks": watch.hits,  # functions dynamo gave up compiling: their shapes ran eagerly
        **temp,
        "context": ctx,
        "drafter": args.drafter_dir,
        "rows": results,
    }
    # Our engines pad rows: a step is priced at its own row count and width (verify_width_ms).
    by_width = width_curves(results, widths)
    cost = CostModel(cost_curve(results, widths), context_len=ctx, padded=True, verify_width_ms=by_width)

    def save() -> None:  # after each stage: a run cut off later keeps what it measured
        atomic_write_json(args.out, report)
        if args.cost_table:
            tables = ("rows", "draft_len_ms", "draft_ms", "round_len_ms")  # in the cost table itself
            cost.meta = {k: v for k, v in report.items() if k not in tables}
            cost.meta["source"] = "python -m dspark.bench.engine_sps (running max)"
            cost.save(args.cost_table)

    save()
    if args.drafter_dir:
        drafter = load_served_drafter(target, args.drafter_dir)
        vocab, report["draft_vocab"] = served_draft_vocab(args, target)
        serving = {"draft_vocab": vocab}  # how every drafter engine below serves it
        rows_all, cap = row_counts(widths, sizes, args.max_rows), capacity(ctx, widths + [drafter.gamma + 1])
        lengths = draft_step_times(
            target, drafter, rows_all, ctx, cap, compile=args.compile, **timing, **temp, **serving
        )
        report.update(draft_ms=lengths[drafter.gamma], draft_len_ms=lengths)
        full = lengths[drafter.gamma]  # the whole block
        cost = CostModel(
            cost.verify_ms, draft_ms=full, draft_len_ms=lengths, context_len=ctx, padded=True,
            verify_width_ms=by_width,
        )  # fmt: skip
        save()
        if args.overhead:
            report["round_overhead"] = round_overhead_ms(
                target, drafter, cost, ctx, compile=args.compile, **temp, **serving
            )
            cost.overhead_ms = report["round_overhead"]["overhead_ms"]
            cost.readback_ms = report["round_overhead"]["readback_ms"]
            save()
        if args.rounds:
            rows = [int(r) for r in args.rounds.split(",")]
            report["round_context"] = args.round_context or ctx
            report["round_passes"] = args.round_passes
            report["round_len_ms"] = round_times(
                target, drafter, rows, report["round_context"], args.compile, passes=args.round_passes,
                **temp, **serving,
            )  # fmt: skip
            cost = CostModel.from_dict({**cost.to_dict(), "round_len_ms": report["round_len_ms"]})
            save()
            # The floor a plain round is held to: what the drafter context's upkeep costs above it.
            floor = round_times(  # no drafter: target-only's rounds
                target, None, rows, report["round_context"], args.compile, lengths=[0],
                passes=args.round_passes, **temp,
            )[0]  # fmt: skip
            report["target_round_ms"] = floor
            plain = report["round_len_ms"][0]
            print("plain round above target-only: " + "  ".join(
                f"R={r}: {plain[r] - floor[r]:+.3f} ms ({plain[r] / floor[r] - 1:+.1%})" for r in rows
            ), flush=True)  # fmt: skip
            save()
        if args.draft_parts:
            parts = [int(r) for r in args.draft_parts.split(",")]
            report["draft_parts"] = draft_parts(target, drafter, parts, ctx, **timing, **temp, **serving)
            save()
    if args.attention_splits:
        from .attention_splits import attention_splits

        attention_rows = [int(r) for r in args.attention_splits.split(",")]
        ends = sorted({min(widths), max(widths)})  # decode and the whole block (the widths between: time)
        cap = capacity(ctx, widths)
        report["attention_splits"] = attention_splits(target, attention_rows, ends, ctx, cap, **timing)
        save()
    if args.kernels:  # last: the profiler's own cost stays out of every timing above
        kernel_rows = [int(r) for r in args.kernels.split(",")]
        served = drafter if args.drafter_dir else None
        vocab_kw = serving if args.drafter_dir else {}
        report["kernels"] = step_kernels(
            target, served, kernel_rows, ctx, compile=args.compile, **temp, **vocab_kw
        )  # fmt: skip
        save()
    kernel_fallbacks(report)
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
    save()
    say_compile_fallbacks(watch.hits)
    return report


if __name__ == "__main__":
    from ..cli import user_errors

    with user_errors():
        main()
