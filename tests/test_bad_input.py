"""The bad-input battery: every entry point given a mistake (a bad value, an unknown key, a broken
user file, a folder it must not write) ends in exit status 2 and one `dspark: error:` line naming
the key or file, before any model loads and without writing anything. The cases run in-process
(the Hydra mains called with a composed config, on the shared error path); a few run as real
commands."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_group
from hydra import compose, initialize_config_module

from dspark.checkpoints import save_drafter
from dspark.cli import user_errors
from dspark.core.types import TargetDims
from dspark.drafters import build_drafter


@pytest.fixture(scope="module")
def drafter_src(tiny_target, tmp_path_factory) -> Path:
    """A real DSpark-Markov drafter folder for the tiny target (block size 7)."""
    dc, hc = load_group("drafter", "dspark"), load_group("head", "markov")
    dc.num_layers, hc.rank = 1, 8
    folder = tmp_path_factory.mktemp("drafter") / "drafter"
    torch.manual_seed(0)
    save_drafter(build_drafter(TargetDims.of(tiny_target), dc, hc), folder, dc, hc, tiny_target.describe())
    return folder


# ---- user files a case may need, made inside its own tmp_path --------------------------------


def corrupt(name: str, data: bytes):
    def make(tmp: Path, drafter: Path) -> None:
        (drafter / name).write_bytes(data)

    return make


def calibration(data: bytes):
    return corrupt("calibration.json", data)


def truncated_weights(tmp: Path, drafter: Path) -> None:
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def bench_file(line: bytes):
    def make(tmp: Path, drafter: Path) -> None:
        (tmp / "bench").mkdir()
        (tmp / "bench" / "gsm8k.jsonl").write_bytes(line + b"\n")

    return make


def prompts_file(data: bytes):
    def make(tmp: Path, drafter: Path) -> None:
        (tmp / "p.jsonl").write_bytes(data)

    return make


def cost_table(obj):
    def make(tmp: Path, drafter: Path) -> None:
        (tmp / "c.json").write_text(json.dumps(obj))

    return make


def non_empty_out(tmp: Path, drafter: Path) -> None:
    (tmp / "export").mkdir()
    (tmp / "export" / "calibration.json").write_text(
        '{"method": "sts", "temperatures": [1, 1, 1, 1, 1, 1, 1]}'
    )


BASE = {
    "train": ["target=tiny", "data=smoke", "data.dir={tmp}/data", "out_dir={tmp}/run"],
    "prepare": ["target=tiny", "data=smoke", "data.dir={tmp}/data"],
    "evaluate": ["target=tiny", "drafter_dir={drafter}", "out_dir={tmp}/eval", "benchmarks=[gsm8k]"],
    "schedule": ["rounds={tmp}/rounds.jsonl", "out_dir={tmp}/frontier"],
    "report": ["runs={tmp}", "out_dir={tmp}/report"],
    "export": ["drafter_dir={drafter}", "out={tmp}/export", "format=vllm"],
}
BENCH = "benchmark_dir={tmp}/bench"

# (app, overrides, what the one line must say[, the user files the case needs])
CASES = [
    # train: values, enums, unknown keys, rules across keys, the target's context
    ("train", ["loss.tv=-1"], "loss.tv=-1: must be >= 0"),
    ("train", ["loss.confidence=-0.5"], "loss.confidence=-0.5: must be >= 0"),
    ("train", ["loss.kl=-1"], "loss.kl=-1: must be >= 0"),
    ("train", ["loss.gamma_decay=0"], "loss.gamma_decay=0: must be > 0"),
    ("train", ["loss.ce=0", "loss.tv=0", "loss.confidence=0"], "nothing to train on"),
    ("train", ["loss.impl=cuda"], "loss.impl='cuda': must be one of"),
    ("train", ["loss.chunk_rows=0"], "loss.chunk_rows=0: must be >= 1"),
    ("train", ["+loss.chunk_size=4"], "unknown key loss.chunk_size: did you mean loss.chunk_rows?"),
    ("train", ["drafter.attention=bogus"], "drafter.attention='bogus': must be one of 'auto', 'dense'"),
    ("train", ["drafter.compile=maybe"], "drafter.compile='maybe'"),
    ("train", ["drafter.num_heads=3"], "drafter.num_heads=3 is not a multiple of num_kv_heads=2"),
    ("train", ["drafter.block_size=0"], "drafter.block_size=0: must be >= 1"),
    ("train", ["drafter.nonexistent=1"], "unknown key drafter.nonexistent"),
    ("train", ["+drafter.nonexistent=1"], "unknown key drafter.nonexistent"),
    ("train", ["drafter=dflash", "head=rnn"], "drafter=dflash has no sequential head"),
    ("train", ["head.rank=-1"], "head.rank=-1: must be >= 0"),
    ("train", ["data.val_fraction=1.5"], "data.val_fraction=1.5: must be >= 0 and < 1"),
    ("train", ["data.num_prompts=-1"], "data.num_prompts=-1: must be >= 1"),
    ("train", ["data.gen_batch_size=0"], "data.gen_batch_size=0: must be >= 1"),
    ("train", ["data.anchors_per_sequence=-1"], "data.anchors_per_sequence=-1: must be >= 1"),
    ("train", ["data.batch_size=0"], "data.batch_size=0: must be >= 1"),
    ("train", ["data.global_batch_size=3"], "data.global_batch_size=3 is not a multiple"),
    ("train", ["data.max_length=100000"], "data.max_length=100000 does not fit target tiny's context"),
    ("train", ["data.max_new_tokens=5000"], "data.max_new_tokens=5000 does not fit"),
    ("train", ["callbacks.checkpoint_every_n_steps=0"], "callbacks.checkpoint_every_n_steps=0: must be"),
    ("train", ["trainer.val_check_interval=0"], "trainer.val_check_interval=0: must be >= 1"),
    ("train", ["trainer.max_steps=0"], "trainer.max_steps=0"),
    ("train", ["trainer.precision=bogus"], "trainer.precision='bogus': must be one of"),
    ("train", ["trainer.devices=0"], "trainer.devices=0: must be >= 1"),
    ("train", ["trainer.max_time=5min"], "trainer.max_time='5min': must look like DD:HH:MM:SS"),
    ("train", ["trainer.strategy=warp"], "trainer: strategy='warp' is not a Lightning strategy"),
    ("train", ["optim.lr=0"], "optim.lr=0: must be > 0"),
    ("train", ["optim.lr=nan"], "optim.lr=nan: must be a finite number"),
    ("train", ["optim.betas=[0.9]"], "betas=[0.9] must hold two numbers"),
    ("train", ["optim.schedule_by=epochs"], "optim.schedule_by='epochs': must be one of 'auto', 'steps'"),
    ("train", ["optim.schedule_by=clock", "trainer.max_time=null"], "optim.schedule_by=clock needs a clock"),
    ("train", ["optim.schedule_by=steps", "trainer.max_steps=-1"], "optim.schedule_by=steps needs steps"),
    ("train", ["features=both"], "features='both': must be one of 'online', 'offline'"),
    ("train", ["target.layer_ids=[1,3]"], "out of range for a 4-layer target"),
    ("train", ["target.generation.top_p=0"], "target.generation.top_p=0: must be > 0 and <= 1"),
    ("train", ["target=not_a_target"], "target/not_a_target does not exist: choose one of"),
    ("train", ["loss.tv=[1,"], "cannot read the override 'loss.tv=[1,'"),
    ("train", ["seed=one"], "seed='one': must be an integer"),
    # prepare
    ("prepare", ["data.num_prompts=0"], "data.num_prompts=0: must be >= 1"),
    ("prepare", ["data.source=bogus"], "data.source='bogus': must be one of"),
    ("prepare", ["data.engine=turbo"], "data.engine='turbo': must be one of 'auto', 'plain', 'fast'"),
    ("prepare", ["data.tokenize_workers=many"], "data.tokenize_workers='many': must be one of 'auto' or"),
    ("prepare", ["data.max_prompt_length=600"], "max_prompt_length=600 leaves no room"),
    ("prepare", ["data.min_prompt_chars=5000"], "no prompt could pass"),
    ("prepare", ["target.dtype=float64"], "target.dtype='float64': must be one of"),
    ("prepare", ["data=jsonl"], "data: source=jsonl needs jsonl.path=<file.jsonl>"),
    ("prepare", ["data.jsonl.path={tmp}/p.jsonl"], "is not UTF-8 text", prompts_file(b"\xff\xfe{")),
    ("prepare", ["data.jsonl.path={tmp}/missing.jsonl"], "no such file"),
    ("prepare", ["+force2=true"], "unknown key force2: did you mean force?"),
    # evaluate: values, the checkpoint's files, the benchmark files
    ("evaluate", ["max_prompts=-1"], "max_prompts=-1: must be >= 1 (or null)"),
    ("evaluate", ["max_new_tokens=1e9"], "max_new_tokens=1000000000.0: must be an integer"),
    ("evaluate", ["max_new_tokens=100000"], "max_new_tokens=100000 does not fit target tiny's context"),
    ("evaluate", ["calibration.max_new_tokens=9000"], "calibration.max_new_tokens=9000 does not fit"),
    ("evaluate", ["concurrency=0"], "concurrency=0: must be >= 1"),
    ("evaluate", ["temperature=-1"], "temperature=-1: must be >= 0"),
    ("evaluate", ["engine=turbo"], "engine='turbo': must be one of 'plain', 'fast'"),
    ("evaluate", ["thresholds=[1.5]"], "thresholds[0]=1.5: must be >= 0 and <= 1"),
    ("evaluate", ["benchmarks=[]"], "benchmarks is empty"),
    ("evaluate", ["+policy.foo=1"], "policy fixed: it takes"),
    ("evaluate", ["policy.gamma=9"], "policy.gamma=9 exceeds the 7 tokens the drafter"),
    ("evaluate", ["policy=threshold", "policy.threshold=2"], "policy threshold"),
    ("evaluate", ["drafter_dir={tmp}/nowhere"], "is not a drafter checkpoint"),
    ("evaluate", ["drafter_dir=???"], "drafter_dir is required"),
    ("evaluate", [], "model.safetensors is not a readable safetensors", truncated_weights),
    ("evaluate", [], "model.safetensors is not a readable safetensors", corrupt("model.safetensors", b"x")),
    ("evaluate", [], "config.json is not readable JSON", corrupt("config.json", b"{not json")),
    ("evaluate", [], "config.json is not readable JSON (not UTF-8", corrupt("config.json", b"\xff\xfe")),
    ("evaluate", [], "calibration.json is not readable JSON", calibration(b"[1,")),
    ("evaluate", [], "calibration.json is not a calibration file", calibration(b'{"t": 1}')),
    ("evaluate", [], "temperatures must be finite and positive", calibration(b'{"temperatures": [1, -1]}')),
    ("evaluate", [], "holds 2 temperatures for a drafter of 7", calibration(b'{"temperatures": [1, 1]}')),
    ("evaluate", [BENCH], "gsm8k.jsonl is not UTF-8 text", bench_file(b'{"turns": ["\xff"]}')),
    ("evaluate", [BENCH], "'turns' must be a non-empty list of strings", bench_file(b'{"turns": "text"}')),
    ("evaluate", [BENCH], "the first turn is empty", bench_file(b'{"turns": ["  "]}')),
    ("evaluate", [BENCH], "expected a JSON object with a 'turns' list", bench_file(b"[1, 2")),
    ("evaluate", ["policy=hardware_aware", "policy.cost_table={tmp}/c.json"], "not a cost", cost_table([1])),
    # schedule
    ("schedule", ["mode=bogus"], "mode='bogus': must be one of 'analytical', 'measured'"),
    ("schedule", ["concurrency=[0,2]"], "concurrency[0]=0: must be >= 1"),
    ("schedule", ["gamma=0"], "gamma=0: must be >= 1 (or null)"),
    ("schedule", ["threshold=1.5"], "threshold=1.5: must be >= 0 and <= 1"),
    ("schedule", ["replay.outcome=bogus"], "replay.outcome='bogus'"),
    ("schedule", ["+replay.foo=1"], "unknown key replay.foo"),
    ("schedule", ["policies=[fixed,warp]"], "unknown policy 'warp'"),
    ("schedule", ["cost_table={tmp}/c.json"], "not a valid cost table", cost_table([1, 2])),
    # report
    ("report", ["+foo=1"], "unknown key foo"),
    ("report", ["title=[1,2]"], "title=[1, 2]: must be a string"),
    ("report", ["runs={tmp}/nowhere"], "no such folder"),
    # export
    ("export", ["out={drafter}"], "is drafter_dir itself"),
    ("export", [], "is not empty: choose an empty folder, or force=true", non_empty_out),
    ("export", ["format=onnx"], "format='onnx': must be one of 'hf', 'vllm', 'sglang'"),
    ("export", ["dtype=int8"], "dtype='int8'"),
    ("export", ["format=hf"], "add target=tiny, or embeddings=false"),
    ("export", [], "model.safetensors is not a readable safetensors file", truncated_weights),
]  # fmt: skip


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_entry(app: str, overrides: list[str]) -> None:
    """``python -m dspark.<app> <overrides>`` in this process: compose, then the Hydra main with the
    composed config, both on the shared error path."""
    module = importlib.import_module(f"dspark.{app}")
    with user_errors():
        with initialize_config_module("dspark.conf", version_base="1.3"):
            cfg = compose(app, overrides=overrides)
        module.main(cfg)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a target model is built or drafter weights are read (patched where
    load_target and load_drafter look them up at call time, so every caller is covered)."""
    no_model_loads(monkeypatch)


