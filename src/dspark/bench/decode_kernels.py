"""The decoding kernels against what they replace, each step timed as replays of a captured CUDA
graph (what a round pays for it inside its graph):

* a greedy drafted position of a Markov head at the target's vocabulary and rank: the compiled
  ops ``DSparkDrafter.position_argmax`` runs (the W1 gather, the bias GEMM, the sum, the argmax in
  vocabulary slices) against ``kernels.bias_argmax`` gathering the features itself, per row count;
* top-p at data generation's row counts: the sort (``kernels.nucleus.nucleus_reference``) against
  ``kernels.nucleus``, beside the plain softmax both follow;
* the draft step's LM-head GEMM over a block's positions, in the layout the draft step has them
  (position-major [n, R, d], transposed from [R, n, d]): ``x @ W^T`` as ``torch.matmul`` runs it
  (``batched_ms``: at R = 1 a batched GEMM reading the head once per position, what the draft step
  ran before ``drafters.base.head_product``) against ``head_product`` (``folded_ms``: one GEMM), with
  the head's bytes at the H200's bandwidth as the floor (``lm_head_floor_ms``).

    python -m dspark.bench.decode_kernels [--rows 1,4,16,64] [--topp-rows 64,256,1024] \\
        [--head-positions 7,8] [--hidden 576] [--vocab 49152] [--rank 256] [--top-p 0.9] \\
        [--out decode_kernels.json]

Each row also says whether the kernel agreed with its reference on those inputs. The kernels run on
CUDA only (or under Triton's interpreter): elsewhere the references alone are timed, eagerly.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ..core.sampling import greedy_tokens
from .common import median_ms, publish

__all__ = ["main"]


def _parse(argv):
    what = "The decoding kernels against what they replace, timed as CUDA-graph replays."
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.decode_kernels", description=what)
    ap.add_argument("--rows", default="1,4,16,64", help="rows of the greedy drafted position")
    ap.add_argument("--topp-rows", default="64,256,1024", help="rows of the top-p filter")
    ap.add_argument("--head-positions", default="7,8", help="positions of the draft step's LM-head GEMM")
    ap.add_argument("--hidden", type=int, default=576, help="the LM head's input width (SmolLM2-135M: 576)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=0.7, help="the softmax before top-p")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="decode_kernels.json")
    return ap.parse_args(argv)


def _markov_position(base, table, weight, prev):
    """What the compiled greedy step computes for a Markov head (``position_argmax``)."""
    bias = F.linear(F.embedding(prev, table), weight)
    return greedy_tokens(base.float() + bias.float())


def main(argv=None) -> dict:
    import sys

    from ..core.provenance import provenance
    from ..decoding.graphs import GraphBank
    from ..drafters.base import head_product
    from ..kernels.bias_argmax import bias_argmax, near_greedy
    from ..kernels.nucleus import nucleus, nucleus_reference

    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    bank = GraphBank(device) if cuda else None

    def ms(key, step) -> float:  # a captured graph's replays on CUDA, the eager step elsewhere
        run = (lambda: bank.run(key, step)) if cuda else step
        return median_ms(run, device, args.warmup, args.repeats)

    g = torch.Generator(device=device).manual_seed(0)
    v, k = args.vocab, args.rank
    table = (torch.randn(v, k, device=device, generator=g) * 0.02).to(dtype)
    weight = (torch.randn(v, k, device=device, generator=g) * 0.05).to(dtype)
    compiled = torch.compile(_markov_position, fullgraph=True, dynamic=False) if cuda else _markov_position
    greedy, topp, head = [], [], []
    lm_weight = (torch.randn(v, args.hidden, device=device, generator=g) * 0.02).to(dtype)
    with torch.inference_mode():
        # The draft step's LM head over its positions at once (``sample_block_fused``: [n, R, d] @ W^T):
        # at one row a thin GEMM that reads the whole head, so its floor is the head's bytes.
        for r in [int(x) for x in args.rows.split(",") if x]:
            for n in [int(x) for x in args.head_positions.split(",") if x]:
                # As draft_hidden returns it: at R = 1 .contiguous() keeps the transpose's strides.
                x = torch.randn(r, n, args.hidden, device=device, generator=g).to(dtype).transpose(0, 1)
                x = x.contiguous()

                def batched(x=x):
                    return x @ lm_weight.t()

                def folded(x=x):
                    return head_product(x, lm_weight)

                agrees = bool(torch.allclose(batched().float(), folded().float(), rtol=2e-2, atol=2e-2))
                head.append({"rows": r, "positions": n, "batched_ms": ms(("batched", r, n), batched),
                             "folded_ms": ms(("folded", r, n), folded), "agrees": agrees})  # fmt: skip
        for r in [int(x) for x in args.rows.split(",") if x]:
            base = (4 * torch.randn(r, v, device=device, generator=g)).to(dtype)
            prev = torch.randint(0, v, (r,), device=device, generator=g)
            ops = (base, weight, table, prev)

            def replaced(base=base, prev=prev):
                return compiled(base, table, weight, prev)

            def kernel(ops=ops):
                return bias_argmax(*ops, impl="triton")

            row = {"rows": r, "compiled_ms": ms(("position", r), replaced)}
            if cuda:
                row.update(kernel_ms=ms(("bias_argmax", r), kernel), agrees=near_greedy(kernel(), *ops))
            greedy.append(row)
        for r in [int(x) for x in args.topp_rows.split(",") if x]:
            logits = 4 * torch.randn(r, v, device=device, generator=g)

            def softmax(logits=logits):
                return torch.softmax(logits / args.temperature, -1)

            def sort(softmax=softmax):
                return nucleus_reference(softmax(), args.top_p)

            def filtered(softmax=softmax):
                return nucleus(softmax(), args.top_p, impl="triton")

            row = {"rows": r, "softmax_ms": ms(("softmax", r), softmax), "sort_ms": ms(("sort", r), sort)}
            if cuda:
                agrees = bool(torch.equal(filtered() > 0, sort() > 0))
                row.update(kernel_ms=ms(("nucleus", r), filtered), agrees=agrees)
            topp.append(row)
    report = {
        **provenance("dspark.bench.decode_kernels", argv, device),
        "dtype": str(dtype).replace("torch.", ""),
        "vocab": v,
        "rank": k,
        "top_p": args.top_p,
        "temperature": args.temperature,
        "greedy_position": greedy,
        "top_p_filter": topp,
        "lm_head": head,
        "lm_head_floor_ms": 1e3 * lm_weight.numel() * lm_weight.element_size() / 4.8e12,  # H200: 4.8 TB/s
    }
    nan = float("nan")
    cells = [[f"greedy position, R = {r['rows']}", f"{r['compiled_ms'] * 1e3:.1f}",
              f"{r.get('kernel_ms', nan) * 1e3:.1f}", str(r.get("agrees", "-"))] for r in greedy]  # fmt: skip
    cells += [[f"top-p {args.top_p}, R = {r['rows']} (softmax {r['softmax_ms'] * 1e3:.1f})",
               f"{r['sort_ms'] * 1e3:.1f}", f"{r.get('kernel_ms', nan) * 1e3:.1f}",
               str(r.get("agrees", "-"))] for r in topp]  # fmt: skip
    cells += [[f"LM head, {r['positions']} positions x R = {r['rows']} (matmul / one GEMM)",
               f"{r['batched_ms'] * 1e3:.1f}", f"{r['folded_ms'] * 1e3:.1f}",
               str(r["agrees"])] for r in head]  # fmt: skip
    publish(args.out, report, ["step", "replaced µs", "kernel µs", "agrees"], cells)
    return report


if __name__ == "__main__":
    from ..cli import user_errors

    with user_errors():
        main()
