"""The drafter's fused inference paths (``compile_inference``) against their eager references: the
context write of every layer in one function (``drafters.context_write``), the weights it derives
from the parameters, and one compiled graph for every shape the fast engine meets.

The fused code runs here eagerly (``compiler=None``: its logic, to float32 rounding) and through
inductor on the CPU (the compiled graph); the ``gpu`` tests repeat the compiled comparison on CUDA,
inside captured CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import head_group, load_group

from dspark.core.types import DraftCache, TargetDims
from dspark.drafters import build_drafter
from dspark.drafters.context_write import ContextWriter, stacked_kv
from dspark.drafters.derived import DerivedWeights


def build(target, name="dspark", head="markov", layers=3, gamma=4, slots="anchor", seed=0):
    """A drafter of ``layers`` layers whose norms are not all ones (so a mixed-up layer or a
    skipped norm shows in its numbers)."""
    dc, hc = load_group("drafter", name), head_group(head)
    dc.num_layers, dc.block_size, dc.slots = layers, gamma, slots
    hc.rank = 16 if head != "none" else 0
    torch.manual_seed(seed)
    drafter = build_drafter(TargetDims.of(target), dc, hc).eval()
    with torch.no_grad():
        for module in drafter.modules():
            if type(module).__name__ == "RMSNorm":
                module.weight.normal_(1.0, 0.3)
        for layer in drafter.layers:  # layers that move the hidden states off the block's embeddings
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.normal_(0.0, 0.2)
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
    """Built once; rebuilt after an in-place update into the tensor handed out before (captured
    CUDA graphs hold its address), as a new tensor when the shape changes; ``.data`` writes are
    not seen until ``reset``."""
    calls = []
    w = torch.nn.Parameter(torch.ones(2, 3))
    derived = DerivedWeights(lambda: [w], lambda t: calls.append(1) or t * 2)
    with torch.inference_mode():  # as the engine first builds it: an inference tensor
        first = derived.get()
    assert derived.get() is first and calls == [1]
    with torch.no_grad():
        w.add_(1)
    assert derived.get() is first and torch.equal(first, torch.full((2, 3), 4.0)) and calls == [1, 1]
    w.data.add_(1)  # .data bypasses the version counter: documented, reset() is the way
    assert torch.equal(derived.get(), torch.full((2, 3), 4.0))
    derived.reset()
    assert torch.equal(derived.get(), torch.full((2, 3), 6.0))
    w = torch.nn.Parameter(torch.ones(3, 3))  # another shape: a new tensor
    assert derived.get() is not first and derived.get().shape == (3, 3)


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
    from test_fast_engine import _engines, assert_same_rounds, seven_requests

    name, head = kind.split("-")
    drafter = build(small_target, name, head, layers=2, seed=3)
    drafter.compile_inference(compiler=None)
    fused_writes = []
    writer = drafter._context_writer
    inner = writer._write
    writer._write = lambda kv, taps, *a: fused_writes.append(taps.shape[0]) or inner(kv, taps, *a)
    reqs = seven_requests(small_target)
    plain, fast = _engines(small_target, drafter, temperature, seed=7, deferred_context=2)
    drafter._context_writer = None  # the plain engine extends its growing cache: the reference
    a = plain.generate(reqs)
    drafter._context_writer = writer
    b = fast.generate(reqs)
    assert_same_rounds(b, a)
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


# ---------------------------------------------------------------------------------------------
# the draft step (drafters.draft_step)

# Every head, both slot conventions, DFlash; (name, head, slots, confidence).
DRAFTERS = [
    ("dspark", "markov", "anchor", True),
    ("dspark", "gated", "masks", True),
    ("dspark", "rnn", "anchor", True),
    ("dspark", "rnn", "masks", False),
    ("dspark", "rnn@2", "anchor", True),  # the head from position 2: position 1 as DFlash drafts
    ("dspark", "markov@3", "masks", True),
    ("dspark", "none", "anchor", True),
    ("dflash", "none", "anchor", False),
    ("dflash", "none", "masks", False),
]


def drafting_setup(target, name, head, slots, confidence=True, r_max=4, seed=0, device="cpu"):
    """A drafter with a static cache (block room included) holding a ragged context, the anchors
    after it, uniforms for the whole block."""
    drafter = build(target, name, head, layers=2, slots=slots, seed=seed).to(device)
    if not confidence:
        drafter.confidence = None
    capacity = 24
    g = torch.Generator().manual_seed(seed + 1)
    with torch.inference_mode():  # inference tensors throughout, as the engine's static buffers
        cache = drafter.new_cache(r_max, device, capacity=capacity + drafter.block_size)
        cache.block_slots = drafter.block_size
        taps = torch.randn(r_max, capacity, drafter.fc.in_features, generator=g).to(device)
        positions = torch.arange(capacity, device=device).expand(r_max, -1)
        drafter.write_context(cache, taps, positions, torch.arange(r_max, device=device))
        cache.length.copy_(torch.tensor([20, 3, 13, 1, 24, 9][:r_max]))
        anchors = torch.randint(4, target.vocab_size, (r_max,), generator=g).to(device)
        u = torch.rand(r_max, drafter.gamma, generator=g).to(device)
    return drafter, cache, anchors, u


def rows_of(cache: DraftCache, r: int) -> DraftCache:
    """The first r rows, as the fast engine hands a rows bucket to the drafter."""
    return DraftCache(
        k=[k[:r] for k in cache.k], v=[v[:r] for v in cache.v], length=cache.length[:r],
        block_slots=cache.block_slots,
    )  # fmt: skip


def reference_proposal(drafter, *args, **kw):
    fused, drafter._fused = drafter._fused, None
    try:
        return drafter.propose(*args, **kw)
    finally:
        drafter._fused = fused


def assert_same_proposal(got, want, tol=1e-5, greedy=False):
    """``greedy``: a fused T = 0 proposal, tokens without probabilities (greedy verification
    reads none), where the reference's are one-hot at the same tokens."""
    assert torch.equal(got.tokens, want.tokens)
    if greedy:
        assert got.probs is None
    else:
        torch.testing.assert_close(got.probs, want.probs, rtol=tol, atol=tol * 1e-2)
    if want.confidence_logits is None:
        assert got.confidence_logits is None
    else:
        torch.testing.assert_close(got.confidence_logits, want.confidence_logits, rtol=tol, atol=tol)


