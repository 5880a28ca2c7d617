"""python -m dspark.export drafter_dir=<checkpoint dir> format=hf|vllm|sglang out=<dir> [target=<target>]

Writes the drafter as a Hugging Face style folder (config.json + model.safetensors) with the key
names and config fields that DeepSpec (format=hf), vLLM or SGLang load; the required keys and
shapes are checked before anything is written, and drafters an engine cannot represent are refused
with the reason (layouts and sources: docs/formats.md). format=hf ships the target's
embed_tokens/lm_head like DeepSpec's checkpoints, so it needs target=<the drafter's target> (or
embeddings=false). The output folder also loads back here: evaluate drafter_dir=<out>. A non-empty
`out` is refused unless force=true (which replaces the drafter files there), and so is drafter_dir.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from .cli import launch, user_errors

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> Path:
    from .checkpoints import export_drafter
    from .config import check_export

    _, embeddings = check_export(cfg)
    _warn_of_a_trained_vocabulary(cfg)

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


def _warn_of_a_trained_vocabulary(cfg: DictConfig) -> None:
    """A drafter trained over a draft vocabulary (train draft_vocab=K) leaves as a whole-vocabulary
    drafter: the formats have no field for K, and its logits off those K tokens were never trained."""
    from .data.vocab_counts import served_vocab_size

    size = served_vocab_size(None, cfg.drafter_dir)
    if size:
        log.warning(
            "%s was trained over its %d most frequent answer tokens (draft_vocab); format=%s has no field "
            "for them and drafts over the whole vocabulary, where the drafter's logits were never trained: "
            "where the engine takes a draft vocabulary, give it those %d tokens",
            cfg.drafter_dir, size, cfg.format, size,
        )  # fmt: skip


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="export")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run(cfg)


if __name__ == "__main__":
    launch(main)
