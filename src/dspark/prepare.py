"""python -m dspark.prepare [target=…] [data=…] [force=true]: build the training dataset in data.dir
(prompts -> target answers -> tokens -> optional offline feature cache; dspark.data.dataset).
Finished stages are reused; force=true rebuilds the folder from scratch."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .cli import launch, user_errors
from .config import check_prepare


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="prepare")
def main(cfg: DictConfig) -> None:
    with user_errors():
        check_prepare(cfg)
        from .data.dataset import check_data_config, ensure_dataset, prepare_dataset, read_done

        check_data_config(cfg.data)  # before the target loads
        if cfg.get("force", False):
            path = prepare_dataset(cfg.data, cfg.target, force=True)
        else:  # an already finished data.dir only gains a missing cache
            path = ensure_dataset(cfg.data, cfg.target)
        done = read_done(path)
    print(
        f"dataset ready: {path}  ({done['counts']['conversations']} conversations, "
        f"{done['timings']['total_s']:.0f}s, {done['rate']})"
    )


if __name__ == "__main__":
    launch(main)
