"""The one-off work that can stall a decode round without being part of it, counted per round.

A timed round a hundred times slower than its median has usually met a first-time cost: a CUDA
graph captured, a ``torch.compile`` frame (re)compiled (a new size-1 specialisation, say), a
Triton kernel compiled for a new specialisation of its arguments, or a pass of Python's cyclic
garbage collector. ``StallWatch`` counts each of these while ``Engine.generate`` runs; the engine
stores each round's increments in its step record (``events``), so a benchmark's slowest round
names its cause instead of leaving it to guesses.

It imports nothing heavy: torch.compile's counters are read only when ``torch._dynamo`` is already
loaded (nothing can compile otherwise), Triton's compile hook is installed only when ``triton`` is.
"""

from __future__ import annotations

import gc
import sys
import time
from collections import Counter

__all__ = ["StallWatch"]


def _compiled_frames() -> int:
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["frames"]["total"]) if utils is not None else 0


def _reserved_mb() -> float:
    """The CUDA caching allocator's reserve: it grows only by a cudaMalloc (which can stall)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0.0
    # The nested statistics as the allocator gives them: memory_reserved() first flattens all of
    # them into a new dict, a few hundred µs of every round under cProfile on the H200.
    stats = torch.cuda.memory_stats_as_nested_dict()
    return stats.get("reserved_bytes", {}).get("all", {}).get("current", 0) / 2**20


def _graph_captures() -> int:
    graphs = sys.modules.get("dspark.decoding.graphs")
    return int(graphs.GraphBank.captured) if graphs is not None else 0


class StallWatch:
    """Context manager; ``increments()`` returns what happened since its last call (non-zero
    entries only): ``graph_captures``, ``compiled_frames``, ``triton_compiles`` (with the kernels'
    names in ``triton_kernels``), ``gc_passes`` (collections of generation 1 or 2; generation-0
    passes are too frequent and too short to matter), ``gc_ms``, and ``reserved_mb`` (the CUDA
    allocator's reserve grown or released: a cudaMalloc or an emptied cache)."""

    def __init__(self) -> None:
        self._gc_passes = 0
        self._gc_s = 0.0
        self._gc_t0: float | None = None
        self._kernels: Counter[str] = Counter()
        self._knobs = None
        self._previous_hook = None
        self._last: dict | None = None

    def __enter__(self) -> StallWatch:
        gc.callbacks.append(self._on_gc)
        if "triton" in sys.modules:
            try:
                from triton import knobs
            except ImportError:  # a Triton without knobs (< 3.4): its compiles go uncounted
                knobs = None
            if knobs is not None:
                self._knobs, self._previous_hook = knobs, knobs.runtime.jit_post_compile_hook
                knobs.runtime.jit_post_compile_hook = self._on_triton_compile
        self._last = self._counts()
        return self

    def __exit__(self, *exc) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._previous_hook
            self._knobs = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if info.get("generation", 0) < 1:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self._gc_passes += 1
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_t0 = None

    def _on_triton_compile(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self._kernels[str(getattr(fn, "name", fn))] += 1
        if self._previous_hook is not None:
            return self._previous_hook(*args, **kwargs)
        return None

    def _counts(self) -> dict:
        return {
            "graph_captures": _graph_captures(),
            "compiled_frames": _compiled_frames(),
            "triton_compiles": sum(self._kernels.values()),
            "gc_passes": self._gc_passes,
            "gc_ms": 1e3 * self._gc_s,
            "reserved_mb": _reserved_mb(),
            "triton_kernels": Counter(self._kernels),
        }

    def increments(self) -> dict:
        now = self._counts()
        last, self._last = self._last or now, now
        out = {}
        for key, value in now.items():
            if key == "triton_kernels":
                new = value - last[key]
                if new:
                    out[key] = dict(new)
            elif value != last[key]:
                out[key] = round(value - last[key], 3) if isinstance(value, float) else value - last[key]
        return out
