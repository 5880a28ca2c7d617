"""Benchmark the draft loss: materialised vs fused (PyTorch row pass) vs fused (Triton row pass),
loss + gradient, at DSpark's training shape.

    python -m dspark.kernels.bench_fused_loss --out fused_loss.json                     # GPU
    python -m dspark.kernels.bench_fused_loss --device cpu --v 512 --anchors 4 --gamma 2 \\
        --d 16 --rank 8 --iters 2 --warmup 1 --out /tmp/bench.json                     # toy check

    python -m dspark.kernels.bench_fused_loss --sequences 32 --anchors 128 --positions 290 --out f.json
        # the training step's shape: 32 sequences whose 128 × 7 rows share 290 positions' targets;
        # adds the fused variants that compute each target's logits once (*_shared)

Defaults: SmolLM2-135M (V=49152, d=576), Markov rank 256, 512 anchors × 7 positions, every row
weighting CE, TV and KL (``--loss ce``: CE alone, as DFlash trains: --rank 0 --loss ce). With a rank,
``fused_*_add`` time the fused variants with the bias gradient's product and add apart per chunk
(``fused_loss.GEMM_ACCUMULATES = False``), against which the one accumulating GEMM is measured. Times are
medians over --iters after --warmup (CUDA events on GPU); peak memory is the allocator's peak
during the step above what the inputs hold. TFLOP/s counts the GEMMs each variant does (all
compute each logit once: the fused variants compute the gradient in the same pass). A variant
that runs out of memory is recorded as such instead of aborting the table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.kernels import RowWeights, fused_draft_loss, fused_loss, materialized_draft_loss, triton_available

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(args, device, dtype):
    g = torch.Generator().manual_seed(0)
    n, d, r = args.sequences * args.anchors * args.gamma, args.d, args.rank
    # Random (not zero) data with realistic logit spread: zeros would make every softmax flat.
    x = torch.randn(n, d + r, generator=g)
    lm = torch.randn(args.v, d, generator=g) * (2.5 / d**0.5)
    bias = torch.randn(args.v, r, generator=g) * 0.1
    th = 0.7 * x[:, :d] + 0.3 * torch.randn(n, d, generator=g)
    labels = torch.randint(0, args.v, (n,), generator=g)
    labels[:: args.gamma] = -100
    rw = RowWeights(*(torch.rand(3, n, generator=g) / n).to(device))
    if args.loss == "ce":  # DFlash's loss: no TV or KL term (the row kernel's two-sweep rows)
        rw = RowWeights(rw.ce, torch.zeros_like(rw.tv), torch.zeros_like(rw.kl))
    t = [v.to(device, dtype) for v in (x, lm, bias, th)]
    return t[0].requires_grad_(), t[1], t[2].requires_grad_(), t[3], labels.to(device), rw


def _shared_targets(args, th, device):
    """Each sequence's rows point at its own ``positions`` targets: (targets [S·T, d], index [N])."""
    g = torch.Generator().manual_seed(1)
    rows = args.anchors * args.gamma
    local = torch.randint(0, args.positions, (args.sequences, rows), generator=g)
    index = (local + args.positions * torch.arange(args.sequences)[:, None]).reshape(-1).to(device)
    return th[: args.sequences * args.positions].detach().clone(), index


