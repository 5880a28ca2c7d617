"""DraftingModule: a frozen target, a trainable drafter and its objective, as a LightningModule.

The target is held outside the module's registered children, so it is never in the optimizer or
in a checkpoint; it is moved to the module's device at fit start and kept in eval mode.
"""

from __future__ import annotations

import math
from typing import Protocol

import lightning as L
import torch
from torch import Tensor

from .drafters import Shared
from .drafters.dflash import sample_anchors
from .objectives import LossWeights, compute_loss


class FeatureSource(Protocol):
    """Where a batch's target features come from: (taps [B,T,m·d], last_hidden [B,T,d])."""

    def __call__(self, batch: dict, target) -> tuple[Tensor, Tensor]: ...


def online_features(batch: dict, target) -> tuple[Tensor, Tensor]:
    """Run the frozen target inside the training step."""
    step = target(batch["input_ids"], attention_mask=batch.get("attention_mask"), with_logits=False)
    return step.taps, step.last_hidden


def offline_features(batch: dict, target) -> tuple[Tensor, Tensor]:
    """Features precomputed by `python -m dspark.prepare data.offline_cache=true`."""
    if "taps" not in batch:
        raise KeyError("features=offline needs a dataset prepared with data.offline_cache=true")
    return batch["taps"], batch["last_hidden"]


FEATURE_SOURCES = {"online": online_features, "offline": offline_features}


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to min_ratio of the peak."""
    warmup = max(1, int(total * warmup_ratio))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class DraftingModule(L.LightningModule):
    def __init__(
        self, target, drafter, loss: LossWeights, optim: dict, features: str = "online", num_anchors=None
    ):
        super().__init__()
        object.__setattr__(self, "target", target)  # not a registered submodule, on purpose
        self.drafter = drafter
        self.loss_weights = loss
        self.optim = dict(optim)
        self.features = FEATURE_SOURCES[features]
        self.num_anchors = int(num_anchors or getattr(drafter, "num_anchors", 512))
        self.val_records: list[dict] = []

    @property
    def shared(self) -> Shared:
        return Shared.of(self.target)

    def on_fit_start(self) -> None:
        self.target.to(self.device)

    def on_validation_start(self) -> None:
        self.target.to(self.device)
        self.val_records = []

    def _step(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        with torch.no_grad():
            taps, last_hidden = self.features(batch, self.target)
        loss_mask = batch["loss_mask"]
        anchors = sample_anchors(loss_mask, self.num_anchors, generator).to(loss_mask.device)
        out = self.drafter.train_forward(taps, batch["input_ids"], loss_mask, anchors, self.shared)
        metrics = compute_loss(
            out, last_hidden, self.target.lm_head_weight, self.target.softcap, self.loss_weights
        )
        metrics["_out"] = out
        return metrics

    def _log(self, metrics: dict, prefix: str, batch_size: int) -> None:
        shown = {"loss", "tau_prob", "ce", "tv"}
        for key, value in metrics.items():
            if key.startswith("_") or key == "rows":
                continue
            self.log(
                f"{prefix}/{key}",
                value.float() if isinstance(value, Tensor) else float(value),
                prog_bar=key in shown and prefix == "train",
                on_step=prefix == "train",
                on_epoch=prefix != "train",
                batch_size=batch_size,
                sync_dist=prefix != "train",
            )

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        metrics = self._step(batch)
        self._log(metrics, "train", batch["input_ids"].shape[0])
        return metrics["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # Fixed anchors per batch index, so validation numbers are comparable across epochs.
        gen = torch.Generator().manual_seed(1_000_003 + batch_idx)
        metrics = self._step(batch, gen)
        self._log(metrics, "val", batch["input_ids"].shape[0])
        out = metrics.pop("_out")
        if out.confidence_logits is not None:
            self.val_records.append(self._confidence_record(out, metrics))

    @staticmethod
    @torch.no_grad()
    def _confidence_record(out, metrics) -> dict:
        """Teacher-forced calibration data: per block, confidence logits and the soft prefix-survival
        labels Π_{i≤k} c*_i."""
        c = torch.zeros(out.valid.shape, device=out.valid.device)
        c[out.valid] = metrics["_c_star"].float()
        return {
            "logits": out.confidence_logits.flatten(0, 1).float().cpu(),
            "labels": c.flatten(0, 1).cumprod(-1).cpu(),
            "valid": out.valid.flatten(0, 1).cpu(),
        }

    def configure_optimizers(self):
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            params,
            lr=self.optim["lr"],
            weight_decay=self.optim["weight_decay"],
            betas=tuple(self.optim["betas"]),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_lambda(s, total, self.optim["warmup_ratio"], self.optim["min_lr_ratio"])
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
