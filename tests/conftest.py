import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
BENCHMARKS = ROOT.parent / "shared" / "benchmarks"

torch.set_num_threads(int(os.environ.get("DSPARK_TEST_THREADS", "1")))


def load_group(group: str, name: str):
    cfg = OmegaConf.load(CONF / group / f"{name}.yaml")
    if "defaults" in cfg:
        cfg.pop("defaults")
    return cfg


@pytest.fixture(scope="session")
def tiny_target():
    from dspark.target import load_target

    return load_target(load_group("target", "tiny"))


@pytest.fixture(scope="session")
def smollm2_target():
    from dspark.target import load_target

    cfg = load_group("target", "smollm2_135m")
    cfg.device = "cpu"
    return load_target(cfg)
