"""Lightning callbacks: calibration on validation end, drafter export, throughput."""

from __future__ import annotations

import time
from types import SimpleNamespace

import lightning as L
import torch

from .artifacts import DrafterFolder
from .calibration.metrics import position_metrics, summary
from .calibration.sts import Calibration, fit_sts
from .checkpoints import save_drafter
from .module import host_scalar


def gather_records(trainer, records: list[dict]) -> list[dict]:
    """Every rank's validation records, on every rank (the STS fit then sees the whole validation
    set and gives the same temperatures everywhere). Collective: call it on all ranks."""
    dist = torch.distributed
    if trainer.world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        return list(records)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, list(records))
    return [r for part in gathered for r in part]


class CalibrationCallback(L.Callback):
    """Fit Sequential Temperature Scaling on the validation blocks (soft labels Π c*_i), log
    per-position ECE raw/after STS, and keep the temperatures for the exported checkpoint."""

    def on_validation_epoch_end(self, trainer, module) -> None:
        if trainer.sanity_checking:
            return
        records = gather_records(trainer, getattr(module, "val_records", []))
        if not records:
            return
        # Fitted where the model runs: STS's grid (200 temperatures × every validation block) is
        # seconds of work for the few CPU threads a GPU process keeps (core.threads).
        logits, labels, valid = (
            torch.cat([r[key] for r in records]).to(module.device) for key in ("logits", "labels", "valid")
        )
        temps = fit_sts(logits, labels, valid)
        rows = position_metrics(logits, labels, valid, temps)
        stats = summary(rows)
        module.calibration = Calibration([float(t) for t in temps])
        module.calibration_report = {"per_position": rows, **stats}
        for key in ("ece_raw_mean", "ece_sts_mean", "auroc_mean"):
            if stats.get(key) is not None:
                # Equal on every rank (fitted on the gathered records); sync_dist only keeps Lightning quiet.
                module.log(f"val/{key}", float(stats[key]), sync_dist=True)


