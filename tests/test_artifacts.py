"""The folders the stages hand each other: one owner per file name, atomic strict-JSON writes, and
a schema stamp that lets a reader refuse what it cannot read."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from dspark.artifacts import (
    SCHEMA_VERSION,
    DrafterFolder,
    EvaluationFolder,
    FrontierFolder,
    RunFolder,
    read_rounds,
)
from dspark.calibration.sts import Calibration
from dspark.core.errors import DataError, DrafterCheckpointError


def test_descriptor_is_stamped_and_checked(tmp_path):
    run = RunFolder(tmp_path / "run")
    path = run.write_summary({"global_step": 3, "final": {"loss": math.nan}})
    on_disk = json.loads(path.read_text())  # strict JSON: NaN became null
    assert on_disk == {"schema": f"dspark.run/v{SCHEMA_VERSION}", "global_step": 3, "final": {"loss": None}}
    assert run.read_summary()["global_step"] == 3
    # A file written before folders were versioned reads as it is.
    path.write_text(json.dumps({"global_step": 4}))
    assert run.read_summary() == {"global_step": 4}
    path.write_text(json.dumps({"schema": f"dspark.run/v{SCHEMA_VERSION + 1}"}))
    with pytest.raises(DataError, match="newer dspark"):
        run.read_summary()
    path.write_text(json.dumps({"schema": "dspark.evaluation/v1"}))
    with pytest.raises(DataError, match="evaluation file, not a run file"):
        run.read_summary()
    assert RunFolder(tmp_path / "none").read_summary() == {}  # still training


def test_run_folder_layout(tmp_path):
    run = RunFolder(tmp_path)
    assert not run.is_run()
    run.write_config(OmegaConf.create({"seed": 1, "out_dir": "${seed}"}))
    assert not run.is_run()  # a config alone is not a run yet
    run.logs.mkdir()
    assert run.is_run() and run.read_config() == {"seed": 1, "out_dir": 1}  # saved resolved
    assert run.drafter.path == tmp_path / "drafter" and run.last_checkpoint.name == "last.ckpt"


def test_drafter_folder(tmp_path):
    folder = DrafterFolder(tmp_path)
    with pytest.raises(DrafterCheckpointError, match="not a drafter checkpoint"):
        folder.read_config()
    assert folder.read_calibration() is None and folder.read_calibration_report() is None
    folder.write_calibration(Calibration([0.5, 2.0]))
    folder.write_calibration_report({"ece_raw_mean": math.inf})
    assert folder.read_calibration().temperatures == [0.5, 2.0]
    assert folder.read_calibration_report() == {"ece_raw_mean": None}
    # config.json of another project's layout passes: it carries no dspark stamp.
    folder.config_path.write_text(json.dumps({"architectures": ["Qwen3DSparkModel"]}))
    assert folder.read_config()["architectures"] == ["Qwen3DSparkModel"]
    folder.config_path.write_text(json.dumps({"schema": "dspark.run/v1"}))
    with pytest.raises(DataError, match="not a drafter file"):
        folder.read_config()


def test_evaluation_recorder_is_all_or_nothing(tmp_path):
    ev = EvaluationFolder(tmp_path)
    with pytest.raises(RuntimeError), ev.recorder() as (write_round, write_generation):
        write_round({"request": 0})
        raise RuntimeError("killed mid-run")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no partial files, no temp files
    with ev.recorder() as (write_round, write_generation):
        write_round({"request": 0, "round": 0})
        write_generation({"id": 0})
    assert list(read_rounds(ev.rounds_path)) == [{"request": 0, "round": 0}]
    ev.rounds_path.write_text('{"request": 0}\n[1]\n')
    with pytest.raises(DataError, match=r"rounds.jsonl:2: expected a JSON object"):
        list(read_rounds(ev.rounds_path))
    assert not ev.exists()
    ev.write_results({"benchmarks": {}})
    ev.write_meta({"command": "python -m dspark.evaluate"})
    assert ev.exists() and ev.read_meta()["schema"] == f"dspark.evaluation/v{SCHEMA_VERSION}"
    with pytest.raises(DataError, match="not a frontier file"):
        FrontierFolder(tmp_path).read_meta()