@pytest.mark.parametrize("name,head,slots,confidence", DRAFTERS)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fused_draft_step_equals_the_reference(small_target, name, head, slots, confidence, softcap):
    """``FusedDraft`` run eagerly (its logic: one function from the anchors to the hidden states,
    position-major for DSpark, the head's step and the confidences as functions of their own, each
    position's probabilities written into the proposal's buffer, the confidences over the padded
    block) proposes the reference's tokens, probabilities and confidences for every row count,
    drafted length and temperature (at T = 0 the tokens alone); the soft-capped head included."""
    from dspark.core.types import Shared

    drafter, cache, anchors, u = drafting_setup(small_target, name, head, slots, confidence)
    shared = Shared(small_target.embed, small_target.lm_head_weight, softcap)
    drafter.compile_inference(compiler=None)
    calls = []
    inner = drafter._fused.hidden
    drafter._fused.hidden = lambda *a: calls.append(1) or inner(*a)
    seen_tokens = set()
    with torch.inference_mode():
        for r in (4, 1, 3):
            for n in sorted({1, 2, drafter.gamma}):
                for temperature in (0.0, 1.0, 8.0):
                    args = (rows_of(cache, r), anchors[:r], cache.length[:r], shared, temperature)
                    kw = dict(uniforms=u[:r], draft_len=n)
                    got = drafter.propose(*args, **kw)
                    want = reference_proposal(drafter, *args, **kw)
                    assert_same_proposal(got, want, greedy=temperature == 0)
                    seen_tokens.update(got.tokens.flatten().tolist())
    assert len(calls) == 3 * 3 * len({1, 2, drafter.gamma})  # every proposal went the fused way
    assert len(seen_tokens) > 2  # not one degenerate token: the comparison had something to see


COMPILED = [("dspark", "rnn", "masks"), ("dspark", "gated@2", "anchor"), ("dflash", "none", "anchor")]


@pytest.mark.parametrize("name,head,slots", COMPILED)
def test_compiled_draft_step_equals_the_reference_in_two_graphs_per_path(small_target, name, head, slots):
    """Inductor on the CPU, as the fast engine asks for it (``fullgraph``: no graph break): the
    compiled draft step proposes the reference's tokens, and its probabilities and confidences to
    rounding, for every rows count and drafted length, at T = 1 and T = 0 (tokens alone); each
    compiled function (the hidden states, DSpark's per-position head step, its greedy step and its
    confidences) is one graph for a single row and one for every larger count, whatever the
    drafted length."""
    compiled_draft_step_matches(small_target, name, head, slots)