class DrafterExport(L.Callback):
    """Keep `<out>/drafter/` (safetensors + config.json [+ calibration.json], and the training
    answers' token counts) in step with the latest checkpoint, so a killed run still leaves a
    usable drafter. ``draft_vocab``: the K tokens the loss covered (0: all), which its config
    records so that serving drafts among them (``data.vocab_counts.served_vocab_size``)."""

    def __init__(
        self, folder: DrafterFolder, drafter_cfg, head_cfg, every_n_steps: int, draft_vocab: int = 0
    ):
        self.folder = folder
        self.draft_vocab = int(draft_vocab)
        self.drafter_cfg = drafter_cfg
        self.head_cfg = head_cfg
        self.every = max(1, int(every_n_steps))
        self.last_step = -1

    def export(self, trainer, module) -> None:
        # The strategy's state dict: plain for one device and DDP, gathered from the shards under
        # FSDP (a collective, so every rank comes here; only rank 0 writes).
        state = trainer.strategy.lightning_module_state_dict()
        self.last_step = int(trainer.global_step)
        if not trainer.is_global_zero:
            return
        prefix = "drafter."
        weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        drafter = SimpleNamespace(dims=module.drafter.dims, state_dict=lambda: weights)
        extra = {"global_step": int(trainer.global_step)}
        if self.draft_vocab:
            extra["draft_vocab"] = self.draft_vocab
        target = module.target.describe()
        save_drafter(drafter, self.folder.path, self.drafter_cfg, self.head_cfg, target, extra)
        counts = getattr(getattr(trainer, "datamodule", None), "answer_token_counts", None)
        if counts is not None and not self.folder.file(self.folder.TOKEN_COUNTS).is_file():
            self.folder.write_token_counts(counts(module.drafter.dims.vocab_size))  # once: the data is fixed
        if getattr(module, "calibration", None) is not None:
            self.folder.write_calibration(module.calibration)
            report = getattr(module, "calibration_report", None)
            if report is not None:
                self.folder.write_calibration_report(report)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        # Once per optimizer step (accumulation calls this hook per micro-batch), never before step 1.
        step = int(trainer.global_step)
        if step > 0 and step % self.every == 0 and step != self.last_step:
            self.export(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        self.export(trainer, module)


class Throughput(L.Callback):
    """Training tokens/s and samples/s, over all ranks, between the first and the last training
    batch with validation time taken out (and what others hand to `exclude`: writing a profile);
    `steady` leaves out the first `warmup_steps` optimizer steps too (compilation, allocator and
    cache warm-up), which is the number to compare runs by. Past the warm-up, each logged step also
    logs `train/step_ms`, the wall time per optimizer step since the last logged one: a stall (a
    recompilation, a slow batch) shows where it happened, and the summary names the slowest interval."""

    def __init__(self, warmup_steps: int = 5):
        self.warmup_steps = int(warmup_steps)
        self.tokens = 0
        self.samples = 0
        self.batches = 0
        self.start = None
        self.elapsed = 0.0
        self.val_seconds = 0.0
        self.setup_seconds = 0.0  # fit start to the training loop's (``on_train_start``)
        self.sanity_seconds = 0.0  # of it, the sanity check's validation batches
        self._fit_start = None
        self._sanity_start = None
        self.excluded_seconds = 0.0  # see exclude
        self._val_start = None
        self.steady_mark = None  # (time, tokens, samples, batches, paused seconds) at the end of warm-up
        self.world_size = 1
        self.totals = None
        self._pending = None  # device tensor: tokens of batches not yet counted on the host
        self._host_base = None  # the datamodule's host count at the start (see _host_tokens)
        self._log_mark = None  # (elapsed, optimizer step) at the last logged step past the warm-up
        self.step_ms: list[tuple[int, int, float]] = []  # (from step, to step, ms per step)

    @staticmethod
    def _host_tokens(trainer) -> int | None:
        """Training tokens the datamodule has sent to the device, counted on the host from the rows'
        lengths before the transfer (``DraftDataModule.train_tokens``); None for a datamodule that
        keeps no count."""
        n = getattr(getattr(trainer, "datamodule", None), "train_tokens", None)
        return None if n is None else int(n)

    def on_fit_start(self, trainer, module) -> None:
        self._fit_start = time.perf_counter()

    def on_sanity_check_start(self, trainer, module) -> None:
        self._sanity_start = time.perf_counter()

    def on_sanity_check_end(self, trainer, module) -> None:
        if self._sanity_start is not None:
            self.sanity_seconds = time.perf_counter() - self._sanity_start

    def on_train_start(self, trainer, module) -> None:
        self._host_base = self._host_tokens(trainer)
        # What a run spends before its first step (data, the sanity check and its compilation): a
        # session's minutes that no training clock counts.
        if self._fit_start is not None:
            self.setup_seconds = time.perf_counter() - self._fit_start

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def on_validation_start(self, trainer, module) -> None:
        if self.start is not None:
            self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, module) -> None:
        if self._val_start is not None:
            self.val_seconds += time.perf_counter() - self._val_start
            self._val_start = None

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of the time since the first batch out of the rates (not training)."""
        self.excluded_seconds += float(seconds)

    def _paused(self) -> float:
        return self.val_seconds + self.excluded_seconds

    def _count_tokens(self) -> None:
        """Fold the device-side token count into `tokens` (a host sync: only when a number is read)."""
        if self._pending is not None:
            self.tokens += int(self._pending)
            self._pending = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        host = self._host_tokens(trainer) if self._host_base is not None else None
        if host is not None:  # counted on the host: nothing to read back from the device
            self.tokens = host - self._host_base
        else:  # summed on the device and read only when logged: no host sync per batch
            n = batch["attention_mask"].sum()
            self._pending = n if self._pending is None else self._pending + n
        self.samples += int(batch["input_ids"].shape[0])
        self.batches += 1
        now = time.perf_counter()
        self.elapsed = now - self.start - self._paused()
        self.world_size = int(trainer.world_size)
        warmup_batches = self.warmup_steps * int(trainer.accumulate_grad_batches)
        if self.steady_mark is None and self.batches >= warmup_batches:
            self._count_tokens()
            self.steady_mark = (now, self.tokens, self.samples, self.batches, self._paused())
        stepped = (self.batches % int(trainer.accumulate_grad_batches)) == 0
        if stepped and trainer.global_step % max(1, int(trainer.log_every_n_steps)) == 0 and self.elapsed > 0:
            self._count_tokens()
            # This rank's count times the world size: ranks run the same number of batches.
            rate = self.tokens * self.world_size / self.elapsed
            # In host memory, like the module's metrics (module.host_scalar): no device round trip.
            module.log("train/tokens_per_s", host_scalar(rate), on_step=True, prog_bar=False)
            self._log_step_time(module, int(trainer.global_step))

    def _log_step_time(self, module, step: int) -> None:
        if self.steady_mark is None:
            return
        if self._log_mark is not None and step > self._log_mark[1]:
            ms = 1e3 * (self.elapsed - self._log_mark[0]) / (step - self._log_mark[1])
            self.step_ms.append((self._log_mark[1], step, ms))
            module.log("train/step_ms", host_scalar(ms), on_step=True, prog_bar=False)
        self._log_mark = (self.elapsed, step)

    def on_train_end(self, trainer, module) -> None:
        """Sum the counts over ranks (a collective: every rank calls this hook)."""
        end = time.perf_counter()
        self._count_tokens()
        mark = self.steady_mark or (end, self.tokens, self.samples, self.batches, self._paused())
        local = torch.tensor(
            [self.tokens, self.samples, self.tokens - mark[1], self.samples - mark[2]], dtype=torch.float64
        )
        if trainer.world_size > 1:
            local = trainer.strategy.reduce(local.to(module.device), reduce_op="sum").cpu()
        self.totals = {
            "tokens": int(local[0]),
            "samples": int(local[1]),
            "steady_tokens": int(local[2]),
            "steady_samples": int(local[3]),
            "steady_batches": self.batches - mark[3],
            "steady_seconds": end - mark[0] - (self._paused() - mark[4]),
        }

    def summary(self) -> dict:
        e = max(self.elapsed, 1e-9)
        out = {
            "world_size": self.world_size,
            "tokens": self.tokens,  # this rank
            "samples": self.samples,
            "batches": self.batches,
            "seconds": self.elapsed,
            "validation_seconds": self.val_seconds,
            "excluded_seconds": self.excluded_seconds,
            "setup_seconds": self.setup_seconds,
            "sanity_seconds": self.sanity_seconds,
            "tokens_per_s": self.tokens * self.world_size / e,
            "samples_per_s": self.samples * self.world_size / e,
        }
        if self.step_ms:
            ms = sorted(m for _, _, m in self.step_ms)
            first, last, slowest = max(self.step_ms, key=lambda x: x[2])
            out["step_ms"] = {
                "median": ms[len(ms) // 2],
                "slowest": {"from_step": first, "to_step": last, "ms_per_step": slowest},
            }
        if self.totals is not None:
            t = self.totals
            steady = max(t["steady_seconds"], 1e-9)
            out.update(
                global_tokens=t["tokens"],
                global_samples=t["samples"],
                tokens_per_s=t["tokens"] / e,
                samples_per_s=t["samples"] / e,
                steady={
                    "warmup_steps": self.warmup_steps,
                    "batches": t["steady_batches"],
                    "seconds": t["steady_seconds"],
                    "samples": t["steady_samples"],
                    "samples_per_s": t["steady_samples"] / steady if t["steady_batches"] else None,
                    "tokens_per_s": t["steady_tokens"] / steady if t["steady_batches"] else None,
                },
            )
        return out
