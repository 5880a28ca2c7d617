"""No default config points outside the repository: every string the composed default configs hold,
read as a path, stays inside the checkout (`pkg://` paths: inside the installed package, and they
exist), so a fresh clone with nothing beside it trains and evaluates. Every YAML file of the config
tree gets the same check, and the check itself is shown to catch a `../` path, absolute paths
and a packaged path that is not there."""

import os
from importlib.resources import files
from pathlib import Path

import pytest
from conftest import CONF, ROOT
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dspark.data.io import PACKAGE_SCHEME, resolve_path

ENTRY_POINTS = ["train", "prepare", "evaluate", "schedule", "report", "export"]
PACKAGE_DIR = Path(files("dspark"))
RUN_DIRS = ["hydra.run.dir", "hydra.sweep.dir"]  # the only keys of Hydra's own node that we set


def compose_default(app: str, *overrides: str):
    with initialize_config_module("dspark.conf", version_base="1.3"):
        return compose(app, overrides=list(overrides), return_hydra_config=True)


def string_leaves(cfg) -> dict[str, str]:
    """Every string value by dotted key (of Hydra's own node only the run folders we set),
    interpolations resolved where they resolve outside a run (`${hydra:runtime.output_dir}` does
    not; its raw text is kept)."""
    out: dict[str, str] = {}

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")
        elif isinstance(node, str) and (not key.startswith("hydra.") or key in RUN_DIRS):
            value = OmegaConf.select(cfg, key, throw_on_resolution_failure=False) if "${" in node else node
            out[key] = value if isinstance(value, str) else node

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


def is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def outside(value: str) -> str | None:
    """Where `value` leads when it leaves the repository (or names a missing packaged file), else None."""
    if value.startswith(PACKAGE_SCHEME):
        path = resolve_path(value)
        # Inside the package as installed (conf/ and kernels/ enter it through links: not resolved).
        return None if path.exists() and is_within(Path(os.path.normpath(path)), PACKAGE_DIR) else str(path)
    if "://" in value:  # a URL, not a file
        return None
    path = Path(os.path.normpath(ROOT / Path(value).expanduser()))
    return None if is_within(path, ROOT) else str(path)


def paths_outside(cfg) -> dict[str, str]:
    return {key: where for key, value in string_leaves(cfg).items() if (where := outside(value))}


@pytest.mark.parametrize("app", ENTRY_POINTS)
def test_default_configs_stay_inside_the_repository(app):
    cfg = compose_default(app)
    assert len(string_leaves(cfg)) > 3  # the walk saw the config
    assert paths_outside(cfg) == {}


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_every_config_file_stays_inside_the_repository(path):
    assert paths_outside(OmegaConf.load(path)) == {}


def test_the_check_catches_paths_outside():
    cfg = compose_default("train", "data.benchmark_dir=../beside/benchmarks", "data.dir=/srv/elsewhere")
    assert set(paths_outside(cfg)) == {"data.benchmark_dir", "data.dir"}
    cfg = compose_default("evaluate", "benchmark_dir=pkg://dspark/data/nowhere", "hydra.run.dir=/srv/runs")
    assert set(paths_outside(cfg)) == {"benchmark_dir", "hydra.run.dir"}
    assert outside("~/data") and outside("data/../../x") and not outside("data/x/../y")


def test_packaged_defaults_resolve_to_the_shipped_files():
    cfg = compose_default("train")
    assert cfg.data.benchmark_dir.startswith(PACKAGE_SCHEME)
    folder = resolve_path(cfg.data.benchmark_dir)
    assert is_within(folder, PACKAGE_DIR) and len(list(folder.glob("*.jsonl"))) == 6
    smoke = compose_default("train", "experiment=cpu_smoke").data.jsonl.path
    assert resolve_path(smoke, must_exist=True).is_file()
