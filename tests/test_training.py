"""End-to-end training on the tiny target: the Lightning loop, checkpoints, export, resume."""

import json

import pytest
import torch
from conftest import smoke_run
from hydra import compose, initialize_config_module

from dspark.artifacts import DrafterFolder
from dspark.checkpoints import load_drafter
from dspark.data.datamodule import tokens_path
from dspark.data.tokenize import load_tokens
from dspark.training import run_training


def cfg_for(out_dir, data_dir, *overrides):
    with initialize_config_module("dspark.conf", version_base="1.3"):
        return compose("train", smoke_run(out_dir, data_dir, "trainer.val_check_interval=2", *overrides))


@pytest.fixture(scope="module")
def data_dir(smoke_data):
    return smoke_data


def test_auto_anchors_follow_the_longest_training_answer(tmp_path, data_dir):
    """data.anchors_per_sequence=auto: the step's anchors per sequence from the data (the smoke set's
    12-token answers: 11 positions at most, one multiple of 64), not the drafter's 512."""
    summary = run_training(
        cfg_for(tmp_path / "run", data_dir, "trainer.max_steps=1", "data.anchors_per_sequence=auto",
                "drafter.num_anchors=512")
    )  # fmt: skip
    assert summary["global_step"] == 1 and summary["anchors_per_sequence"] == 64


def test_train_export_and_resume(tmp_path, data_dir):
    out = tmp_path / "run"
    first = run_training(cfg_for(out, data_dir, "trainer.max_steps=2"))
    assert first["global_step"] == 2
    # of the time before step 1, the sanity check's validation batches (a resumed run has none)
    assert 0 < first["throughput"]["sanity_seconds"] < first["throughput"]["setup_seconds"]
    assert (out / "checkpoints" / "last.ckpt").exists()
    assert {"model.safetensors", "config.json", "calibration.json", "token_counts.safetensors"} <= {
        p.name for p in (out / "drafter").iterdir()
    }
    # the training answers' tokens, from which a draft vocabulary is chosen (decoding.draft_vocab)
    split = load_tokens(tokens_path(data_dir, "train"))
    counts = DrafterFolder(out / "drafter").read_token_counts()
    assert int(counts.sum()) == int(split.loss_mask.bool().sum()) > 0
    # A later run in the same folder resumes from the saved step instead of starting over.
    second = run_training(cfg_for(out, data_dir, "trainer.max_steps=4"))
    assert second["global_step"] == 4
    assert second["throughput"]["batches"] == 2  # only the two remaining steps ran
    assert (out / "logs" / "resumed-2" / "metrics.csv").exists()  # the first part's log is kept
    drafter, config = load_drafter(out / "drafter")
    assert config["global_step"] == 4 and config["drafter"]["name"] == "dspark"
    metrics = (out / "logs" / "metrics.csv").read_text().splitlines()[0]
    for key in (
        "train/ce",
        "train/tv",
        "train/conf_loss",
        "train/tau_prob",
        "train/c_star_1",
        "train/conf_bias",
    ):
        assert key in metrics
    summary = json.loads((out / "summary.json").read_text())
    assert summary["throughput"]["tokens_per_s"] > 0
    assert summary["throughput"]["setup_seconds"] > 0  # the data and the sanity check, before step 1
    assert summary["throughput"]["sanity_seconds"] == 0  # the resumed run checked nothing first


def test_a_run_trains_on_data_dir_and_its_extra_dirs(tmp_path, data_dir):
    """``data.extra_dirs`` through the real training path: another set (``data.seed=1``, prepared by its
    own run) joins the training split, and the summary says how many conversations the steps drew from."""
    other = tmp_path / "seed1"
    alone = run_training(cfg_for(tmp_path / "a", other, "trainer.max_steps=1", "data.seed=1"))
    both = run_training(
        cfg_for(tmp_path / "b", data_dir, "trainer.max_steps=1", f"data.extra_dirs=[{other}]")
    )
    own = run_training(cfg_for(tmp_path / "c", data_dir, "trainer.max_steps=1"))
    assert both["extra_data_dirs"] == [str(other)] and own["extra_data_dirs"] == []
    # The seed-1 prompts are the tiny target's own, drawn again: some may repeat the first set's.
    assert own["train_conversations"] < both["train_conversations"]
    assert both["train_conversations"] <= own["train_conversations"] + alone["train_conversations"]


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_other_drafters_train(tmp_path, data_dir, drafter):
    out = tmp_path / drafter
    result = run_training(cfg_for(out, data_dir, f"drafter={drafter}", "trainer.max_steps=2", "head=none"))
    assert result["global_step"] == 2
    assert torch.isfinite(torch.tensor(result["final"]["train/loss"]))
    _, config = load_drafter(out / "drafter")
    assert config["drafter"]["name"] == drafter
    assert not (out / "drafter" / "calibration.json").exists()  # no confidence head, nothing to calibrate


