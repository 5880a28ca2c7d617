"""The measured frontier: the real engine per policy and concurrency, its decode rounds timed
(python -m dspark.schedule mode=measured, python -m dspark.bench.e2e). The analytical frontier,
from recorded rounds, is ``dspark.scheduling.replay``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from ..core.progress import progress_bar
from ..decoding.engine import Request
from ..decoding.fast_engine import build_engine
from ..scheduling.cost import CostModel
from ..scheduling.policies import Policy

log = logging.getLogger(__name__)

__all__ = ["measure", "speedup_rows"]


def measure(
    target,
    drafter,
    policies: Mapping[str, Policy],
    concurrency: Sequence[int],
    prompts: Sequence[Sequence[int]],
    *,
    cost: CostModel | None = None,
    calibration=None,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    warmup: bool = True,
    progress: bool = False,
    engine_kind: str = "plain",
    engine_kw: dict | None = None,
) -> dict[str, list[dict]]:
    """Run the engine per policy and concurrency; time its decode rounds.

    Prompts are repeated to fill at least R slots. Throughput = tokens emitted by decode rounds /
    their summed wall time (prefill is excluded: no policy changes it, and the analytical mode does
    not model it); tok/s/user = mean over requests of its tokens / the time of the rounds it was in
    (the tail, when fewer than R requests remain, counts: that is how a finite job behaves)."""
    if not prompts:
        raise ValueError("measured mode needs at least one prompt")
    first = next(iter(policies.values()))

    def engine(R: int, n_new: int):
        return build_engine(
            engine_kind,
            target,
            drafter,
            first,
            temperature=temperature,
            concurrency=R,
            max_new_tokens=n_new,
            calibration=calibration,
            cost=cost,
            seed=seed,
            **(engine_kw or {}),
        )

    if warmup:  # one-off costs (allocator growth, lazy kernels) stay out of the first point
        engine(1, 2).generate([list(prompts[0])])
    out: dict[str, list[dict]] = {name: [] for name in policies}
    bar = progress_bar(len(concurrency) * len(policies), "measure", progress)
    for R in concurrency:
        R = int(R)
        eng = None  # drop the previous R's caches (and graphs) before building this one's
        eng = engine(R, max_new_tokens)  # one engine serves every policy: a fast engine keeps its graphs
        n = max(len(prompts), R)
        reqs = [Request(prompt=list(prompts[i % len(prompts)]), id=i) for i in range(n)]
        for name, pol in policies.items():
            eng.set_policy(pol)
            eng.generator.manual_seed(seed)
            if hasattr(eng, "prepare"):
                eng.prepare(reqs)  # captures CUDA graphs before the timed run
            res = eng.generate(reqs)
            step_s = {s["step"]: s["ms"] * 1e-3 for s in res.steps}
            total_s = sum(step_s.values())
            toks: dict = {}
            secs: dict = {}
            for rec in res.rounds:
                toks[rec.request] = toks.get(rec.request, 0) + rec.emitted
                secs[rec.request] = secs.get(rec.request, 0.0) + step_s[rec.step]
            emitted = sum(toks.values())
            users = [toks[r] / secs[r] for r in toks if secs[r] > 0]
            rounds = max(len(res.rounds), 1)
            out[name].append(
                {
                    "concurrency": R,
                    "throughput": emitted / total_s if total_s > 0 else float("nan"),
                    "tps_per_user": float(np.mean(users)) if users else float("nan"),
                    "budget": sum(r.proposed for r in res.rounds) / rounds,
                    "tau": sum(r.accepted + 1 for r in res.rounds) / rounds,
                }
            )
            log.info("%s R=%d: %s", name, R, out[name][-1])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return out


def speedup_rows(base: list[dict], runs: dict[str, list[dict]], label: str) -> list[dict]:
    """Per concurrency: the target-only point, then each policy's (``<label>/<policy>``) with its
    speed-up over target-only at the same R, per user and in aggregate."""
    rows = []
    for i, b in enumerate(base):
        rows.append({"run": "target_only", **b})
        for name, points in runs.items():
            p = points[i]
            rows.append(
                {
                    "run": f"{label}/{name}",
                    **p,
                    "speedup_per_user": p["tps_per_user"] / b["tps_per_user"],
                    "speedup_throughput": p["throughput"] / b["throughput"],
                }
            )
    return rows
