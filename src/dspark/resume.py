"""What makes a training run resumable, and exactly: Lightning checkpoints written atomically
(``AtomicCheckpointIO``: beside the target, synced, renamed, the previous one kept), the choice of
the checkpoint to resume from (``resume_point``: the last readable one), and a graceful Ctrl-C
(``GracefulStop``: finish the optimizer step, save, stop). The data order follows the optimizer
step (data.datamodule.GlobalBatchSampler) and so do the anchors (module.anchor_generator), so a run
resumed from step k goes on as if it had never stopped."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from .artifacts import RunFolder
from .core.errors import DataError
from .core.io import atomic_open

log = logging.getLogger(__name__)

PREVIOUS = "previous.ckpt"  # the checkpoint before last.ckpt, beside it


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temp file beside the target, synced and renamed into place, the one
    they replace kept as ``previous.ckpt``; read back with ``weights_only=True`` (no pickle runs).
    (Lightning's own ``_atomic_save`` writes the temp file in $TMPDIR and moves it: across
    filesystems that is a copy, which a full disk or a kill leaves truncated under the real name.)"""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options}")
        path = Path(path)
        with atomic_open(path, "wb", keep=path.with_name(PREVIOUS)) as f:
            torch.save(checkpoint, f)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


def read_checkpoint(path: Path) -> dict:
    """A Lightning checkpoint of ours, loaded without running any pickle; DataError if it is not."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupt, or not a checkpoint: torch raises many types
        raise DataError(f"{path} is unreadable ({type(err).__name__})") from None
    if not isinstance(ckpt, dict) or not {"global_step", "state_dict", "loops"} <= set(ckpt):
        raise DataError(f"{path} is not a Lightning checkpoint of a dspark run")
    return ckpt


def resume_point(run: RunFolder) -> tuple[Path, int] | None:
    """(checkpoint, its step) to resume ``run`` from: ``last.ckpt``, or the one before it when the
    last cannot be read; None when the run has none. DataError when none that exists is readable."""
    candidates = [p for p in (run.last_checkpoint, run.checkpoints / PREVIOUS) if p.is_file()]
    problems = []
    for path in candidates:
        try:
            step = int(read_checkpoint(path)["global_step"])
        except DataError as err:
            problems.append(str(err))
            log.warning("%s; trying an earlier checkpoint", err)
            continue
        return path, step
    if problems:
        raise DataError(
            f"{'; '.join(problems)}: no checkpoint in {run.checkpoints} can be resumed. Move the folder "
            f"away to start over, or rerun with resume=false"
        )
    return None


class Interrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C after saving a checkpoint (the message says where)."""


class GracefulStop(L.Callback):
    """The first Ctrl-C (SIGINT) lets the optimizer step in flight finish, saves the checkpoint
    (``path``) at that step and stops the fit; ``interrupted`` then tells the caller. A second Ctrl-C
    interrupts at once. Every rank stops at the same step (the flag is reduced across ranks)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.requested = False
        self.interrupted = False  # stopped here, with a checkpoint
        self.hard = False  # a second Ctrl-C stopped the fit where it was
        self._previous = None

    def _request(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)  # the next one is hard
        log.warning("Ctrl-C: saving a checkpoint after this optimizer step (again to stop at once)")

    def on_fit_start(self, trainer, module) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._request)

    def on_fit_end(self, trainer, module) -> None:
        self._restore()

    def on_exception(self, trainer, module, exception) -> None:
        self.hard = isinstance(exception, KeyboardInterrupt)
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % int(trainer.accumulate_grad_batches) and not trainer.is_last_batch:
            return  # inside an accumulation window: the optimizer step is not done yet
        stop = self.requested
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop and not self.interrupted:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True
            self.interrupted = True
