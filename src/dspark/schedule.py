"""python -m dspark.schedule mode=analytical rounds=<evaluation folder | rounds.jsonl> cost_table=<json>|null
python -m dspark.schedule mode=measured drafter_dir=<checkpoint> target=<target> [cost_table=<json>]

Sweeps concurrency R for each verification-length policy and writes into out_dir:
  frontier.json            {"mode", "cost_table", "policies": {name: [{"concurrency", "throughput",
                           "tps_per_user", "budget", "tau"}]}} (cost_table: the CostModel's JSON)
  fig7_frontier.png/.json  aggregate throughput vs tok/s/user, one curve per policy (Fig. 7), with
                           the check whether hardware_aware's frontier dominates every fixed-γ one
  fig8_budget.png/.json    throughput and mean verification budget vs concurrency (Fig. 8)
  cost_table.json          measured mode: the profiled (or given) table
  meta.json                command, commit, machine, date, timings, config

Analytical mode replays recorded rounds (see ``dspark.scheduling.replay``); with cost_table=null
it prices them on a SYNTHETIC roofline (``analytical_cost``), which shows the shape of the
trade-off but no real hardware. Measured mode runs the engine; without a cost table it first
profiles the target's verification step over token batch sizes at ``context_len`` (and the
drafter per R), which the load-aware policies then use.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from .cli import user_errors
from .core.errors import ConfigError
from .core.provenance import provenance

log = logging.getLogger(__name__)

FRONTIER_KEYS = ("concurrency", "throughput", "tps_per_user", "budget", "tau")


# ----------------------------------------------------------------------------------------------
# checks that run before any model loads


def check_config(cfg: DictConfig) -> None:

    if cfg.mode not in ("analytical", "measured"):
        raise ConfigError(f"mode must be 'analytical' or 'measured', got '{cfg.mode}'")
    conc = list(cfg.concurrency) if isinstance(cfg.concurrency, ListConfig) else [cfg.concurrency]
    if not conc or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in conc):
        raise ConfigError(f"concurrency must be a list of integers >= 1, got {cfg.concurrency}")
    if not cfg.policies:
        raise ConfigError("policies is empty: e.g. policies=[mtp1,fixed,hardware_aware]")
    if cfg.gamma is not None and int(cfg.gamma) < 1:
        raise ConfigError(f"gamma must be >= 1 (or null for the drafter's block), got {cfg.gamma}")
    policies = _policies(cfg)  # names and arguments; γ bounds are checked once the block is known
    for name, policy in policies.items():
        if not policy.lossless:
            log.warning("policy %s is NOT lossless (Appendix A); it is a diagnostic upper bound", name)
    if cfg.cost_table is not None and not Path(str(cfg.cost_table)).expanduser().is_file():
        raise ConfigError(f"cost_table={cfg.cost_table}: no such file (null: synthetic / profile)")
    if cfg.mode == "analytical":
        if cfg.rounds is None:
            raise ConfigError(
                "rounds is required in analytical mode: rounds=<evaluation folder or rounds.jsonl> "
                "(python -m dspark.evaluate policy=fixed policy.gamma=null writes one)"
            )
        if int(cfg.replay.steps) < 1 or int(cfg.replay.warmup) < 0:
            raise ConfigError(f"replay.steps must be >= 1 and replay.warmup >= 0, got {cfg.replay}")
        if cfg.replay.outcome not in ("recorded", "expected"):
            raise ConfigError(f"replay.outcome must be 'recorded' or 'expected', got '{cfg.replay.outcome}'")
        if cfg.calibration is not None and not Path(str(cfg.calibration)).expanduser().exists():
            raise ConfigError(f"calibration={cfg.calibration}: no such file")
    else:
        if cfg.drafter_dir is None:
            raise ConfigError("drafter_dir is required in measured mode: drafter_dir=<checkpoint dir>")
        spec = _drafter_spec(cfg)
        needy = [name for name, p in policies.items() if p.needs_confidence]
        if needy and not spec.has_confidence:
            raise ConfigError(
                f"policies {needy} need confidences, but the {spec.kind} drafter in {cfg.drafter_dir} has "
                "no confidence head: keep fixed/mtp1 policies only"
            )
        if int(cfg.measured.max_new_tokens) < 1 or float(cfg.measured.temperature) < 0:
            raise ConfigError("measured.max_new_tokens must be >= 1 and measured.temperature >= 0")
        if int(cfg.context_len) < 1:
            raise ConfigError(f"context_len must be >= 1, got {cfg.context_len}")


def _drafter_spec(cfg: DictConfig):
    folder = Path(str(cfg.drafter_dir)).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"drafter_dir={folder} is not a drafter checkpoint (no config.json there)")
    from .checkpoints import read_drafter_spec  # ours, or a DeepSpec/engine-format folder (translated)

    return read_drafter_spec(folder)


def _gamma(cfg: DictConfig, block: int) -> int:
    g = block if cfg.gamma is None else int(cfg.gamma)
    if g > block:
        raise ConfigError(f"gamma={g} exceeds the drafter's block size {block}: set gamma<={block} or null")
    return g


def _policies(cfg: DictConfig, gamma: int | None = None, block: int | None = None) -> dict:
    from .scheduling.policies import build_policy

    defaults = {"threshold": float(cfg.threshold), "delay": int(cfg.async_delay), "check": False}
    out = {}
    for spec in cfg.policies:
        try:
            out[str(spec)] = build_policy(str(spec), gamma=gamma, block=block, defaults=defaults)
        except ConfigError as err:
            raise ConfigError(f"policies: {err}") from None
    return out


def load_cost(cfg: DictConfig):
    from .scheduling.cost import CostModel, CostTableError

    path = Path(str(cfg.cost_table)).expanduser()
    try:
        cost = CostModel.load(path)
    except (CostTableError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"cost_table={cfg.cost_table}: not a valid cost table ({err})") from None
    cost.meta.setdefault("source", str(path.resolve()))
    return cost


def synthetic_cost(cfg: DictConfig):
    from .scheduling.cost import CostModel, CostTableError

    kw = OmegaConf.to_container(cfg.analytical_cost, resolve=True)
    try:
        cost = CostModel.analytical(**kw, context_len=int(cfg.context_len))
    except (CostTableError, TypeError) as err:
        raise ConfigError(f"analytical_cost: {err}") from None
    cost.meta["source"] = "synthetic roofline (CostModel.analytical), not a measurement"
    log.warning(
        "cost_table=null: pricing rounds on a SYNTHETIC roofline %s; the frontier shows the shape of "
        "the trade-off, not any real hardware. Profile one with mode=measured.",
        kw,
    )
    return cost


# ----------------------------------------------------------------------------------------------
# modes


def run_analytical(cfg: DictConfig) -> tuple[dict, dict, object, dict]:
    from .scheduling.replay import ReplayError, load_rounds, replay

    temps = None
    if cfg.calibration is not None:
        from .artifacts import load_calibration

        temps = load_calibration(str(cfg.calibration)).temperatures
    rounds_arg = cfg.rounds
    paths = list(rounds_arg) if isinstance(rounds_arg, ListConfig) else [str(rounds_arg)]
    try:
        rounds = load_rounds(paths, temperatures=temps)
    except ReplayError as err:
        raise ConfigError(str(err)) from None
    gamma = _gamma(cfg, rounds.gamma)
    policies = _policies(cfg, gamma, rounds.gamma)
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


def _prompts(cfg: DictConfig, target) -> list[list[int]]:
    from .core.errors import DataError
    from .data.benchmarks import first_turns

    chat_kw = cfg.target.get("chat_template_kwargs")
    chat_kw = OmegaConf.to_container(chat_kw, resolve=True) if chat_kw else {}
    m = cfg.measured
    texts = []
    for name in m.benchmarks:
        try:
            texts += first_turns(str(name), m.benchmark_dir, m.max_prompts)
        except DataError as err:
            raise ConfigError(f"measured.benchmarks: {err}") from None
    if not texts:
        raise ConfigError("measured mode found no prompts: set measured.benchmarks / measured.benchmark_dir")
    return [target.chat_ids([{"role": "user", "content": t}], **chat_kw) for t in texts]


def run_measured(cfg: DictConfig, out: Path) -> tuple[dict, dict, object, dict]:
    import torch

    from .artifacts import DrafterFolder, FrontierFolder
    from .bench.measure import measure
    from .bench.profile import profile_drafter, profile_target, settle_profile
    from .checkpoints import load_drafter
    from .scheduling.cost import CostModel
    from .target import load_target

    target = load_target(cfg.target)
    drafter, _ = load_drafter(cfg.drafter_dir, target, device=target.device)
    block = int(drafter.gamma)
    gamma = _gamma(cfg, block)
    policies = _policies(cfg, gamma, block)
    prompts = _prompts(cfg, target)  # before profiling: a missing benchmark fails fast
    calibration = DrafterFolder(str(cfg.drafter_dir)).read_calibration()
    conc = [int(r) for r in cfg.concurrency]
    if cfg.cost_table is not None:
        cost = load_cost(cfg)
    else:
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
                ),
                sorted(set(conc)),
            )
        cost = CostModel(
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
    cost.save(FrontierFolder(out).cost_table_path)
    frontier = measure(
        target,
        drafter,
        policies,
        conc,
        prompts,
        cost=cost,
        calibration=calibration,
        temperature=float(cfg.measured.temperature),
        max_new_tokens=int(cfg.measured.max_new_tokens),
        seed=int(cfg.seed),
        warmup=bool(cfg.measured.warmup),
        progress=bool(cfg.progress),
        engine_kind=str(cfg.measured.get("engine", "plain")),
    )
    info = {"prompts": len(prompts), "block": block, "gamma": gamma, "device": str(target.device)}
    return frontier, policies, cost, info


def _powers_of_two(top: int) -> list[int]:
    sizes, b = [], 1
    while b < top:
        sizes.append(b)
        b *= 2
    return sizes + [top]


# ----------------------------------------------------------------------------------------------
# outputs


def write_outputs(
    cfg: DictConfig, out: Path, frontier: dict, policies: dict, cost, info: dict, started: float
) -> dict:
    from .artifacts import FrontierFolder
    from .reporting.frontier_plots import budget_plot, frontier_plot
    from .scheduling.policies import HardwareAware
    from .scheduling.replay import dominance

    points = {name: [{k: p[k] for k in FRONTIER_KEYS} for p in pts] for name, pts in frontier.items()}
    result = {"mode": str(cfg.mode), "cost_table": cost.to_dict(), "policies": points}
    folder = FrontierFolder(out)
    folder.write_frontier(result)

    fixed = [n for n, p in policies.items() if not p.needs_confidence]  # fixed lengths: fixed_<g>, mtp1
    ha = next((n for n, p in policies.items() if isinstance(p.base, HardwareAware)), None)
    check = None
    if ha is not None and fixed:
        misses = dominance(points, ha, fixed)
        check = {
            "policy": ha,
            "against": fixed,
            "dominates": not misses,
            "not_dominated": misses,
            "definition": f"a point of another policy counts as dominated when some {ha} point has "
            "throughput and tok/s/user both >= it",
        }
        if misses:
            log.warning("%s does not dominate %d fixed-length points: %s", ha, len(misses), misses)
    synthetic = cost.meta.get("analytical") is not None
    tag = f"{cfg.mode}{' (synthetic roofline cost)' if synthetic else ''}"
    frontier_plot(
        points,
        out / "fig7_frontier.png",
        title=f"Throughput vs interactivity — {tag}",
        data={
            "mode": str(cfg.mode),
            "x": "tps_per_user",
            "y": "throughput",
            "policies": points,
            "dominance": check,
            **info,
        },
    )
    budget_plot(
        points,
        out / "fig8_budget.png",
        title=f"Throughput and budget vs concurrency — {tag}",
        data={
            "mode": str(cfg.mode),
            "x": "concurrency",
            "y": ["throughput", "budget"],
            "budget": "mean draft tokens verified per request per round (paper's Fig. 8 adds the anchor: +1)",
            "policies": points,
            **info,
        },
    )
    folder.write_meta(
        {
            **provenance("dspark.schedule"),
            "wall_s": time.time() - started,
            **info,
            "config": OmegaConf.to_container(cfg, resolve=True),
        },
    )
    return result


def run(cfg: DictConfig) -> dict:
    check_config(cfg)
    started = time.time()
    out = Path(str(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    if cfg.mode == "analytical":
        frontier, policies, cost, info = run_analytical(cfg)
    else:
        frontier, policies, cost, info = run_measured(cfg, out)
    result = write_outputs(cfg, out, frontier, policies, cost, info, started)
    for name, pts in result["policies"].items():
        log.info(
            "%-16s %s",
            name,
            "  ".join(f"R={p['concurrency']}: {p['throughput']:.0f} tok/s, τ={p['tau']:.2f}" for p in pts),
        )
    log.info("frontier in %s", out)
    return result


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="schedule")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
