import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dspark.data.benchmarks import PACKAGED_BENCHMARKS
from dspark.data.io import resolve_path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"  # installed as dspark.conf (src/dspark/conf links here)
BENCHMARKS = resolve_path(PACKAGED_BENCHMARKS)  # the suites shipped with dspark, inside the repository

torch.set_num_threads(int(os.environ.get("DSPARK_TEST_THREADS", "1")))


def load_group(group: str, name: str):
    cfg = OmegaConf.load(CONF / group / f"{name}.yaml")
    if "defaults" in cfg:
        cfg.pop("defaults")
    return cfg


def head_group(spec: str):
    """conf/head/<name>.yaml for ``spec`` = "<name>" or "<name>@<first_position>" (a head that starts
    at a later draft position: parametrized tests name that variant as one string)."""
    name, _, first = spec.partition("@")
    cfg = load_group("head", name)
    if first:
        cfg.first_position = int(first)
    return cfg


def smoke_run(out_dir, data_dir, *more: str) -> list[str]:
    """Overrides of a seconds-long training run on the tiny target over ``smoke_data``."""
    return [
        "experiment=cpu_smoke",
        f"out_dir={out_dir}",
        f"data.dir={data_dir}",
        "data.num_prompts=12",
        "data.max_new_tokens=12",
        "data.val_fraction=0.25",
        "data.batch_size=2",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "callbacks.checkpoint_every_n_steps=2",
        *more,
    ]


@pytest.fixture(scope="session")
def smoke_data(tmp_path_factory):
    """The data.dir of the tiny target's smoke set (12 prompts, 12-token answers, a quarter held
    out) that the training tests share; prepared by the first run that needs it."""
    return tmp_path_factory.mktemp("smoke-data") / "smoke"


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


@pytest.fixture(scope="module")
def small_target():
    """The tiny target's architecture with a 256-token vocabulary (peaky: ~1.5-2.5 nats): the
    engine tests' target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.target import Target

    tiny = load_group("target", "tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=tiny.tiny.hidden_size,
        intermediate_size=tiny.tiny.intermediate_size,
        num_hidden_layers=tiny.tiny.num_layers,
        num_attention_heads=tiny.tiny.num_heads,
        num_key_value_heads=tiny.tiny.num_kv_heads,
        tie_word_embeddings=True,
        initializer_range=0.5,
        max_position_embeddings=512,
    )
    return Target(
        LlamaForCausalLM(cfg),
        None,
        layer_ids=list(tiny.layer_ids),
        mask_token_id=3,
        eos_token_ids=[],
        name="tiny-v256",
    )