def _variants(args):
    def materialized(x, lm, bias, th, labels, rw):
        return materialized_draft_loss(x, torch.cat([lm, bias], 1), th, labels, rw, args.softcap)

    def fused(impl):
        def run(x, lm, bias, th, labels, rw):
            weight = torch.cat([lm, bias.detach()], 1)
            return fused_draft_loss(x, weight, th, labels, rw, trainable=bias, softcap=args.softcap,
                                    impl=impl, chunk_rows=args.chunk_rows)  # fmt: skip

        return run

    def shared(impl):
        def run(x, lm, bias, th, labels, rw):
            weight = torch.cat([lm, bias.detach()], 1)
            targets, index = args.shared
            return fused_draft_loss(x, weight, targets, labels, rw, trainable=bias, softcap=args.softcap,
                                    impl=impl, chunk_rows=args.chunk_rows, target_index=index,
                                    group_rows=args.anchors * args.gamma)  # fmt: skip

        return run

    def separate_add(run):  # the bias gradient's per-chunk product and add apart, as before GEMM accumulation
        def apart(*inputs):
            fused_loss.GEMM_ACCUMULATES = False
            try:
                return run(*inputs)
            finally:
                fused_loss.GEMM_ACCUMULATES = True

        return apart

    impls = ["torch"] + (["triton"] if triton_available() and args.device == "cuda" else [])
    out = {"materialized": materialized, **{f"fused_{i}": fused(i) for i in impls}}
    if args.rank:
        out.update({f"fused_{i}_add": separate_add(fused(i)) for i in impls})
    if args.positions:
        out.update({f"fused_{i}_shared": shared(i) for i in impls})
    return out


def _step(fn, x, lm, bias, th, labels, rw):
    x.grad = bias.grad = None
    fn(x, lm, bias, th, labels, rw).loss.backward()


def _timed(cuda, body):
    if not cuda:
        t0 = time.perf_counter()
        body()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    body()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _measure(fn, inputs, args, cuda):
    for _ in range(args.warmup):
        _step(fn, *inputs)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = [_timed(cuda, lambda: _step(fn, *inputs)) for _ in range(args.iters)]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return statistics.median(times), peak


def main(argv=None):
    from dspark.core.io import atomic_write_json
    from dspark.core.provenance import provenance

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--v", type=int, default=49152)
    p.add_argument("--sequences", type=int, default=1)
    p.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    p.add_argument("--positions", type=int, default=0, help="positions per sequence its rows share (0: none)")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--d", type=int, default=576)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--softcap", type=float, default=None)
    p.add_argument("--loss", choices=["mixed", "ce"], default="mixed", help="ce: DFlash's (no TV, no KL)")
    p.add_argument("--chunk-rows", type=int, default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=None, help="comma list (default: all available)")
    p.add_argument("--out", required=True, help="JSON results path")
    args = p.parse_args(argv)

    cuda = args.device == "cuda"
    inputs = _inputs(args, args.device, DTYPES[args.dtype])
    if args.positions:
        args.shared = _shared_targets(args, inputs[3], args.device)
    n, k = args.sequences * args.anchors * args.gamma, args.d + args.rank
    # GEMMs per step: draft and target logits, d(features), d(bias block); the shared variants
    # compute the target logits once per position.
    flops = 2 * n * args.v * (k + args.d + k + args.rank)
    shared_flops = flops - 2 * (n - args.sequences * args.positions) * args.v * args.d
    variants = _variants(args)
    if args.variants:
        variants = {name: fn for name, fn in variants.items() if name in args.variants.split(",")}
    rows = []
    for name, fn in variants.items():
        try:
            ms, peak = _measure(fn, inputs, args, cuda)
            err = None
        except torch.OutOfMemoryError as exc:
            ms, peak, err = None, None, f"OOM: {str(exc).splitlines()[0]}"
        if cuda:
            torch.cuda.empty_cache()
        f = shared_flops if name.endswith("_shared") else flops
        tflops = None if ms is None else f / (ms * 1e-3) / 1e12
        rows.append(dict(variant=name, median_ms=ms, peak_mib=peak, flops=f, tflops=tflops, error=err))

    def cell(v, fmt):
        return "-" if v is None else format(v, fmt)

    settings = {k: v for k, v in vars(args).items() if k != "shared"}
    report = {**provenance("dspark.kernels.bench_fused_loss", argv, torch.device(args.device)),
              "args": settings, "rows": rows}  # fmt: skip
    atomic_write_json(args.out, report)
    print("| variant | loss+grad ms | peak MiB | TFLOP/s |\n|---|---:|---:|---:|")
    for r in rows:
        cells = [cell(r["median_ms"], ".2f"), cell(r["peak_mib"], ".0f"), cell(r["tflops"], ".1f")]
        print(f"| {r['variant']} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