def compiled_draft_step_matches(target, name, head, slots, device="cpu", tol=1e-5, attention="auto"):
    """Compile the draft step with inductor (``fullgraph``), check its proposals against the
    reference for every rows count and drafted length, and that each compiled function made one
    graph for a single row and one for every larger count; returns what a caller checks further
    (drafter, cache, anchors, uniforms, Shared, the compile counter). ``attention``: the draft
    step's (``FusedDraft.attention``)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dspark.core.types import Shared

    drafter, cache, anchors, u = drafting_setup(target, name, head, slots, device=device)
    shared = Shared.of(target)
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    drafter.compile_inference(compiler=lambda fn: torch.compile(fn, backend=counter, fullgraph=True))
    drafter._fused.attention = attention
    with torch.inference_mode():
        for temperature in (1.0, 0.0):
            for r in (4, 2, 1, 3):
                for n in sorted({1, 2, drafter.gamma}):
                    args = (rows_of(cache, r), anchors[:r], cache.length[:r], shared, temperature)
                    kw = dict(uniforms=u[:r], draft_len=n)
                    want = reference_proposal(drafter, *args, **kw)
                    got = drafter.propose(*args, **kw)
                    assert_same_proposal(got, want, tol=tol, greedy=temperature == 0)
    assert counter.frame_count == compiled_graphs(name, head, device)
    return drafter, cache, anchors, u, shared, counter


def compiled_graphs(name: str, head: str, device: str) -> int:
    """The graphs a compiled draft step makes over both temperatures: two per compiled function
    (one row, more rows). DFlash: the hidden states. DSpark: those, the head's position step and the
    confidences, and at T = 0 ``position_argmax`` off CUDA; on CUDA ``kernels.bias_argmax`` takes
    the head's features instead, from the head's step compiled alone or, for a Markov head,
    gathered by the kernel itself (nothing compiled)."""
    if name != "dspark":
        return 2
    greedy = 0 if device == "cuda" and head.partition("@")[0] == "markov" else 2
    return 6 + greedy


def test_draft_step_attention_keeps_sdpa_off_cuda_and_without_block_room(small_target):
    """``FusedDraft.attention_impl``: the kernel only over a static cache on CUDA (or forced, as
    the interpreter tests do); a concatenating cache keeps SDPA even when forced."""
    drafter, cache, _, _ = drafting_setup(small_target, "dflash", "none", "anchor")
    drafter.compile_inference(compiler=None)
    fused = drafter._fused
    assert fused.attention_impl(cache) == "torch"  # auto, on the CPU
    fused.attention = "triton"
    assert fused.attention_impl(cache) == "triton"
    assert fused.attention_impl(DraftCache(k=cache.k, v=cache.v, length=cache.length)) == "torch"


def test_fused_draft_step_follows_parameter_changes(small_target):
    """The stacked q/k/v and gate/up weights of the fused draft step are rebuilt when a layer's
    parameters change in place (``load_state_dict``, an optimizer step): its proposals keep equal
    to the reference's, which read the parameters themselves."""
    from dspark.core.types import Shared

    drafter, cache, anchors, u = drafting_setup(small_target, "dspark", "markov", "anchor")
    drafter.compile_inference(compiler=None)
    shared = Shared.of(small_target)
    args = (cache, anchors, cache.length, shared, 1.0)

    def check():
        with torch.inference_mode():
            got = drafter.propose(*args, uniforms=u)
            assert_same_proposal(got, reference_proposal(drafter, *args, uniforms=u))
        return got

    before = check()
    state = drafter.state_dict()
    for key in ("layers.1.attn.v_proj.weight", "layers.0.mlp.up_proj.weight"):
        state[key] = torch.randn_like(state[key])
    drafter.load_state_dict(state)
    after = check()
    assert not torch.allclose(after.probs, before.probs)  # the change reached the proposals
    with torch.no_grad():
        drafter.layers[0].attn.q_proj.weight.mul_(-1.0)
    check()


def test_a_function_that_does_not_compile_runs_eagerly_with_a_warning():
    """``inference_compiler`` (the fast engine's): a fused function dynamo cannot capture whole (a
    data-dependent branch here) runs eagerly, the same code, with a warning naming it, and is not
    retried; a working one compiles."""
    from torch._dynamo.testing import CompileCounter

    from dspark.core.compiling import EagerOnFailure

    def branchy(x):
        return x + 1 if x.sum().item() > 0 else x - 1

    def plain(x):
        return x * 2

    counter = CompileCounter()
    torch._dynamo.reset()
    wrapped = EagerOnFailure(torch.compile(branchy, backend=counter, fullgraph=True), branchy)
    with pytest.warns(UserWarning, match="branchy, which runs eagerly"):
        assert torch.equal(wrapped(torch.ones(3)), torch.full((3,), 2.0))
    assert torch.equal(wrapped(-torch.ones(3)), torch.full((3,), -2.0)) and wrapped.error is not None
    working = EagerOnFailure(torch.compile(plain, backend=counter, fullgraph=True), plain)
    assert torch.equal(working(torch.ones(3)), torch.full((3,), 2.0))
    assert working.error is None and counter.frame_count == 1


