"""python -m dspark.evaluate drafter_dir=<checkpoint dir> benchmarks=[gsm8k,mt-bench] temperature=1.0 \
    policy=fixed policy.gamma=7 [calibrate=true]

Speculative decoding of benchmark prompts with a saved drafter; writes into the output folder:
  results.json                 τ per benchmark, position-wise acceptance, macro averages (issue 5)
  table.md                     paper Table 1 layout
  acceptance_by_position.png/.json   conditional acceptance per draft position (Fig. 2)
  threshold_sweep.png/.json    tokens per step and acceptance rate vs threshold (Fig. 5; drafters
                               with a confidence head)
  rounds.jsonl                 one line per request per round (the engine's RoundRecord + benchmark)
  generations.jsonl            decoded outputs; meta.json: command, commit, machine, timings
  calibration.json, reliability.png/.json   with calibrate=true (issue 6)

The issue writes ``drafter=<dir>``; here it is ``drafter_dir=<dir>`` because ``drafter`` is a config
group of the train entry point and the two must not mean different things.

Calibration split (calibrate=true): held-out prompts that never count in the report. With
``calibration.file`` (a turns-JSONL file, or a folder of them) those prompts are used; otherwise the
LAST ``calibration.prompts`` prompts of each benchmark, so the reported prompts (the first
``max_prompts``) are the same whether or not calibration runs. Calibration rollouts verify the whole
block (fixed γ) so every position gets a label; STS is fitted on them, the benchmark rollouts then
use the fitted temperatures, and calibration.json reports raw vs calibrated metrics on the benchmark
rounds (held out from the fit). ``calibration.save_to_drafter=true`` also writes the temperatures
into the drafter folder, where every later engine picks them up.
"""

from __future__ import annotations

import logging
import time
import zlib
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .cli import user_errors
from .core.errors import ConfigError
from .core.provenance import provenance
from .scheduling.policies import Fixed, build_policy

log = logging.getLogger(__name__)

# Paper Table 1 suites that the shared loader (dspark.data.benchmarks.DOMAINS) may not list yet.
EXTRA_DOMAINS = {"livecodebench": "code", "lcb": "code", "alpaca": "chat", "arena-hard": "chat"}


# ----------------------------------------------------------------------------------------------
# checks that run before any model loads


def check_config(cfg: DictConfig) -> dict:
    """Validate the config against the drafter checkpoint's config.json; returns that config."""
    if OmegaConf.is_missing(cfg, "drafter_dir") or cfg.get("drafter_dir") is None:
        raise ConfigError(
            "drafter_dir is required: python -m dspark.evaluate drafter_dir=<checkpoint dir>"
        )
    folder = Path(str(cfg.drafter_dir)).expanduser()
    if not (folder / "config.json").exists():
        raise ConfigError(f"drafter_dir={folder} is not a drafter checkpoint (no config.json there)")
    from .checkpoints import read_drafter_config
    from .drafters import DrafterSpec, static_cache_drafters

    dconf = read_drafter_config(folder)
    spec = DrafterSpec.from_config(dconf)
    if not cfg.benchmarks:
        raise ConfigError("benchmarks is empty: e.g. benchmarks=[gsm8k,mt-bench]")
    if float(cfg.temperature) < 0:
        raise ConfigError(f"temperature must be >= 0, got {cfg.temperature}")
    if int(cfg.concurrency) < 1:
        raise ConfigError(f"concurrency must be >= 1, got {cfg.concurrency}")
    if int(cfg.max_new_tokens) < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    engine = str(cfg.get("engine", "plain"))
    if engine not in ("plain", "fast"):
        raise ConfigError(f"engine={engine} is not one of plain, fast")
    if engine == "fast" and not spec.supports_static_cache:
        raise ConfigError(
            f"engine=fast drafts with block drafters ({', '.join(static_cache_drafters())}); "
            f"{spec.kind} runs on engine=plain"
        )
    policy = build_policy(cfg.policy)
    gamma = spec.gamma
    has_conf = spec.has_confidence
    if isinstance(policy, Fixed) and policy.gamma is not None and policy.gamma > gamma:
        raise ConfigError(
            f"policy.gamma={policy.gamma} exceeds the drafter's block size {gamma}: "
            f"set policy.gamma<={gamma} (or policy.gamma=null for the whole block)"
        )
    if policy.needs_confidence and not has_conf:
        raise ConfigError(
            f"policy={policy.name} needs confidences, but the drafter in {folder} ({spec.kind}) "
            f"has no confidence head: use policy=fixed or policy=mtp1"
        )
    if policy.needs_cost and not cfg.policy.get("cost_table"):
        raise ConfigError(
            f"policy={policy.name} needs a profiled cost table: "
            f"set policy.cost_table=<json> (python -m dspark.schedule)"
        )
    if cfg.calibrate and not has_conf:
        raise ConfigError(
            f"calibrate=true needs a drafter with a confidence head; {folder} holds a "
            f"{spec.kind} drafter without one"
        )
    if cfg.calibrate and not cfg.calibration.get("file") and int(cfg.calibration.prompts) < 1:
        raise ConfigError("calibrate=true needs calibration.prompts >= 1 or calibration.file=<jsonl>")
    return dconf


