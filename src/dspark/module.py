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

from .core.phases import phase
from .core.types import Shared
from .drafters.dflash import sample_anchors
from .feature_graphs import FeatureGraphs
from .objectives import LossWeights, compute_loss


def online_features(batch: dict, target) -> tuple[Tensor, Tensor]:
    """Run the frozen target inside the training step (rows are right-padded: no mask needed)."""
    return target.features(batch["input_ids"])


def offline_features(batch: dict, target) -> tuple[Tensor, Tensor]:
    """Features precomputed by `python -m dspark.prepare data.offline_cache=true`."""
    if "taps" not in batch:
        raise KeyError("features=offline needs a dataset prepared with data.offline_cache=true")
    return batch["taps"], batch["last_hidden"]


FEATURE_SOURCES = {"online": online_features, "offline": offline_features}


MEAN_KEYS = ("loss", "ce", "tv", "kl", "conf_loss", "conf_abs_err", "conf_bias")
COUNT_KEYS = ("rows", "acceptance_blocks")
PROGRESS = {"loss", "tau_prob", "ce", "tv"}


def host_scalar(value: float) -> Tensor:
    """``value`` as ``LightningModule.log`` makes a tensor of a number (the default float dtype,
    float32 at least), but in host memory: Lightning reads every logged tensor back with
    ``.item()`` (the progress bar's on every later step), which on a device tensor waits for the
    device to finish all the work queued before it."""
    dtype = torch.get_default_dtype()
    dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    return torch.tensor(float(value), dtype=dtype)


class MetricSums:
    """Running sums behind the logged metrics, reduced across ranks as one tensor.

    Means (loss, ce, tv, …) are Σ value·w / Σ w over micro-batches (w = 1 in training: the gradient
    is the mean of the micro-batch losses over accumulation steps and ranks; w = batch size in
    validation). τ_prob and the per-position acceptance c*_k are ratios of global sums (see
    objectives.acceptance_metrics), never means of per-rank or per-batch means.

    ``add`` runs a handful of operators per micro-batch on the device (two stacks, one cat, one
    add) and reads nothing back; the weights w are host numbers and are summed on the host, joining
    the device sums only when ``take`` hands them to the reduction. Layout of the taken vector:
    [Σ value·w per mean key, counts, the 4 τ sums, the 2·γ c*_k sums, Σ w per mean key]."""

    def __init__(self, gamma: int):
        self.gamma = int(gamma)
        self.size = 2 * len(MEAN_KEYS) + len(COUNT_KEYS) + 4 + 2 * self.gamma
        self.total: Tensor | None = None  # on the device: everything but the weights
        self.weights = [0.0] * len(MEAN_KEYS)  # Σ w per mean key, on the host
        self._zeros: dict = {}  # device -> zero placeholders for absent metrics

    def _absent(self, device) -> tuple[Tensor, Tensor, Tensor]:
        """Zeros standing in for an absent scalar, τ sums and c*_k sums (made once per device)."""
        key = torch.device(device)
        if key not in self._zeros:
            z = dict(device=device, dtype=torch.float64)
            self._zeros[key] = (torch.zeros((), **z), torch.zeros(4, **z), torch.zeros(2 * self.gamma, **z))
        return self._zeros[key]

    @staticmethod
    def _scalar(value, device) -> Tensor:
        """A metric as a 0-d tensor to stack: integers (row counts) in float64 first, since a stack with
        floats would round them to float32; no operator at all for the usual 0-d float tensor."""
        if not isinstance(value, Tensor):
            value = torch.as_tensor(value, device=device)
        if value.dim():
            value = value.reshape(())
        return value if value.is_floating_point() else value.double()

    @torch.no_grad()  # the sums hold no graph (and a stack of detached views needs no detach per value)
    def add(self, metrics: dict, weight: float = 1.0) -> None:
        """Add one micro-batch's metrics (device tensors; nothing here waits for the device)."""
        device = metrics["loss"].device
        zero, no_tau, no_pos = self._absent(device)
        w = float(weight)
        means = []
        for i, key in enumerate(MEAN_KEYS):
            if key in metrics:
                means.append(self._scalar(metrics[key], device))
                self.weights[i] += w
            else:
                means.append(zero)
        # Each value in float64 before it is weighted, as the sums are kept (the stack promotes
        # float32 and bfloat16 exactly; the float64 copy is one operator for all of them).
        mean_vec = torch.stack(means).double()
        if w != 1.0:
            mean_vec = mean_vec * w
        counts = torch.stack([self._scalar(metrics[k], device) if k in metrics else zero for k in COUNT_KEYS])
        tau = metrics.get("_tau_sums", no_tau)
        pos = metrics.get("_pos_sums")
        if pos is None:
            pos = no_pos
        elif pos.shape[-1] != self.gamma:
            raise ValueError(f"acceptance has {pos.shape[-1]} positions, the metric sums {self.gamma}")
        # cat promotes every part to float64 (mean_vec is), exactly.
        v = torch.cat([mean_vec, counts, tau if tau.dim() == 1 else tau.reshape(-1), pos.reshape(-1)])
        self.total = v if self.total is None else self.total + v

    def take(self, device) -> Tensor:
        """The sums so far (zeros when nothing was added: every rank must join the reduction)."""
        n = len(MEAN_KEYS)
        body = self.total if self.total is not None else torch.zeros(self.size - n, dtype=torch.float64)
        weights = torch.tensor(self.weights, dtype=torch.float64)
        self.total, self.weights = None, [0.0] * n
        return torch.cat([body.to(device), weights.to(device)])

    def compute(self, total: Tensor) -> dict[str, float]:
        t = total.double().cpu().tolist()
        n, c = len(MEAN_KEYS), len(COUNT_KEYS)
        weights = t[-n:]
        out = {key: t[i] / weights[i] for i, key in enumerate(MEAN_KEYS) if weights[i] > 0}
        out.update({key: t[n + i] for i, key in enumerate(COUNT_KEYS)})
        o = n + c
        full_num, full_den, part_num, part_den = t[o : o + 4]
        if full_den > 0:
            out["tau_prob"] = 1 + full_num / full_den
        elif part_den > 0:
            out["tau_prob"] = 1 + part_num / part_den
        num, den = t[o + 4 : o + 4 + self.gamma], t[o + 4 + self.gamma : o + 4 + 2 * self.gamma]
        if any(d > 0 for d in den):
            out.update({f"c_star_{k + 1}": num[k] / max(den[k], 1.0) for k in range(self.gamma)})
        return out


