"""The drafter's fused inference paths (``compile_inference``) against their eager references: the
context write of every layer in one function (``drafters.context_write``), the weights it derives
from the parameters, and one compiled graph for every shape the fast engine meets.

The fused code runs here eagerly (``compiler=None``: its logic, to float32 rounding) and through
inductor on the CPU (the compiled graph); the ``gpu`` tests repeat the compiled comparison on CUDA,
inside captured CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import load_group

from dspark.core.types import DraftCache, TargetDims
from dspark.drafters import build_drafter
from dspark.drafters.context_write import ContextWriter, stacked_kv
from dspark.drafters.derived import DerivedWeights


def build(target, name="dspark", head="markov", layers=3, gamma=4, slots="anchor", seed=0):
    """A drafter of ``layers`` layers whose norms are not all ones (so a mixed-up layer or a
    skipped norm shows in its numbers)."""
    dc, hc = load_group("drafter", name), load_group("head", head)
    dc.num_layers, dc.block_size, dc.slots = layers, gamma, slots
    hc.rank = 16 if head != "none" else 0
    torch.manual_seed(seed)
    drafter = build_drafter(TargetDims.of(target), dc, hc).eval()
    with torch.no_grad():
        for module in drafter.modules():
            if type(module).__name__ == "RMSNorm":
                module.weight.normal_(1.0, 0.3)
        if getattr(drafter, "head", None) is not None:
            drafter.head.W2.weight.normal_(0.0, 0.5)
    return drafter


def random_write(drafter, r_max, capacity, r, w, g):
    """Taps [r, w, m·d], rows (distinct, shuffled) and each row's w consecutive positions."""
    taps = torch.randn(r, w, drafter.fc.in_features, generator=g)
    rows = torch.randperm(r_max, generator=g)[:r]
    start = torch.randint(0, capacity - w + 1, (r, 1), generator=g)
    return taps, start + torch.arange(w), rows


def assert_same_cache(got: DraftCache, want: DraftCache, rtol=1e-5):
    for a, b in zip(got.k + got.v, want.k + want.v):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))


SHAPES = [(3, 4), (1, 1), (1, 8), (2, 1), (4, 8)]  # (rows, width): verify steps, prefill, flush


@pytest.mark.parametrize("name,head,slots", [("dspark", "markov", "anchor"), ("dflash", "none", "masks")])
def test_fused_context_write_equals_the_layer_loop(small_target, name, head, slots):
    """``write_layers`` (one GEMM for every layer's k/v, k_norm and RoPE on all layers at once, one
    indexed store) writes what the per-layer reference loop writes, at every slot of every layer,
    for the shapes the fast engine meets; slots it does not write keep their contents exactly."""
    drafter = build(small_target, name, head, slots=slots)
    r_max, capacity = 5, 24
    ref = drafter.new_cache(r_max, "cpu", capacity=capacity)
    fused = drafter.new_cache(r_max, "cpu", capacity=capacity)
    for buf in ref.k + ref.v:
        buf.normal_()  # stale contents the writes must leave alone
    for a, b in zip(fused.k + fused.v, ref.k + ref.v):
        a.copy_(b)
    writer = ContextWriter(drafter, compiler=None)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for r, w in SHAPES:
            taps, positions, rows = random_write(drafter, r_max, capacity, r, w, g)
            drafter.write_context_reference(ref, taps, positions, rows)
            assert writer.write(fused, taps, positions, rows)
            assert_same_cache(fused, ref)
        # Not vacuous: the same taps a position further (another rotation) give other keys there.
        pos = torch.tensor([[7]])
        shifted = drafter.new_cache(r_max, "cpu", capacity=capacity)
        writer.write(shifted, taps[:1, :1], pos + 1, rows[:1])
        writer.write(fused, taps[:1, :1], pos, rows[:1])
        a, b = shifted.k[-1][rows[0], :, 8], fused.k[-1][rows[0], :, 7]
        assert not torch.allclose(a, b, rtol=1e-3) and torch.allclose(a.norm(dim=-1), b.norm(dim=-1))
        torch.testing.assert_close(shifted.v[-1][rows[0], :, 8], fused.v[-1][rows[0], :, 7])


