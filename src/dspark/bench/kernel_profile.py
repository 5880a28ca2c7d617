"""Where a step's device time goes, kernel by kernel (torch.profiler), for ``engine_sps --kernels``.

A captured step is opaque: its graph replays one launch. The same step run eagerly launches the
same kernels (the compiled functions and the eager ones alike), so profiling it gives each
kernel's device time and count per step; their sum against the step's graph time says how much of
a replay is kernel work and how much the gaps between kernels. On the CPU the rows are the
operators' own CPU times (what the tests can check)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["kernel_table"]


def _own_time_us(event, cuda: bool) -> float:
    if not cuda:
        return float(event.self_cpu_time_total)
    us = getattr(event, "self_device_time_total", None)  # torch >= 2.4; older releases say cuda
    return float(event.self_cuda_time_total if us is None else us)


def kernel_table(fn: Callable[[], object], device: torch.device, steps: int = 10, top: int = 15) -> dict:
    """Profile ``steps`` calls of ``fn`` (after one untimed call). Returns per step: the summed
    kernel time (``kernel_ms``), the kernel launches (``kernels``), and the ``top`` kernels by
    time (``name``, ``calls``, ``us``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    rows = []
    for event in prof.key_averages():
        if cuda and event.device_type != DeviceType.CUDA:
            continue  # host-side operators: their kernels are listed on their own
        us = _own_time_us(event, cuda)
        if us > 0:
            rows.append({"name": event.key[:120], "calls": event.count / steps, "us": us / steps})
    rows.sort(key=lambda r: -r["us"])
    return {
        "kernel_ms": sum(r["us"] for r in rows) / 1e3,
        "kernels": sum(r["calls"] for r in rows),
        "top": rows[:top],
    }
