"""Benchmark the draft loss: materialised vs chunked (PyTorch) vs Triton, forward + backward.

    python -m dspark.kernels.bench_fused_loss --out docs/results/fused_loss.json        # GPU
    python -m dspark.kernels.bench_fused_loss --device cpu --v 512 --anchors 4 --gamma 2 \\
        --k 32 --d 16 --iters 2 --warmup 1 --out /tmp/bench.json                       # toy check

Defaults are the DSpark training shape on SmolLM2-135M: V=49152, 512 anchors x 7 positions,
K = 576 (hidden) + 256 (head rank), D = 576. Times are medians over --iters after --warmup, with
CUDA events on GPU (forward alone is timed too); peak memory is the allocator's peak during
forward + backward above what the inputs already hold. TFLOP/s counts the GEMM work each
variant actually does (the chunked ones recompute logits), so it measures hardware use.
A variant that runs out of memory is recorded as such instead of aborting the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dspark.kernels import chunked_draft_loss, fused_draft_loss, materialized_draft_loss, triton_available
from dspark.kernels import fused_loss as _fused_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(args, device, dtype):
    g = torch.Generator().manual_seed(0)
    n = args.anchors * args.gamma
    # Random (not zero) data with realistic logit spread: zeros would make every softmax flat.
    x = torch.randn(n, args.k, generator=g)
    w = torch.randn(args.v, args.k, generator=g) * (2.5 / args.k**0.5)
    th = torch.randn(n, args.d, generator=g)
    tw = torch.randn(args.v, args.d, generator=g) * (2.5 / args.d**0.5)
    labels = torch.randint(0, args.v, (n,), generator=g)
    labels[:: args.gamma] = -100
    t = [x.to(device, dtype), w.to(device, dtype), th.to(device, dtype), tw.to(device, dtype)]
    return t[0].requires_grad_(), t[1].requires_grad_(), t[2], t[3], labels.to(device)


def _variants(args):
    out = {"materialized": lambda *a: materialized_draft_loss(*a, softcap=args.softcap)}
    out["chunked"] = lambda *a: chunked_draft_loss(*a, softcap=args.softcap, chunk=args.chunk)
    if triton_available() and args.device == "cuda":
        out["triton"] = lambda *a: fused_draft_loss(*a, softcap=args.softcap, chunk=args.chunk, impl="triton")
    return out


def _step(fn, x, w, th, tw, labels):
    x.grad = w.grad = None
    out = fn(x, w, th, tw, labels)
    (0.1 * out.ce.sum() + 0.9 * out.tv.sum()).backward()


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
    with torch.no_grad():
        fwd = statistics.median(_timed(cuda, lambda: fn(*inputs)) for _ in range(args.iters))
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(args.iters):
        times.append(_timed(cuda, lambda: _step(fn, *inputs)))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return statistics.median(times), fwd, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--v", type=int, default=49152)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--k", type=int, default=576 + 256)
    p.add_argument("--d", type=int, default=576)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--softcap", type=float, default=None)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=None, help="comma list (default: all available)")
    p.add_argument(
        "--fp32-precision", default=None, help="Triton dot precision for fp32: ieee, tf32x3, bf16x3"
    )
    p.add_argument(
        "--tiles",
        default=None,
        help="Triton tiles for this dtype: BLOCK_N,BLOCK_V,BLOCK_K,num_warps,num_stages",
    )
    p.add_argument("--out", type=Path, required=True, help="JSON results path")
    args = p.parse_args(argv)

    cuda = args.device == "cuda"
    dtype = DTYPES[args.dtype]
    if args.fp32_precision:
        _fused_loss.FP32_DOT_PRECISION = args.fp32_precision
    if args.tiles:
        names = ("BLOCK_N", "BLOCK_V", "BLOCK_K", "num_warps", "num_stages")
        key = dtype if dtype == torch.float32 else "half"
        _fused_loss.GPU_TILES[key] = dict(zip(names, map(int, args.tiles.split(","))))
    inputs = _inputs(args, args.device, dtype)
    n = args.anchors * args.gamma
    # Work count (per fwd+bwd): forward recomputes both logit GEMMs twice, backward once more,
    # plus the two draft-gradient GEMMs. The materialised path does the logit GEMMs once.
    gemm = 2 * n * args.v
    flops_chunked = gemm * (3 * (args.k + args.d) + 2 * args.k)
    flops_materialized = gemm * (args.k + args.d + 2 * args.k)

    variants = _variants(args)
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    rows = []
    for name, fn in variants.items():
        try:
            ms, fwd_ms, peak = _measure(fn, inputs, args, cuda)
            err = None
        except torch.OutOfMemoryError as exc:
            ms, fwd_ms, peak, err = None, None, None, f"OOM: {str(exc).splitlines()[0]}"
        if cuda:
            torch.cuda.empty_cache()
        flops = flops_materialized if name == "materialized" else flops_chunked
        rows.append(
            dict(
                variant=name,
                median_ms=ms,
                fwd_median_ms=fwd_ms,
                peak_mib=peak,
                flops=flops,
                tflops=None if ms is None else flops / (ms * 1e-3) / 1e12,
                error=err,
            )
        )

    print(
        f"N={n} V={args.v} K={args.k} D={args.d} dtype={args.dtype} chunk={args.chunk} device={args.device}"
    )
    print(f"{'variant':<14}{'fwd+bwd ms':>12}{'fwd ms':>10}{'peak MiB':>12}{'TFLOP/s':>10}")
    for r in rows:
        ms = "-" if r["median_ms"] is None else f"{r['median_ms']:.2f}"
        fwd = "-" if r["fwd_median_ms"] is None else f"{r['fwd_median_ms']:.2f}"
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        tf = "-" if r["tflops"] is None else f"{r['tflops']:.1f}"
        print(
            f"{r['variant']:<14}{ms:>12}{fwd:>10}{peak:>12}{tf:>10}"
            + (f"  {r['error']}" if r["error"] else "")
        )

    meta = dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        triton=_triton_version(),
        device=torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    tmp.replace(args.out)  # atomic: a crashed run never leaves half a JSON
    return rows


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
