"""CPU threads of a process whose model runs on a GPU.

There torch's CPU operations are bookkeeping: validation's records (their STS fit and metrics run
on the GPU, ``CalibrationCallback``), an evaluation's rounds with their STS fit and metrics. By
default each process takes an OpenMP thread per core, so two runs trained (or evaluated) at once
on one machine oversubscribe it, and OpenMP's threads then wait on each other: on this project's
2-core CPU with another job running, the calibration metrics of 68 000 validation blocks took
0.9–2.7 s on 2 threads and 0.13–0.21 s on 1. A GPU process keeps a few threads; where its model
runs on the CPU the threads are its compute, and OMP_NUM_THREADS, when set, is the user's choice:
both are left alone."""

from __future__ import annotations

import os

import torch

GPU_PROCESS_THREADS = 4

__all__ = ["GPU_PROCESS_THREADS", "cap_cpu_threads"]


def cap_cpu_threads(device: str | torch.device) -> int | None:
    """At most GPU_PROCESS_THREADS intra-op threads for a process whose model is on ``device`` when
    that is a GPU and OMP_NUM_THREADS is unset; returns the number set (None: left alone)."""
    if torch.device(device).type != "cuda" or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = min(torch.get_num_threads(), GPU_PROCESS_THREADS)
    torch.set_num_threads(threads)
    return threads