def test_checkpoint_excludes_target(tmp_path, data_dir):
    out = tmp_path / "ckpt"
    run_training(cfg_for(out, data_dir, "trainer.max_steps=1"))
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["state_dict"]
    assert state and all(k.startswith("drafter.") for k in state)


def test_lr_factor_warms_up_then_decays_to_the_floor():
    from dspark.module import lr_factor

    f = [lr_factor(p / 100, 0.1, 0.1) for p in range(101)]
    assert f[5] == pytest.approx(0.5) and f[10] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:11], f[1:11]))  # warm-up rises
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # then only decays
    assert f[100] == pytest.approx(0.1)
    assert lr_factor(0.0, 0.1, 0.1) > 0  # the first step still moves


@pytest.mark.parametrize("by, progress", [("auto", 0.6), ("steps", 0.2), ("clock", 0.6)])
def test_run_progress_follows_what_the_schedule_is_set_by(by, progress):
    """Step 20 of 100 with 60 of the clock's 100 seconds gone: auto takes the further along (a GPU
    shared three ways runs a step-bounded run's clock ahead of its steps), steps or clock one alone."""
    from datetime import timedelta
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import Timer

    from dspark.module import run_progress

    timer = Timer(duration=timedelta(seconds=100))
    timer.time_elapsed = lambda stage="train": 60.0
    trainer = SimpleNamespace(global_step=19, max_steps=100, callbacks=[timer])
    assert run_progress(trainer, None, by) == pytest.approx(progress)


