"""What an install gets: the wheel carries every file of src/dspark (the Hydra configs and kernels
it links to, and the benchmark prompt sets), and neither the wheel nor the editable build has anything to warn
about (the editable one is a plain path entry, not a meta path finder). Builds run through
setuptools' own backend from a copy of the project, offline, in seconds."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

pytest.importorskip("setuptools", minversion="77")  # the build backend pyproject.toml names

PACKAGE = ROOT / "src" / "dspark"


def build(tmp_path: Path, hook: str) -> tuple[Path, str]:
    """Run `setuptools.build_meta.<hook>` on a copy of the project (the checkout stays clean);
    return the wheel and everything the backend printed."""
    project = tmp_path / "project"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    # src/dspark/conf and the modules of src/dspark/kernels are symbolic links into the top-level
    # folders: copied as links, as a checkout has them, so the build has to follow them.
    for name in ("src", "conf", "kernels"):
        shutil.copytree(ROOT / name, project / name, symlinks=True, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    out = tmp_path / "dist"
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "default"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out / run.stdout.strip().splitlines()[-1], run.stdout + run.stderr


def warnings_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if "warning" in line.lower()]


def test_wheel_ships_configs_and_benchmark_prompts_quietly(tmp_path):
    wheel, log = build(tmp_path, "build_wheel")
    assert warnings_in(log) == []
    names = set(zipfile.ZipFile(wheel).namelist())
    source = {
        f"dspark/{(Path(folder) / f).relative_to(PACKAGE).as_posix()}"
        for folder, _, files in os.walk(PACKAGE, followlinks=True)  # into conf/ and kernels/ too
        for f in files
        if "__pycache__" not in Path(folder).parts
    }
    assert any(n.startswith("dspark/kernels/") for n in source)
    assert source - names == set()  # every file of the package tree is in the wheel
    prompts = {n.split("/")[-1] for n in names if n.startswith("dspark/data/benchmark_prompts/")}
    suites = ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "mt-bench")
    assert prompts == {f"{name}.jsonl" for name in suites} | {"README.md"}
    configs = {"train.yaml", "evaluate.yaml", "data/quick.yaml", "data/prompts/smoke.jsonl"}
    assert {f"dspark/conf/{c}" for c in configs} <= names


def test_editable_build_is_a_plain_path_entry_and_quiet(tmp_path):
    wheel, log = build(tmp_path, "build_editable")
    assert warnings_in(log) == []
    files = {n: zipfile.ZipFile(wheel).read(n).decode() for n in zipfile.ZipFile(wheel).namelist()}
    pth = [text.strip() for name, text in files.items() if name.endswith(".pth")]
    assert pth == [str(tmp_path / "project" / "src")]
    assert not any("finder" in name for name in files)


def test_top_level_kernels_folder_does_not_shadow_the_kernels_distribution():
    """transformers imports the `kernels` distribution (its hub kernels); `python -m ...` from the
    checkout's root puts the root first on sys.path, where a kernels/__init__.py would be found
    first and break that import. kernels/ holds the modules only (dspark.kernels has the package)."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    modules = {p.name for p in (ROOT / "kernels").glob("*.py")}
    assert modules and modules <= {p.name for p in (PACKAGE / "kernels").glob("*.py")}
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    origin = run.stdout.strip()
    assert origin == "None" or not Path(origin).resolve().is_relative_to(ROOT / "kernels"), origin
