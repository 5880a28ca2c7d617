"""A profile window inside a real training run: ``StepProfile`` (callbacks.profile in the config).

After warm-up and compilation it records a few optimizer steps of the run itself with
torch.profiler (CPU activity, and CUDA on a GPU), each step a host range ``dspark:step#<n>`` from
the end of the step before to its own end (so the data fetch, the transfer and Lightning's loop
are in it), and writes into ``<run>/profile/``: ``step_profile.json`` and ``step_profile.md``
(``bench.step_trace``: device and host time per step, kernels per step, the phases, the top
kernels, the runtime calls that waited for the device) and the Chrome trace ``trace.json.gz``
(Perfetto, chrome://tracing). The training's numbers do not change: the profiler only watches.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from ..core.io import atomic_write_json, atomic_write_text, finite
from ..core.phases import STEP
from .step_trace import markdown, read_trace, step_report

log = logging.getLogger(__name__)

REPORT, TABLE, TRACE = "step_profile.json", "step_profile.md", "trace.json.gz"
SCHEMA = "dspark.step_profile/v1"


class StepProfile(L.Callback):
    """Records optimizer steps ``start_step`` … ``start_step + steps - 1`` (by the global step each
    starts at), after ``warmup_steps`` more recorded and left out (the profiler's own start-up).
    Rank 0 only. ``exclude(seconds)`` is handed the time spent starting the profiler and writing
    the files, which is not training (the run's throughput leaves it out)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        start_step: int = 200,
        steps: int = 10,
        warmup_steps: int = 1,
        top: int = 30,
        keep_trace: bool = True,
        exclude: Callable[[float], None] | None = None,
    ):
        if steps < 1 or warmup_steps < 0 or start_step <= warmup_steps:
            raise ValueError(
                f"a profile window needs steps >= 1 and start_step > warmup_steps >= 0, got "
                f"start_step={start_step}, steps={steps}, warmup_steps={warmup_steps}"
            )
        self.folder = Path(folder)
        self.start_step, self.steps, self.warmup = int(start_step), int(steps), int(warmup_steps)
        self.top, self.keep_trace, self.exclude = int(top), bool(keep_trace), exclude
        self.open_at = self.start_step - self.warmup  # steps done when the window opens
        self.report: dict | None = None
        self.done = False  # the window was recorded (or failed): never again in this run
        self._prof = None
        self._range = None  # the open step range
        self._recorded: list[int] = []
        self._seen_step: int | None = None
        self._last_end: float | None = None
        self._walls: collections.deque[float] = collections.deque(maxlen=50)  # unprofiled steps
        self._validated = False
        self._cuda = False

    # ---- the window ----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)
        if step == self._seen_step:  # within gradient accumulation: not an optimizer step's end
            return
        self._seen_step = step
        now = time.perf_counter()
        wall, self._last_end = (None if self._last_end is None else now - self._last_end), now
        if self._prof is None:
            if wall is not None and not self.done:
                self._walls.append(wall)
            if step == self.open_at and not self.done and trainer.is_global_zero:
                self._guarded(self._open, module.device)
                self._last_end = time.perf_counter()
                if self.exclude is not None:  # the profiler's start-up (CUPTI's, on a GPU): no training
                    self.exclude(self._last_end - now)
            return
        self._range.__exit__(None, None, None)
        if len(self._recorded) < self.warmup + self.steps:
            self._open_step(step)
        else:
            self._finish(trainer)

    def on_validation_start(self, trainer, module) -> None:
        if self._prof is not None:
            self._validated = True

    def on_train_end(self, trainer, module) -> None:
        if self._prof is not None:  # the run ended inside the window: report what was recorded
            self._range.__exit__(None, None, None)
            self._recorded.pop()  # the step that was opened never ran
            self._finish(trainer)
        elif not self.done and trainer.is_global_zero and int(trainer.global_step) > self.open_at:
            log.info("profile window (step %d) not recorded: the run started past it", self.start_step)

    def on_exception(self, trainer, module, exception) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()

    def _guarded(self, work, *args) -> None:
        """Run a part of the window; a failure is logged and ends the window, never the training."""
        try:
            work(*args)
        except Exception as err:
            self.done = True
            if self._prof is not None:
                prof, self._prof = self._prof, None
                with contextlib.suppress(Exception):
                    prof.stop()
            why = f"{type(err).__name__}: {err}"
            log.warning("the profile window failed (%s): training goes on without it", why)
            with contextlib.suppress(OSError):
                self.folder.mkdir(parents=True, exist_ok=True)
                atomic_write_json(self.folder / REPORT, {"schema": SCHEMA, "error": why[:2000]})

    def _open(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device)
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.start()
        log.info("profiling optimizer steps %d-%d", self.start_step, self.start_step + self.steps - 1)
        self._open_step(self.open_at)

    def _open_step(self, step: int) -> None:
        self._range = torch.profiler.record_function(f"{STEP}{step}")
        self._range.__enter__()
        self._recorded.append(step)

    def _finish(self, trainer) -> None:
        t0 = time.perf_counter()
        self._guarded(self._write, trainer)
        self.done = True
        seconds = time.perf_counter() - t0
        if self.exclude is not None:
            self.exclude(seconds)
        self._last_end = None  # the next step's wall time would include the writing

    def _write(self, trainer) -> None:
        t0 = time.perf_counter()
        prof, self._prof = self._prof, None
        prof.stop()  # waits for the device: every recorded kernel has ended
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / (TRACE if self.keep_trace else f".{TRACE}.tmp")
        prof.export_chrome_trace(str(trace))
        try:
            events = read_trace(trace)
        finally:
            if not self.keep_trace:
                trace.unlink(missing_ok=True)
        steps = self._recorded[self.warmup :]
        if not steps:
            log.warning("profile window: no step recorded after the warm-up; nothing written")
            return
        report = {"schema": SCHEMA, "steps": steps, "warmup_steps": self.warmup}
        report.update(step_report(events, steps, top=self.top))
        report["device_name"] = torch.cuda.get_device_name() if self._cuda else "cpu"
        report["unprofiled_step_ms"] = 1e3 * statistics.median(self._walls) if self._walls else None
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if self._cuda else None
        report["validation_in_window"] = self._validated
        report["accumulate_grad_batches"] = int(trainer.accumulate_grad_batches)
        report["trace"] = TRACE if self.keep_trace else None
        atomic_write_json(self.folder / REPORT, finite(report))
        atomic_write_text(self.folder / TABLE, markdown(report))
        self.report = report
        seconds = time.perf_counter() - t0
        log.info("profile of steps %s written to %s (%.1f s)", report["steps"], self.folder, seconds)
