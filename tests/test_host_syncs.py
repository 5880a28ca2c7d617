"""Host work of the training step: no host↔device synchronisation between logged steps, one per
logged step (bench.sync_watch counts them on the CPU), and the cheaper bookkeeping (metric sums,
gradient clipping) giving exactly the numbers it replaced."""

import math

import lightning
import pytest
import torch
from conftest import smoke_run
from hydra import compose, initialize_config_module

from dspark.bench.sync_watch import SyncWatch, watching
from dspark.module import COUNT_KEYS, MEAN_KEYS, MetricSums, clip_grad_norm, host_scalar
from dspark.objectives import acceptance_metrics
from dspark.training import run_training


def test_sync_watch_counts_reads_of_device_data_only():
    layer = torch.nn.Linear(3, 2)
    tolist, arange = torch.Tensor.tolist, torch.arange
    with SyncWatch() as watch:
        watch.mark(layer)
        y = layer(torch.ones(4, 3))
        float(y.detach().sum())
        y.tolist()
        bool((y > 0).any())
        y[y > 0]  # boolean indexing: a data-dependent shape
        y.flatten().repeat_interleave(torch.ones(8, dtype=torch.long), output_size=8)  # sized: no wait
        host = torch.arange(5.0)  # host data, however it is read
        host.sum().item()
        host[host > 1].tolist()
        named = torch.arange(5, device=host.device)  # a device named: on CUDA made on the GPU
        bool((named > 2).any())
    assert [e.op for e in watch.events] == [
        "aten::_local_scalar_dense",
        "Tensor.tolist",
        "aten::_local_scalar_dense",
        "aten::index",
        "aten::_local_scalar_dense",
    ]
    assert all("test_host_syncs.py" in e.where for e in watch.events)
    assert torch.Tensor.tolist is tolist and "tolist" not in vars(torch.Tensor)  # unpatched again
    assert torch.arange is arange