def test_compile_inference_is_idempotent_for_one_compiler(small_target):
    """Every fast engine asks ``compile_inference``: the same compiler keeps the fused paths (and
    the tensors they derive, which earlier engines' captured graphs read); another replaces them."""
    drafter = build(small_target)
    drafter.compile_inference(compiler=None)
    fused, writer = drafter._fused, drafter._context_writer
    drafter.compile_inference(compiler=None)
    assert drafter._fused is fused and drafter._context_writer is writer
    drafter.compile_inference(compiler=lambda fn: fn)
    assert drafter._fused is not fused and drafter._context_writer is not writer


@pytest.mark.parametrize("name,head", [("dspark", "markov"), ("dflash", "none")])
def test_draft_step_reads_the_lm_head_once_at_one_request(small_target, name, head):
    """The block's LM-head product is one GEMM over all its positions, also at R = 1, where the
    position-major block [γ, 1, d] (a transpose of [1, γ, d]) keeps a stride that stops
    ``torch.matmul`` from folding it: a batched GEMM would read the head once per position (on the
    H200 75.8 µs for SmolLM2's seven positions against ~16 for one pass)."""
    from torch.profiler import profile

    from dspark.core.types import Shared

    drafter, cache, anchors, u = drafting_setup(small_target, name, head, "anchor", True)
    shared = Shared(small_target.embed, small_target.lm_head_weight, None)
    drafter.compile_inference(compiler=None)
    vocab = small_target.vocab_size
    with torch.inference_mode():
        for temperature in (0.0, 1.0):
            args = (rows_of(cache, 1), anchors[:1], cache.length[:1], shared, temperature)
            with profile(record_shapes=True) as prof:
                drafter.propose(*args, uniforms=u[:1], draft_len=drafter.gamma)
            head_gemms = [
                (e.name, e.input_shapes)
                for e in prof.events()
                if e.name in ("aten::mm", "aten::bmm") and any(s and s[-1] == vocab for s in e.input_shapes)
            ]
            assert head_gemms and all(op == "aten::mm" for op, _ in head_gemms), head_gemms


def test_eagle3_compiled_static_paths_equal_its_eager_code(small_target):
    """Eagle3's static-cache paths, a commit, the chain's steps writing the block room and each
    position's draw, compiled by inductor on the CPU (fullgraph: no break) write the eager code's
    cache and chain seed and propose its tokens and probabilities, at every drafted length and both
    temperatures."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dspark.core.types import Shared

    drafter, shared = build(small_target, "eagle3", "none", layers=1, gamma=4), Shared.of(small_target)
    counter = CompileCounterWithBackend("inductor")
    g = torch.Generator().manual_seed(3)
    r, w = 3, 6
    taps = torch.randn(r, w, drafter.fc.in_features, generator=g)
    nxt = torch.randint(5, 200, (r, w), generator=g)
    positions, kept = torch.arange(w).expand(r, -1), torch.tensor([6, 4, 5])
    anchors, u = nxt[torch.arange(r), kept - 1], torch.rand(r, drafter.gamma, generator=g)
    runs = []
    for compiler in (None, lambda fn: torch.compile(fn, backend=counter, fullgraph=True)):
        torch._dynamo.reset()
        drafter.compile_inference(compiler=compiler)
        cache = drafter.new_cache(r, "cpu", capacity=16 + drafter.gamma)
        cache.block_slots = drafter.gamma
        with torch.inference_mode():
            drafter.commit_context(cache, taps, positions, nxt, kept, shared)
            cache.length.copy_(kept)
            props = [
                drafter.propose(cache, anchors, kept, shared, t, uniforms=u, draft_len=n)
                for t in (1.0, 0.0)
                for n in range(1, drafter.gamma + 1)
            ]
        runs.append((cache, props))
    (eager, want), (compiled, got) = runs
    assert_same_cache(compiled, eager)
    torch.testing.assert_close(compiled.extra["last"], eager.extra["last"], rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        assert_same_proposal(a, b, tol=1e-3)  # float32, fused by inductor: rounding only
    assert counter.frame_count >= 4  # the commit, the chain's step, the draw at T = 1 and at T = 0
    drafter.compile_inference(compiler=None)
