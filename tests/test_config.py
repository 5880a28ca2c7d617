"""Every config group composes; the CLI composes without the network; bad configs are refused
before anything loads."""

import json
import subprocess
import sys

import pytest
from conftest import CONF
from hydra import compose, initialize_config_module

from dspark.config import check_train
from dspark.core.errors import ConfigError

GROUPS = ["target", "drafter", "head", "loss", "data", "trainer", "logger", "callbacks"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def train_cfg(*overrides):
    with initialize_config_module("dspark.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "head" and option != "none":
        overrides.append("drafter=dspark")
    cfg = train_cfg(*overrides)
    assert cfg[group] is not None


@pytest.mark.parametrize("app", ["prepare", "evaluate", "schedule", "report"])
def test_entry_configs_compose(app):
    with initialize_config_module("dspark.conf", version_base="1.3"):
        assert compose(app) is not None


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiments_compose(experiment):
    check_train(train_cfg(f"experiment={experiment}"))


def test_drafter_defaults_choose_head_and_loss():
    cfg = train_cfg("drafter=dflash")
    assert cfg.head.name == "none" and cfg.loss.ce == 1.0
    cfg = train_cfg("drafter=dspark", "head=rnn", "head.rank=64", "drafter.block_size=12", "loss.tv=0.5")
    assert (cfg.head.name, cfg.head.rank, cfg.drafter.block_size, cfg.loss.tv) == ("rnn", 64, 12, 0.5)


def test_cli_composes_qwen3_14b_without_network():
    out = subprocess.run(
        [sys.executable, "-m", "dspark.train", "target=qwen3_14b", "head=rnn", "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert "Qwen/Qwen3-14B" in out.stdout and "name: rnn" in out.stdout


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["drafter=dflash", "head=rnn"], "drafter=dflash has no sequential head"),
        (["drafter=eagle3", "head=markov"], "drafter=eagle3 has no sequential head"),
        (["target.layer_ids=[1,29]"], "final layer"),
        (["target.layer_ids=[8,1]"], "strictly increasing"),
        (["drafter.block_size=0"], "block_size"),
        (["head.rank=0"], "head.rank"),
    ],
)
def test_bad_configs_rejected(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_train(train_cfg(*overrides))


@pytest.mark.parametrize("override", ["drafter.nonexistent=1", "target=not_a_target"])
def test_unknown_keys_and_names_fail_in_hydra(override):
    with pytest.raises(Exception, match="nonexistent|not_a_target"):
        train_cfg(override)


def test_cli_config_error_is_a_clear_message():
    out = subprocess.run(
        [sys.executable, "-m", "dspark.train", "drafter=dflash", "head=rnn"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "drafter=dflash has no sequential head" in out.stderr


def test_cli_stale_dataset_is_a_one_line_error(tmp_path):
    """A data.dir built for another config: one line naming the fix, exit 2, before the target loads."""
    (tmp_path / "build.json").write_text(json.dumps({"data": {"num_prompts": 3}, "target": {"name": "tiny"}}))
    out = subprocess.run(
        [sys.executable, "-m", "dspark.train", "experiment=cpu_smoke", f"data.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "was prepared with another config" in out.stderr and "force=true" in out.stderr
    assert "Traceback" not in out.stderr and "loaded in" not in out.stderr + out.stdout