class _Tiny(lightning.LightningModule):
    def __init__(self, log_host: bool):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.log_host = log_host

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        value = float(loss.detach())  # the one read a logged step makes (here: every step)
        self.log("loss", host_scalar(value) if self.log_host else value, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("log_host", [False, True])
def test_lightning_reads_logged_numbers_back_from_the_device(tmp_path, log_host):
    """A number handed to ``self.log`` goes to the module's device and Lightning reads it back with
    ``.item()`` at the step's end (the progress bar), a sync per step; the same value in host memory
    (``host_scalar``) costs none. The watch sees the difference on the CPU."""
    if not hasattr(lightning.LightningModule, "_LightningModule__to_tensor"):
        pytest.skip("this Lightning makes tensors of logged numbers elsewhere: SyncWatch misses them")
    data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    with watching() as (watch, callback):
        trainer = lightning.Trainer(
            accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
            enable_model_summary=False, enable_progress_bar=False, callbacks=[callback],
            default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(_Tiny(log_host), data)
    for step, events in callback.steps.items():
        lightning_reads = [e for e in events if "test_host_syncs.py" not in e.where]
        assert len(events) - len(lightning_reads) == 1  # float(loss)
        assert bool(lightning_reads) == (not log_host), (step, [str(e) for e in events])


@pytest.mark.parametrize(
    "variant",
    [[], ["drafter=dflash", "head=none", "loss.impl=torch"]],  # + the chunked loss the GPU runs
    ids=["dspark-markov", "dflash-chunked-loss"],
)
def test_training_steps_read_the_device_only_to_log(tmp_path, smoke_data, monkeypatch, variant):
    """A whole training run on the tiny target watched step by step: between two logged steps
    nothing reads device data back (no .item(), no data-dependent shape, no number logged as a
    device tensor); a logged step reads its metric sums once. Adding a sync anywhere in the step,
    its logging or the callbacks fails this test."""
    steps = 9  # one epoch of the smoke set's nine training conversations, one per batch
    with watching() as (watch, callback):
        plain = lightning.Trainer

        class Watched(plain):
            def __init__(self, *args, callbacks=(), **kwargs):
                super().__init__(*args, callbacks=[*callbacks, callback], **kwargs)

        monkeypatch.setattr(lightning, "Trainer", Watched)
        with initialize_config_module("dspark.conf", version_base="1.3"):
            cfg = compose("train", smoke_run(
                tmp_path / "run", smoke_data, "data.batch_size=1", f"trainer.max_steps={steps}",
                "trainer.log_every_n_steps=3", "trainer.val_check_interval=100",
                "trainer.num_sanity_val_steps=0", "callbacks.throughput_warmup_steps=2", *variant,
            ))  # fmt: skip
        summary = run_training(cfg)
    assert sorted(callback.steps) == list(range(steps))
    logged = {2, 5, 8}  # optimizer steps 3, 6 and 9
    for step, events in callback.steps.items():
        seen = [str(e) for e in events]
        if step in logged:
            # MetricSums.compute reading the reduced sums: the logged step's one sync
            assert len(events) == 1 and events[0].where.startswith("dspark/module.py"), (step, seen)
            assert events[0].where.endswith(" in compute"), (step, seen)
        else:
            assert not events, (step, seen)
    # The throughput's tokens, counted on the host, are the epoch's real tokens.
    from dspark.data.datamodule import tokens_path
    from dspark.data.tokenize import load_tokens

    lengths = load_tokens(tokens_path(smoke_data, "train")).lengths
    assert len(lengths) == steps
    assert summary["throughput"]["tokens"] == int(lengths.sum())
    assert summary["final"]["train/tokens_per_s"] > 0 and math.isfinite(summary["final"]["train/loss"])


class _ReferenceSums:
    """MetricSums as it was before it stacked its values (one small vector per metric, weights on
    the device): the numbers the logged metrics must keep."""

    def __init__(self, gamma):
        self.gamma, self.total = gamma, None

    def add(self, metrics, weight=1.0):
        f64 = dict(dtype=torch.float64)

        def vec(value):
            return torch.as_tensor(value).detach().to(**f64).reshape(-1)

        w, parts = float(weight), []
        for key in MEAN_KEYS:
            if key in metrics:
                parts += [vec(metrics[key]) * w, torch.full((1,), w, **f64)]
            else:
                parts.append(torch.zeros(2, **f64))
        parts += [vec(metrics[key]) if key in metrics else torch.zeros(1, **f64) for key in COUNT_KEYS]
        for key, size in (("_tau_sums", 4), ("_pos_sums", 2 * self.gamma)):
            parts.append(vec(metrics[key]) if key in metrics else torch.zeros(size, **f64))
        v = torch.cat(parts)
        self.total = v if self.total is None else self.total + v

    def compute(self):
        t, n = self.total.tolist(), len(MEAN_KEYS)
        out = {key: t[2 * i] / t[2 * i + 1] for i, key in enumerate(MEAN_KEYS) if t[2 * i + 1] > 0}
        out.update({key: t[2 * n + i] for i, key in enumerate(COUNT_KEYS)})
        o = 2 * n + len(COUNT_KEYS)
        full_num, full_den, part_num, part_den = t[o : o + 4]
        if full_den > 0:
            out["tau_prob"] = 1 + full_num / full_den
        elif part_den > 0:
            out["tau_prob"] = 1 + part_num / part_den
        num, den = t[o + 4 : o + 4 + self.gamma], t[o + 4 + self.gamma :]
        if any(d > 0 for d in den):
            out.update({f"c_star_{k + 1}": num[k] / max(den[k], 1.0) for k in range(self.gamma)})
        return out


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [4.0, 4.0, 3.0]])  # training, validation
def test_metric_sums_give_exactly_the_numbers_they_replaced(weights):
    gamma = 5
    g = torch.Generator().manual_seed(0)
    new, ref = MetricSums(gamma), _ReferenceSums(gamma)
    for i, w in enumerate(weights):
        valid = torch.rand(3, 4, gamma, generator=g) > 0.3
        c = torch.rand(valid.shape, generator=g) * valid
        metrics = {key: torch.rand((), generator=g) * 10 for key in ("loss", "ce", "tv", "conf_loss")}
        metrics["conf_bias"] = torch.rand((), generator=g).to(torch.bfloat16)  # any float dtype
        if i != 1:
            metrics["conf_abs_err"] = torch.rand((), generator=g)  # present in some batches only
        metrics.update(acceptance_metrics(c, valid), rows=valid.sum())  # rows: an integer count
        new.add(metrics, w)
        ref.add(metrics, w)
    assert new.compute(new.take("cpu")) == ref.compute()  # equal floats, not close ones
    assert new.compute(new.take("cpu")) == {"rows": 0.0, "acceptance_blocks": 0.0}  # taken: empty again


def test_metric_sums_add_few_operators():
    """add() is a handful of operators whatever the number of metrics (it was ~55 a step)."""
    from torch.profiler import ProfilerActivity, profile

    valid = torch.rand(2, 3, 4) > 0.3
    metrics = {key: torch.rand(()) for key in MEAN_KEYS}
    metrics.update(acceptance_metrics(torch.rand(valid.shape) * valid, valid), rows=valid.sum())
    sums = MetricSums(4)
    sums.add(metrics)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sums.add(metrics)
    top = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    assert len(top) <= 10, [e.name for e in top]


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clipped, and left alone
def test_clip_grad_norm_equals_torch_bit_for_bit(max_norm):
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    x = torch.randn(5, 8)
    for net in nets:
        net(x).pow(2).sum().backward()
    nets[0][0].bias.grad = None  # a parameter without a gradient is skipped by both
    nets[1][0].bias.grad = None
    torch.nn.utils.clip_grad_norm_(nets[0].parameters(), max_norm)
    clip_grad_norm(nets[1].parameters(), max_norm)
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


def test_host_scalar_is_what_lightning_would_log_but_on_the_host():
    value = 1 / 3
    logged = host_scalar(value)
    assert logged.device.type == "cpu" and logged.dtype == torch.float32 and logged.dim() == 0
    assert logged.item() == torch.tensor(value, dtype=torch.float32).item()
