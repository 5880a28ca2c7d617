"""Fig. 4's latency panel: what the sequential head costs a round, per drafter family and block size.

    python -m dspark.bench.head_latency target=smollm2_135m target.device=cuda target.dtype=bfloat16 \\
        [--families dflash,markov,rnn] [--blocks 4,7,10,16] [--rows 1,128] [--context 512[,1024,…]] \\
        [--layers 5] [--warmup 3] [--repeats 10] [--round-tokens 32] [--no-compile] \\
        [--draft-vocab K --draft-vocab-counts DATA_DIR] \\
        [--out head_latency.json] [drafter.… head.… overrides for every family]
    python -m dspark.report mode=head_latency runs=head_latency.json   # fig4_latency.png (+ .json)

Latency does not depend on trained weights, so each drafter is a fresh one, built exactly as
training builds it (``conf/train.yaml`` composed with ``drafter=dflash`` or ``drafter=dspark
head=<family>``, ``drafter.block_size=B``, ``drafter.num_layers=--layers``; DSpark keeps its
confidence head, as trained) and served as the engines serve one (``sps.served``: the target's
device and precision). Per family, block size B, row count R and context length (the context cache
holding that many random positions; ``--context 512,1024,2048,4096`` is the paper's protocol):

  * ``sequential_head_ms``: what the sequential head adds to the draft step, the drafter's heads
    and sampling over the γ positions (left to right, each position conditioned on the token drawn
    before it; DSpark's confidence pass included) against DFlash's parallel sampling of the same
    hidden states (``sps.draft_parts``, captured on CUDA). DFlash has no sequential head: its
    ``sequential_head_ms`` is 0 by definition, and the difference measured for it (``parts``'
    ``sequential_head_ms``: the same work timed twice) is the measurement's noise floor;
  * ``draft_step_ms``: the whole draft step at γ (``sps.draft_step_times``: the fast engine's step);
  * ``round_ms``: a whole round drafting and verifying the whole block, ``plain_round_ms`` one that
    drafts nothing (target-only's round plus the drafter context's upkeep), both as the engine runs
    them (``sps.round_times``, ``--round-tokens`` new tokens per request);
  * ``head_share``: ``sequential_head_ms / round_ms`` (issue 19's check: at most 3 % at R = 128;
    the paper's 4B target verifies slowly enough for that, a small target leaves the head more);
  * ``round_vs_dflash``: ``round_ms`` over DFlash's at the same B, R and context, minus 1 (what the
    paper's panel reports: 0.2 % to 1.3 % at R = 128, averaged over contexts of 512 to 4096).

With several contexts, ``mean_over_contexts`` holds each family, B and R averaged over them as the
paper's panel is (the mean round and head latency; the share and ``round_vs_dflash`` of the means),
and the figure draws those.

``--draft-vocab K``: every drafter drafts among the K most frequent answer tokens of
``--draft-vocab-counts`` (a prepared data folder, or a counts file), as the engines serve a trained
drafter with ``decoding.draft_vocab``: the LM head, the head's bias and the sampling then cover K
columns, not the whole vocabulary (what decides the head's cost on a large vocabulary: Gemma 3's 262 144).

The JSON (with provenance) is rewritten after each configuration, so a run cut off keeps what it
measured; the blocks are the outer loop, DFlash first. A configuration that does not fit in the
device's memory is recorded under ``out_of_memory`` (with its larger contexts, not tried) and the
run goes on with the next one. Prints a table; ``python -m dspark.report
mode=head_latency`` draws it (round latency, head latency and the head's share against the block
size, a column per R).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core.errors import ConfigError

__all__ = ["FAMILIES", "check_args", "main"]

# family -> (label, the overrides that select it, as for python -m dspark.train)
FAMILIES = {
    "dflash": ("DFlash", ["drafter=dflash"]),
    "markov": ("DSpark-Markov", ["drafter=dspark", "head=markov"]),
    "gated": ("DSpark-Gated", ["drafter=dspark", "head=gated"]),
    "rnn": ("DSpark-RNN", ["drafter=dspark", "head=rnn"]),
}
_PASSED = ("target", "drafter.", "head.")  # the overrides this command takes


def _parse(argv):
    from .common import add_draft_vocab_args

    doc = __doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.head_latency", description=doc)
    ap.add_argument("--families", default="dflash,markov,rnn", help=f"of {', '.join(FAMILIES)}")
    ap.add_argument("--blocks", default="4,7,10,16", help="drafter.block_size values (>= 2)")
    ap.add_argument("--rows", default="1,128", help="row counts R (the batch)")
    ap.add_argument(
        "--context", default="512",
        help="cached context positions per row; several (512,1024,2048,4096: the paper's) are each "
        "measured and averaged",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=5, help="drafter.num_layers (the paper's 5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--round-tokens", type=int, default=32, help="new tokens per request of a timed run")
    ap.add_argument(
        "--temperature", type=float, default=1.0,
        help="every step and round's; at 0 the rounds are greedy while the head's parts still time "
        "the eager sampler: keep 1 for Fig. 4",
    )  # fmt: skip
    ap.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the fast path's layer functions (default: on CUDA)",
    )  # fmt: skip
    add_draft_vocab_args(
        ap, counts_help="their counts: a data folder (its training answers) or a counts file"
    )
    ap.add_argument("--out", default="head_latency.json")
    return ap.parse_known_args(argv)


def _ints(text: str, flag: str, least: int, example: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        why = f"{flag} {text!r} is not a comma-separated list of integers: e.g. {flag} {example}"
        raise ConfigError(why) from None
    if not values:
        raise ConfigError(f"{flag} is empty: give at least one value, e.g. {flag} {example}")
    low = [v for v in values if v < least]
    if low:
        raise ConfigError(f"{flag} {text!r}: {low} below {least}; each must be >= {least}, e.g. {example}")
    return list(dict.fromkeys(values))  # in order, once each


def check_args(args, overrides: list[str]) -> dict:
    """Every input checked before a model is built: ``ConfigError`` naming the problem and the fix."""
    families = list(dict.fromkeys(f.strip() for f in args.families.split(",") if f.strip()))
    if not families:
        raise ConfigError(f"--families is empty: name at least one of {', '.join(FAMILIES)}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ConfigError(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    blocks = _ints(args.blocks, "--blocks", 2, "4,7,10,16")
    rows = _ints(args.rows, "--rows", 1, "1,128")
    contexts = _ints(args.context, "--context", 1, "512,1024,2048,4096")
    for flag, value, least in (
        ("--layers", args.layers, 1), ("--repeats", args.repeats, 1),
        ("--warmup", args.warmup, 0), ("--round-tokens", args.round_tokens, 2),
    ):  # fmt: skip
        if value < least:
            raise ConfigError(f"{flag} {value} is below {least}: pass {flag} {max(least, 1)} or more")
    if args.draft_vocab < 0:
        raise ConfigError(
            f"--draft-vocab {args.draft_vocab} is negative: give a token count, or 0 for the whole"
        )
    if args.draft_vocab and not args.draft_vocab_counts:
        raise ConfigError(
            f"--draft-vocab {args.draft_vocab} needs --draft-vocab-counts: the drafters here are fresh and "
            f"carry no token counts; pass the data folder they would train on (its tokens/train.safetensors)"
        )
    if args.draft_vocab:
        from ..data.datamodule import tokens_path

        source = Path(args.draft_vocab_counts).expanduser()
        if not (source.is_file() or tokens_path(source, "train").is_file()):
            raise ConfigError(
                f"--draft-vocab-counts {args.draft_vocab_counts} is neither a token counts file nor a data "
                f"folder with its tokenised training split ({tokens_path(source, 'train')})"
            )
    stray = [o for o in overrides if not o.startswith(_PASSED)]
    if stray:
        raise ConfigError(
            f"unknown arguments {stray}: this command takes its --options and target=…, target.…, "
            f"drafter.… and head.… overrides (see --help); --families picks the drafters and heads"
        )
    return {"families": families, "blocks": blocks, "rows": rows, "contexts": contexts}


def drafter_configs(families: list[str], blocks: list[int], layers: int, overrides: list[str]) -> dict:
    """``{(family, B): (cfg.drafter, cfg.head, the overrides)}`` composed as ``python -m
    dspark.train`` composes them (``drafter.…``/``head.…`` overrides applied to every family), each
    checked against its class's schema and rules and the target's heads where known before loading."""
    from hydra import compose, initialize_config_module

    from ..drafters.registry import check_drafter_config

    passed = [o for o in overrides if o.startswith(("drafter.", "head."))]
    target = [o for o in overrides if o.startswith("target")]
    out = {}
    with initialize_config_module(config_module="dspark.conf", version_base="1.3"):
        for family in families:
            for b in blocks:
                chosen = [
                    *FAMILIES[family][1],
                    f"drafter.block_size={b}",
                    f"drafter.num_layers={layers}",
                    *passed,
                ]
                cfg = compose(config_name="train", overrides=[*target, *chosen])
                check_drafter_config(cfg.drafter, cfg.head, cfg.target)
                out[family, b] = (cfg.drafter, cfg.head, chosen)
    return out


def measure(target, drafter, rows: list[int], ctx: int, args, family: str, vocab=None) -> list[dict]:
    """One drafter's rows of the table, one per R (see the module's docstring); ``vocab``: the draft
    vocabulary served, None for the whole."""
    from .sps import capacity, draft_parts, draft_step_times, round_times

    gamma = int(drafter.gamma)
    timing = {"warmup": args.warmup, "repeats": args.repeats}
    cap = capacity(ctx, [gamma + 1])
    t = {"temperature": args.temperature, "draft_vocab": vocab}
    draft = draft_step_times(
        target, drafter, rows, ctx, cap, compile=args.compile, lengths=[gamma], **timing, **t
    )
    release(target)  # each phase's engine and CUDA graphs gone before the next captures its own
    rounds = round_times(target, drafter, rows, ctx, args.compile, args.round_tokens, lengths=[0, gamma], **t)
    release(target)
    parts = {p["rows"]: p for p in draft_parts(target, drafter, rows, ctx, **timing, **t)}
    out = []
    for r in rows:
        head = 0.0 if family == "dflash" else parts[r]["sequential_head_ms"]
        round_ms = rounds[gamma][r]
        out.append(
            {
                "family": family,
                "label": FAMILIES[family][0],
                "block_size": int(drafter.block_size),
                "gamma": gamma,
                "rows": r,
                "context": ctx,
                "sequential_head_ms": head,
                "head_us_per_position": 1000.0 * head / gamma,  # flat in γ when the head scales as it should
                "draft_step_ms": draft[gamma][r],
                "round_ms": round_ms,
                "plain_round_ms": rounds[0][r],
                "head_share": head / round_ms,
                "parts": parts[r],
            }
        )
    return out


def release(target) -> None:
    """Free what the measurements before left: their engines (the collector's cycles) and, on CUDA,
    the cached blocks of their graphs' memory pools."""
    import gc

    import torch

    gc.collect()
    if target.device.type == "cuda":
        torch.cuda.empty_cache()


def _relate(results: list[dict], where: tuple[str, ...] = ("block_size", "rows", "context")) -> None:
    """``round_vs_dflash`` on every row whose DFlash counterpart (the same ``where``) was measured."""
    base = {tuple(r[k] for k in where): r["round_ms"] for r in results if r["family"] == "dflash"}
    for r in results:
        ref = base.get(tuple(r[k] for k in where))
        if ref:
            r["round_vs_dflash"] = r["round_ms"] / ref - 1.0


def mean_over_contexts(results: list[dict]) -> list[dict]:
    """Each family, B and R with every measured context, averaged as the paper's Fig. 4 panel is:
    the mean round and head latency, the head's share of the mean round, and ``round_vs_dflash``
    of the means. A configuration cut off before its last context is left out, not averaged over fewer."""
    contexts = sorted({r["context"] for r in results})
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["family"], r["block_size"], r["rows"]), []).append(r)
    out = []
    for (family, block, rows), rs in groups.items():
        if sorted(r["context"] for r in rs) != contexts:
            continue
        keys = ("sequential_head_ms", "draft_step_ms", "round_ms")
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in keys}
        share = mean["sequential_head_ms"] / mean["round_ms"]
        out.append(
            {"family": family, "label": rs[0]["label"], "block_size": block, "gamma": rs[0]["gamma"],
             "rows": rows, "contexts": contexts, **mean, "head_share": share}
        )  # fmt: skip
    _relate(out, ("block_size", "rows"))
    return out


