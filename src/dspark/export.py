"""python -m dspark.export drafter_dir=<checkpoint dir> format=hf|vllm|sglang out=<dir> [target=<target>]

Writes the drafter as a Hugging Face style folder (config.json + model.safetensors) with the key
names and config fields that DeepSpec (format=hf), vLLM or SGLang load; the required keys and
shapes are checked before anything is written, and drafters an engine cannot represent are refused
with the reason (layouts and sources: docs/formats.md). format=hf ships the target's
embed_tokens/lm_head like DeepSpec's checkpoints, so it needs target=<the drafter's target> (or
embeddings=false). The output folder also loads back here: evaluate drafter_dir=<out>.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .cli import user_errors
from .core.errors import ConfigError

log = logging.getLogger(__name__)


def check_config(cfg: DictConfig) -> tuple[dict, bool]:
    """Before any model loads: the folder, the format, and whether the target is needed."""
    from .artifacts import DrafterFolder
    from .checkpoints import read_drafter_config, refusal
    from .interop import FORMATS

    for key in ("drafter_dir", "out"):
        if OmegaConf.is_missing(cfg, key) or cfg.get(key) is None:
            raise ConfigError(
                f"{key} is required: python -m dspark.export drafter_dir=<dir> format=hf out=<dir>"
            )
    if cfg.format not in FORMATS:
        raise ConfigError(f"format={cfg.format} is not one of {FORMATS}")
    folder = Path(str(cfg.drafter_dir)).expanduser()
    if not DrafterFolder(folder).exists():
        raise ConfigError(f"drafter_dir={folder} is not a drafter checkpoint (no config.json there)")
    config = read_drafter_config(folder)
    why = refusal(str(cfg.format), config)
    if why:
        raise ConfigError(f"cannot export drafter_dir={folder} as format={cfg.format}: {why}")
    embeddings = cfg.format == "hf" if cfg.embeddings is None else bool(cfg.embeddings)
    if embeddings:
        recorded = (config.get("target") or {}).get("name")
        chosen = cfg.get("target") and cfg.target.get("name")
        if not chosen:
            raise ConfigError(
                f"format={cfg.format} ships the target's embed_tokens/lm_head (DeepSpec's loader reads "
                f"them from the drafter folder): add target={recorded or '<its target>'}, or embeddings=false"
            )
        if recorded and recorded != "unknown" and chosen != recorded:
            raise ConfigError(f"drafter_dir={folder} was trained for target {recorded}, not target={chosen}")
    return config, embeddings


def run(cfg: DictConfig) -> Path:
    _, embeddings = check_config(cfg)
    from .checkpoints import export_drafter

    target = None
    if embeddings:
        from .target import load_target

        target = load_target(cfg.target)
    out = export_drafter(
        Path(str(cfg.drafter_dir)).expanduser(),
        Path(str(cfg.out)).expanduser(),
        str(cfg.format),
        target=target,
        dtype=cfg.dtype,
        embeddings=embeddings,
    )
    log.info("wrote %s (format=%s)", out, cfg.format)
    print(out)
    return out


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="export")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
