"""What the benchmark scripts share: a target from Hydra overrides, timing (``core.timing``, re-exported
here for the scripts), the published report."""

from __future__ import annotations

from ..core.timing import median_ms

__all__ = [
    "compose_target",
    "kernel_fallbacks",
    "median_ms",
    "publish",
    "report_header",
    "say_compile_fallbacks",
]


def compose_target(overrides: list[str]):
    """The ``target`` group composed exactly as the entry points do (``target=... target.path=...``)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="dspark.conf", version_base="1.3"):
        cfg = compose(config_name="schedule", overrides=[o for o in overrides if o.startswith("target")])
    return cfg.target


def report_header(command: str, argv: list[str], target, compile: bool | None) -> dict:
    """What every benchmark's JSON opens with: provenance (command, commit, machine, date), the target,
    its precision, and whether its layers were compiled (``--compile``; default: on CUDA)."""
    from ..core.provenance import provenance

    return {
        **provenance(command, argv, target.device),
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "compiled": compile if compile is not None else target.device.type == "cuda",
    }


def kernel_fallbacks(report: dict) -> None:
    """Record in ``report`` the Triton kernels' self-checks (``kernel_checks``: which ran, which
    fell back to their reference), and say any fallback: it changes what the timings measured."""
    from ..kernels._common import self_check_results

    report["kernel_checks"] = self_check_results()
    off = [f"{c['kernel']} ({', '.join(c['key'])})" for c in report["kernel_checks"] if not c["runs"]]
    if off:
        print(f"WARNING: Triton kernels off after their self-check, their fallbacks timed: {'; '.join(off)}")


def say_compile_fallbacks(hits: list[str]) -> None:
    """A benchmark's closing line when dynamo gave up compiling some function (``RecompileLimitWatch``)."""
    if hits:
        print(
            f"WARNING: dynamo stopped compiling {', '.join(sorted(set(hits)))} at its recompile limit: "
            "their later shapes ran eagerly, and the timings above include them"
        )


def publish(path: str, report: dict, header: list[str], cells: list[list[str]]) -> None:
    """Write ``report`` as JSON (atomically) and print its rows as a markdown table; the first
    column is text, the others right-aligned numbers."""
    from ..core.io import atomic_write_json

    atomic_write_json(path, report)
    print("\n| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for row in cells:
        print("| " + " | ".join(row) + " |")


def add_draft_vocab_args(ap, counts_help: str | None = None) -> None:
    """``--draft-vocab K`` (and where its counts come from) for a benchmark that serves a drafter."""
    ap.add_argument(
        "--draft-vocab", type=int, default=0,
        help="draft among the drafter's K most frequent training-answer tokens (0: the whole vocabulary)",
    )  # fmt: skip
    ap.add_argument(
        "--draft-vocab-counts", default=None,
        help=counts_help
        or "their counts: the data folder the drafter was trained on (default: the drafter folder's own)",
    )  # fmt: skip


def served_draft_vocab(args, target) -> tuple[object, dict | None]:
    """(the draft vocabulary of ``--draft-vocab`` or None, what the report records of it)."""
    from ..data.vocab_counts import load_draft_vocab, vocab_record

    vocab, coverage = load_draft_vocab(
        args.drafter_dir, args.draft_vocab, target.vocab_size, target.eos_token_ids, args.draft_vocab_counts
    )
    return vocab, vocab_record(vocab, coverage)
