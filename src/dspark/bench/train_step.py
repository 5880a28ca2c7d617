"""One training step of a drafter at a real target's shape: time per phase, peak memory, floor.

    python -m dspark.bench.train_step [--variants default,materialized,dense,flex] [--steps 10] \\
        [--out train_step.json] [overrides... e.g. drafter=dflash head=rnn loss.impl=torch]

The default configuration is DeepSpec's Qwen3 DSpark recipe at a Qwen3-0.6B shape: a random bf16
target (hidden 1024, 28 layers, vocab 151 936, taps [1, 7, 13, 19, 25]), one sequence of 2048
tokens with cached (offline) target features, 512 anchors, block 7, 5 draft layers, Markov rank
256, loss CE 0.1 / TV 0.9 / confidence 1.0. The step is the one Lightning runs under bf16-mixed:
``DraftingModule._step`` under autocast, backward, gradient clipping at 1.0, AdamW.

Per variant: median ms of the target's features (its forward, online), the drafter's forward +
loss, backward, optimizer, and the whole step over ``--steps`` steps after ``--warmup`` (CUDA
events; the timed batches' target forwards run once before them, as a long run's first steps
compile and capture every shape it meets), peak memory (everything resident, the target's
weights included, and above what was resident before the step), the loss of the first step (the
variants must agree), the first step's wall time (``first_step_s``: the compilations a run's first
step pays, the target's included), and the step's floor: its matmul FLOPs (draft layers forward
and backward, attention over the blocks each query may see, the loss's logit and gradient GEMMs,
the target's forward online) over the bf16 peak.
With ``--data DIR`` the batches are a prepared folder's, in training order, and the target is
the configured one (``target=…`` overrides).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ..core.provenance import provenance
from .common import publish

VARIANTS = {
    "default": [],
    "materialized": ["loss.impl=materialized"],
    "torch_loss": ["loss.impl=torch"],
    "dense": ["drafter.attention=dense"],
    "flex": ["drafter.attention=flex"],
    "eager": ["drafter.compile=false"],
    "compiled": ["drafter.compile=true"],
    "eager_target": ["compile_target=false", "graph_target=false"],
    "graphed_target": ["graph_target=true"],
}
H200_BF16_TFLOPS = 989.4  # dense bf16 datasheet peak (one H200 SXM); measured ~790 on random data


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.train_step")
    ap.add_argument("--variants", default="default,materialized")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--taps", default="1,7,13,19,25")
    ap.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    ap.add_argument(
        "--features",
        choices=["offline", "online"],
        default="offline",
        help="cached target features, or the target's forward inside the step (as training runs it)",
    )
    ap.add_argument(
        "--data",
        default=None,
        help="a prepared data folder: time the step on its training batches (varying lengths, in "
        "training order) with the configured target (target=… overrides) instead of a random "
        "target and one fixed batch; the shape arguments are then unused",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    ap.add_argument("--out", default="train_step.json")
    return ap.parse_known_args(argv)


def _configs(overrides: list[str]):
    from hydra import compose, initialize_config_module

    base = ["drafter=dspark", "head=markov", "head.rank=256", "drafter.num_layers=5", "drafter.block_size=7"]
    base += ["loss.ce=0.1", "loss.tv=0.9", "loss.confidence=1.0"]
    with initialize_config_module(config_module="dspark.conf", version_base="1.3"):
        return compose(config_name="train", overrides=base + overrides)


def random_target(args, device):
    """A Qwen3-shaped target with random bf16 weights (nothing downloaded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..target import Target

    cfg = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=max(4096, args.seq),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    taps = [int(t) for t in args.taps.split(",")]
    return Target(model, None, layer_ids=taps, mask_token_id=1, eos_token_ids=[0], name="qwen3-0.6b-shape")


def random_batch(args, target, device):
    """Packed sequences with cached target features (random, never zeros); with online features the
    step runs the target itself and ignores them."""
    g = torch.Generator(device="cpu").manual_seed(1)
    b, t, d = args.batch, args.seq, target.hidden_size
    loss_mask = torch.ones(b, t, dtype=torch.long)
    loss_mask[:, : t // 16] = 0  # a prompt: anchors come from the answer only
    batch = {
        "input_ids": torch.randint(0, target.vocab_size, (b, t), generator=g),
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "loss_mask": loss_mask,
        "taps": torch.randn(b, t, d * len(target.layer_ids), generator=g).to(torch.bfloat16),
        "last_hidden": torch.randn(b, t, d, generator=g).to(torch.bfloat16),
    }
    return {k: v.to(device) for k, v in batch.items()}


def data_batches(args, target, device) -> list[dict]:
    """The first warm-up + timed batches of ``--data``'s training split, as training draws them
    (length-bucketed, right-padded, the configured batch size), on the device."""
    from ..data.datamodule import DraftDataModule

    cfg = _configs([f"data.dir={args.data}", *args.overrides])
    module = DraftDataModule(cfg.data, features=args.features, pad_token_id=target.tokenizer.pad_token_id)
    loader = iter(module.train_dataloader())
    return [{k: v.to(device) for k, v in next(loader).items()} for _ in range(args.warmup + args.steps)]


def step_flops(module, batch, anchors, online: bool = False) -> dict:
    """Matmul FLOPs of one step (forward + backward = 3× forward for trained weights; 2× for the
    frozen-weight logit GEMMs, which need no weight gradient)."""
    from ..kernels.fused_loss import default_chunk_rows, shares_targets

    d = module.drafter
    s = d.layers[0].attn.s
    b, t = batch["input_ids"].shape
    q = anchors.shape[1] * d.gamma * b
    hd, h, hkv = s.head_dim, s.num_heads, s.num_kv_heads
    per_token = 2 * s.hidden_size * (h * hd + 2 * hkv * hd) + 2 * h * hd * s.hidden_size
    per_token += 3 * 2 * s.hidden_size * s.intermediate_size
    layers = len(d.layers)
    draft = 3 * layers * q * per_token
    ctx_tokens = b * t
    draft += 3 * layers * ctx_tokens * 2 * s.hidden_size * 2 * hkv * hd  # context K/V projections
    draft += 3 * ctx_tokens * 2 * d.fc.in_features * d.fc.out_features
    # Attention: each query sees its anchor's prefix and its own block (QKᵀ and PV), ×3 with backward.
    seen = (anchors.clamp(min=0).sum() * d.gamma + q * d.gamma).item()
    attention = 3 * layers * 2 * 2 * seen * h * hd
    v = module.target.vocab_size
    rank = getattr(getattr(d, "head", None), "rank", 0)
    k = s.hidden_size + rank
    # The target's logits: once per position when a sequence's rows outnumber its positions (the
    # fused loss shares them, kernels.fused_loss), else once per row.
    per_sequence = anchors.shape[1] * d.gamma
    loss = module.loss_weights
    chunk = loss.chunk_rows or default_chunk_rows(v)
    shared = loss.impl != "materialized" and shares_targets(per_sequence, t, chunk)
    targets = b * t if shared else q
    logits = 2 * q * v * k + 2 * targets * v * s.hidden_size  # draft and target logits
    grads = 2 * q * v * k + 2 * q * v * rank  # d(features) and d(W2)
    out = {"draft_layers": draft, "attention": attention, "loss_gemms": logits + grads}
    if online:  # the frozen target's forward over every token (its layers; embeddings are a lookup)
        body = sum(p.numel() for n, p in module.target.model.base_model.layers.named_parameters())
        out["target_forward"] = 2 * body * b * t
    return out


def _mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _ms(start, end) -> float:
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else 1e3 * (end - start)


def run_variant(name, overrides, args, target, batches, device) -> dict:
    from ..core.types import TargetDims
    from ..drafters import build_drafter
    from ..drafters.dflash import sample_anchors
    from ..module import DraftingModule
    from ..objectives import LossWeights

    cfg = _configs(overrides)
    torch.manual_seed(0)
    drafter = build_drafter(TargetDims.of(target), cfg.drafter, cfg.head)
    module = DraftingModule(
        target,
        drafter,
        LossWeights.from_cfg(cfg.loss),
        dict(cfg.optim),
        args.features,
        num_anchors=args.anchors,
        compile_target=cfg.compile_target,
        graph_target=cfg.graph_target,
        graph_target_multiple=cfg.graph_target_multiple,
    ).to(device)
    module.on_fit_start()  # what Lightning runs before the first step (the target's compilation)
    opt = module.configure_optimizers()["optimizer"]
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    steps = []
    first_loss = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) if cuda else 0
    start, first_step_s = time.perf_counter(), None
    for i in range(args.warmup + args.steps):
        batch = batches[i % len(batches)]
        if i == args.warmup:  # the timed batches' target shapes met once first: a long run's steady
            with autocast:  # state, whose CUDA graphs (graph_target) were captured in its first steps
                for later in batches[args.warmup :]:
                    module.target_features(later)
        gen = torch.Generator(device=device).manual_seed(1234)  # the same anchors for the same batch
        marks = [_mark(cuda)]
        with autocast:
            features = module.target_features(batch)
            marks.append(_mark(cuda))
            loss = module.draft_step(batch, *features, gen)["loss"]
        marks.append(_mark(cuda))
        loss.backward()
        marks.append(_mark(cuda))
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(_mark(cuda))
        if first_loss is None:
            first_loss = float(loss.detach())  # reads the loss back: the step has ended
            first_step_s = time.perf_counter() - start
        if i >= args.warmup:
            steps.append(marks)
    if cuda:
        torch.cuda.synchronize(device)
    times = [[_ms(m[j], m[j + 1]) for j in range(4)] for m in steps]
    med = [statistics.median(col) for col in zip(*times)]
    step = statistics.median([sum(t) for t in times])
    # FLOPs of the timed batches, averaged (one fixed batch: that batch's).
    timed = [batches[i % len(batches)] for i in range(args.warmup, args.warmup + args.steps)]
    per_batch = []
    for batch in timed:
        gen = torch.Generator(device=device).manual_seed(1234)
        anchors = sample_anchors(batch["loss_mask"], module.num_anchors, gen)
        per_batch.append(step_flops(module, batch, anchors, args.features == "online"))
    flops = {k: sum(f[k] for f in per_batch) / len(per_batch) for k in per_batch[0]}
    total = sum(flops.values())
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    row = {
        "variant": name,
        "overrides": overrides,
        "ms_per_step": step,
        "target_ms": med[0],  # the target's forward (online features) or reading the cache
        "fwd_loss_ms": med[1],
        "backward_ms": med[2],
        "optimizer_ms": med[3],
        "peak_gib": peak / 2**30,
        "peak_above_resident_gib": (peak - resident) / 2**30,
        "first_loss": first_loss,
        "first_step_s": first_step_s,
        "flops": flops,
        "tflops_per_s": total / (step * 1e-3) / 1e12 if step else None,
        "floor_ms": total / (args.peak_tflops * 1e12) * 1e3,
        "fraction_of_peak": total / (step * 1e-3) / (args.peak_tflops * 1e12) if step else None,
    }
    del module, drafter, opt
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = _parse(argv)
    device = torch.device(args.device)
    args.overrides = extra
    if args.data:
        from ..target import load_target

        target = load_target(_configs(extra).target)
        batches = data_batches(args, target, device)
    else:
        target = random_target(args, device)
        batches = [random_batch(args, target, device)]
    rows = []
    for name in args.variants.split(","):
        parts = name.split("+")  # "flex+compiled": both variants' overrides
        unknown = [p for p in parts if p not in VARIANTS]
        if unknown:
            raise SystemExit(
                f"unknown variant '{unknown[0]}': choose from {', '.join(VARIANTS)} (join with +)"
            )
        overrides = [o for p in parts for o in VARIANTS[p]]
        rows.append(run_variant(name, [*extra, *overrides], args, target, batches, device))
        r = rows[-1]
        print(f"{name}: {r['ms_per_step']:.1f} ms/step, peak {r['peak_gib']:.2f} GiB", flush=True)
    ref = rows[0]["first_loss"]
    for r in rows:
        r["loss_rel_diff_vs_first"] = abs(r["first_loss"] - ref) / max(abs(ref), 1e-30)
    shape = {k: getattr(args, k) for k in ("seq", "batch", "hidden", "layers", "vocab", "heads", "kv_heads",
                                           "head_dim", "intermediate", "taps")}  # fmt: skip
    if args.data:  # the real batches' shape
        lengths = [int(b["attention_mask"].sum(1).float().mean()) for b in batches]
        shape = {"data": args.data, "target": target.name, "batch": int(batches[0]["input_ids"].shape[0]),
                 "mean_tokens_per_row": statistics.mean(lengths),
                 "padded_lengths": [int(b["input_ids"].shape[1]) for b in batches]}  # fmt: skip
    report = {
        **provenance("dspark.bench.train_step", argv, device),
        "shape": shape,
        "peak_tflops": args.peak_tflops,
        "deepspec_reference": {
            "ms_per_step": 101.0,
            "peak_gib": 21.5,
            "source": "issue 17, DeepSpec eager, torch 2.11",
        },
        "rows": rows,
    }
    publish(
        args.out,
        report,
        [
            "variant",
            "ms/step",
            "target",
            "fwd+loss",
            "backward",
            "optimizer",
            "first step s",
            "peak GiB",
            "floor ms",
            "% of peak",
            "× DeepSpec",
        ],
        [
            [
                r["variant"],
                f"{r['ms_per_step']:.1f}",
                f"{r['target_ms']:.1f}",
                f"{r['fwd_loss_ms']:.1f}",
                f"{r['backward_ms']:.1f}",
                f"{r['optimizer_ms']:.1f}",
                f"{r['first_step_s']:.1f}",
                f"{r['peak_gib']:.2f}",
                f"{r['floor_ms']:.1f}",
                f"{100 * (r['fraction_of_peak'] or 0):.1f}",
                f"{101.0 / r['ms_per_step']:.2f}" if r["ms_per_step"] else "-",
            ]
            for r in rows
        ],  # fmt: skip
    )
    return report


if __name__ == "__main__":
    main()
