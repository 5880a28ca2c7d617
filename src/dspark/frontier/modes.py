"""The ways to the frontier: replaying recorded rounds against a cost table (analytical,
dspark.scheduling.replay), running the engine at each concurrency (measured, dspark.bench.measure),
profiling the target and the drafter into a cost table first when none is given, or reading the
rows a ``python -m dspark.bench.e2e`` run measured (e2e)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig

from ..artifacts import DrafterFolder, FrontierFolder, load_calibration
from ..bench.measure import measure
from ..bench.profile import profile_drafter, profile_target, settle_profile
from ..checkpoints import load_drafter
from ..core.errors import ConfigError, DataError
from ..data.benchmarks import first_turns
from ..data.vocab_counts import load_draft_vocab, served_vocab_size, vocab_record
from ..scheduling.cost import CostModel
from ..scheduling.policies import Fixed, build_policy
from ..scheduling.replay import ReplayError, load_rounds, replay
from ..target import load_target
from .checks import load_cost, sweep_gamma, sweep_policies, synthetic_cost

log = logging.getLogger(__name__)


def run_analytical(cfg: DictConfig) -> tuple[dict, dict, CostModel, dict]:
    calibration = None if cfg.calibration is None else load_calibration(str(cfg.calibration))
    rounds_arg = cfg.rounds
    paths = list(rounds_arg) if isinstance(rounds_arg, ListConfig) else [str(rounds_arg)]
    try:
        rounds = load_rounds(paths, calibration)
    except ReplayError as err:
        raise ConfigError(str(err)) from None
    gamma = sweep_gamma(cfg, rounds.gamma)
    policies = sweep_policies(cfg, gamma, rounds.gamma)
    cost = load_cost(cfg) if cfg.cost_table is not None else synthetic_cost(cfg)
    log.info("replaying %d rounds of %d requests (γ=%d)", len(rounds), len(rounds.sequences), rounds.gamma)
    try:
        frontier = replay(
            rounds,
            policies,
            cost,
            list(cfg.concurrency),
            steps=int(cfg.replay.steps),
            seed=int(cfg.seed),
            warmup=int(cfg.replay.warmup),
            outcome=str(cfg.replay.outcome),
            progress=bool(cfg.progress),
        )
    except ReplayError as err:
        raise ConfigError(str(err)) from None
    info = {"rounds": len(rounds), "requests": len(rounds.sequences), "block": rounds.gamma, "gamma": gamma}
    return frontier, policies, cost, info


def benchmark_prompts(cfg: DictConfig, target) -> list[list[int]]:
    """The measured mode's prompts, through the target's one prompt function."""
    m = cfg.measured
    texts = []
    for name in m.benchmarks:
        try:
            texts += first_turns(str(name), m.benchmark_dir, m.max_prompts)
        except DataError as err:
            raise ConfigError(f"measured.benchmarks: {err}") from None
    if not texts:
        raise ConfigError("measured mode found no prompts: set measured.benchmarks / measured.benchmark_dir")
    return [target.prompt_ids(t) for t in texts]


def run_measured(cfg: DictConfig, folder: FrontierFolder) -> tuple[dict, dict, CostModel, dict]:
    target = load_target(cfg.target)
    drafter, _ = load_drafter(cfg.drafter_dir, target, device=target.device)
    block = int(drafter.gamma)
    gamma = sweep_gamma(cfg, block)
    policies = sweep_policies(cfg, gamma, block)
    prompts = benchmark_prompts(cfg, target)  # before profiling: a missing benchmark fails fast
    calibration = DrafterFolder(str(cfg.drafter_dir)).read_calibration()
    m = cfg.measured
    vocab, coverage = load_draft_vocab(
        cfg.drafter_dir, served_vocab_size(m.get("draft_vocab"), cfg.drafter_dir), target.vocab_size,
        target.eos_token_ids,
        m.get("draft_vocab_counts"),
    )  # fmt: skip
    served = vocab_record(vocab, coverage)
    conc = [int(r) for r in cfg.concurrency]
    if cfg.cost_table is not None:
        cost = load_cost(cfg)
        mismatch = cost.draft_vocab_mismatch(served)
        if mismatch:
            log.warning(mismatch)
    else:
        cost = profiled_cost(cfg, target, drafter, gamma, vocab)
        cost.meta["draft_vocab"] = served
    cost.save(folder.cost_table_path)
    engine_kw = {"draft_vocab": vocab}
    if m.get("engine") == "fast":
        engine_kw["compile"] = m.get("compile")
    frontier = measure(
        target,
        drafter,
        policies,
        conc,
        prompts,
        cost=cost,
        calibration=calibration,
        temperature=float(m.temperature),
        max_new_tokens=int(m.max_new_tokens),
        seed=int(cfg.seed),
        warmup=bool(m.warmup),
        repeats=int(m.repeats),
        progress=bool(cfg.progress),
        engine_kind=str(m.get("engine", "plain")),
        engine_kw=engine_kw,
    )
    info = {"prompts": len(prompts), "block": block, "gamma": gamma, "device": str(target.device),
            "draft_vocab": served}  # fmt: skip
    return frontier, policies, cost, info


def profiled_cost(cfg: DictConfig, target, drafter, gamma: int, draft_vocab=None) -> CostModel:
    """The cost table timed here: the target's verification step over token batch sizes at
    ``context_len`` (and the drafter's step per concurrency with profile.draft, over
    ``draft_vocab``'s tokens where given)."""
    conc = [int(r) for r in cfg.concurrency]
    p = cfg.profile
    sizes = list(p.batch_sizes) if p.batch_sizes else _powers_of_two(max(conc) * (gamma + 1))
    log.info("profiling the target step at context %d over B=%s", cfg.context_len, sizes)
    t0 = time.perf_counter()
    verify_ms, v_notes = settle_profile(
        lambda b: profile_target(
            target, b, int(cfg.context_len), gamma, warmup=int(p.warmup), repeats=int(p.repeats)
        ),
        sizes,
    )
    draft_ms, d_notes = (None, {})
    if p.draft:
        draft_ms, d_notes = settle_profile(
            lambda r: profile_drafter(
                target,
                drafter,
                r,
                int(cfg.context_len),
                float(cfg.measured.temperature),
                warmup=int(p.warmup),
                repeats=int(p.repeats),
                draft_vocab=draft_vocab,
            ),
            sorted(set(conc)),
        )
    return CostModel(
        verify_ms,
        draft_ms=draft_ms,
        context_len=int(cfg.context_len),
        meta={
            "source": "profiled by python -m dspark.schedule mode=measured",
            "target": target.name,
            "device": str(target.device),
            "dtype": str(target.dtype).replace("torch.", ""),
            "gamma": gamma,
            "profile_s": time.perf_counter() - t0,
            "profile_notes": {"verify": v_notes, "draft": d_notes},
            "torch": torch.__version__,
        },
    )


def run_e2e(cfg: DictConfig) -> tuple[dict, dict, CostModel, dict]:
    """The frontier an e2e benchmark measured: its rows at one temperature (``e2e_temperature``;
    null: its only one), one curve per run (target-only and each policy), priced with the cost
    table it ran with (``cost_table`` overrides)."""
    path = Path(str(cfg.e2e)).expanduser()
    try:
        report = json.loads(path.read_text())
        rows = report["rows"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"e2e={path}: not the json of python -m dspark.bench.e2e ({err})") from None
    temps = sorted({float(r.get("temperature", report.get("temperature", 0.0))) for r in rows})
    want = cfg.get("e2e_temperature")
    if want is None and len(temps) > 1:
        raise ConfigError(f"e2e={path} holds temperatures {temps}: pick one with e2e_temperature=<T>")
    t = temps[0] if want is None else float(want)
    if t not in temps:
        raise ConfigError(f"e2e_temperature={want}: {path} holds temperatures {temps}")
    frontier: dict[str, list[dict]] = {}
    for r in rows:
        if float(r.get("temperature", report.get("temperature", 0.0))) == t:
            frontier.setdefault(r["run"].split("/")[-1], []).append(r)
    policies = {n: Fixed(0) if n == "target_only" else build_policy(n) for n in frontier}
    if cfg.cost_table is not None:
        cost = load_cost(cfg)
    elif report.get("cost_table"):
        cost = CostModel.from_dict(report["cost_table"])
    else:
        raise ConfigError(f"e2e={path} ran without a cost table: pass cost_table=<json>")
    info = {"e2e": str(path), "temperature": t, "goals": report.get("goals", {}).get(f"{t:g}")}
    info.update({k: report.get(k) for k in ("target", "drafter", "engine", "compiled")})
    return frontier, policies, cost, info


def _powers_of_two(top: int) -> list[int]:
    sizes, b = [], 1
    while b < top:
        sizes.append(b)
        b *= 2
    return sizes + [top]
