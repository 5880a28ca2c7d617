"""Every W&B sweep file expands into Hydra overrides that compose and pass the config checks (no W&B
server: the agent's `${args_no_hyphens}` is expanded here the way wandb's agent does it), and
docs/sweeps.md shows the Hydra multirun line that runs the same grid."""

import itertools
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dspark.config import check_train

SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))
MACRO = "${args_no_hyphens}"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def fixed_args(sweep: dict) -> list[str]:
    """The command's own Hydra overrides: what follows `-m dspark.train`, minus agent macros."""
    cmd = [str(c) for c in sweep["command"]]
    i = cmd.index("dspark.train")
    assert cmd[i - 1] == "-m", cmd
    return [c for c in cmd[i + 1 :] if not (c.startswith("${") and c.endswith("}"))]


def grid(sweep: dict) -> list[list[str]]:
    """wandb's agent renders each parameter as `name=value` (str(value)) for ${args_no_hyphens}."""
    params = sweep["parameters"]
    axes = [[f"{k}={v}" for v in (p["values"] if "values" in p else [p["value"]])] for k, p in params.items()]
    return [list(point) for point in itertools.product(*axes)]


def multirun_line(name: str, sweep: dict) -> str:
    """The offline twin: same overrides with the default (csv) logger, grid as Hydra sweep values.
    run_name is left out: multirun names job folders by their overrides, and `${...}` has no place
    in a folder name."""
    args = [a for a in fixed_args(sweep) if not a.startswith(("logger", "run_name"))]
    params = [f"{k}={','.join(str(v) for v in p['values'])}" for k, p in sweep["parameters"].items()]
    return " ".join(["python -m dspark.train -m", *args, *params, f"hydra.sweep.dir=multirun/{name}"])


def test_the_four_sweeps_exist():
    assert {p.stem for p in SWEEPS} >= {"markov_rank", "block_size", "head_type", "depth"}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_file_shape(path):
    sweep = load(path)
    assert sweep["method"] in ("grid", "random", "bayes")
    assert sweep["metric"]["goal"] in ("maximize", "minimize")
    assert sweep["metric"]["name"].startswith(("val/", "train/"))
    cmd = [str(c) for c in sweep["command"]]
    assert cmd[-1] == MACRO and "dspark.train" in cmd
    assert "logger=wandb" in cmd  # an agent's runs must report to the sweep
    assert sweep["parameters"]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_grid_point_composes(path):
    sweep = load(path)
    with initialize_config_module("dspark.conf", version_base="1.3"):
        for point in grid(sweep):
            cfg = compose("train", overrides=fixed_args(sweep) + point)
            check_train(cfg)
            for override in point:
                key, value = override.split("=", 1)
                node = OmegaConf.select(cfg, key)
                got = node.name if OmegaConf.is_config(node) else node  # a group override: its name
                assert str(got) == value, (path.stem, override, got)
            assert "${" not in cfg.run_name and cfg.logger.name == "wandb"


def test_grid_values_are_the_papers():
    values = {p.stem: next(iter(load(p)["parameters"].values()))["values"] for p in SWEEPS}
    assert values["markov_rank"] == [32, 64, 128, 256, 512]
    assert values["block_size"] == [4, 8, 12, 16]
    assert values["depth"] == [1, 2, 3, 4, 5]
    assert set(values["head_type"]) == {"none", "markov", "gated", "rnn"}


def test_rank_zero_is_the_headless_dspark():
    """r = 0 is run as drafter=dspark head=none: a Markov head of rank 0 is refused by the config
    check, and head=none carries rank 0 with the DSpark backbone, loss and confidence head."""
    from dspark.core.errors import ConfigError

    with initialize_config_module("dspark.conf", version_base="1.3"):
        with pytest.raises(ConfigError, match="head.rank"):
            check_train(compose("train", overrides=["drafter=dspark", "head=markov", "head.rank=0"]))
        zero = compose("train", overrides=["drafter=dspark", "head=none"])
        ranked = compose("train", overrides=["drafter=dspark", "head=markov", "head.rank=32"])
    check_train(zero)
    assert zero.head.rank == 0 and zero.drafter.name == "dspark" and zero.drafter.confidence.enabled
    assert zero.loss == ranked.loss and zero.drafter == ranked.drafter
    assert "head=none" in (ROOT / "sweeps" / "markov_rank.yaml").read_text()


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_docs_show_launch_and_multirun_lines(path):
    docs = (ROOT / "docs" / "sweeps.md").read_text()
    assert f"wandb sweep sweeps/{path.name}" in docs
    assert multirun_line(path.stem, load(path)) in docs, multirun_line(path.stem, load(path))


def test_a_grid_runs_at_once_as_one_multirun_and_reports_as_a_sweep(tmp_path):
    """The parallel twin of a sweep (what the H200 sessions run): one Hydra multirun, its two grid points
    trained at once by the joblib launcher, each in the folder `hydra.sweep.subdir` names from its own
    config, each loading its batches in a worker process of its own (under loky, the launcher's backend,
    the first GPU sweep failed there); the dashboard then reads the folders as a sweep over the swept key."""
    import json
    import subprocess
    import sys

    data = tmp_path / "data"
    smoke = ["data.num_prompts=12", "data.max_new_tokens=12", "data.val_fraction=0.25", f"data.dir={data}"]

    def run(*args):
        out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    # Parallel runs must not race to build the data (a data.dir lock refuses the second): prepare it first.
    run("dspark.prepare", "target=tiny", "data=smoke", *smoke)
    sweep = tmp_path / "rank"
    run("dspark.train", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "experiment=cpu_smoke",
        *smoke, "data.batch_size=2", "data.num_workers=1", "trainer.max_steps=3",
        "trainer.limit_val_batches=1", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=r${head.rank}",
        "head.rank=8,16")  # fmt: skip
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["r16", "r8"]
    for rank in (8, 16):
        assert json.loads((sweep / f"r{rank}" / "summary.json").read_text())["global_step"] == 3
        assert (sweep / f"r{rank}" / "drafter" / "config.json").is_file()
    run("dspark.report", f"runs={sweep}", f"hydra.run.dir={tmp_path / 'dashboard'}")
    dashboard = json.loads((tmp_path / "dashboard" / "dashboard.json").read_text())
    assert dashboard["axis"] == "head.rank" and [r["axis_value"] for r in dashboard["runs"]] == [8, 16]