def test_a_run_scheduled_by_its_clock_ignores_its_steps(tmp_path, data_dir):
    """optim.schedule_by reaches the optimizer: by the clock (5 minutes, barely started) a run of 6
    steps keeps its peak learning rate to the end, where by the default it decays to the floor."""
    import csv

    peak, lrs = 6e-4, {}  # conf/train.yaml optim.lr
    for by in ("auto", "clock"):
        out = tmp_path / by
        overrides = ["trainer.max_steps=6", "trainer.max_time=00:00:05:00", "trainer.log_every_n_steps=1"]
        run_training(cfg_for(out, data_dir, *overrides, "optim.warmup_ratio=0", f"optim.schedule_by={by}"))
        with (out / "logs" / "metrics.csv").open() as f:
            lrs[by] = [float(r["lr-AdamW"]) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    assert lrs["clock"][-1] > 0.99 * peak, lrs
    assert lrs["auto"][-1] < 0.2 * peak, lrs


def test_time_bounded_run_gets_a_whole_schedule(tmp_path, data_dir):
    """A run that stops on the clock (trainer.max_time, max_steps out of reach) warms up to the peak
    learning rate and decays towards the floor within that time, and logs the learning rate and
    the wall time per step between logged steps (the summary names the slowest interval)."""
    import csv

    out = tmp_path / "clock"
    summary = run_training(
        cfg_for(
            out,
            data_dir,
            "trainer.max_steps=100000",
            "trainer.max_time=00:00:00:12",
            "trainer.val_check_interval=1000",
            "optim.warmup_ratio=0.2",
            "optim.min_lr_ratio=0.1",
        )  # fmt: skip
    )
    with (out / "logs" / "metrics.csv").open() as f:
        lrs = [float(r["lr-AdamW"]) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    peak = 6e-4  # conf/train.yaml optim.lr
    assert len(lrs) >= 10, lrs
    top = max(range(len(lrs)), key=lrs.__getitem__)
    assert lrs[top] > 0.8 * peak and 0 < top < len(lrs) - 3, lrs  # reached mid-run, not at the end
    assert lrs[0] < 0.5 * peak and lrs[-1] < 0.35 * peak, lrs  # warm-up, then decay towards the floor
    with (out / "logs" / "metrics.csv").open() as f:
        step_ms = [
            (int(r["step"]), float(r["train/step_ms"])) for r in csv.DictReader(f) if r.get("train/step_ms")
        ]
    assert len(step_ms) >= 3 and all(ms > 0 for _, ms in step_ms), step_ms
    slowest = summary["throughput"]["step_ms"]["slowest"]
    assert slowest["ms_per_step"] == pytest.approx(max(ms for _, ms in step_ms), rel=1e-4)
    assert slowest["to_step"] - slowest["from_step"] == 1  # smoke_run logs every step


def test_init_from_goes_on_from_a_saved_drafter(tmp_path, data_dir):
    """``init_from``: a new run starts from a saved drafter's weights (a warm start: its own
    optimizer and schedule), here restored into the new run's own folder as the H200 pipeline's
    ``restore`` stage leaves it (the run's exports then replace it). At a learning rate that
    cannot move them, the weights it exports are the saved ones; a fresh run's are not."""
    import shutil

    first = tmp_path / "first"
    run_training(cfg_for(first, data_dir, "trainer.max_steps=2"))
    saved, _ = load_drafter(first / "drafter")
    shutil.copytree(first / "drafter", tmp_path / "warm" / "drafter")
    for name, init in (("warm", f"init_from={tmp_path / 'warm' / 'drafter'}"), ("fresh", "seed=1")):
        run_training(cfg_for(tmp_path / name, data_dir, "trainer.max_steps=1", "optim.lr=1e-12", init))
    warm, _ = load_drafter(tmp_path / "warm" / "drafter")
    fresh, _ = load_drafter(tmp_path / "fresh" / "drafter")
    saved, warm, fresh = (d.state_dict() for d in (saved, warm, fresh))
    for name, want in saved.items():
        torch.testing.assert_close(warm[name], want, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.allclose(fresh[name], want) for name, want in saved.items())


def test_init_from_another_architecture_is_refused_before_the_run(tmp_path, data_dir):
    """A folder saved with other drafter settings is refused with the settings to train it with;
    a folder that holds no drafter, too; both before the target loads (no run folder content)."""
    from dspark.core.errors import ConfigError, DrafterCheckpointError

    first = tmp_path / "first"
    run_training(cfg_for(first, data_dir, "trainer.max_steps=1"))
    layers = load_drafter(first / "drafter")[1]["drafter"]["num_layers"]
    with pytest.raises(ConfigError, match=rf"drafter.num_layers={layers + 1} \(saved: {layers}\).*"
                                          rf"train it with drafter.num_layers={layers}"):  # fmt: skip
        run_training(cfg_for(tmp_path / "other", data_dir, f"drafter.num_layers={layers + 1}",
                             f"init_from={first / 'drafter'}"))  # fmt: skip
    with pytest.raises(DrafterCheckpointError):
        run_training(cfg_for(tmp_path / "none", data_dir, f"init_from={tmp_path / 'nowhere'}"))
    assert not any((tmp_path / name / "checkpoints").exists() for name in ("other", "none"))


def test_gpu_processes_keep_few_cpu_threads(monkeypatch):
    """cap_cpu_threads: a process whose model is on a GPU keeps GPU_PROCESS_THREADS intra-op threads
    at most (runs at once must not oversubscribe the cores); a CPU model keeps them all, and so
    does a process whose OMP_NUM_THREADS the user set."""
    from dspark.core.threads import GPU_PROCESS_THREADS, cap_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(GPU_PROCESS_THREADS + 2)
        assert cap_cpu_threads("cpu") is None and torch.get_num_threads() == GPU_PROCESS_THREADS + 2
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
        assert cap_cpu_threads("cuda") is None and torch.get_num_threads() == GPU_PROCESS_THREADS + 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert cap_cpu_threads(torch.device("cuda", 0)) == GPU_PROCESS_THREADS
        assert torch.get_num_threads() == GPU_PROCESS_THREADS
        torch.set_num_threads(1)
        assert cap_cpu_threads("cuda") == 1 and torch.get_num_threads() == 1  # never raised
    finally:
        torch.set_num_threads(before)