# ----------------------------------------------------------------------------------------------
# benchmarks


def first_turns(name: str, folder) -> list[str]:
    """First user turn of each row (the paper evaluates the first turn): ``<folder>/<name>.jsonl``,
    else the hub (dspark.data.benchmarks)."""
    from .data.benchmarks import first_turns as shared_first_turns

    return shared_first_turns(name, folder)


def domain_map(names) -> dict[str, str]:
    from .data.benchmarks import DOMAINS

    table = {**EXTRA_DOMAINS, **DOMAINS}
    return {n: table[n] for n in names if n in table}


def split_prompts(cfg: DictConfig) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Reported prompts per benchmark and the held-out calibration prompts (benchmark, text)."""
    report, calib = {}, []
    n_cal = int(cfg.calibration.prompts) if cfg.calibrate and not cfg.calibration.get("file") else 0
    for name in cfg.benchmarks:
        prompts = first_turns(str(name), cfg.benchmark_dir)
        if n_cal:
            if len(prompts) <= n_cal:
                raise ConfigError(
                    f"benchmark {name} has {len(prompts)} prompts, too few to hold out "
                    f"calibration.prompts={n_cal}"
                )
            calib += [(str(name), p) for p in prompts[-n_cal:]]
            prompts = prompts[:-n_cal]
        report[str(name)] = prompts if cfg.max_prompts is None else prompts[: int(cfg.max_prompts)]
    if cfg.calibrate and cfg.calibration.get("file"):
        from .data.io import resolve_path

        src = resolve_path(str(cfg.calibration.file))
        files = sorted(src.glob("*.jsonl")) if src.is_dir() else [src]
        if not files or not all(f.exists() for f in files):
            raise ConfigError(f"calibration.file={cfg.calibration.file}: no turns-JSONL file there")
        for f in files:
            calib += [(f.stem, p) for p in first_turns(f.stem, f.parent)]
    return report, calib


# ----------------------------------------------------------------------------------------------
# run


def run(cfg: DictConfig) -> dict:
    dconf = check_config(cfg)
    import torch

    from .artifacts import DrafterFolder, EvaluationFolder
    from .calibration.sts import Calibration
    from .checkpoints import load_drafter
    from .decoding.engine import (
        Request,
        calibration_arrays,
        conditional_acceptance,
        tau,
        threshold_sweep,
    )
    from .decoding.fast_engine import build_engine
    from .drafters import DrafterSpec
    from .reporting.plots import acceptance_by_position_plot, threshold_sweep_plot
    from .reporting.tables import table1
    from .scheduling.cost import CostModel
    from .target import load_target

    folder = EvaluationFolder(str(cfg.out_dir))
    out = folder.path
    out.mkdir(parents=True, exist_ok=True)
    report_prompts, calib_prompts = split_prompts(cfg)  # before the models: a missing file fails fast
    started = time.time()
    target = load_target(cfg.target)
    drafter, _ = load_drafter(cfg.drafter_dir, target, device=target.device)
    drafter_folder = DrafterFolder(str(cfg.drafter_dir))
    calibration = drafter_folder.read_calibration()
    policy = build_policy(cfg.policy)
    cost = CostModel.load(cfg.policy.cost_table) if cfg.policy.get("cost_table") else None
    chat_kw = cfg.target.get("chat_template_kwargs")
    chat_kw = OmegaConf.to_container(chat_kw, resolve=True) if chat_kw else {}
    has_conf = drafter.has_confidence

    def requests(prompts, tag):
        return [
            Request(prompt=target.chat_ids([{"role": "user", "content": p}], **chat_kw), id=f"{tag}/{i}")
            for i, p in enumerate(prompts)
        ]

    def engine(policy_, calibration_, name):
        gen = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + zlib.crc32(name.encode()))
        return build_engine(
            str(cfg.get("engine", "plain")),
            target,
            drafter,
            policy_,
            temperature=float(cfg.temperature),
            concurrency=int(cfg.concurrency),
            max_new_tokens=int(cfg.max_new_tokens),
            calibration=calibration_,
            cost=cost,
            generator=gen,
            progress=bool(cfg.progress),
            desc=name,
        )

    calib_report = None
    if cfg.calibrate:
        # Full blocks, raw confidences: every position gets a label and the fit starts from scratch.
        reqs = [
            Request(
                prompt=target.chat_ids([{"role": "user", "content": p}], **chat_kw), id=f"calibration/{b}/{i}"
            )
            for i, (b, p) in enumerate(calib_prompts)
        ]
        calib_engine = engine(Fixed(None), None, "calibration")
        if cfg.calibration.get("max_new_tokens"):
            calib_engine.max_new_tokens = int(cfg.calibration.max_new_tokens)
        calib_res = calib_engine.generate(reqs)
        z, y, valid = calibration_arrays(calib_res.rounds)
        calibration = Calibration.fit(z, y, valid, n_bins=int(cfg.calibration.n_bins))
        log.info(
            "STS temperatures %s from %d calibration rounds", calibration.temperatures, len(calib_res.rounds)
        )
        if cfg.calibration.save_to_drafter:
            drafter_folder.write_calibration(calibration)
        calib_report = {
            "fit_rounds": len(calib_res.rounds),
            "fit_prompts": len(reqs),
            "z": z,
            "y": y,
            "valid": valid,
        }

    rounds_by_bench, timing, gens = {}, {}, {}
    with folder.recorder() as (write_round, write_generation):
        for name, prompts in report_prompts.items():
            res = engine(policy, calibration, name).generate(requests(prompts, name))
            rounds_by_bench[name] = res.rounds
            gens[name] = res.generations
            timing[name] = {
                "wall_s": res.wall_s,
                "new_tokens": res.new_tokens,
                "tokens_per_s": res.new_tokens / res.wall_s if res.wall_s else None,
            }
            for r in res.rounds:
                write_round({"benchmark": name, **r.to_dict()})
            for g in res.generations:
                write_generation(
                    {
                        "benchmark": name,
                        "id": g.id,
                        "finish": g.finish,
                        "rounds": g.rounds,
                        "accepted": g.accepted,
                        "tokens": g.tokens,
                        "text": _decode(target.tokenizer, g.tokens),
                    }
                )

    gamma = int(drafter.gamma)
    domains = domain_map(report_prompts)
    results = {
        "target": target.name,
        "drafter": DrafterSpec.from_config(dconf).label,
        "temperature": float(cfg.temperature),
        "policy": OmegaConf.to_container(cfg.policy, resolve=True),
        "benchmarks": {
            name: {
                "tau": tau(recs),
                "rounds": len(recs),
                "new_tokens": sum(len(g.tokens) for g in gens[name]),
                "accept_rate_by_position": conditional_acceptance(recs, gamma),
            }
            for name, recs in rounds_by_bench.items()
        },
    }
    results["macro"] = macro(results["benchmarks"], domains)
    folder.write_results(results)
    table = table1([results], domains)
    folder.write_table(table)

    # Fig. 2: domain panels (mean over the domain's benchmarks), the benchmarks as extra lines.
    present = [d for d in ("math", "code", "chat") if d in domains.values()]
    panels = {d: [n for n in results["benchmarks"] if domains.get(n) == d] for d in present}
    if len(panels) != 1 or len(panels[present[0]]) != len(results["benchmarks"]):
        panels["all"] = list(results["benchmarks"])
    curves = {}
    for dom, members in panels.items():
        recs = [r for n in members for r in rounds_by_bench[n]]
        curves[dom] = {results["drafter"]: conditional_acceptance(recs, gamma)}
        if len(members) > 1:
            curves[dom].update({n: results["benchmarks"][n]["accept_rate_by_position"] for n in members})
    acceptance_by_position_plot(
        curves,
        out / "acceptance_by_position.png",
        data={
            "drafter": results["drafter"],
            "positions": list(range(1, gamma + 1)),
            "benchmarks": {n: b["accept_rate_by_position"] for n, b in results["benchmarks"].items()},
            "domains": {d: c[results["drafter"]] for d, c in curves.items()},
            "definition": "P(position k accepted | positions 1..k-1 accepted), "
            "over rounds that verified position k",
        },
    )

    if has_conf:
        thresholds = [float(t) for t in cfg.thresholds]
        sweep = {
            d: threshold_sweep([r for n in m for r in rounds_by_bench[n]], thresholds)
            for d, m in panels.items()
        }
        threshold_sweep_plot(
            sweep,
            out / "threshold_sweep.png",
            data={
                "drafter": results["drafter"],
                "confidence": "calibrated (STS)" if calibration is not None else "raw",
                "rule": "verify the longest prefix with cumulative confidence >= threshold",
                "sweep": sweep,
            },
        )

    if calib_report is not None:
        n_bins = int(cfg.calibration.n_bins)
        write_calibration_report(folder, calibration, calib_report, rounds_by_bench, n_bins)

    meta = {
        **provenance("dspark.evaluate", device=target.device),
        "drafter_dir": str(Path(str(cfg.drafter_dir)).resolve()),
        "calibration_temperatures": None if calibration is None else calibration.temperatures,
        "report_prompts": {n: len(p) for n, p in report_prompts.items()},
        "calibration_prompts": len(calib_prompts),
        "timing": timing,
        "wall_s": time.time() - started,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    folder.write_meta(meta)
    log.info("results in %s\n%s", out, table)
    return results


def macro(benchmarks: dict, domains: dict[str, str]) -> dict:
    """Mean τ over the benchmarks of each domain (None when the run has none) and over all."""

    def mean(vals):
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None

    out = {
        d: mean([b["tau"] for n, b in benchmarks.items() if domains.get(n) == d])
        for d in ("math", "code", "chat")
    }
    out["all"] = mean([b["tau"] for b in benchmarks.values()])
    return out


def write_calibration_report(folder, calibration, fit: dict, rounds_by_bench: dict, n_bins: int) -> None:
    """calibration.json in the issue-6 format (metrics on the benchmark rounds, held out from the
    fit) plus the temperatures, and reliability diagrams per position before/after STS."""
    from .calibration.metrics import position_metrics, reliability_data, summary
    from .calibration.plots import reliability_diagram
    from .decoding.engine import calibration_arrays

    temps = calibration.temperatures
    held = [r for recs in rounds_by_bench.values() for r in recs]
    z, y, valid = calibration_arrays(held)
    keys = ("position", "count", "ece_raw", "ece_sts", "auroc", "brier_raw", "brier_sts", "temperature")
    per_pos = [{k: row.get(k) for k in keys} for row in position_metrics(z, y, valid, temps, n_bins)]
    fit_rows = position_metrics(fit["z"], fit["y"], fit["valid"], temps, n_bins)
    s, fs = summary(per_pos), summary(fit_rows)
    report = {
        **calibration.to_dict(),  # method + temperatures: Calibration.load reads this file
        "per_position": per_pos,
        "ece_raw_mean": s.get("ece_raw_mean"),
        "ece_sts_mean": s.get("ece_sts_mean"),
        "auroc_mean": s.get("auroc_mean"),
        "evaluated_on": f"benchmark rounds ({len(held)}), held out from the fit",
        "fit": {
            "rounds": fit["fit_rounds"],
            "prompts": fit["fit_prompts"],
            "ece_raw_mean": fs.get("ece_raw_mean"),
            "ece_sts_mean": fs.get("ece_sts_mean"),
            "auroc_mean": fs.get("auroc_mean"),
        },
    }
    folder.write_calibration(report)
    reliability_diagram(
        reliability_data(z, y, valid, temps, n_bins),
        folder.file("reliability.png"),
        title="Prefix survival on the benchmark rounds (held out)",
    )


def _decode(tokenizer, tokens: list[int]) -> str | None:
    # Clean-up rewrites spaces around punctuation in BPE text (and transformers warns about it).
    return tokenizer.decode(tokens, clean_up_tokenization_spaces=False) if tokenizer is not None else None


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
