"""python -m dspark.train: train a drafter against a frozen target."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .cli import launch, user_errors
from .config import check_train


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="train")
def main(cfg: DictConfig) -> None:
    with user_errors():
        check_train(cfg)
        from .training import run_training

        run_training(cfg)


if __name__ == "__main__":
    launch(main)
