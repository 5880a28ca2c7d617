"""Sampling continuations from the target for the data pipeline: one decoding path, the engine.

Self-generated prompts and regenerated answers are target-only decoding through
``decoding.engine.Engine`` (plain PyTorch, the reference, used on the CPU) or
``decoding.fast_engine.FastEngine`` (static KV caches, CUDA graphs per row bucket, used on CUDA),
with the data config's temperature / top-k / top-p as the target's distribution. ``data.engine``
forces one (``plain`` | ``fast``); on the CPU both decode the same tokens for a seed (tested).
Throughput settings for bulk generation: wide concurrency (capped by GPU memory), a static cache
sized from the longest prompt + budget, finished rows leaving in batches (``refill``), no round
records, and each continuation handed to ``on_result`` the moment it finishes.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..core.errors import DataError
from .io import stable_hash

log = logging.getLogger(__name__)

ENGINE_CHOICES = ("auto", "plain", "fast")
# Share of the free GPU memory the static KV cache may take when concurrency is capped to fit.
KV_MEMORY_SHARE = 0.5
# Prompt tokens per prefill chunk of the fast engine (bounds the prefill's mask and activations).
PREFILL_TOKENS = 16384


@dataclass
class Continuation:
    tokens: list[int]  # generated tokens, stop token excluded
    finished: bool  # True when the target stopped by itself (an eos), False when max_new_tokens cut it


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 192

    @classmethod
    def from_config(cls, generation, max_new_tokens: int | None = None) -> Sampling:
        g = dict(generation or {})
        return cls(
            temperature=float(g.get("temperature", 1.0)),
            top_p=float(g.get("top_p", 1.0) or 1.0),
            top_k=int(g.get("top_k", 0) or 0),
            max_new_tokens=int(max_new_tokens or g.get("max_new_tokens", 192)),
        )


def engine_options(cfg_data) -> dict:
    """``generate_continuations``' engine keywords from the data config: ``data.engine``
    (auto | plain | fast) and ``data.engine_compile``. The removed ``data.generate_backend`` is
    mapped (``loop``, the old default, is what ``auto`` does now) or refused (``hf``)."""
    old = cfg_data.get("generate_backend")
    if old not in (None, "loop"):
        raise DataError(
            f"data.generate_backend={old} was removed: answers are decoded by the engine only "
            f"(data.engine=auto|plain|fast); drop generate_backend from the data config"
        )
    if old == "loop":
        log.warning("data.generate_backend is deprecated and ignored (the engine decodes): drop it")
    kind = str(cfg_data.get("engine", "auto"))
    if kind not in ENGINE_CHOICES:
        raise DataError(f"data.engine '{kind}' is not one of {', '.join(ENGINE_CHOICES)}")
    return {"engine": kind, "compile": bool(cfg_data.get("engine_compile", False))}


def engine_kind(setting: str, device: torch.device) -> str:
    """``auto`` is ``fast`` on CUDA (graphs) and ``plain`` elsewhere."""
    if setting == "auto":
        return "fast" if device.type == "cuda" else "plain"
    if setting not in ENGINE_CHOICES:
        raise DataError(f"engine '{setting}' is not one of {', '.join(ENGINE_CHOICES)}")
    return setting


def fit_concurrency(target, want: int, capacity: int, share: float = KV_MEMORY_SHARE) -> int:
    """``want`` rows, or fewer where their static KV cache (plus a few vocabulary-wide sampling
    buffers per row) would take more than ``share`` of the free GPU memory."""
    if target.device.type != "cuda":
        return want
    free, _ = torch.cuda.mem_get_info(target.device)
    # Blocks the caching allocator holds but no tensor uses (an earlier engine's) are free to us.
    free += torch.cuda.memory_reserved(target.device) - torch.cuda.memory_allocated(target.device)
    elem = torch.empty((), dtype=target.dtype).element_size()
    per_row = capacity * target.num_layers * 2 * target.num_kv_heads * target.head_dim * elem
    per_row += 8 * target.vocab_size * 4
    rows = max(1, int(share * free // per_row))
    if rows < want:
        log.warning(
            "concurrency %d -> %d: %d rows x %d cache positions fit in %.0f%% of the free GPU memory",
            want, rows, rows, capacity, 100 * share,
        )  # fmt: skip
    return min(want, rows)


def _buckets(concurrency: int) -> tuple[int, ...]:
    """Powers of two below ``concurrency``, then ``concurrency`` itself (a full batch pads nothing)."""
    return tuple(2**i for i in range(max(0, math.ceil(math.log2(concurrency))))) + (concurrency,)


def bulk_engine(target, sampling: Sampling, kind: str, concurrency: int, capacity: int, **kw):
    """A target-only engine for bulk sampling: no round records, finished rows leave in batches
    of an eighth of the concurrency (one cache compaction and one prefill per batch)."""
    from ..decoding.engine import Engine
    from ..decoding.fast_engine import FastEngine

    common = dict(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        concurrency=concurrency,
        max_new_tokens=sampling.max_new_tokens,
        record_rounds=False,
        refill=max(1, concurrency // 8),
        **kw,
    )
    if kind == "plain":
        return Engine(target, None, **common)
    return FastEngine(target, None, buckets=_buckets(concurrency), capacity=capacity, **common)


@torch.no_grad()
def generate_continuations(
    target,
    prefixes: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    batch_size: int,
    seed: object,
    max_new_tokens: Sequence[int] | None = None,
    on_result: Callable[[int, Continuation], None] | None = None,
    on_step: Callable[[], None] | None = None,
    engine: str = "auto",
    compile: bool = False,
    report: dict | None = None,
) -> list[Continuation]:
    """Sample a continuation of every prefix from the target (target-only engine decoding), with
    per-prefix token limits, ``batch_size`` prefixes decoded together (continuous batching).

    Sampling uses a generator on the target's device seeded from ``seed`` alone, so a call is
    reproducible (on the CPU the plain and fast engines draw the same tokens). ``on_result(index,
    continuation)`` fires as each continuation completes (progress, shard writes; it may raise to
    stop early), ``on_step()`` after each. ``report``, when given, receives the engine, its
    concurrency and cache capacity, the call's wall time and, for a run that finished, its decode
    rounds (``round_times``: whether the device or the host sets their pace)."""
    from ..decoding.engine import Request

    limits = [sampling.max_new_tokens] * len(prefixes)
    if max_new_tokens is not None:
        limits = [max(1, min(sampling.max_new_tokens, int(m))) for m in max_new_tokens]
    out: list[Continuation | None] = [None] * len(prefixes)
    if not prefixes:
        return out  # type: ignore[return-value]
    kind = engine_kind(engine, target.device)
    longest = max(map(len, prefixes))
    capacity = 128 * math.ceil((longest + max(limits) + 2) / 128)  # the fast engine's static cache
    concurrency = max(1, min(int(batch_size), len(prefixes)))
    extra: dict = {}
    if kind == "fast":
        concurrency = fit_concurrency(target, concurrency, capacity)
        extra = {"compile": compile, "prefill_chunk": max(1, min(concurrency, PREFILL_TOKENS // longest))}
    gen = torch.Generator(device=target.device).manual_seed(int(stable_hash(seed, 15), 16))
    eng = bulk_engine(target, sampling, kind, concurrency, capacity, generator=gen, **extra)

    def finished(i: int, g) -> None:
        eos = g.finish == "eos"
        out[i] = c = Continuation(g.tokens[:-1] if eos else g.tokens, eos)
        if on_result:
            on_result(i, c)
        if on_step:
            on_step()

    requests = [Request(prompt=list(p), id=i, max_new_tokens=limits[i]) for i, p in enumerate(prefixes)]
    start = time.perf_counter()
    result = None
    try:
        result = eng.generate(requests, on_result=finished)
    finally:  # also when on_result stopped the run early
        if report is not None:
            fast = kind == "fast"
            report.update(
                engine=kind,
                compile=bool(compile) and fast,
                concurrency=concurrency,
                capacity=capacity if fast else None,
                seconds=time.perf_counter() - start,
                rounds=None if result is None else round_times(result.steps),
            )
    return out  # type: ignore[return-value]


def round_times(steps: list[dict]) -> dict:
    """A run's decode rounds (``EngineResult.steps``): how many, their mean span (``ms``: the
    device's timeline on CUDA, the host's clock elsewhere), the device's work in it (``gpu_ms``,
    CUDA only) and the host's own work (``host_ms``); ms ≈ gpu_ms says the device sets the pace,
    ms ≈ host_ms the host."""

    def mean(key: str) -> float | None:
        values = [s[key] for s in steps if s.get(key) is not None]
        return round(sum(values) / len(values), 3) if values else None

    return {"rounds": len(steps), **{f"{k}_per_round": mean(k) for k in ("ms", "gpu_ms", "host_ms")}}


def decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()


# ----------------------------------------------------------------------------------------------
# CPU threads


def cpu_threads(setting: object = "auto") -> int:
    """Torch threads for CPU generation. "auto": one per core not already busy (one-minute load
    average), at least one: on a shared box, OpenMP threads beyond the free cores spin against the
    other jobs and decoding runs several times slower (measured 6x on 2 busy cores)."""
    cores = os.cpu_count() or 1
    if setting in (None, "auto"):
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        return max(1, min(torch.get_num_threads(), cores - int(round(busy))))
    return max(1, int(setting))


class ThreadGovernor:
    """Keeps torch's CPU thread count at `cpu_threads("auto")` while a long generation runs, so it
    takes the second core back when the other jobs finish (and yields it when they return).
    `tick()` is cheap; it re-reads the load average at most every `period` seconds."""

    def __init__(self, setting: object = "auto", period: float = 30.0):
        self.auto = setting in (None, "auto")
        self.ceiling = torch.get_num_threads()
        self.period = period
        self.last = time.monotonic()
        torch.set_num_threads(cpu_threads(setting))

    def tick(self) -> None:
        now = time.monotonic()
        if not self.auto or now - self.last < self.period or not hasattr(os, "getloadavg"):
            return
        self.last = now
        ours = torch.get_num_threads()
        others = max(0.0, os.getloadavg()[0] - ours)  # the load average counts our own threads too
        want = max(1, min(self.ceiling, (os.cpu_count() or 1) - int(round(others))))
        if want != ours:
            torch.set_num_threads(want)
            log.info("CPU threads %d -> %d (load average %.1f)", ours, want, os.getloadavg()[0])
