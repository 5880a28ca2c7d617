"""dspark.bench.batch, the logic of scripts/h200_table1.sh: drafter specs split and checked, the
evaluate overrides each real drafter folder needs, and the held-out calibration prompts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT
from test_evaluate import _save

from dspark.bench.batch import BatchEntry, eval_overrides, parse_batch, parse_entry, write_calibration_prompts
from dspark.core.errors import ConfigError, DataError
from dspark.data.benchmarks import first_turns


def test_specs_split_into_names_and_overrides():
    assert parse_entry("DSpark-Markov:drafter=dspark head=markov") == BatchEntry(
        "DSpark-Markov", ("drafter=dspark", "head=markov")
    )
    assert parse_entry("b16:drafter=dflash drafter.block_size=16 +drafter.extra=[1,2]").overrides == (
        "drafter=dflash",
        "drafter.block_size=16",
        "+drafter.extra=[1,2]",
    )
    names = [e.name for e in parse_batch(["Eagle3:drafter=eagle3", "DFlash:drafter=dflash"])]
    assert names == ["Eagle3", "DFlash"]  # the order is the training order


@pytest.mark.parametrize(
    "spec, message",
    [
        ("drafter=dflash", "write NAME:OVERRIDES"),
        ("my run:drafter=dflash", "write NAME:OVERRIDES"),
        ("DFlash:", "has no overrides"),
        ("DFlash:dflash", "'dflash' is not a key=value override"),
        ("DFlash:drafter=dflash 'head=a b'", "holds a space"),
        ("DFlash:drafter=dflash trainer.max_time=00:00:09:00", "sets trainer.max_time"),
        ("DFlash:drafter=dflash data.batch_size=4", "sets data: the batch sets it for every drafter alike"),
        ("DFlash:drafter=dflash data=quick", "sets data"),
        ("DFlash:drafter=dflash target.dtype=float32", "sets target"),
        ("DFlash:drafter=dflash hydra.run.dir=x", "sets hydra"),
    ],
)
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_entry(spec)


def test_a_spec_may_train_its_own_seed():
    """A second seed of one recipe in the same batch: the spread between two trainings."""
    assert parse_entry("DSpark-S1:drafter=dspark seed=1").overrides == ("drafter=dspark", "seed=1")
    with pytest.raises(ConfigError, match="sets data"):  # data.seed is the data's, owned by the batch
        parse_entry("DSpark-S1:drafter=dspark data.seed=1")


def test_batch_names_are_unique_and_present():
    with pytest.raises(ConfigError, match="two drafter specs are named dflash"):
        parse_batch(["DFlash:drafter=dflash", "dflash:drafter=dflash drafter.num_layers=2"])
    with pytest.raises(ConfigError, match="no drafter spec"):
        parse_batch([])


def test_eval_overrides_follow_the_drafter_folder(tiny_target, tmp_path):
    eagle = _save(tiny_target, tmp_path / "eagle3", "eagle3")
    dflash = _save(tiny_target, tmp_path / "dflash", "dflash")
    dspark = _save(tiny_target, tmp_path / "dspark", "dspark", "markov")
    assert eval_overrides(eagle, "cal.jsonl") == ["engine=fast"]  # its context written after verification
    assert eval_overrides(dflash, "cal.jsonl") == ["engine=fast"]  # no confidence head: nothing to fit
    assert eval_overrides(dspark, "cal.jsonl") == [
        "engine=fast",
        "calibrate=true",
        "calibration.file=cal.jsonl",
    ]
    assert eval_overrides(dspark) == ["engine=fast"]
    # The command line the script reads: one line of words.
    proc = subprocess.run(
        [sys.executable, "-m", "dspark.bench.batch", "eval-args", str(dspark), "cal.jsonl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout == "engine=fast calibrate=true calibration.file=cal.jsonl\n"


def test_calibration_prompts_are_the_data_validation_prompts(tmp_path):
    data = tmp_path / "data"
    (data / "prompts").mkdir(parents=True)
    rows = [{"id": f"v{i}", "prompt": f"Validation question {i}?", "domain": "chat"} for i in range(5)]
    (data / "prompts" / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = write_calibration_prompts(data, tmp_path / "cal" / "calibration.jsonl", 3)
    # Read back the way evaluate reads calibration.file: first turns of a turns-JSONL file.
    assert first_turns(out.stem, out.parent) == [
        "Validation question 0?",
        "Validation question 1?",
        "Validation question 2?",
    ]
    with pytest.raises(DataError, match="has no prompts/val.jsonl: not a data.dir"):
        write_calibration_prompts(tmp_path / "nothing", tmp_path / "x.jsonl")
    with pytest.raises(ConfigError, match="N must be >= 1"):
        write_calibration_prompts(data, tmp_path / "x.jsonl", 0)


def test_calibration_prompts_add_the_benchmark_prompts_evaluation_never_reports(tmp_path):
    """With SKIP (evaluation's prompts per benchmark: each suite's first ones), N prompts of each
    suite past its first SKIP join the validation prompts, where the suite has them: STS is fitted
    on the domains the benchmark rounds hold, on prompts no row reports."""
    data = tmp_path / "data"
    (data / "prompts").mkdir(parents=True)
    rows = [{"id": f"v{i}", "prompt": f"Validation question {i}?", "domain": "chat"} for i in range(5)]
    (data / "prompts" / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "bench"
    bench.mkdir()
    for name, size in (("long", 6), ("short", 3)):
        lines = [json.dumps({"turns": [f"{name} {i}"]}) + "\n" for i in range(size)]
        (bench / f"{name}.jsonl").write_text("".join(lines))
    out = write_calibration_prompts(data, tmp_path / "calibration.jsonl", 2, skip=3, benchmark_dir=bench)
    assert first_turns(out.stem, out.parent) == [
        "Validation question 0?", "Validation question 1?", "long 3", "long 4",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="SKIP must be >= 0"):
        write_calibration_prompts(data, tmp_path / "x.jsonl", 2, skip=-1)
    # From the command line, as h200_session.sh calls it, with the packaged suites.
    proc = subprocess.run(
        [sys.executable, "-m", "dspark.bench.batch", "calibration-prompts", str(data),
         str(tmp_path / "c.jsonl"), "2", "80"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    turns = first_turns("c", tmp_path)
    assert len(turns) == 2 + 4 * 2  # GSM8K, MATH500, HumanEval, MBPP have prompts past the 80th
    assert turns[2] == first_turns("gsm8k")[80]


def test_cli_errors_are_one_line():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark.bench.batch",
            "split",
            "DFlash:drafter=dflash",
            "DFlash:drafter=dflash",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "dspark: error: two drafter specs are named DFlash: give each its own name"
    proc = subprocess.run(
        [sys.executable, "-m", "dspark.bench.batch"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "usage: python -m dspark.bench.batch split" in proc.stderr
