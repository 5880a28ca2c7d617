"""H200 check: the fast engine with the Triton rejection kernel (verify_impl=auto) gives the same
tokens as with its PyTorch reference, at R=1 and R=64 (the drafter from h200_fast_path.sh). At T = 1
from the same seed: at T = 0 the fast engine's greedy rounds run neither (they compare tokens)."""

import sys

import torch

from dspark.bench.common import compose_target
from dspark.checkpoints import load_drafter
from dspark.data.benchmarks import first_turns
from dspark.decoding.fast_engine import FastEngine
from dspark.target import load_target

target = load_target(compose_target(sys.argv[2:]))
drafter = load_drafter(sys.argv[1], target, device=target.device)[0].to(target.dtype)
prompts = [target.prompt_ids(t) for t in first_turns("gsm8k", max_prompts=64)]
for r in (1, 64):
    out = {}
    for impl in ("torch", "auto"):
        eng = FastEngine(
            target, drafter, temperature=1.0, seed=0, concurrency=r, max_new_tokens=64, verify_impl=impl
        )
        res = eng.generate(prompts[: max(r, 8)])
        out[impl] = [g.tokens for g in res.generations]
        print(f"R={r} verify_impl={impl}: tau={res.tau:.3f} wall={res.wall_s:.2f}s", flush=True)
    print(f"R={r} identical tokens: {out['torch'] == out['auto']}", flush=True)
torch.cuda.synchronize()
