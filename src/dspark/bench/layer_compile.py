"""The fast engine's target layer functions (``static_target.attention_inputs`` and ``layer_output``:
norms, q/k/v projections, RoPE, the K/V store, the output projection, the SwiGLU MLP), one layer, each
step timed as replays of a captured CUDA graph, compiled four ways:

* ``eager``: the plain PyTorch ops (the reference);
* ``symbolic``: ``torch.compile(dynamic=True)``, every size symbolic, the weights' too (they enter as
  plain tensors): what the engine ran before 2026-12-04;
* ``engine``: as the engine compiles them now (``compiled_layer_function``: automatic dynamic shapes,
  only the sizes that change between calls symbolic);
* ``static``: compiled for this step's shape alone (``torch.compile(dynamic=False)``), the bound.

A kernel compiled for symbolic sizes divides its element indices by run-time values where one for
constant sizes divides by constants: on the H200, 99.5 µs a layer at 256 x 8 rows symbolic against
60.7 as the engine now compiles it and 60.8 per shape.

    python -m dspark.bench.layer_compile [--steps 1x8,64x8,256x1,256x8] [--context 512] \\
        [--hidden 576 --heads 9 --kv-heads 3 --head-dim 64 --intermediate 1536] [--out layer_compile.json]

Steps are ROWSxWIDTH (the engine's rows bucket and verify width), in order: ``engine``'s graphs are
those a run meeting these shapes in this order compiles. The defaults are SmolLM2-135M's layer. Each
compiled variant says whether its outputs and K/V stores agree with eager's. Off CUDA the steps run
uncaptured (``--variants`` picks which).
"""

from __future__ import annotations

import argparse
import functools

import torch

from .common import median_ms, publish

__all__ = ["main"]

VARIANTS = ("eager", "symbolic", "engine", "static")


def _parse(argv):
    what = "The target layer functions eager, all sizes symbolic, as the engine compiles them, per shape."
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.layer_compile", description=what)
    ap.add_argument("--steps", default="1x8,64x8,256x1,256x8", help="ROWSxWIDTH, comma-separated")
    ap.add_argument("--context", type=int, default=512, help="cache slots per row")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {', '.join(VARIANTS)}")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="layer_compile.json")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "eager" not in variants:
        ap.error(f"--variants: {args.variants!r} must name eager and any of {', '.join(VARIANTS)}")
    try:
        steps = [tuple(int(n) for n in s.lower().split("x")) for s in args.steps.split(",") if s]
    except ValueError:
        steps = []
    if not steps or any(len(s) != 2 or min(s) < 1 or s[1] > args.context for s in steps):
        ap.error(f"--steps: {args.steps!r} must be ROWSxWIDTH pairs, each width at most --context")
    return args, variants, steps


# Dynamo keeps graphs per code object: each compiled variant wraps the layer functions in code of its
# own, so no variant's graphs (or recompile history) serve another's calls.
def _symbolic_inputs(*args):
    from ..decoding.static_target import attention_inputs

    return attention_inputs(*args)


def _symbolic_output(*args):
    from ..decoding.static_target import layer_output

    return layer_output(*args)


def _static_inputs(*args):
    from ..decoding.static_target import attention_inputs

    return attention_inputs(*args)


def _static_output(*args):
    from ..decoding.static_target import layer_output

    return layer_output(*args)


def _layer(args, device, dtype, g):
    from ..decoding.static_target import LayerWeights

    d, hd, f = args.hidden, args.head_dim, args.intermediate

    def w(*shape, scale=0.02):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    qkv_rows = (args.heads + 2 * args.kv_heads) * hd
    return LayerWeights(
        ln1=1 + w(d),
        qkv=w(qkv_rows, d),
        o=w(d, args.heads * hd),
        ln2=1 + w(d),
        gate_up=w(2 * f, d),
        down=w(d, f),
    )


def _layer_step(inputs, output, head, caches, where, attn):
    """One layer as the engine's step runs it: q (its K/V stored into ``caches``), then the output."""
    x, weights, eps = head[0], head[1], head[4]
    return inputs(*head, *caches, *where), output(x, attn, weights, eps)


def main(argv=None) -> dict:
    import sys

    from ..core.provenance import provenance
    from ..decoding.graphs import GraphBank
    from ..decoding.static_target import LAYER_GRAPHS, attention_inputs, compiled_layer_function, layer_output

    argv = sys.argv[1:] if argv is None else argv
    args, variants, steps = _parse(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    bank = GraphBank(device) if cuda else None
    g = torch.Generator(device=device).manual_seed(0)
    weights = _layer(args, device, dtype, g)
    eps, hd = 1e-5, args.head_dim
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, LAYER_GRAPHS)
    functions = {"eager": (attention_inputs, layer_output)}
    if "symbolic" in variants:
        functions["symbolic"] = tuple(
            torch.compile(f, dynamic=True) for f in (_symbolic_inputs, _symbolic_output)
        )
    if "engine" in variants:
        functions["engine"] = tuple(compiled_layer_function(f) for f in (attention_inputs, layer_output))
    if "static" in variants:
        functions["static"] = tuple(torch.compile(f, dynamic=False) for f in (_static_inputs, _static_output))

    def ms(key, step) -> float:  # a captured graph's replays on CUDA, the eager step elsewhere
        run = (lambda: bank.run(key, step)) if cuda else step
        return median_ms(run, device, args.warmup, args.repeats)

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    rows_out = []
    with torch.inference_mode():
        for r, width in steps:
            x, attn = rand(r, width, args.hidden), rand(r, width, args.heads * hd)
            head = (x, weights, rand(r, width, 1, hd), rand(r, width, 1, hd), eps, args.heads, args.kv_heads)
            positions = args.context - width + torch.arange(width, device=device)
            where = (torch.arange(r, device=device)[:, None], positions.expand(r, width).contiguous())
            row, outs = {"rows": r, "width": width}, {}
            for name, (inputs, output) in functions.items():
                caches = [torch.zeros(r, args.kv_heads, args.context, hd, device=device, dtype=dtype)
                          for _ in range(2)]  # fmt: skip
                step = functools.partial(_layer_step, inputs, output, head, caches, where, attn)
                row[f"{name}_ms"] = ms((name, r, width), step)
                outs[name] = [t.float() for t in (*step(), *caches)]
            for name in functions.keys() - {"eager"}:
                pairs = zip(outs[name], outs["eager"])
                row[f"{name}_agrees"] = all(torch.allclose(a, b, rtol=2e-2, atol=2e-2) for a, b in pairs)
            rows_out.append(row)
    report = {
        **provenance("dspark.bench.layer_compile", argv, device),
        "dtype": str(dtype).replace("torch.", ""),
        "layer": {k: getattr(args, k) for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")},
        "context": args.context,
        "variants": list(functions),
        "steps": rows_out,
    }
    nan = float("nan")
    header = ["step (rows x width)", *[f"{v} µs" for v in functions], "engine / symbolic"]
    cells = [[f"{s['rows']} x {s['width']}", *[f"{s[f'{v}_ms'] * 1e3:.1f}" for v in functions],
              f"{s.get('engine_ms', nan) / s.get('symbolic_ms', nan):.2f}"] for s in rows_out]  # fmt: skip
    publish(args.out, report, header, cells)
    return report


if __name__ == "__main__":
    from ..cli import user_errors

    with user_errors():
        main()
