"""Faults on the tiny target: a killed and then interrupted run resumes to exactly the weights of the
uninterrupted run; a full disk keeps the last good checkpoint; a damaged checkpoint falls back to
the one before; a second writer of a run folder or a data.dir is refused; a finished run's
summary survives a rerun; the report skips a run it cannot read."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, smoke_run
from hydra import compose, initialize_config_module

from dspark.artifacts import RunFolder
from dspark.cli import user_errors
from dspark.core.errors import DataError
from dspark.core.io import atomic_open
from dspark.resume import AtomicCheckpointIO, read_checkpoint, resume_point
from dspark.training import run_training

STEPS = 14
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DSPARK_TEST_THREADS": "1"}


def overrides(out_dir: Path, data_dir: Path, *more: str) -> list[str]:
    return smoke_run(
        out_dir,
        data_dir,
        "data.global_batch_size=4",  # two micro-batches per optimizer step
        f"trainer.max_steps={STEPS}",
        "trainer.max_time=null",  # the learning rate follows the steps, not the clock
        "trainer.val_check_interval=4",
        *more,
    )


def cfg_for(*args: str):
    with initialize_config_module("dspark.conf", version_base="1.3"):
        return compose("train", overrides=list(args))


@pytest.fixture(scope="module")
def data_dir(smoke_data):
    from dspark.data.dataset import ensure_dataset

    cfg = cfg_for(*overrides(smoke_data.parent / "unused", smoke_data))
    ensure_dataset(cfg.data, cfg.target)
    return smoke_data


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir) -> dict:
    """The drafter weights of the run that nobody interrupted."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_training(cfg_for(*overrides(out, data_dir)))
    return read_checkpoint(RunFolder(out).last_checkpoint)


def _step(path: Path) -> int:
    try:
        return int(read_checkpoint(path)["global_step"]) if path.is_file() else -1
    except DataError:  # never half-written under its name; a vanished file between checks is -1
        return -1


