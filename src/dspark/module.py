"""DraftingModule: a frozen target, a trainable drafter and its objective, as a LightningModule.

The target is held outside the module's registered children, so it is never in the optimizer or
in a checkpoint; it is moved to the module's device at fit start and kept in eval mode.
Under DDP every rank holds a full copy of the target (frozen, no gradients, never synchronised);
under FSDP only the drafter is sharded (parameters, gradients, optimizer states) and the target is
still replicated: it is not part of the wrapped module.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import Tensor

from .core.types import Shared
from .drafters.dflash import sample_anchors
from .objectives import LossWeights, compute_loss


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


MEAN_KEYS = ("loss", "ce", "tv", "kl", "conf_loss", "conf_abs_err", "conf_bias")
COUNT_KEYS = ("rows", "acceptance_blocks")
PROGRESS = {"loss", "tau_prob", "ce", "tv"}


class MetricSums:
    """Running sums behind the logged metrics, reduced across ranks as one tensor.

    Means (loss, ce, tv, …) are Σ value·w / Σ w over micro-batches (w = 1 in training: the gradient
    is the mean of the micro-batch losses over accumulation steps and ranks; w = batch size in
    validation). τ_prob and the per-position acceptance c*_k are ratios of global sums (see
    objectives.acceptance_metrics), never means of per-rank or per-batch means."""

    def __init__(self, gamma: int):
        self.gamma = int(gamma)
        self.size = 2 * len(MEAN_KEYS) + len(COUNT_KEYS) + 4 + 2 * self.gamma
        self.total: Tensor | None = None

    def add(self, metrics: dict, weight: float = 1.0) -> None:
        loss = metrics["loss"]
        v = torch.zeros(self.size, device=loss.device, dtype=torch.float64)
        n = len(MEAN_KEYS)
        for i, key in enumerate(MEAN_KEYS):
            if key in metrics:
                v[2 * i] = float(weight) * torch.as_tensor(metrics[key]).detach().double()
                v[2 * i + 1] = float(weight)
        for i, key in enumerate(COUNT_KEYS):
            v[2 * n + i] = float(metrics.get(key, 0))
        o = 2 * n + len(COUNT_KEYS)
        if "_tau_sums" in metrics:
            v[o : o + 4] = metrics["_tau_sums"].double()
        if "_pos_sums" in metrics:
            pos = metrics["_pos_sums"]
            if pos.shape[-1] != self.gamma:
                raise ValueError(f"acceptance has {pos.shape[-1]} positions, the metric sums {self.gamma}")
            v[o + 4 :] = pos.double().flatten()
        self.total = v if self.total is None else self.total + v

    def take(self, device) -> Tensor:
        """The sums so far (zeros when nothing was added: every rank must join the reduction)."""
        out = self.total if self.total is not None else torch.zeros(self.size, dtype=torch.float64)
        self.total = None
        return out.to(device)

    def compute(self, total: Tensor) -> dict[str, float]:
        t = total.double().cpu().tolist()
        n = len(MEAN_KEYS)
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


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to min_ratio of the peak."""
    warmup = max(1, int(total * warmup_ratio))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class DraftingModule(L.LightningModule):
    def __init__(
        self,
        target,
        drafter,
        loss: LossWeights,
        optim: dict,
        features: str = "online",
        num_anchors=None,
        seed: int = 0,
    ):
        super().__init__()
        object.__setattr__(self, "target", target)  # not a registered submodule, on purpose
        self.drafter = drafter
        self.loss_weights = loss
        self.optim = dict(optim)
        self.features = FEATURE_SOURCES[features]
        self.num_anchors = int(num_anchors or getattr(drafter, "num_anchors", 512))
        self.seed = int(seed)
        self.val_records: list[dict] = []
        gamma = int(getattr(drafter, "ttt_steps", None) or drafter.gamma)
        self.train_sums, self.val_sums = MetricSums(gamma), MetricSums(gamma)

    @property
    def shared(self) -> Shared:
        return Shared.of(self.target)

    def on_fit_start(self) -> None:
        self.target.to(self.device)

    def on_validation_start(self) -> None:
        self.target.to(self.device)
        self.val_records = []
        self.val_sums.take(self.device)  # drop what an interrupted validation left

    def _world(self) -> tuple[int, int, int]:
        """(world size, global rank, accumulate_grad_batches); (1, 0, 1) without a trainer."""
        t = self._trainer
        if t is None:
            return 1, 0, 1
        return int(t.world_size), int(t.global_rank), int(t.accumulate_grad_batches)

    def anchor_generator(self, batch_idx: int) -> torch.Generator:
        """Training anchors from a generator fixed by (seed, optimizer step, micro-batch of the global
        batch): rank r's accumulation step a holds micro-batch a·W + r (data.GlobalBatchSampler), so
        a run on W ranks and one on 1 rank with W× accumulation draw the same anchors for the same
        samples, and a resumed run draws what the uninterrupted one would have."""
        world, rank, accumulate = self._world()
        micro = (batch_idx % accumulate) * world + rank
        seed = (self.seed * 1_000_003 + int(self.global_step)) * 10_007 + micro
        return torch.Generator().manual_seed(seed % (2**63))

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

    def _reduce(self, sums: MetricSums) -> dict[str, float]:
        total = sums.take(self.device)
        if self._trainer is not None and self.trainer.world_size > 1:
            total = self.trainer.strategy.reduce(total, reduce_op="sum")
        return sums.compute(total)

    def _log_values(self, values: dict[str, float], prefix: str) -> None:
        train = prefix == "train"
        for key, value in values.items():
            self.log(
                f"{prefix}/{key}",
                float(value),
                prog_bar=train and key in PROGRESS,
                on_step=train,
                on_epoch=not train,
                batch_size=1,
                # Already summed over ranks; validation passes sync_dist=True only to keep Lightning
                # from warning (the mean of equal values is the value).
                sync_dist=not train,
            )

    def _window_ends(self, batch_idx: int) -> bool:
        """True on the micro-batch that ends an optimizer step (gradient accumulation window)."""
        _, _, accumulate = self._world()
        if accumulate <= 1 or (batch_idx + 1) % accumulate == 0:
            return True
        t = self._trainer
        return bool(t is not None and t.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        metrics = self._step(batch, self.anchor_generator(batch_idx))
        self.train_sums.add(metrics, 1.0)
        if self._window_ends(batch_idx):
            # One small all-reduce per optimizer step: the logged numbers describe the global batch.
            self._log_values(self._reduce(self.train_sums), "train")
        loss = metrics["loss"]
        if not metrics.get("rows", 1):
            # No valid block in this micro-batch: touch every trainable parameter with a zero, so DDP
            # (find_unused_parameters=false) still sees a gradient for each and ranks stay in step.
            loss = loss + sum(p.sum() for p in self.drafter.parameters() if p.requires_grad) * 0
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # Fixed anchors per batch, so validation numbers are comparable across epochs; rank r runs
        # batches r, r+W, … of the fixed list (DraftDataModule.val_dataloader), seeded by that index.
        world, rank, _ = self._world()
        gen = torch.Generator().manual_seed(1_000_003 + batch_idx * world + rank)
        metrics = self._step(batch, gen)
        self.val_sums.add(metrics, batch["input_ids"].shape[0])
        out = metrics.pop("_out")
        if out.confidence_logits is not None:
            self.val_records.append(self._confidence_record(out, metrics))

    def on_validation_epoch_end(self) -> None:
        self._log_values(self._reduce(self.val_sums), "val")

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

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Under FSDP the norm must be taken over all shards: the FSDP root's clip_grad_norm_ does
        that (Lightning's own norm clipping refuses FSDP); elsewhere Lightning's clipping."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.trainer.model
        if gradient_clip_val and isinstance(model, FullyShardedDataParallel):
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(f"FSDP clips by norm only, not '{gradient_clip_algorithm}'")
            model.clip_grad_norm_(float(gradient_clip_val))
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

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
