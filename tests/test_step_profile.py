"""The profile window of a training run (bench.step_profile, bench.step_trace, core.phases): the
trace reading on a hand-made CUDA-shaped trace whose every number is known, and the window in a real
CPU run of the tiny target (files and fields; no timing is asserted)."""

import json

import pytest
import torch
from conftest import smoke_run
from hydra import compose, initialize_config_module
from safetensors.torch import load_file

from dspark.bench.step_trace import OUTSIDE, markdown, read_trace, step_report
from dspark.config import check_train
from dspark.core.errors import ConfigError
from dspark.core.phases import phase, recording
from dspark.training import run_training


def x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}


def synthetic_trace() -> list[dict]:
    """Step 10 (warm-up) then step 11 (100–300 µs) on host thread 1; autograd's thread 2 launches the
    backward kernel; device stream 7. Kernel K5 belongs to step 10 and must not count."""
    return [
        x("user_annotation", "dspark:step#10", 0, 100),
        x("cuda_runtime", "cudaLaunchKernel", 50, 2, correlation=5),
        x("kernel", "warmup_kernel", 60, 10, tid=7, correlation=5),
        x("user_annotation", "dspark:step#11", 100, 200),
        x("user_annotation", "dspark:data_to_device", 102, 6),
        x("cuda_runtime", "cudaMemcpyAsync", 104, 1, correlation=4),
        x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 105, 2, tid=7, correlation=4),
        x("user_annotation", "dspark:optimizer_step", 110, 170),
        x("user_annotation", "dspark:training_step", 120, 80),
        x("user_annotation", "dspark:target_forward", 125, 25),
        x("cpu_op", "aten::mm", 128, 5),
        x("cpu_op", "aten::empty", 129, 1),  # called by aten::mm: not a top-level operator
        x("cuda_runtime", "cudaLaunchKernel", 130, 2, correlation=1),
        x("kernel", "gemm", 140, 30, tid=7, correlation=1),
        x("user_annotation", "dspark:backward", 200, 60),
        x("cuda_runtime", "cudaLaunchKernel", 210, 2, tid=2, correlation=2),
        x("kernel", "gemm", 215, 20, tid=7, correlation=2),
        x("cpu_op", "aten::add", 262, 1),
        x("cuda_runtime", "cudaLaunchKernel", 265, 2, correlation=3),
        x("kernel", "adam", 270, 10, tid=7, correlation=3),
        x("cuda_runtime", "cudaStreamSynchronize", 285, 10),
        x("gpu_user_annotation", "dspark:backward", 215, 20, tid=7),  # device-side copy: ignored
    ]


def test_step_report_charges_kernels_to_the_phase_that_launched_them():
    report = step_report(synthetic_trace(), steps=[11])
    s = report["per_step"]
    assert report["device"] == "cuda" and report["steps_recorded"] == 2 and report["steps_reported"] == 1
    assert s["host_ms"] == pytest.approx(0.2)
    assert s["kernels"] == 4 and s["device_ms"] == pytest.approx(0.062)
    assert s["device_busy_ms"] == pytest.approx(0.062)
    assert s["device_span_ms"] == pytest.approx(0.175)  # first kernel start 105, last end 280
    assert s["device_idle_ms"] == pytest.approx(0.113)
    assert s["device_utilization"] == pytest.approx(62 / 175)
    assert s["launch_lag_ms"]["median"] == pytest.approx(0.005)  # lags 1, 10, 5, 5 µs
    assert s["blocking_calls_ms"] == pytest.approx(0.01)
    assert s["host_ops"] == 2  # aten::mm and aten::add; aten::empty runs inside aten::mm
    rows = {r["phase"]: r for r in report["phases"]}
    forward = rows["optimizer_step/training_step/target_forward"]
    assert forward["self_device_ms"] == pytest.approx(0.03) and forward["host_ops"] == 1
    assert rows["optimizer_step/backward"]["self_device_ms"] == pytest.approx(0.02)  # thread 2's launch
    opt = rows["optimizer_step"]
    assert opt["self_device_ms"] == pytest.approx(0.01) and opt["device_ms"] == pytest.approx(0.06)
    assert opt["kernels"] == 3 and opt["self_kernels"] == 1 and opt["host_ops"] == 1
    assert opt["host_ms"] == pytest.approx(0.17) and opt["self_host_ms"] == pytest.approx(0.03)
    assert rows["data_to_device"]["self_device_ms"] == pytest.approx(0.002)
    assert rows[OUTSIDE]["self_host_ms"] == pytest.approx(0.024)  # 200 - 170 - 6 µs
    top = report["top_kernels"][0]
    assert (top["name"], top["calls"], top["us"]) == ("gemm", 2, 50)
    assert top["phase"] == "optimizer_step/training_step/target_forward"  # 30 of its 50 µs
    assert "warmup_kernel" not in {r["name"] for r in report["top_kernels"]}
    calls = {r["name"]: r for r in report["runtime_calls"]}
    assert calls["cudaStreamSynchronize"]["blocking"] and not calls["cudaLaunchKernel"]["blocking"]
    assert calls["cudaLaunchKernel"]["calls"] == 3
    text = markdown({**report, "steps": [11]})
    assert "device utilization" in text and "· target_forward" in text and "`gemm`" in text
    assert "# Training step profile: step 11" in text and "the device idles" in text  # busy 35 %
    with pytest.raises(ValueError, match="none of the steps"):
        step_report(synthetic_trace(), steps=[12])