def _start(out: Path, data_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dspark.train", *overrides(out, data_dir), f"hydra.run.dir={out}"]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _wait_for_checkpoint(proc: subprocess.Popen, path: Path, after: int, timeout: float = 240) -> int:
    start = time.monotonic()
    while (step := _step(path)) <= after:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() - start < timeout, "no checkpoint appeared"
        time.sleep(0.01)
    return step


def test_killed_then_interrupted_run_resumes_to_the_same_weights(tmp_path, data_dir, reference, monkeypatch):
    out = tmp_path / "run"
    last = RunFolder(out).last_checkpoint
    # 1. SIGKILL once the first checkpoint exists: whatever was being written, nothing half-written.
    proc = _start(out, data_dir)
    killed_at = _wait_for_checkpoint(proc, last, after=0)
    proc.kill()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert 0 < _step(last) < STEPS
    # 2. The rerun resumes; Ctrl-C lets the step in flight finish, saves it, exits 130.
    proc = _start(out, data_dir)
    _wait_for_checkpoint(proc, last, after=killed_at)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    stopped_at = _step(last)
    assert killed_at < stopped_at < STEPS
    assert err.strip().splitlines()[-1] == (
        f"dspark: interrupted: saved {last} at step {stopped_at}: resume with the same command and "
        f"hydra.run.dir={out}"
    )
    # 3. Resumed to the end, the weights are the uninterrupted run's, bit for bit.
    summary = run_training(cfg_for(*overrides(out, data_dir)))
    assert summary["global_step"] == STEPS
    final = read_checkpoint(last)
    assert final["global_step"] == reference["global_step"] == STEPS
    assert final["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        assert torch.equal(final["state_dict"][key], value), key
    assert not list(out.rglob("*.tmp"))  # the killed writer's temp files were cleaned up
    # 4. A rerun of the finished run does nothing, loads nothing, and keeps its summary.
    from test_bad_input import no_model_loads

    no_model_loads(monkeypatch)
    before = (out / "summary.json").read_bytes()
    assert run_training(cfg_for(*overrides(out, data_dir))) == json.loads(before)
    assert (out / "summary.json").read_bytes() == before


def test_disk_full_keeps_the_last_good_checkpoint(tmp_path, data_dir, monkeypatch, capsys):
    """ENOSPC while the second checkpoint is written: one line, exit 2, the first one intact."""
    import dspark.resume
    from dspark import train

    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(dspark.resume.torch, "save", full_disk)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_, user_errors():
        train.main(cfg_for(*overrides(out, data_dir)))
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    last = RunFolder(out).last_checkpoint
    assert err.splitlines()[-1] == f"dspark: error: No space left on device: {last}"
    assert _step(last) == 2 and not list(out.rglob("*.tmp"))
    assert resume_point(RunFolder(out)) == (last, 2)


def test_the_batches_follow_the_optimizer_step():
    """The sampler at step k yields what a run from step 0 takes after its first k optimizer steps
    (two micro-batches each), across epochs, each epoch its own order."""
    from dspark.data.datamodule import GlobalBatchSampler

    lengths = [(i * 7) % 13 + 1 for i in range(23)]

    def batches(step: int) -> list[list[int]]:
        sampler = GlobalBatchSampler(range(23), lengths, 2, accumulate=2, bucket_batches=2, seed=3)
        sampler.steps = lambda: step
        return list(sampler)

    per_epoch = 23 // 4
    epochs = [batches(e * per_epoch) for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    for k in range(3 * per_epoch):
        epoch, into = divmod(k, per_epoch)
        assert batches(k) == epochs[epoch][2 * into :]


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path):
    run = RunFolder(tmp_path)
    io = AtomicCheckpointIO()
    for step in (2, 4):
        io.save_checkpoint({"global_step": step, "state_dict": {}, "loops": {}}, run.last_checkpoint)
    assert resume_point(run) == (run.last_checkpoint, 4)
    assert oct(run.last_checkpoint.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    run.last_checkpoint.write_bytes(run.last_checkpoint.read_bytes()[:100])  # a copy cut short
    assert resume_point(run) == (run.checkpoints / "previous.ckpt", 2)
    (run.checkpoints / "previous.ckpt").write_bytes(b"junk")
    with pytest.raises(DataError, match="no checkpoint in .* can be resumed"):
        resume_point(run)


def test_an_interrupted_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(OSError) as err, atomic_open(path, "w") as f:
        f.write("half of the new")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert err.value.filename == str(path) and err.value.errno == errno.ENOSPC
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.fixture
def holder(tmp_path):
    """Another process holding a folder's lock (as a running dspark command does)."""
    procs = []

    def hold(folder: Path, key: str) -> None:
        code = "\n".join(
            [
                "import time",
                "from dspark.core.lock import folder_lock",
                f"with folder_lock({str(folder)!r}, {key!r}):",
                "    print('held', flush=True)",
                "    time.sleep(120)",
            ]
        )
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("app,key", [("train", "out_dir"), ("train", "data.dir"), ("prepare", "data.dir")])
def test_a_second_writer_is_refused(app, key, tmp_path, data_dir, holder, monkeypatch, capsys):
    import importlib

    from test_bad_input import no_model_loads

    no_model_loads(monkeypatch)
    out, data = tmp_path / "run", tmp_path / "data"
    holder(out if key == "out_dir" else data, key)
    args = overrides(out, data) if app == "train" else ["target=tiny", "data=smoke", f"data.dir={data}"]
    with pytest.raises(SystemExit) as exit_, user_errors():
        with initialize_config_module("dspark.conf", version_base="1.3"):
            cfg = compose(app, overrides=args)
        importlib.import_module(f"dspark.{app}").main(cfg)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert f"dspark: error: {key}=" in err and "is in use by another dspark command (pid" in err


def test_report_skips_an_unreadable_run(tmp_path, caplog):
    from dspark.reporting.runs import find_runs

    for name, config in (("good", "run_name: good\n"), ("bad", "run_name: [unclosed\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(config)
        (tmp_path / name / "summary.json").write_text('{"global_step": 1}')
    (tmp_path / "worse").mkdir()
    (tmp_path / "worse" / "config.yaml").write_text("run_name: worse\n")
    (tmp_path / "worse" / "summary.json").write_bytes(b"\xff{")
    with caplog.at_level(logging.WARNING):
        runs = find_runs(str(tmp_path))
    assert [r.name for r in runs] == ["good"]
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert len(skipped) == 2 and "not readable YAML" in " ".join(skipped)
