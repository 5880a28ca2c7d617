"""Which benchmark prompts evaluate reports and which it holds out for calibration.

With ``calibration.file`` (a turns-JSONL file, or a folder of them) those prompts are the held-out
ones; otherwise the LAST ``calibration.prompts`` prompts of each benchmark, so the reported prompts
(the first ``max_prompts``) are the same whether or not calibration runs. The first user turn of
each row is the prompt (the paper evaluates the first turn)."""

from __future__ import annotations

from omegaconf import DictConfig

from ..core.errors import ConfigError
from ..data.benchmarks import DOMAINS, first_turns
from ..data.io import resolve_path

# Paper Table 1 suites that the shared loader (dspark.data.benchmarks.DOMAINS) may not list yet.
EXTRA_DOMAINS = {"livecodebench": "code", "lcb": "code", "alpaca": "chat", "arena-hard": "chat"}


def domain_map(names) -> dict[str, str]:
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
        src = resolve_path(str(cfg.calibration.file))
        files = sorted(src.glob("*.jsonl")) if src.is_dir() else [src]
        if not files or not all(f.exists() for f in files):
            raise ConfigError(f"calibration.file={cfg.calibration.file}: no turns-JSONL file there")
        for f in files:
            calib += [(f.stem, p) for p in first_turns(f.stem, f.parent)]
    return report, calib