def main(argv=None) -> dict:
    import sys

    import torch

    from ..core.io import atomic_write_json
    from ..core.types import TargetDims
    from ..data.vocab_counts import load_draft_vocab, vocab_record
    from ..drafters import build_drafter
    from ..target import load_target
    from .common import compose_target, publish, report_header
    from .sps import served

    argv = sys.argv[1:] if argv is None else argv
    args, overrides = _parse(argv)
    chosen = check_args(args, overrides)
    configs = drafter_configs(chosen["families"], chosen["blocks"], args.layers, overrides)
    target = load_target(compose_target(overrides))
    contexts, rows = chosen["contexts"], chosen["rows"]
    vocab, coverage = load_draft_vocab(
        None, args.draft_vocab, target.vocab_size, target.eos_token_ids, args.draft_vocab_counts
    )
    results: list[dict] = []
    out_of_memory: list[dict] = []
    report = {
        **report_header("dspark.bench.head_latency", argv, target, args.compile),
        "draft_vocab": vocab_record(vocab, coverage),  # None: the whole vocabulary
        "contexts": contexts,
        "layers": args.layers,
        "families": chosen["families"],
        "blocks": chosen["blocks"],
        "rows": rows,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "round_tokens": args.round_tokens,
        "definitions": {
            "sequential_head_ms": "heads + sampling over the γ positions (captured on CUDA) minus DFlash's "
            "parallel sampling of the same hidden states; 0 for DFlash (no sequential head)",
            "head_us_per_position": "sequential_head_ms / γ, in µs",
            "draft_step_ms": "the fast engine's draft step at γ",
            "round_ms": "a whole round drafting and verifying γ, median on the device's timeline",
            "plain_round_ms": "a round drafting nothing (γ_d = 0)",
            "head_share": "sequential_head_ms / round_ms",
            "round_vs_dflash": "round_ms / DFlash's round_ms at the same block size, R and context - 1",
            "mean_over_contexts": "per family, block size and R: the means over the contexts (the paper's "
            "panel), head_share and round_vs_dflash of the means",
        },
        "results": results,
        "out_of_memory": out_of_memory,
    }
    # Each configuration's drafter is a new module with its own block size, and each context a new
    # cache shape: its fused paths would pass dynamo's default recompile limit (8) after a few, and run
    # eagerly from then on.
    dynamo = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    with dynamo.patch({limit: max(getattr(dynamo, limit), 8 * len(configs) * len(contexts))}):
        for b in chosen["blocks"]:
            for family in chosen["families"]:
                drafter_cfg, head_cfg, picked = configs[family, b]
                print(f"== {FAMILIES[family][0]}, block {b}: {' '.join(picked)}", flush=True)
                torch.manual_seed(0)
                drafter = served(build_drafter(TargetDims.of(target), drafter_cfg, head_cfg), target)
                built = {"overrides": picked, "parameters": sum(p.numel() for p in drafter.parameters())}
                for ctx in contexts:
                    try:
                        rows_measured = measure(target, drafter, rows, ctx, args, family, vocab)
                    except torch.OutOfMemoryError as err:
                        # A larger context needs more: this drafter is done; the next may fit.
                        skipped = {
                            "family": family,
                            "block_size": b,
                            "contexts": contexts[contexts.index(ctx) :],
                        }
                        out_of_memory.append({**skipped, "error": str(err).split(".")[0]})
                        print(f"NOT MEASURED (out of memory): {FAMILIES[family][0]}, block {b}, contexts "
                              f"{skipped['contexts']}", flush=True)  # fmt: skip
                        atomic_write_json(args.out, report)
                        break
                    finally:
                        release(target)
                    results += [{**row, **built} for row in rows_measured]
                    _relate(results)
                    if len(contexts) > 1:
                        report["mean_over_contexts"] = mean_over_contexts(results)
                    atomic_write_json(args.out, report)  # a run cut off keeps what it measured
                del drafter
                release(target)
    nan = float("nan")
    publish(
        args.out,
        report,
        ["drafter", "B", "γ", "R", "context", "head ms", "head µs/pos", "draft ms", "round ms", "plain ms",
         "head share", "vs DFlash"],
        [
            [r["label"], f"{r['block_size']}", f"{r['gamma']}", f"{r['rows']}", f"{r['context']}",
             f"{r['sequential_head_ms']:.3f}", f"{r['head_us_per_position']:.1f}",
             f"{r['draft_step_ms']:.3f}", f"{r['round_ms']:.3f}", f"{r['plain_round_ms']:.3f}",
             f"{100 * r['head_share']:.2f} %",
             f"{100 * r.get('round_vs_dflash', nan):+.2f} %"]
            for r in results
        ],
    )  # fmt: skip
    return report


if __name__ == "__main__":
    from ..cli import user_errors

    with user_errors():
        main()
