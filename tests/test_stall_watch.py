"""StallWatch counts the one-off work that can stall a round (compiles, GC passes, graph captures,
Triton compiles), and the engine files each round's share in its step record."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from test_engine import Oracle, prompts_for

from dspark.decoding.engine import Engine
from dspark.decoding.graphs import GraphBank
from dspark.decoding.stall_watch import StallWatch


class _Cycle:
    def __init__(self):
        self.me = self


def test_counts_gc_passes_and_compiled_frames_and_only_new_ones():
    with StallWatch() as watch:
        assert watch.increments() == {}  # nothing happened yet
        gc.disable()  # only the passes below: an automatic one in between failed CI once (2 == 1)
        try:
            for _ in range(100):
                _Cycle()
            gc.collect(1)
            gc.collect(0)  # generation-0 passes are not counted
            events = watch.increments()
        finally:
            gc.enable()
        assert events["gc_passes"] == 1 and events["gc_ms"] >= 0
        assert watch.increments() == {}  # increments, not totals

        f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=True)
        f(torch.ones(3))
        assert watch.increments().get("compiled_frames") == 1
        f(torch.ones(5))  # the same dynamic graph
        assert "compiled_frames" not in watch.increments()
        f(torch.ones(1))  # size 1 is specialised: a recompile inside a run would show here
        assert watch.increments().get("compiled_frames") == 1
    gc.collect(2)
    assert watch.increments() == {}  # the callback is gone once the watch is closed


def test_counts_graph_captures_from_the_bank_counter(monkeypatch):
    with StallWatch() as watch:
        monkeypatch.setattr(GraphBank, "captured", GraphBank.captured + 2)
        assert watch.increments() == {"graph_captures": 2}


def test_triton_compile_hook_is_chained_and_restored():
    knobs = pytest.importorskip("triton").knobs
    seen = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        with StallWatch() as watch:
            hook = knobs.runtime.jit_post_compile_hook
            hook(key=None, repr="", fn=SimpleNamespace(name="_rejection_kernel"), compile={},
                 is_manual_warmup=False, already_compiled=False)  # fmt: skip
            events = watch.increments()
            assert events["triton_compiles"] == 1 and events["triton_kernels"] == {"_rejection_kernel": 1}
            assert seen == ["_rejection_kernel"]  # the hook that was there still runs
        assert knobs.runtime.jit_post_compile_hook is not hook  # restored on exit
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_engine_rounds_record_the_work_done_around_them(tiny_target):
    """A GC pass forced while requests finish lands in the steps' ``events``; the rounds of a run
    with nothing one-off in them record nothing."""
    prompts = prompts_for(tiny_target, 3, seed=1)
    eng = Engine(tiny_target, Oracle(tiny_target, gamma=2), temperature=1.0, concurrency=2, max_new_tokens=6)
    gc.disable()  # no automatic pass: the only ones are those forced below
    try:
        quiet = eng.generate(prompts)
        forced = eng.generate(prompts, on_result=lambda i, g: gc.collect(1))
    finally:
        gc.enable()
    assert all("events" in s for s in quiet.steps)
    assert sum(s["events"].get("gc_passes", 0) for s in quiet.steps) == 0
    # The first request to end does so before the last round is recorded: its pass is on record.
    assert sum(s["events"].get("gc_passes", 0) for s in forced.steps) >= 1