def test_write_context_uses_the_fused_write_only_on_a_stacked_cache(small_target):
    """After ``compile_inference`` the drafter writes a cache from ``new_cache`` (one buffer behind
    every layer's keys and values) through the fused function; a cache of separate tensors, or one
    whose tensors were replaced, is written by the reference loop, with the same result."""
    drafter = build(small_target)
    drafter.compile_inference(compiler=None)
    stacked = drafter.new_cache(3, "cpu", capacity=16)
    assert stacked_kv(stacked) is not None
    with torch.inference_mode():  # as the fast engine allocates it (views record no base there)
        assert stacked_kv(drafter.new_cache(3, "cpu", capacity=16)) is not None
    loose = DraftCache([k.clone() for k in stacked.k], [v.clone() for v in stacked.v], stacked.length)
    assert stacked_kv(loose) is None
    swapped = DraftCache(k=stacked.k[::-1], v=stacked.v, length=stacked.length)  # views, wrong order
    assert stacked_kv(swapped) is None
    calls = []
    writer = drafter._context_writer
    inner = writer._write
    writer._write = lambda *a: calls.append(1) or inner(*a)
    g = torch.Generator().manual_seed(2)
    taps, positions, rows = random_write(drafter, 3, 16, 2, 5, g)
    with torch.inference_mode():
        drafter.write_context(stacked, taps, positions, rows)
        assert calls == [1]
        drafter.write_context(loose, taps, positions, rows)
        assert calls == [1]
    assert_same_cache(loose, stacked)


def test_fused_weights_follow_parameter_changes(small_target):
    """The concatenated k/v weights are derived once and rebuilt when a parameter changes in
    place (an optimizer step, ``load_state_dict``) or is replaced (``.to(dtype)``): the fused write
    then equals the reference with the new weights."""
    drafter = build(small_target)
    writer = ContextWriter(drafter, compiler=None)
    assert writer.kv_weight.get() is writer.kv_weight.get()  # derived once, not per call
    g = torch.Generator().manual_seed(3)
    taps, positions, rows = random_write(drafter, 3, 16, 2, 4, g)

    def check():
        ref, fused = drafter.new_cache(3, "cpu", capacity=16), drafter.new_cache(3, "cpu", capacity=16)
        with torch.inference_mode():
            drafter.write_context_reference(ref, taps.to(drafter.fc.weight.dtype), positions, rows)
            writer.write(fused, taps.to(drafter.fc.weight.dtype), positions, rows)
        assert_same_cache(fused, ref)
        return fused

    before = check()
    with torch.no_grad():
        drafter.layers[1].attn.k_proj.weight.mul_(1.5)  # in place, as an optimizer step
    after = check()
    assert not torch.allclose(after.k[1], before.k[1]) and torch.equal(after.k[0], before.k[0])
    state = drafter.state_dict()
    state["layers.2.attn.v_proj.weight"] = torch.randn_like(state["layers.2.attn.v_proj.weight"])
    state["layers.0.attn.k_norm.weight"] = torch.randn_like(state["layers.0.attn.k_norm.weight"])
    drafter.load_state_dict(state)
    check()
    drafter.double()  # every parameter replaced
    assert writer.kv_weight.get().dtype == torch.float64
    check()


def test_derived_weights_rebuild_only_on_a_change():
    calls = []
    w = torch.nn.Parameter(torch.ones(2, 3))
    derived = DerivedWeights(lambda: [w], lambda t: calls.append(1) or t * 2)
    derived.get(), derived.get()
    assert calls == [1]
    with torch.no_grad():
        w.add_(1)
    assert torch.equal(derived.get(), torch.full((2, 3), 4.0)) and calls == [1, 1]
    w.data.add_(1)  # .data bypasses the version counter: documented, reset() is the way
    assert torch.equal(derived.get(), torch.full((2, 3), 4.0))
    derived.reset()
    assert torch.equal(derived.get(), torch.full((2, 3), 6.0))


