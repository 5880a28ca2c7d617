"""Host work of the training step: no host↔device synchronisation between logged steps, one per
logged step (bench.sync_watch counts them on the CPU)."""

import math

import lightning
import pytest
import torch
from conftest import smoke_run
from hydra import compose, initialize_config_module

from dspark.bench.sync_watch import SyncWatch, watching
from dspark.module import host_scalar
from dspark.training import run_training


def test_sync_watch_counts_reads_of_device_data_only():
    layer = torch.nn.Linear(3, 2)
    tolist = torch.Tensor.tolist
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
    assert [e.op for e in watch.events] == [
        "aten::_local_scalar_dense",
        "Tensor.tolist",
        "aten::_local_scalar_dense",
        "aten::index",
    ]
    assert all("test_host_syncs.py" in e.where for e in watch.events)
    assert torch.Tensor.tolist is tolist and "tolist" not in vars(torch.Tensor)  # unpatched again


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


def test_host_scalar_is_what_lightning_would_log_but_on_the_host():
    value = 1 / 3
    logged = host_scalar(value)
    assert logged.device.type == "cpu" and logged.dtype == torch.float32 and logged.dim() == 0
    assert logged.item() == torch.tensor(value, dtype=torch.float32).item()
