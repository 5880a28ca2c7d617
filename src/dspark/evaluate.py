"""python -m dspark.evaluate drafter_dir=<checkpoint dir> benchmarks=[gsm8k,mt-bench] temperature=1.0 \
    [policy=fixed policy.gamma=<g>] [calibrate=true]

The default policy verifies the drafter's whole proposal each round (policy=fixed policy.gamma=null:
block_size tokens, block_size-1 for a drafter whose anchor slot drafts nothing).

Speculative decoding of benchmark prompts with a saved drafter (dspark.evaluation); writes an
evaluation folder into out_dir (dspark.artifacts.EvaluationFolder): results.json, table.md,
rounds.jsonl, generations.jsonl, meta.json, the Fig. 2 / Fig. 5 figures and, with calibrate=true,
calibration.json and reliability diagrams. ``drafter_dir``, not ``drafter``: ``drafter`` is the
drafter config group of the train entry point and the two must not mean different things.

calibrate=true fits STS on held-out prompts (calibration.file, or the last calibration.prompts of
each benchmark) before the benchmark rollouts, which then use the fitted temperatures;
calibration.save_to_drafter=true also writes them into the drafter folder for every later engine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .cli import launch, user_errors

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> dict:
    from .artifacts import EvaluationFolder
    from .config import check_evaluate
    from .evaluation import split_prompts

    spec = check_evaluate(cfg)
    report, held_out = split_prompts(cfg)  # before the models: a missing file fails fast
    with EvaluationFolder(str(cfg.out_dir)).claimed("out_dir") as folder:
        return _evaluate(cfg, spec, report, held_out, folder)


def _evaluate(cfg: DictConfig, spec, report: dict, held_out: list, folder) -> dict:
    from .artifacts import DrafterFolder
    from .core.provenance import provenance
    from .core.threads import cap_cpu_threads
    from .evaluation import Evaluator, write_outputs
    from .target import load_target

    started = time.time()
    target = load_target(cfg.target)
    cap_cpu_threads(target.device)
    ev = Evaluator.load(cfg, target)
    ev.check_context(report, held_out)
    fit = ev.calibrate(held_out) if cfg.calibrate else None
    if fit is not None and cfg.calibration.save_to_drafter:
        DrafterFolder(str(cfg.drafter_dir)).write_calibration(fit.calibration)
    rollouts = ev.decode(report, folder)
    results = write_outputs(folder, cfg, spec, ev, rollouts, fit)
    folder.write_meta(
        {
            **provenance("dspark.evaluate", device=ev.target.device),
            "drafter_dir": str(Path(str(cfg.drafter_dir)).resolve()),
            "calibration_temperatures": None if ev.calibration is None else ev.calibration.temperatures,
            "report_prompts": {n: len(p) for n, p in report.items()},
            "calibration_prompts": len(held_out),
            "timing": rollouts.timing,
            "wall_s": time.time() - started,
            "config": OmegaConf.to_container(cfg, resolve=True),
        }
    )
    log.info("results in %s\n%s", folder.path, folder.file(folder.TABLE).read_text())
    return results


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run(cfg)


if __name__ == "__main__":
    launch(main)