def test_compiled_context_write_is_one_graph_for_every_shape(small_target):
    """Inductor on the CPU: the compiled fused write equals the reference loop for every rows count
    and width (a lone entry included), and dynamo compiles it once (a shape of its own, e.g. a
    size of 1 specialised, would count a second frame). Its stores update the cache in place."""
    from torch._dynamo.testing import CompileCounterWithBackend

    drafter = build(small_target, layers=2)
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    drafter.compile_inference(compiler=lambda fn: torch.compile(fn, backend=counter))
    r_max, capacity = 6, 32
    ref = drafter.new_cache(r_max, "cpu", capacity=capacity)
    fused = drafter.new_cache(r_max, "cpu", capacity=capacity)
    buffer = stacked_kv(fused).data_ptr()
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for r, w in [(3, 4), *SHAPES, (6, 2)]:
            taps, positions, rows = random_write(drafter, r_max, capacity, r, w, g)
            drafter.write_context_reference(ref, taps, positions, rows)
            drafter.write_context(fused, taps, positions, rows)
            assert_same_cache(fused, ref)
    assert counter.frame_count == 1
    assert stacked_kv(fused).data_ptr() == buffer  # written in place, never reallocated


@pytest.mark.parametrize("kind", ["dspark-rnn", "dflash-none"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_engine_with_the_fused_paths_reproduces_the_plain_engine(small_target, kind, temperature):
    """The fast engine over a drafter whose fused paths run (eagerly: their logic, not inductor's)
    gives the plain engine's tokens, acceptance and confidences: prefills, verify steps and the
    ring's flushes all write the context through the fused function."""
    from test_engine import prompts_for
    from test_fast_engine import _engines

    from dspark.decoding.engine import Request

    name, head = kind.split("-")
    drafter = build(small_target, name, head, layers=2, seed=3)
    drafter.compile_inference(compiler=None)
    fused_writes = []
    writer = drafter._context_writer
    inner = writer._write
    writer._write = lambda kv, taps, *a: fused_writes.append(taps.shape[0]) or inner(kv, taps, *a)
    prompts = prompts_for(small_target, 7, seed=12)
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [5, 30, 12, 22, 1, 17, 26])]
    plain, fast = _engines(small_target, drafter, temperature, seed=7, deferred_context=2)
    drafter._context_writer = None  # the plain engine extends its growing cache: the reference
    a = plain.generate(reqs)
    drafter._context_writer = writer
    b = fast.generate(reqs)
    assert [g.tokens for g in b.generations] == [g.tokens for g in a.generations]
    assert [(r.request, r.accepted, r.proposed) for r in b.rounds] == [
        (r.request, r.accepted, r.proposed) for r in a.rounds
    ]
    for ra, rb in zip(a.rounds, b.rounds):
        if ra.confidence_logits is not None:
            torch.testing.assert_close(torch.tensor(rb.confidence_logits), torch.tensor(ra.confidence_logits))
    assert len(fused_writes) > 10
    if temperature == 1.0:
        assert sum(r.accepted for r in a.rounds) > 0  # drafts were accepted: the context mattered
    if name == "dspark":  # a fused write that wrote nothing would show in the confidences
        writer._write = lambda *a: None
        c = _engines(small_target, drafter, temperature, seed=7, deferred_context=2)[1].generate(reqs)
        assert any(
            not torch.allclose(torch.tensor(ra.confidence_logits), torch.tensor(rc.confidence_logits))
            for ra, rc in zip(a.rounds, c.rounds)
            if rc.request == ra.request and ra.confidence_logits is not None
        )
