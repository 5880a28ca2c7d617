"""What an evaluation writes into its folder: results.json (τ per benchmark with its standard error
over prompts, position-wise acceptance, macro averages), table.md (paper Table 1), the Fig. 2
acceptance and Fig. 5 threshold sweep figures (drafters with a confidence head), and with
calibrate=true calibration.json (the temperatures and their metrics on the benchmark rounds, held
out from the fit) with reliability diagrams."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ..artifacts import EvaluationFolder
from ..calibration.metrics import position_metrics, reliability_data, summary
from ..calibration.plots import reliability_diagram
from ..data.vocab_counts import vocab_record
from ..decoding.engine import calibration_arrays, conditional_acceptance, tau, threshold_sweep
from ..decoding.uncertainty import mean_stderr, per_request_positions, per_request_totals, tau_stderr
from ..drafters import DrafterSpec
from ..reporting.plots import acceptance_by_position_plot, threshold_sweep_plot
from ..reporting.tables import table1
from .evaluator import CalibrationFit, Evaluator, Rollouts
from .prompts import domain_map


def write_outputs(
    folder: EvaluationFolder, cfg: DictConfig, spec: DrafterSpec, ev: Evaluator, out: Rollouts,
    fit: CalibrationFit | None,
) -> dict:  # fmt: skip
    """Everything but meta.json; returns the results. ``gamma`` is the block each round verifies
    (the policy's fixed γ, else the drafter's); ``tau_stderr`` is τ's standard error over the
    benchmark's requests (``decoding.uncertainty``), ``macro_stderr`` that of each macro average;
    ``request_totals`` each request's Σ (accepted + 1) and rounds, so that a report compares two
    drafters paired on the same prompts; ``request_positions`` each request's rounds that accepted
    and that reached each draft position, for the same comparison position by position."""
    gamma, domains = spec.gamma, domain_map(out.rounds)
    fixed_gamma = cfg.policy.get("gamma")
    results = {
        "target": ev.target.name,
        "drafter": spec.label,
        "temperature": float(cfg.temperature),
        "gamma": int(fixed_gamma) if fixed_gamma is not None else gamma,
        "policy": OmegaConf.to_container(cfg.policy, resolve=True),
        "draft_vocab": vocab_record(ev.draft_vocab, ev.vocab_coverage),  # None: the whole vocabulary
        "benchmarks": {
            name: _benchmark(recs, out.generations[name], gamma) for name, recs in out.rounds.items()
        },
    }
    results["macro"] = macro(results["benchmarks"], domains)
    results["macro_stderr"] = macro_stderr(results["benchmarks"], domains)
    folder.write_results(results)
    folder.write_table(table1([results], domains))
    panels = _panels(results["benchmarks"], domains)
    _acceptance_figure(folder, results, panels, out, gamma)
    if spec.has_confidence:
        _threshold_sweep_figure(folder, results, panels, out, cfg, ev.calibration)
    if fit is not None:
        write_calibration_report(folder, fit, out, int(cfg.calibration.n_bins))
    return results


def _benchmark(recs: list, generations: list, gamma: int) -> dict:
    totals = per_request_totals(recs)
    return {
        "tau": tau(recs),
        "tau_stderr": tau_stderr(recs),
        "requests": len(totals),
        "rounds": len(recs),
        "new_tokens": sum(len(g.tokens) for g in generations),
        "accept_rate_by_position": conditional_acceptance(recs, gamma),
        # Σ (accepted + 1) and rounds per request: what pairs two drafters' τ on the same prompts
        "request_totals": totals,
        # per request, the rounds that accepted / reached each position: Fig. 2's curve, paired
        "request_positions": per_request_positions(recs, gamma),
    }


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


def macro_stderr(benchmarks: dict, domains: dict[str, str]) -> dict:
    """The standard error of each ``macro`` average: benchmarks are independent prompt sets."""

    def err(names):  # over the benchmarks ``macro`` averages: those with a τ
        names = [n for n in names if benchmarks[n]["tau"] is not None]
        return mean_stderr([benchmarks[n].get("tau_stderr") for n in names]) if names else None

    out = {d: err([n for n in benchmarks if domains.get(n) == d]) for d in ("math", "code", "chat")}
    out["all"] = err(list(benchmarks))
    return out


def _panels(benchmarks: dict, domains: dict[str, str]) -> dict[str, list[str]]:
    """Figure panels: one per domain present (its benchmarks), plus "all" unless that is one."""
    present = [d for d in ("math", "code", "chat") if d in domains.values()]
    panels = {d: [n for n in benchmarks if domains.get(n) == d] for d in present}
    if len(panels) != 1 or len(panels[present[0]]) != len(benchmarks):
        panels["all"] = list(benchmarks)
    return panels


def _acceptance_figure(folder, results: dict, panels: dict, out: Rollouts, gamma: int) -> None:
    """Fig. 2: domain panels (mean over the domain's benchmarks), the benchmarks as extra lines."""
    label, benchmarks = results["drafter"], results["benchmarks"]
    curves = {}
    for dom, members in panels.items():
        recs = [r for n in members for r in out.rounds[n]]
        curves[dom] = {label: conditional_acceptance(recs, gamma)}
        if len(members) > 1:
            curves[dom].update({n: benchmarks[n]["accept_rate_by_position"] for n in members})
    acceptance_by_position_plot(
        curves,
        folder.file(folder.ACCEPTANCE_FIGURE),
        data={
            "drafter": label,
            "positions": list(range(1, gamma + 1)),
            "benchmarks": {n: b["accept_rate_by_position"] for n, b in benchmarks.items()},
            "domains": {d: c[label] for d, c in curves.items()},
            "definition": "P(position k accepted | positions 1..k-1 accepted), "
            "over rounds that verified position k",
        },
    )


def _threshold_sweep_figure(folder, results: dict, panels: dict, out: Rollouts, cfg, calibration) -> None:
    """Fig. 5: tokens per step and acceptance rate against the confidence threshold."""
    thresholds = [float(t) for t in cfg.thresholds]
    sweep = {d: threshold_sweep([r for n in m for r in out.rounds[n]], thresholds) for d, m in panels.items()}
    threshold_sweep_plot(
        sweep,
        folder.file(folder.THRESHOLD_FIGURE),
        data={
            "drafter": results["drafter"],
            "confidence": "calibrated (STS)" if calibration is not None else "raw",
            "rule": "verify the longest prefix with cumulative confidence >= threshold",
            "sweep": sweep,
        },
    )


def write_calibration_report(folder: EvaluationFolder, fit: CalibrationFit, out: Rollouts, n_bins: int):
    """calibration.json in the issue-6 format (metrics on the benchmark rounds, held out from the
    fit) plus the temperatures (and offsets), and reliability diagrams per position before/after
    calibration ("sts" in the keys: STS or STS with offsets, whichever was fitted)."""
    cal = fit.calibration
    held = [r for recs in out.rounds.values() for r in recs]
    z, y, valid = calibration_arrays(held)
    keys = ("position", "count", "ece_raw", "ece_sts", "auroc", "brier_raw", "brier_sts", "temperature")
    keys += ("offset", "ece_raw_floor", "ece_sts_floor")  # STS with offsets; binary labels
    per_pos = [{k: row[k] for k in keys if k in row} for row in position_metrics(z, y, valid, cal, n_bins)]
    s, fs = summary(per_pos), summary(position_metrics(fit.z, fit.y, fit.valid, cal, n_bins))
    folder.write_calibration(
        {
            **cal.to_dict(),  # method + temperatures (+ offsets): Calibration.load reads this file
            "per_position": per_pos,
            "ece_raw_mean": s.get("ece_raw_mean"),
            "ece_sts_mean": s.get("ece_sts_mean"),
            "ece_sts_floor_mean": s.get("ece_sts_floor_mean"),  # what perfect calibration would show here
            "auroc_mean": s.get("auroc_mean"),
            "evaluated_on": f"benchmark rounds ({len(held)}), held out from the fit",
            "fit": {
                "rounds": fit.rounds,
                "prompts": fit.prompts,
                "ece_raw_mean": fs.get("ece_raw_mean"),
                "ece_sts_mean": fs.get("ece_sts_mean"),
                "auroc_mean": fs.get("auroc_mean"),
            },
        }
    )
    reliability_diagram(
        reliability_data(z, y, valid, cal, n_bins),
        folder.file(folder.RELIABILITY_FIGURE),
        title="Prefix survival on the benchmark rounds (held out)",
    )
