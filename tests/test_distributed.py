"""Distributed training on the CPU: a 2-process gloo DDP run of the tiny target against a 1-process
run with the same global batch (accumulation 2), the pieces that make them agree (global batch
arithmetic, rank slicing of global batches, metrics from global sums), and the FSDP config.

Lightning's FSDPStrategy refuses a CPU accelerator: the default tests check its construction from
`trainer=fsdp`; a `slow` test runs 2-process FSDP on the CPU through a test-only strategy subclass
(pytest -m slow tests/test_distributed.py)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from safetensors.torch import load_file

from dspark.checkpoints import load_drafter
from dspark.core.types import TargetDims
from dspark.data.datamodule import DraftDataModule, GlobalBatchSampler
from dspark.drafters import build_drafter
from dspark.module import DraftingModule, MetricSums
from dspark.objectives import LossWeights, acceptance_metrics
from dspark.training import BatchConfigError, resolve_batch, run_training, trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4

# Both runs: 2 samples per micro-batch, 4 per optimizer step; validation every 2 steps on 2 batches.
COMMON = [
    "experiment=cpu_smoke",
    "data.num_prompts=12",
    "data.max_new_tokens=12",
    "data.val_fraction=0.25",
    "data.batch_size=2",
    "data.global_batch_size=4",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "callbacks.checkpoint_every_n_steps=2",
]
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def compose_train(*overrides):
    with initialize_config_module("dspark.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


def metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} from a run's CSV log."""
    out: dict[str, dict[int, float]] = {}
    with open(run_dir / "logs" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value != "":
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("distributed")
    data = f"data.dir={base / 'data'}"
    # One process, accumulation 2 (derived from the global batch); prepares the shared dataset.
    one = run_training(compose_train(*COMMON, data, f"out_dir={base / 'one'}"))
    # Two gloo processes launched the way a user would; Lightning starts rank 1 itself.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "dspark.train", *COMMON, *DDP, data, f"hydra.run.dir={base / 'ddp'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"one": base / "one", "ddp": base / "ddp", "data": base / "data", "one_summary": one}


def test_ddp_matches_one_process(runs):
    one, ddp = metrics(runs["one"]), metrics(runs["ddp"])
    loss_one, loss_ddp = one["train/loss"], ddp["train/loss"]
    assert len(loss_one) == STEPS and sorted(loss_one) == sorted(loss_ddp)  # one row per optimizer step
    for key in (
        "train/loss",
        "train/ce",
        "train/tv",
        "train/tau_prob",
        "train/c_star_1",
        "val/loss",
        "val/tau_prob",
    ):
        assert one[key].keys() == ddp[key].keys(), key
        for step in one[key]:
            assert ddp[key][step] == pytest.approx(one[key][step], rel=1e-5, abs=1e-6), (key, step)
    # The same weights after the same optimizer steps.
    w_one = torch.load(runs["one"] / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    w_ddp = torch.load(runs["ddp"] / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert w_one.keys() == w_ddp.keys()
    for k in w_one:
        torch.testing.assert_close(w_ddp[k], w_one[k], rtol=1e-4, atol=1e-6)
    # STS is fitted on every rank's validation blocks: the same temperatures as one process.
    cal_one = OmegaConf.load(runs["one"] / "drafter" / "calibration.json")
    cal_ddp = OmegaConf.load(runs["ddp"] / "drafter" / "calibration.json")
    assert OmegaConf.to_container(cal_ddp) == OmegaConf.to_container(cal_one)


def test_ddp_run_writes_once_and_counts_all_ranks(runs):
    ddp = runs["ddp"]
    summary = OmegaConf.to_container(OmegaConf.load(ddp / "summary.json"))
    assert summary["strategy"] == "DDPStrategy" and summary["global_step"] == STEPS
    assert summary["batch"] == {"per_device": 2, "world": 2, "accumulate": 1, "global": 4}
    assert runs["one_summary"]["batch"] == {"per_device": 2, "world": 1, "accumulate": 2, "global": 4}
    assert summary["throughput"]["global_samples"] == STEPS * 4  # both ranks' samples
    assert sorted(p.name for p in (ddp / "checkpoints").iterdir()) == ["last.ckpt", "previous.ckpt"]
    assert not list(ddp.glob("**/*.tmp*"))


def test_ddp_checkpoint_evaluates_in_one_process(runs, tiny_target):
    """The 2-process checkpoint (one file, drafter weights only) loads on one CPU process: the
    validation loss there equals the DDP run's last validation loss, and the exported drafter holds
    the same weights."""
    ddp = runs["ddp"]
    cfg = compose_train(*COMMON, f"data.dir={runs['data']}", f"out_dir={ddp}")
    drafter = build_drafter(TargetDims.of(tiny_target), cfg.drafter, cfg.head)
    module = DraftingModule(
        tiny_target,
        drafter,
        LossWeights.from_cfg(cfg.loss),
        OmegaConf.to_container(cfg.optim),
        num_anchors=cfg.data.anchors_per_sequence,
    )
    state = torch.load(ddp / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    module.load_state_dict(state["state_dict"])
    dm = DraftDataModule(cfg.data, pad_token_id=tiny_target.tokenizer.pad_token_id)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (result,) = trainer.validate(module, datamodule=dm, verbose=False)
    last_val = metrics(ddp)["val/loss"]
    assert result["val/loss"] == pytest.approx(last_val[max(last_val)], rel=1e-5)
    exported, config = load_drafter(ddp / "drafter")
    assert config["global_step"] == STEPS
    weights = load_file(ddp / "drafter" / "model.safetensors")
    for k, v in exported.state_dict().items():
        torch.testing.assert_close(v, state["state_dict"][f"drafter.{k}"])
        torch.testing.assert_close(weights[k], v)


@pytest.mark.parametrize("world,accumulate", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_global_batches_are_sliced_by_rank(world, accumulate):
    """Every layout of the same global batch (ranks × accumulation) sees the same samples in each
    optimizer step, with no sample on two ranks."""
    lengths = [(i * 37) % 23 + 1 for i in range(50)]
    data = list(range(50))

    def steps(world, accumulate):
        per_rank = [
            list(GlobalBatchSampler(data, lengths, 2, world, r, accumulate, bucket_batches=2, seed=3))
            for r in range(world)
        ]
        assert len({len(p) for p in per_rank}) == 1  # every rank runs the same number of batches
        n = len(per_rank[0]) // accumulate
        return [
            [per_rank[r][s * accumulate + a] for a in range(accumulate) for r in range(world)]
            for s in range(n)
        ]

    reference = steps(1, world * accumulate)  # one process accumulating over all micro-batches
    got = steps(world, accumulate)
    assert len(got) == len(reference) == 50 // (2 * world * accumulate)
    for mine, ref in zip(got, reference):
        assert sorted(sum(mine, [])) == sorted(sum(ref, []))
        assert len(set(sum(mine, []))) == 2 * world * accumulate
    # One device without accumulation: the plain length-bucketed batches, all of one size (a
    # partial one would recompile the compiled layers mid-run): the last 50 mod 4 samples wait.
    single = list(GlobalBatchSampler(data, lengths, 4, bucket_batches=2, seed=3))
    assert {len(b) for b in single} == {4} and len(single) == 12 == len(GlobalBatchSampler(data, lengths, 4))
    assert len(set(sum(single, []))) == 48


def test_global_batch_arithmetic():
    data = OmegaConf.create({"batch_size": 4, "global_batch_size": 32})
    trainer = OmegaConf.create(
        {"devices": 2, "num_nodes": 2, "accelerator": "gpu", "accumulate_grad_batches": 1}
    )
    assert resolve_batch(data, trainer) == {"per_device": 4, "world": 4, "accumulate": 2, "global": 32}
    data.global_batch_size = None
    trainer.accumulate_grad_batches = 3
    assert resolve_batch(data, trainer)["global"] == 48
    data.global_batch_size = 24
    with pytest.raises(BatchConfigError, match="global_batch_size=24 is not a multiple"):
        trainer.accumulate_grad_batches = 1
        resolve_batch(data, OmegaConf.merge(trainer, {"devices": [0, 1, 2, 3, 4]}))
    with pytest.raises(BatchConfigError, match="accumulate_grad_batches=3 contradicts"):
        data.global_batch_size = 32
        trainer.accumulate_grad_batches = 3
        resolve_batch(data, trainer)
    # The optimizer-step settings become Lightning's micro-batch counts.
    kw = trainer_kwargs(compose_train(*COMMON, *DDP).trainer, accumulate=2, world=2)
    assert kw["accumulate_grad_batches"] == 2 and kw["val_check_interval"] == 4
    assert kw["limit_val_batches"] == 1 and kw["use_distributed_sampler"] is False
    assert type(kw["strategy"]).__name__ == "DDPStrategy"


# Lightning refuses FSDP without a GPU. This launcher (a file, so Lightning's launcher can start rank 1
# from it) swaps in an FSDPStrategy subclass that wraps on the CPU first and gathers the full state
# dict without CPU offload (which crashes when the parameters already live on the CPU). Everything
# else (module, metrics, sampler, export, checkpoint) is the code a GPU run uses.
FSDP_CPU_LAUNCHER = """
import sys
import torch
from hydra import compose, initialize_config_module
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType

import dspark.training as training

torch.set_num_threads(1)


class CPUFSDP(FSDPStrategy):
    def _setup_model(self, model):
        if not isinstance(model, FSDP):
            model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                         sharding_strategy=self.sharding_strategy)
        return super()._setup_model(model)

    def lightning_module_state_dict(self):
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, config):
            return self.model.state_dict()


build = training.build_strategy


def cpu_fsdp(cfg):
    s = build(cfg)
    if isinstance(s, FSDPStrategy):
        return CPUFSDP(process_group_backend="gloo", state_dict_type=s._state_dict_type,
                       sharding_strategy=s.sharding_strategy)
    return s


training.build_strategy = cpu_fsdp
with initialize_config_module("dspark.conf", version_base="1.3"):
    cfg = compose("train", overrides=sys.argv[1:])
training.run_training(cfg)
"""


@pytest.mark.slow
def test_fsdp_two_processes_on_cpu_match_ddp(runs, tmp_path):
    """trainer=fsdp on 2 gloo processes (drafter sharded, target outside the wrapped module): the same
    loss curve and final weights as DDP, one full checkpoint and a drafter export from rank 0."""
    launcher = tmp_path / "fsdp_cpu.py"
    launcher.write_text(FSDP_CPU_LAUNCHER)
    out = tmp_path / "fsdp"
    fsdp = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]
    cmd = [sys.executable, str(launcher), *COMMON, *fsdp, f"data.dir={runs['data']}", f"out_dir={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ddp, sharded = metrics(runs["ddp"]), metrics(out)
    for key in ("train/loss", "train/tau_prob", "val/loss"):
        assert sharded[key].keys() == ddp[key].keys(), key
        for step in ddp[key]:
            assert sharded[key][step] == pytest.approx(ddp[key][step], rel=1e-5, abs=1e-6), (key, step)
    w_ddp = torch.load(runs["ddp"] / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    w_fsdp = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert w_fsdp.keys() == w_ddp.keys()  # full (gathered) drafter weights, no target
    for k in w_ddp:
        torch.testing.assert_close(w_fsdp[k], w_ddp[k], rtol=1e-4, atol=1e-6)
    exported, _ = load_drafter(out / "drafter")
    for k, v in exported.state_dict().items():
        torch.testing.assert_close(v, w_fsdp[f"drafter.{k}"])


def test_fsdp_config_builds_the_strategy():
    from lightning.pytorch.strategies import FSDPStrategy

    cfg = compose_train("trainer=fsdp", "trainer.devices=2")
    kw = trainer_kwargs(cfg.trainer, accumulate=1, world=2)
    strategy = kw["strategy"]
    assert isinstance(strategy, FSDPStrategy) and strategy._state_dict_type == "full"
    assert kw["precision"] == "bf16-mixed" and kw["devices"] == 2
    # Lightning runs FSDP on GPUs only; that refusal is what keeps this test off the CPU.
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)


def test_acceptance_uses_global_sums():
    """τ_prob and c*_k from two shards' summed numerators equal the values over the union, not the
    mean of the shards' values."""
    g = torch.Generator().manual_seed(0)
    valid = torch.rand(6, 5, 4, generator=g) > 0.2
    valid[:, :, 1:] &= valid[:, :, :1]  # prefix-shaped like real blocks
    c = torch.rand(valid.shape, generator=g) * valid
    whole = acceptance_metrics(c, valid)
    sums = MetricSums(4)
    parts = [acceptance_metrics(c[:2], valid[:2]), acceptance_metrics(c[2:], valid[2:])]
    for part in parts:
        sums.add({"loss": torch.tensor(0.0), **part})
    got = sums.compute(sums.take("cpu"))
    assert got["tau_prob"] == pytest.approx(float(whole["tau_prob"]), rel=1e-6)
    for k in range(1, 5):
        assert got[f"c_star_{k}"] == pytest.approx(float(whole[f"c_star_{k}"]), rel=1e-6)
    mean_of_means = sum(float(p["tau_prob"]) for p in parts) / 2
    assert mean_of_means != pytest.approx(got["tau_prob"], rel=1e-6)
