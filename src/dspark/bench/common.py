"""What the benchmark scripts share: a target from Hydra overrides, run metadata, timing."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch


def compose_target(overrides: list[str]):
    """The ``target`` group composed exactly as the entry points do (``target=... target.path=...``)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="dspark.conf", version_base="1.3"):
        cfg = compose(config_name="schedule", overrides=[o for o in overrides if o.startswith("target")])
    return cfg.target


def run_meta(module: str, argv: list[str], device: torch.device) -> dict:
    """Command, commit (``DSPARK_COMMIT`` wins: a copied tree may carry a stale .git), machine, date."""
    commit = os.environ.get("DSPARK_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "command": " ".join(["python -m", module, *argv]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
    }


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` in ms, synchronised around each call (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def publish(path: str, report: dict, header: list[str], cells: list[list[str]]) -> None:
    """Write ``report`` as JSON (atomically) and print its rows as a markdown table; the first
    column is text, the others right-aligned numbers."""
    from ..data.io import atomic_write_json

    atomic_write_json(path, report)
    print("\n| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for row in cells:
        print("| " + " | ".join(row) + " |")