def test_phase_is_a_profiler_range_only_while_one_records(tmp_path):
    assert not recording()
    with phase("idle") as idle:
        pass
    assert idle is None  # the no-op context: nothing was dispatched
    from torch.profiler import ProfilerActivity, profile

    step = torch.profiler.record_function("dspark:step#0")
    with profile(activities=[ProfilerActivity.CPU]) as prof, step, phase("outer"), phase("inner"):
        torch.ones(3).sum()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    report = step_report(read_trace(tmp_path / "t.json"), steps=[0])
    assert report["device"] == "cpu" and report["per_step"]["device_ms"] is None
    rows = {r["phase"]: r for r in report["phases"]}
    assert rows["outer/inner"]["host_ops"] >= 2 and rows["outer"]["host_ops"] == 0
    assert {r["name"] for r in report["top_kernels"]} >= {"aten::ones", "aten::sum"}
    assert "CPU run" in markdown(report)


def drive(callback, steps: int) -> None:
    """Lightning's side of a run without Lightning: optimizer steps 0 … steps-1, each some work."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(global_step=0, is_global_zero=True, accumulate_grad_batches=1)
    module = SimpleNamespace(device=torch.device("cpu"))
    for _ in range(steps):
        with phase("training_step"):
            torch.randn(64, 64).matmul(torch.randn(64, 64)).sum()
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, module, None, None, 0)
    callback.on_train_end(trainer, module)


def test_a_failing_window_never_stops_the_training(tmp_path, monkeypatch, caplog):
    from dspark.bench import step_profile

    excluded = []
    callback = step_profile.StepProfile(tmp_path / "ok", start_step=2, steps=2, exclude=excluded.append)
    drive(callback, 6)
    assert callback.report["steps"] == [2, 3] and callback.done and len(excluded) == 2  # start-up, writing
    rows = {r["phase"] for r in callback.report["phases"]}
    assert rows == {"training_step", OUTSIDE}

    def broken(*args, **kw):
        raise RuntimeError("unexpected trace")

    monkeypatch.setattr(step_profile, "step_report", broken)
    callback = step_profile.StepProfile(tmp_path / "bad", start_step=2, steps=2)
    drive(callback, 6)  # no exception
    assert callback.done and callback.report is None and "training goes on without it" in caplog.text
    written = json.loads((tmp_path / "bad" / "step_profile.json").read_text())
    assert written["error"] == "RuntimeError: unexpected trace"
    # A run cut inside the window reports the steps it recorded.
    callback = step_profile.StepProfile(tmp_path / "cut", start_step=2, steps=5)
    monkeypatch.undo()
    drive(callback, 4)
    assert callback.report["steps"] == [2, 3]


def test_the_window_needs_a_step_before_it():
    with initialize_config_module("dspark.conf", version_base="1.3"):
        cfg = compose("train", ["callbacks.profile.start_step=1", "callbacks.profile.warmup_steps=1"])
    with pytest.raises(ConfigError, match="callbacks.profile.start_step"):
        check_train(cfg)


def test_profile_window_in_a_real_run_leaves_the_training_unchanged(tmp_path, smoke_data):
    def train(out, *more):
        with initialize_config_module("dspark.conf", version_base="1.3"):
            cfg = compose("train", smoke_run(out, smoke_data, "trainer.max_steps=5",
                                             "trainer.val_check_interval=100", *more))  # fmt: skip
        return run_training(cfg)

    window = ["callbacks.profile.enabled=true", "callbacks.profile.start_step=3", "callbacks.profile.steps=2"]
    profiled = train(tmp_path / "profiled", *window)
    plain = train(tmp_path / "plain")
    # The profiler only watches: the same weights, bit for bit.
    a = load_file(tmp_path / "profiled" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "plain" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "plain" / "profile").exists()

    folder = tmp_path / "profiled" / "profile"
    report = json.loads((folder / "step_profile.json").read_text())
    assert report["schema"] == "dspark.step_profile/v1" and report["device"] == "cpu"
    assert report["steps"] == [3, 4] and report["steps_recorded"] == 3 and report["warmup_steps"] == 1
    s = report["per_step"]
    assert s["host_ms"] > 0 and s["host_ops"] > 0 and s["kernels"] is None
    assert report["unprofiled_step_ms"] > 0 and not report["validation_in_window"]
    phases = {r["phase"] for r in report["phases"]}
    step = "optimizer_step/training_step"
    for path in (
        "data_to_device",
        "optimizer_step/backward",
        "optimizer_step/clip_grad",
        f"{step}/target_forward",
        f"{step}/anchors",
        f"{step}/drafter_forward/context_kv",
        f"{step}/drafter_forward/block_mask",
        f"{step}/drafter_forward/draft_layers",
        f"{step}/drafter_forward/heads",
        f"{step}/loss/fused_loss",
        f"{step}/loss/confidence",
        f"{step}/loss/acceptance_metrics",
        f"{step}/metric_sums",
        f"{step}/log_metrics",  # log_every_n_steps=1 in the smoke runs
    ):
        assert path in phases, path
    assert report["top_kernels"] and all(r["us"] >= 0 and r["calls"] > 0 for r in report["top_kernels"])
    assert read_trace(folder / "trace.json.gz")  # the Chrome trace, readable
    text = (folder / "step_profile.md").read_text()
    assert "# Training step profile: steps 3–4" in text and "· fused_loss" in text
    assert profiled["throughput"]["excluded_seconds"] > 0 and plain["throughput"]["excluded_seconds"] == 0


def test_the_drafter_script_records_and_returns_the_window(tmp_path):
    """`h200_drafter.sh train` turns the window on and copies its files beside the run's summary
    (here a stub stands in for `python3 -m dspark.train` and writes what the window would)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text(f"""#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "dspark.train" ]; then
  for a in "$@"; do case $a in hydra.run.dir=*) run=${{a#hydra.run.dir=}};; esac; done
  mkdir -p $run/profile $run/logs $run/drafter && echo "$*" > $run.args && echo {{}} > $run/config.yaml
  echo {{}} > $run/profile/step_profile.json
  if [ -z "$FAILED_WINDOW" ]; then  # a failed window writes its JSON (the error) alone
    printf '# P\\n\\nReading: stub.\\n' > $run/profile/step_profile.md
    echo trace | gzip > $run/profile/trace.json.gz
  fi
  echo "trained"  # the log the script reads back
  exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    work = tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    (work / "outputs" / "h200").mkdir(parents=True)  # the data step made it
    (work / "scripts" / "h200_drafter.sh").write_text((root / "scripts" / "h200_drafter.sh").read_text())
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "DSPARK_INSTALLED": "1"}

    def train(name, **more):
        env_ = {**env, "OUT": str(tmp_path / "out"), **more}
        proc = subprocess.run(["bash", "scripts/h200_drafter.sh", "train", name, "1"], cwd=work, env=env_,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout, (work / "outputs" / "h200" / f"{name}.args").read_text()

    stdout, args = train("A", TRACE_MAX_MB="1")
    assert "callbacks.profile.enabled=true" in args and "callbacks.profile.start_step=200" in args
    assert "Reading: stub." in stdout
    out = tmp_path / "out" / "A"
    assert {p.name for p in out.iterdir()} >= {
        "step_profile.json", "step_profile.md", "step_profile_trace.json.gz"
    }  # fmt: skip
    _, args = train("B", PROFILE="false")
    assert "callbacks.profile.enabled=false" in args
    assert not (tmp_path / "out" / "B" / "step_profile_trace.json.gz").exists()  # TRACE_MAX_MB: 0 by default
    # A window that failed leaves its error alone: the training step still succeeds.
    train("C", FAILED_WINDOW="1")
    assert {p.name for p in (tmp_path / "out" / "C").iterdir()} == {"config.yaml", "step_profile.json"}
