"""Lightning callbacks: calibration on validation end, drafter export, throughput."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import torch

from .calibration.metrics import position_metrics, summary
from .calibration.sts import Calibration, fit_sts
from .drafters import save_drafter


class CalibrationCallback(L.Callback):
    """Fit Sequential Temperature Scaling on the validation blocks (soft labels Π c*_i), log
    per-position ECE raw/after STS, and keep the temperatures for the exported checkpoint."""

    def on_validation_epoch_end(self, trainer, module) -> None:
        records = getattr(module, "val_records", [])
        if not records or trainer.sanity_checking:
            return
        logits = torch.cat([r["logits"] for r in records])
        labels = torch.cat([r["labels"] for r in records])
        valid = torch.cat([r["valid"] for r in records])
        temps = fit_sts(logits, labels, valid)
        rows = position_metrics(logits, labels, valid, temps)
        stats = summary(rows)
        module.calibration = Calibration([float(t) for t in temps])
        module.calibration_report = {"per_position": rows, **stats}
        for key in ("ece_raw_mean", "ece_sts_mean", "auroc_mean"):
            if stats.get(key) is not None:
                module.log(f"val/{key}", float(stats[key]), sync_dist=False)


class DrafterExport(L.Callback):
    """Keep `<out>/drafter/` (safetensors + config.json [+ calibration.json]) in step with the
    latest checkpoint, so a killed run still leaves a usable drafter."""

    def __init__(self, folder: Path, drafter_cfg, head_cfg, every_n_steps: int):
        self.folder = Path(folder)
        self.drafter_cfg = drafter_cfg
        self.head_cfg = head_cfg
        self.every = max(1, int(every_n_steps))

    def export(self, trainer, module) -> None:
        if not trainer.is_global_zero:
            return
        extra = {"global_step": int(trainer.global_step)}
        save_drafter(
            module.drafter, self.folder, self.drafter_cfg, self.head_cfg, module.target.describe(), extra
        )
        if getattr(module, "calibration", None) is not None:
            module.calibration.save(self.folder / "calibration.json")
            report = getattr(module, "calibration_report", None)
            if report is not None:
                (self.folder / "calibration_report.json").write_text(
                    json.dumps(report, indent=2, default=float)
                )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            self.export(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        self.export(trainer, module)


class Throughput(L.Callback):
    """Training tokens/s and samples/s over the run (wall clock between the first and last step)."""

    def __init__(self):
        self.tokens = 0
        self.samples = 0
        self.batches = 0
        self.start = None
        self.elapsed = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.tokens += int(batch["attention_mask"].sum())
        self.samples += int(batch["input_ids"].shape[0])
        self.batches += 1
        self.elapsed = time.perf_counter() - self.start
        if self.elapsed > 0:
            module.log("train/tokens_per_s", self.tokens / self.elapsed, on_step=True, prog_bar=False)

    def summary(self) -> dict:
        e = max(self.elapsed, 1e-9)
        return {
            "tokens": self.tokens,
            "samples": self.samples,
            "batches": self.batches,
            "seconds": self.elapsed,
            "tokens_per_s": self.tokens / e,
            "samples_per_s": self.samples / e,
        }