def clip_grad_norm(parameters, max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` (2-norm), operator for operator where
    it takes its foreach path, less the ``.to(first device)`` torch dispatches for every parameter's
    norm before stacking them (~60 host operators a step for a 5-layer drafter, each a no-op here:
    the gradients share one device). Anything else (several devices or dtypes, tensor subclasses)
    goes to torch's own function."""
    from torch.utils._foreach_utils import _has_foreach_support

    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    device, dtype = grads[0].device, grads[0].dtype
    alike = all(g.device == device and g.dtype == dtype for g in grads)
    if not (alike and _has_foreach_support(grads, device)):
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return
    total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    clip_coef = max_norm / (total_norm + 1e-6)  # torch's expression: the same operators, the same bits
    torch._foreach_mul_(grads, torch.clamp(clip_coef, max=1.0))


def lr_factor(progress: float, warmup_ratio: float, min_ratio: float) -> float:
    """Learning-rate multiplier at a fraction ``progress`` in [0, 1] of the run: linear warm-up over
    the first ``warmup_ratio``, then cosine decay to ``min_ratio`` of the peak at the end."""
    progress = min(max(float(progress), 0.0), 1.0)
    if warmup_ratio > 0 and progress < warmup_ratio:
        return max(progress / warmup_ratio, 1e-3)
    rest = (progress - warmup_ratio) / max(1e-9, 1.0 - warmup_ratio)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, rest)))


def _timer(trainer):
    from lightning.pytorch.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    return timer if timer is not None and timer._duration else None


def run_progress(trainer, clock_start: float | None = None, by: str = "auto") -> float:
    """How far a fit is, in [0, 1], counting the optimizer step about to be taken: the larger of
    steps / trainer.max_steps and, for a run with a clock (trainer.max_time), its training time /
    max_time on the clock Lightning stops the run by. So a run bounded by time gets its whole
    schedule (warm-up and decay) inside that time, and a step-bounded one inside its steps; with
    neither, the steps Lightning estimates for max_epochs. ``by`` (``optim.schedule_by``) "steps"
    or "clock" counts that one alone: a run compared with others at equal steps keeps the step
    schedule even where a clock set as a safety limit runs ahead (a GPU shared with other runs),
    and stops on that clock with its schedule unfinished. ``clock_start`` (seconds on that clock
    when the first optimizer step ended) moves the clock's zero past compilation and start-up,
    which would otherwise use up the warm-up before the first real step."""
    step = int(trainer.global_step) + 1
    fractions = []
    if trainer.max_steps and trainer.max_steps > 0 and by != "clock":
        fractions.append(step / trainer.max_steps)
    timer = _timer(trainer)
    if timer is not None and by != "steps":
        start = min(clock_start or 0.0, 0.5 * timer._duration)
        fractions.append(max(0.0, timer.time_elapsed("train") - start) / (timer._duration - start))
    if not fractions:
        fractions.append(step / max(1, int(trainer.estimated_stepping_batches)))
    return min(1.0, max(fractions))


def _wanted(option: bool | str, device: torch.device) -> bool:
    """A compile option: true, false, or "auto" (on CUDA only)."""
    return option is True or option == "true" or (option == "auto" and device.type == "cuda")


def _grad_scaler(trainer):
    """The fp16 loss scaler of the trainer's precision plugin, if any (bf16 and fp32 have none)."""
    return getattr(trainer.precision_plugin, "scaler", None)


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
        compile_target: bool | str = "auto",
        draft_vocab: Tensor | None = None,
        graph_target: bool | str = False,
        graph_target_multiple: int = 64,
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
        self.clock_start: float | None = None  # see run_progress
        self.compile_target = compile_target  # true, false or "auto" (on CUDA): see on_fit_start
        self.graph_target = graph_target  # the same, for the target forward's CUDA graphs
        self.graph_target_multiple = int(graph_target_multiple)
        self.feature_graphs: FeatureGraphs | None = None  # the online target forward's CUDA graphs
        gamma = int(getattr(drafter, "ttt_steps", None) or drafter.gamma)
        self.train_sums, self.val_sums = MetricSums(gamma), MetricSums(gamma)
        # [K] sorted token ids the loss covers (objectives.restrict_to_vocab); None: the whole vocabulary.
        # Not in the checkpoint: training derives it from its data's counts again on resume.
        self.register_buffer("draft_vocab", draft_vocab, persistent=False)

    @property
    def shared(self) -> Shared:
        return Shared.of(self.target)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        timer = _timer(self.trainer)
        if self.clock_start is None and timer is not None and self.trainer.global_step >= 1:
            self.clock_start = timer.time_elapsed("train")  # the end of the first optimizer step

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dspark_clock_start"] = self.clock_start  # a resumed run keeps its schedule

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.clock_start = checkpoint.get("dspark_clock_start")

    def on_fit_start(self) -> None:
        self.target.to(self.device)
        if self.features is not online_features:
            return
        self.target.uncompile_features()  # a target shared across fits (the benches' variants) starts plain
        self.feature_graphs = None
        if _wanted(self.compile_target, self.device):
            self.target.compile_features()
        if _wanted(self.graph_target, self.device):
            self.feature_graphs = FeatureGraphs.of(self.target, self.graph_target_multiple)

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
        return torch.Generator(device=self.device).manual_seed(seed % (2**63))

    def _step(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        return self.draft_step(batch, *self.target_features(batch), generator)

    @torch.no_grad()
    def target_features(self, batch: dict) -> tuple[Tensor, Tensor]:
        """(taps, last_hidden) of the batch: the frozen target's forward, or the cache's."""
        with phase("target_forward"):
            if self.feature_graphs is not None:
                return self.feature_graphs(batch["input_ids"])
            return self.features(batch, self.target)

    def draft_step(self, batch: dict, taps: Tensor, last_hidden: Tensor, generator=None) -> dict:
        """The drafter's forward and loss on given target features (the part with gradients)."""
        loss_mask = batch["loss_mask"]
        with phase("anchors"):
            anchors = sample_anchors(loss_mask, self.num_anchors, generator)
        with phase("drafter_forward"):
            out = self.drafter.train_forward(taps, batch["input_ids"], loss_mask, anchors, self.shared)
        with phase("loss"):
            metrics = compute_loss(
                out, last_hidden, self.target.lm_head_weight, self.target.softcap, self.loss_weights,
                self.draft_vocab,
            )  # fmt: skip
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
                # Training values go to Lightning in host memory (host_scalar): it would otherwise
                # copy each number to the device and read it back on every later step. Validation's
                # stay numbers: Lightning puts them on the device, where sync_dist reduces them.
                host_scalar(value) if train else float(value),
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

    def _log_due(self) -> bool:
        """Whether the optimizer step being taken is one Lightning logs (every log_every_n_steps, and
        the last one): only then are the metric sums reduced and read, the step's one host sync."""
        t = self._trainer
        if t is None:
            return True
        step = int(t.global_step) + 1
        return step % max(1, int(t.log_every_n_steps)) == 0 or (0 < t.max_steps <= step)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        with phase("training_step"):
            metrics = self._step(batch, self.anchor_generator(batch_idx))
            with phase("metric_sums"):
                self.train_sums.add(metrics, 1.0)
            if self._window_ends(batch_idx) and self._log_due():
                # One small all-reduce per logged step: the numbers describe the global batches since
                # the last log. Every rank takes the same branch (it depends on the step only).
                with phase("log_metrics"):
                    self._log_values(self._reduce(self.train_sums), "train")
        # Rows without a valid block carry weight 0 in the loss, so every trainable parameter gets a
        # (zero) gradient even from an empty micro-batch and DDP ranks stay in step.
        return metrics["loss"]

    # Profiler ranges around what Lightning runs of the step (core.phases; nothing without a profiler).
    # The batch's transfer is DraftDataModule's (a module hook would displace the datamodule's).
    def backward(self, loss: Tensor, *args, **kwargs) -> None:
        with phase("backward"):
            super().backward(loss, *args, **kwargs)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        # The closure (training_step, backward, clipping) runs inside: this phase's own time is the
        # parameter update and Lightning's glue around it.
        with phase("optimizer_step"):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # Fixed anchors per batch, so validation numbers are comparable across epochs; rank r runs
        # batches r, r+W, … of the fixed list (DraftDataModule.val_dataloader), seeded by that index.
        world, rank, _ = self._world()
        gen = torch.Generator(device=self.device).manual_seed(1_000_003 + batch_idx * world + rank)
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
        c = metrics["_c_star"].float()  # [B, A, γ], 0 where invalid
        return {
            "logits": out.confidence_logits.flatten(0, 1).float().cpu(),
            "labels": c.flatten(0, 1).cumprod(-1).cpu(),
            "valid": out.valid.flatten(0, 1).cpu(),
        }

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Under FSDP the norm must be taken over all shards: the FSDP root's clip_grad_norm_ does
        that (Lightning's own norm clipping refuses FSDP); elsewhere Lightning's clipping."""
        with phase("clip_grad"):
            self._clip_drafter_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def _clip_drafter_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.trainer.model
        if gradient_clip_val and isinstance(model, FullyShardedDataParallel):
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(f"FSDP clips by norm only, not '{gradient_clip_algorithm}'")
            model.clip_grad_norm_(float(gradient_clip_val))
            return
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and not _grad_scaler(self.trainer):
            # Without a loss scaler the gradients are already true gradients: clip them directly.
            # (Lightning's own clipping refuses the fused AdamW, which could unscale internally.)
            clip_grad_norm(self.drafter.parameters(), float(gradient_clip_val))
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            params,
            lr=self.optim["lr"],
            weight_decay=self.optim["weight_decay"],
            betas=tuple(self.optim["betas"]),
            # One kernel for all parameters (4 -> 2 ms at 45M on the H200); not with a loss scaler.
            fused=self.device.type == "cuda" and not (self._trainer and _grad_scaler(self._trainer)),
        )
        warmup, floor, by = self.optim["warmup_ratio"], self.optim["min_lr_ratio"], self.optim["schedule_by"]
        # The multiplier follows the run's progress (steps or clock), not the scheduler's own count.
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda _: lr_factor(
                run_progress(self._trainer, self.clock_start, by) if self._trainer else 0.0, warmup, floor
            ),
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