def no_model_loads(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    for name in ("build_tiny", "load_model_and_tokenizer"):
        monkeypatch.setattr(f"dspark.target.{name}", refuse)
    monkeypatch.setattr("dspark.checkpoints.store.load_file", refuse)


@pytest.mark.parametrize(
    "app,overrides,message,make",
    [(c[0], c[1], c[2], c[3] if len(c) > 3 else None) for c in CASES],
    ids=[f"{c[0]}:{' '.join(c[1]) or getattr(c[3], '__name__', 'files')}" for c in CASES],
)
def test_bad_input_is_one_line_before_anything_loads(
    app, overrides, message, make, tmp_path, drafter_src, no_model_load, capsys
):
    drafter = tmp_path / "drafter"
    shutil.copytree(drafter_src, drafter)
    if make is not None:
        make(tmp_path, drafter)
    before = _files(tmp_path)
    args = [a.format(tmp=tmp_path, drafter=drafter) for a in BASE[app] + overrides]
    with pytest.raises(SystemExit) as exit_:
        run_entry(app, args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspark: error: "), err
    assert message in lines[0], lines[0]
    assert _files(tmp_path) == before  # nothing written, nothing changed


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize(
    "app,args,message",
    [
        ("train", ["target=tiny", "drafter.nonexistent=1"], "unknown key drafter.nonexistent"),
        ("prepare", ["target=tiny", "data.num_prompts=0"], "data.num_prompts=0: must be >= 1"),
        ("evaluate", ["target=tiny", "drafter_dir={drafter}", "max_prompts=-1"], "max_prompts=-1"),
    ],
)
def test_commands_exit_2_with_one_line_and_leave_no_folder(app, args, message, tmp_path, drafter_src):
    """As real commands: exit 2, one line on stderr, and not even Hydra's run folder is left."""
    hydra_dir = tmp_path / "hydra"
    cmd = [sys.executable, "-m", f"dspark.{app}", *(a.format(drafter=drafter_src) for a in args)]
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={hydra_dir}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("dspark: error: ") and message in proc.stderr
    assert not hydra_dir.exists()


def test_export_force_replaces_a_stale_folder(tmp_path, drafter_src):
    """force=true: the new drafter, and no temperatures of an earlier export applied to it."""
    out = tmp_path / "export"
    non_empty_out(tmp_path, drafter_src)
    (out / "calibration_report.json").write_text("{}")
    run_entry("export", [f"drafter_dir={drafter_src}", f"out={out}", "format=vllm", "force=true"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
