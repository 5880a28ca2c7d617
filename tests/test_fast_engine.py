"""The fast engine (static caches, CUDA graphs): the same forward as Hugging Face (Llama and Gemma 3
targets), the same tokens, rounds and confidences as the plain engine (which test_engine holds
lossless), clear refusals.

On the CPU the fast engine runs its static-cache path eagerly; the CUDA-graph replay is compared
with that eager path in the ``gpu`` tests at the end.
"""

from __future__ import annotations

import collections
import contextlib
import gc

import pytest
import torch
from test_engine import Cycling, hf_greedy, make_drafter, prompts_for
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dspark.core.types import Shared
from dspark.decoding.engine import Engine, Request, retire_order
from dspark.decoding.fast_engine import FastEngine
from dspark.decoding.graphs import GraphBank, bucket_for
from dspark.decoding.kv import RaggedKV
from dspark.decoding.static_target import StaticTarget, UnsupportedTarget, store_kv
from dspark.scheduling.cost import CostModel
from dspark.scheduling.policies import DraftAware, Fixed, build_policy
from dspark.target import Target


@pytest.mark.parametrize("with_drafter", [True, False])
def test_prepare_verifies_every_width_once_without_touching_the_random_stream(
    small_target, monkeypatch, with_drafter
):
    """The rejection kernel is compiled per verify width: ``prepare`` runs it at each width
    0..γ on the real steps' outputs (width 0 also inside the plain step it captures), so no timed
    round meets a new width (a compilation stall), and the engine's random stream is the same
    afterwards (runs stay reproducible)."""
    import dspark.decoding.fast_engine as fe

    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=3, seed=1)[0] if with_drafter else None
    eng = FastEngine(t, drafter, concurrency=2, buckets=(1, 2), capacity=32)
    eng._allocate(32)
    widths = []
    inner = fe.rejection_verify
    monkeypatch.setattr(
        fe,
        "rejection_verify",
        lambda tp, dp, *a, _i=inner, **k: widths.append(dp.shape[1]) or _i(tp, dp, *a, **k),
    )
    state = eng.generator.get_state()
    with torch.inference_mode():
        eng._plain_step(eng.in_ids[:2, :1].clone(), eng.in_pos[:2, :1].clone(), draw=False)
        eng._warm_verify(2)
    assert widths == ([0, 0, 1, 2, 3] if with_drafter else [0])  # the plain step's, then γ = 3's
    assert torch.equal(eng.generator.get_state(), state)


def test_static_forward_matches_hugging_face(small_target):
    """Prefill of ragged prompts, then a step of ragged widths with junk beyond the kept tokens:
    final hidden states (hence logits) and taps equal the Hugging Face forward over RaggedKV."""
    t = small_target
    prompts = prompts_for(t, 3, seed=2, lo=5, hi=11)
    width = max(map(len, prompts))
    ids = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    pos = torch.arange(width).expand(3, -1)
    static = StaticTarget(t, rows=4, capacity=32)
    kv = RaggedKV.empty(t.model.config, 3, 32, t.dtype, "cpu")
    with torch.inference_mode():
        for step_ids, step_pos, keep in (
            (ids, pos, lens),
            (torch.randint(4, 256, (3, 4)), lens[:, None] + torch.arange(4), torch.tensor([4, 1, 2])),
            (torch.randint(4, 256, (3, 2)), None, torch.tensor([2, 2, 2])),
        ):
            if step_pos is None:
                step_pos = kv.length[:, None] + torch.arange(step_ids.shape[1])
            hidden, taps = static.forward(step_ids, step_pos, start=1)  # rows 1..3 of the static cache
            ref = t(
                step_ids, positions=step_pos, cache=kv, attention_mask=kv.plan(step_ids.shape[1], t.dtype)
            )
            kv.commit(keep)
            torch.testing.assert_close(hidden, ref.last_hidden, atol=1e-5, rtol=1e-5)
            scale = float(ref.taps.abs().max())  # the random target's residual stream is large
            torch.testing.assert_close(taps, ref.taps, atol=1e-5 * scale, rtol=1e-5)


def test_fused_projections_are_the_model_weights():
    """q|k|v (and gate|up) become one weight whose row blocks ARE the layers' weights: same
    values, shared memory (a write to one shows in the other), the same tensor again on a second
    call, a new one only after a layer's weight is replaced."""
    from torch import nn

    from dspark.decoding.static_target import fused_rows

    layers = [nn.Linear(8, 6), nn.Linear(8, 2), nn.Linear(8, 2)]
    before = [m.weight.detach().clone() for m in layers]
    x = torch.randn(3, 8)
    outputs = [m(x) for m in layers]
    fused = fused_rows(layers)
    assert torch.equal(fused, torch.cat(before)) and fused_rows(layers) is fused
    for m, y in zip(layers, outputs):
        assert isinstance(m.weight, nn.Parameter) and torch.equal(m(x), y)
    with torch.no_grad():
        fused[6, 0] = 42.0
    assert layers[1].weight[0, 0] == 42.0  # one memory
    layers[2].weight = nn.Parameter(torch.zeros(2, 8))
    again = fused_rows(layers)
    assert again is not fused and torch.equal(again[8:], torch.zeros(2, 8))


def _forward_twice(t, compile: bool, device: str):
    """Prefill then one ragged step through a fresh StaticTarget; returns both steps' outputs."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 256, (3, 9), generator=g).to(device)
    step = torch.randint(4, 256, (3, 4), generator=g).to(device)
    static = StaticTarget(t, rows=4, capacity=32, compile=compile)
    with torch.inference_mode():
        first = static.forward(ids, torch.arange(9, device=device).expand(3, -1))
        second = static.forward(
            step, torch.tensor([[9], [5], [7]], device=device) + torch.arange(4, device=device)
        )
    return first + second


# The compiled target's checks: on the CPU (inductor's C++ build takes minutes on 2 cores) and CUDA.
COMPILE_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.mark.parametrize("device", COMPILE_DEVICES)
def test_compiled_layers_match_eager(small_target, device):
    """The torch.compile'd layer functions (fused norms / RoPE / SiLU) against the eager ones."""
    t = small_target.to(device)
    try:
        eager = _forward_twice(t, False, device)
        fused = _forward_twice(t, True, device)
        for a, b in zip(fused, eager):
            scale = float(b.abs().max())
            torch.testing.assert_close(a, b, atol=1e-5 * scale, rtol=1e-5)
    finally:
        small_target.to("cpu")


def test_store_kv_writes_each_token_at_its_slot():
    """The cache store: token (r, w) of k and v at row rows[r], slot positions[r, w], all its KV
    heads; every other slot untouched."""
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = (torch.randn(5, 2, 12, 4, generator=g) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    rows, pos = torch.tensor([[1], [3]]), torch.tensor([[0, 1, 2], [7, 8, 9]])
    k, v = (torch.randn(2, 3, 2, 4, generator=g) for _ in range(2))
    store_kv(k_cache, v_cache, rows, pos, k, v)
    for r in range(2):
        for w in range(3):
            want_k[rows[r, 0], :, pos[r, w]] = k[r, w]
            want_v[rows[r, 0], :, pos[r, w]] = v[r, w]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def _cache_after_steps(t, compile: bool, device: str):
    """A fresh StaticTarget's K/V caches (zeros) after a prompt and two ragged steps in rows 1..3,
    and the ``aten::index_put_`` calls the last step dispatched (the eager path's cache stores)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(11)
    static = StaticTarget(t, rows=4, capacity=32, compile=compile)
    with torch.inference_mode():
        prompt = torch.randint(4, 256, (3, 9), generator=g).to(device)
        static.forward(prompt, torch.arange(9, device=device).expand(3, -1), start=1)
        step = torch.randint(4, 256, (3, 4), generator=g).to(device)
        static.forward(step, torch.tensor([[9], [5], [7]], device=device) + torch.arange(4, device=device), 1)
        last = torch.randint(4, 256, (3, 1), generator=g).to(device)
        at = torch.tensor([[13], [9], [20]], device=device)
        static.forward(last, at, start=1)  # W = 1 compiles a graph of its own: not in the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            static.forward(last, at, start=1)  # the same step again: the same stores
    stores = sum(e.count for e in prof.key_averages() if e.key == "aten::index_put_")
    return static.k + static.v, stores


@pytest.mark.parametrize("device", COMPILE_DEVICES)
def test_compiled_cache_stores_match_eager(small_target, device):
    """The K/V stores inside the compiled input function leave the caches as the eager path's
    advanced-index assignments do (the same slots written, equal to RoPE's rounding, every other
    slot untouched) without an index operator of their own: the eager step dispatches two
    ``aten::index_put_`` a layer, the compiled one none (its stores are the fused kernel's)."""
    t = small_target.to(device)
    try:
        eager, eager_stores = _cache_after_steps(t, False, device)
        fused, fused_stores = _cache_after_steps(t, True, device)
        assert eager_stores == len(eager) and fused_stores == 0  # len(eager): 2 caches a layer
        for a, b in zip(fused, eager):
            assert torch.equal(a != 0, b != 0)
            torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-5)
    finally:
        small_target.to("cpu")


@contextlib.contextmanager
def _layer_graphs(monkeypatch):
    """Every graph dynamo compiles for the target's layer functions inside the block, as (function
    name, GraphModule), run eagerly (the guards and graphs of the real backend, no codegen); yields
    that list and the names of the wrappers ``torch.compile`` made. A fresh wrapper per function
    (``compiled_layer_function``'s cache cleared) before and after, so later tests compile for real."""
    from dspark.decoding.static_target import compiled_layer_function

    wrappers, graphs = [], []
    real_compile = torch.compile

    def recording(fn, **kw):
        def backend(gm, example_inputs):
            graphs.append((fn.__name__, gm))
            return gm.forward

        wrappers.append(fn.__name__)
        return real_compile(fn, backend=backend, **kw)

    monkeypatch.setattr(torch, "compile", recording)
    compiled_layer_function.cache_clear()
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            yield wrappers, graphs
    finally:
        compiled_layer_function.cache_clear()
        torch._dynamo.reset()


def test_compiled_layers_serve_every_engine_of_a_process(small_target, monkeypatch):
    """bench.e2e builds one engine per rows count in one process. Dynamo keeps a function's graphs
    per code and, past its recompile limit (8), runs new shapes eagerly without an error: the H200's
    rounds at R >= 16 once paid ~1.5 ms for it. Every StaticTarget shares one compiled wrapper per
    layer function, and prompts, plain and verify steps of any rows count and width (sliced out of
    the engine's buffers, or not) at R = 1, 16, 64 and 256 fit in fewer graphs than that limit."""
    g = torch.Generator().manual_seed(2)
    with _layer_graphs(monkeypatch) as (wrappers, graphs):
        for rows in (1, 16, 64, 256):
            static = StaticTarget(small_target, rows=rows, capacity=64, compile=True)
            buffer = torch.randint(4, 256, (rows, 40), generator=g)
            for r in sorted({1, rows // 2 or 1, rows}):
                static.forward(buffer[:r, :9], torch.arange(9).expand(r, 9))  # prompts
                static.forward(buffer[:r, :9].clone(), torch.arange(9).repeat(r, 1))
                for w in range(1, 9):  # plain (1) and verify steps, as sliced and as copies
                    static.forward(buffer[:r, :w], buffer[:r, 10 : 10 + w] % 40 + 9)
                    static.forward(buffer[:r, :w].clone(), (buffer[:r, 10 : 10 + w] % 40 + 9).clone())
    assert sorted(wrappers) == ["attention_inputs", "layer_output"]  # one wrapper each
    per_function = collections.Counter(name for name, _ in graphs)
    assert sorted(per_function) == sorted(wrappers) and all(n < 8 for n in per_function.values()), (
        per_function
    )


def test_compiled_layers_keep_the_weight_sizes_constant(small_target, monkeypatch):
    """The layer functions take their weights as plain tensors (stacked q|k|v, gate|up), which
    dynamo would make as symbolic as the activations under ``dynamic=True``: every kernel then
    divides its indices by run-time sizes (the H200: 99.5 µs a layer at 256 x 8 rows against 60.7
    with constant weight sizes, ``bench.layer_compile``). Only the sizes that vary (rows, width,
    cache positions) may be symbolic: every graph over several rows counts and widths has the
    weights' sizes as constants."""
    g = torch.Generator().manual_seed(3)
    with _layer_graphs(monkeypatch) as (_, graphs):
        static = StaticTarget(small_target, rows=16, capacity=64, compile=True)
        buffer = torch.randint(4, 256, (16, 40), generator=g)
        for r, w in ((1, 1), (16, 8), (8, 3), (16, 1), (4, 8)):
            static.forward(buffer[:r, :w], buffer[:r, 10 : 10 + w] % 40 + 9)
    weights = static.weights[0]
    sizes = {tuple(t.shape) for t in (weights.qkv, weights.gate_up, weights.o, weights.down)}
    symbolic_graphs = 0
    for name, gm in graphs:
        inputs = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        shapes = [t.shape for t in inputs if isinstance(t, torch.Tensor)]
        symbolic = [s for s in shapes if any(isinstance(d, torch.SymInt) for d in s)]
        symbolic_graphs += bool(symbolic)
        hinted = {tuple(d.node.hint if isinstance(d, torch.SymInt) else d for d in s) for s in symbolic}
        assert not hinted & sizes, f"{name}: a weight's sizes are symbolic in {hinted & sizes}"
    assert symbolic_graphs, "no graph over several shapes: nothing was checked"


def _engines(t, drafter, temperature, deferred_context=8, **kw):
    common = dict(temperature=temperature, concurrency=3, eos_token_ids=(), seed=5, refill=1)
    common.update(kw)
    fast = FastEngine(t, drafter, buckets=(1, 2, 4), deferred_context=deferred_context, **common)
    return Engine(t, drafter, **common), fast


def seven_requests(target, seed: int = 12) -> list[Request]:
    """The engine comparisons' workload: seven prompts with budgets from 1 to 30 tokens, more than
    the engines' slots (continuous batching, rows leaving at different rounds)."""
    prompts = prompts_for(target, 7, seed=seed)
    return [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [5, 30, 12, 22, 1, 17, 26])]


def assert_same_rounds(fast, plain, confidences: bool = True) -> None:
    """Two engines' results (EngineResult) alike: tokens, each round's request, acceptance and
    verified length and (``confidences``: where the plain engine has them) confidence logits."""
    assert [g.tokens for g in fast.generations] == [g.tokens for g in plain.generations]
    assert [(r.request, r.accepted, r.proposed) for r in fast.rounds] == [
        (r.request, r.accepted, r.proposed) for r in plain.rounds
    ]
    for rp, rf in zip(plain.rounds, fast.rounds):
        if confidences and rp.confidence_logits is not None:
            torch.testing.assert_close(torch.tensor(rf.confidence_logits), torch.tensor(rp.confidence_logits))


@pytest.mark.parametrize("kind", ["target", "dspark-rnn", "dflash", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_engine_reproduces_plain_engine(small_target, kind, temperature):
    """Seven requests through three slots (continuous batching, row compaction): identical tokens,
    acceptance and per-round confidences (which depend on the drafter's whole context)."""
    t = small_target
    drafter = None
    if kind != "target":
        name, _, head = kind.partition("-")
        drafter = make_drafter(t, name, head or "none", gamma=4, seed=3)[0]
    reqs = seven_requests(t)
    plain, fast = _engines(t, drafter, temperature, seed=7)  # a seed where a random drafter is accepted
    a, b = plain.generate(reqs), fast.generate(reqs)
    assert_same_rounds(b, a)
    if kind.startswith("dspark"):
        assert all(r.confidence_logits is not None for r in a.rounds)  # compared above
    if temperature == 1.0 and drafter is not None:
        assert sum(r.accepted for r in a.rounds) > 0  # the check covered partial acceptance
    # A second generate on the same engine reuses its caches from a clean state.
    again = fast.generate(reqs[:2])
    assert [g.tokens for g in again.generations] == [g.tokens for g in plain.generate(reqs[:2]).generations]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_engine_reproduces_plain_engine_two_rounds_ahead(small_target, temperature):
    """``pipeline=2`` (round t launched before round t - 2 is read) in both engines: the same
    tokens, acceptance and draft lengths under a policy that chooses them from completed rounds."""
    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=4, seed=3)[0]
    reqs = seven_requests(t)
    plain, fast = _engines(t, drafter, temperature, seed=7, pipeline=2)
    for eng in (plain, fast):
        eng.set_policy(Cycling())
    a, b = plain.generate(reqs), fast.generate(reqs)
    assert_same_rounds(b, a)
    assert len({s["drafted"] for s in a.steps}) > 2  # the policy's choices varied


def test_one_draw_of_a_rounds_uniforms_takes_the_numbers_of_one_draw_each():
    """The fast engine draws a round's uniforms (the drafter's, u_accept, u_sample) at once, where
    the plain engine draws them in turn: the same numbers only because a CPU generator fills a
    tensor element by element, whatever its size (the reproduction tests above rely on it)."""
    for sizes in ((3 * 7, 3 * 2, 3), (64 * 7, 64 * 7, 64), (256 * 7, 256 * 3, 256), (1, 17, 4096)):
        one = torch.rand(sum(sizes), generator=torch.Generator().manual_seed(5))
        g = torch.Generator().manual_seed(5)
        assert torch.equal(one, torch.cat([torch.rand(n, generator=g) for n in sizes])), sizes


# Three rows, γ = 4: verify flat up to 9 tokens, then steep; drafting a position costs 0.5 ms.
POLICY_COST = CostModel(
    {1: 4.0, 9: 4.0, 15: 12.0}, draft_len_ms={m: {1: 0.5 * m, 3: 0.5 * m} for m in range(1, 5)}
)


@pytest.mark.parametrize(
    "policy", ["cycling", "draft_aware", "hardware_aware", "threshold", "async_topk", "mtp1"]
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_engine_reproduces_plain_engine_under_every_policy(small_target, policy, temperature):
    """Every policy's choices (drafted lengths incl. plain rounds, widths read back or known in
    advance, lengths on the device) give the same rounds in both engines, with rows leaving
    two at a time (idle rows) and requests riding along one round after they end."""
    t = small_target
    drafter = make_drafter(t, "dspark", "rnn", gamma=4, seed=3)[0]
    reqs = seven_requests(t, seed=21)

    def make():  # choices that do not depend on timing: the engines' clocks differ
        return Cycling() if policy == "cycling" else build_policy(policy, defaults={"round_clock": False})

    # Two float implementations of the same draws: a uniform within rounding of a CDF step would
    # pick neighbouring tokens (seed 5 meets one under threshold at T = 1, contexts equal).
    plain, fast = _engines(t, drafter, temperature, cost=POLICY_COST, refill=2, seed=6)
    plain.set_policy(make())
    fast.set_policy(make())
    a, b = plain.generate(reqs), fast.generate(reqs)
    assert_same_rounds(b, a, confidences=False)
    assert [s["drafted"] for s in b.steps] == [s["drafted"] for s in a.steps]
    if policy in ("cycling", "draft_aware"):
        assert len({s["drafted"] for s in a.steps}) > 1  # the draft length did change


class Bursts(Cycling):
    """Runs of plain rounds (0, 5 long, then 2 long) between one or two drafting rounds."""

    name = "bursts"

    def draft_length(self, rows, gamma, cost=None):
        return gamma if self.seen % 7 in (5, 6) else 0


def _spied(engine):
    """Record each target-side call of a fast engine: ("draft"|"target"|"plain"|"flush", width)."""
    calls = []
    for name in ("_propose", "_target_step", "_plain_step", "_flush_context"):
        inner = getattr(engine, name)

        def spy(*args, _inner=inner, _name=name):
            width = args[0].shape[1] if _name in ("_target_step", "_plain_step") else engine._stashed
            calls.append((_name.strip("_").split("_")[0], width))
            return _inner(*args)

        setattr(engine, name, spy)
    return calls


@contextlib.contextmanager
def _context_writes(drafter):
    """The widths of the drafter's context writes made inside the block, in order."""
    writes = []
    write = drafter.write_context
    drafter.write_context = lambda cache, taps, pos, rows: (
        writes.append(taps.shape[1]) or write(cache, taps, pos, rows)
    )
    try:
        yield writes
    finally:
        del drafter.write_context


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_rounds_defer_the_drafter_context(small_target, temperature):
    """A round that drafts nothing runs the width-1 plain step (no draft, no drafter layers); the
    context of those rounds reaches the drafter in one write of the ring (3 rounds here) before
    the next draft, when the ring is full, or before rows join; rows that move when requests leave
    take their ring entries along. Tokens, acceptance and every round's confidences (which read the
    whole context) equal the plain engine's, with requests joining and leaving two at a time;
    skipping the deferred writes breaks them."""
    t = small_target
    drafter = make_drafter(t, "dspark", "rnn", gamma=4, seed=3)[0]
    prompts = prompts_for(t, 7, seed=23)
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [9, 40, 14, 31, 2, 25, 36])]
    plain, fast = _engines(t, drafter, temperature, refill=2, deferred_context=3, seed=6)
    plain.set_policy(Bursts())
    fast.set_policy(Bursts())
    calls = _spied(fast)
    keep_rows, stashed_at_moves = fast._keep_rows, []
    fast._keep_rows = lambda index, order: stashed_at_moves.append(fast._stashed) or keep_rows(index, order)
    with _context_writes(drafter) as writes:
        a, b = plain.generate(reqs), fast.generate(reqs)
    assert_same_rounds(b, a)
    drafted = [s["drafted"] for s in b.steps]
    assert drafted.count(0) > 2 * drafted.count(4) > 0
    # Plain rounds: the width-1 plain step, never the drafting target step or the draft step.
    assert {w for kind, w in calls if kind == "plain"} == {1}
    assert [kind for kind, _ in calls if kind in ("target", "plain")].count("plain") == drafted.count(0)
    # The ring was flushed full (3), part-full before drafts and row changes, never empty.
    flushed = [w for kind, w in calls if kind == "flush" and w]
    assert 3 in flushed and {1, 2} & set(flushed)
    assert any(stashed_at_moves)  # rows moved with entries in the ring, and kept them
    # The drafter's context layers ran in prefills (prompt width), drafting rounds' target steps
    # (width 5) and flushes (width 3): never at width 1, a plain round's.
    assert 1 not in writes and 3 in writes and 5 in writes
    # Without the deferred writes the drafter reads stale context: the confidences differ.
    broken = _engines(t, drafter, temperature, refill=2, deferred_context=3, seed=6)[1]
    broken.set_policy(Bursts())
    broken._flush_context = lambda: setattr(broken, "_stashed", 0)
    c = broken.generate(reqs)
    assert any(
        ra.confidence_logits is not None
        and not torch.allclose(torch.tensor(ra.confidence_logits), torch.tensor(rc.confidence_logits))
        for ra, rc in zip(a.rounds, c.rounds)
        if rc.request == ra.request
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_rounds_without_a_ring_write_the_drafter_context_in_their_step(small_target, temperature):
    """``deferred_context=0``: a plain round's step writes its anchors' context itself (width 1), and
    the rounds equal the plain engine's, confidences included."""
    t = small_target
    drafter = make_drafter(t, "dspark", "rnn", gamma=4, seed=3)[0]
    prompts = prompts_for(t, 5, seed=29)
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [11, 30, 6, 24, 17])]
    plain, fast = _engines(t, drafter, temperature, refill=2, deferred_context=0, seed=8)
    plain.set_policy(Bursts())
    fast.set_policy(Bursts())
    with _context_writes(drafter) as writes:
        a, b = plain.generate(reqs), fast.generate(reqs)
    assert_same_rounds(b, a)
    drafted = [s["drafted"] for s in b.steps]
    assert drafted.count(0) > drafted.count(4) > 0
    assert writes.count(1) == drafted.count(0)  # each plain round wrote its own context


@contextlib.contextmanager
def _proposals(drafter):
    """Each proposal the drafter makes inside the block: (tokens, probabilities), copied."""
    made = []
    propose = drafter.propose

    def spy(*args, **kw):
        out = propose(*args, **kw)
        made.append((out.tokens.clone(), out.probs.clone()))
        return out

    drafter.propose = spy
    try:
        yield made
    finally:
        del drafter.propose


@pytest.mark.parametrize("policy", [Bursts, Cycling])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_engine_runs_eagle3_as_the_plain_engine(small_target, policy, temperature):
    """Eagle3's context entry at p pairs the target's features at p with the token after it, so the
    fast engine writes it once the round's tokens are chosen (a verified round's after
    verification, a plain round's inside its step, no ring): the same rounds as the plain engine
    through plain stretches and every draft length, with rows joining and leaving (each row's chain
    seed moving with it). Rows leave at once (refill=1): a finished row waiting for others writes its
    plain rounds' entries past its length and changes its chain seed, both never read for a live
    request, where the plain engine keeps nothing; its void drafts would differ."""
    t = small_target
    drafter = make_drafter(t, "eagle3", gamma=4, seed=3)[0]
    prompts = prompts_for(t, 7, seed=23)
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [9, 40, 14, 31, 2, 25, 36])]
    plain, fast = _engines(t, drafter, temperature, refill=1, seed=6)
    assert fast.deferred_context == 0
    plain.set_policy(policy())
    fast.set_policy(policy())
    with _proposals(drafter) as drafts_a:
        a = plain.generate(reqs)
    with _proposals(drafter) as drafts_b:
        b = fast.generate(reqs)
    assert_same_rounds(b, a)
    # The drafts themselves, which read each row's whole context and its chain seed: a random drafter
    # is seldom accepted, so equal tokens alone would miss a wrong context (at T = 1 the correction
    # drawn from p - q hides most of q).
    assert len(drafts_a) == len(drafts_b) > 0
    for (tok_a, probs_a), (tok_b, probs_b) in zip(drafts_a, drafts_b):
        assert torch.equal(tok_a, tok_b)
        torch.testing.assert_close(probs_b, probs_a)
    drafted = [s["drafted"] for s in b.steps]
    assert 0 in drafted and max(drafted) == 4
    if temperature == 1.0:  # a random drafter is accepted at T = 1 only: entries kept past the anchor
        assert sum(r.accepted for r in a.rounds) > 0


class PlainFirst(Cycling):
    """Plain rounds for the first ``plain`` launches of a generate, then the whole block."""

    name = "plain_first"

    def __init__(self, plain: int) -> None:
        super().__init__()
        self.plain = plain

    def draft_length(self, rows, gamma, cost=None):
        self.seen += 1
        return 0 if self.seen <= self.plain else gamma

    def observe_round(self, lengths, accepted):
        pass


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_joining_rows_need_no_flush_of_the_ring(small_target, temperature):
    """A short request ends after two plain rounds, their taps still in the ring, and a long prompt
    takes its row. The join writes nothing to the drafter (it used to flush the ring first); the
    new row's ring entries point at its own first position, so the flush before its first draft
    rewrites what its prefill wrote instead of the departed request's taps at positions inside the
    new prompt: the confidences equal the plain engine's, and when the flush covers the new row
    without its entries parked they do not."""
    t = small_target
    drafter = make_drafter(t, "dspark", "rnn", gamma=4, seed=3)[0]
    short, long = prompts_for(t, 1, seed=31, lo=3, hi=4)[0], prompts_for(t, 1, seed=32, lo=20, hi=21)[0]
    reqs = [Request(prompt=short, max_new_tokens=3), Request(prompt=long, max_new_tokens=6)]

    def run(park=True):
        plain, fast = _engines(t, drafter, temperature, concurrency=1, seed=6)
        parked = []

        def spy(taps, positions, row0):
            parked.append(fast._stashed)
            if park:
                return real(taps, positions, row0)
            fast._stash_rows = max(fast._stash_rows, row0 + taps.shape[0])  # the flush covers the row

        real, fast._park_ring = fast._park_ring, spy
        calls = _spied(fast)
        for eng in (plain, fast):
            eng.set_policy(PlainFirst(2))
        return plain.generate(reqs), fast.generate(reqs), parked, calls

    a, b, parked, calls = run()
    assert_same_rounds(b, a)
    assert parked == [2]  # the long prompt joined with the short one's two plain rounds in the ring
    kinds = [kind for kind, width in calls if kind != "flush" or width]
    assert kinds[:5] == ["plain", "plain", "propose", "flush", "target"]  # no flush at the join
    a, b, *_ = run(park=False)
    assert any(not torch.allclose(torch.tensor(ra.confidence_logits), torch.tensor(rb.confidence_logits))
               for ra, rb in zip(a.rounds, b.rounds) if ra.confidence_logits is not None)  # fmt: skip


def test_hardware_aware_runs_target_only_rounds_at_saturation(small_target):
    """Issue 18 at R = 256: hardware_aware chose to verify nothing yet drafted every round. On a
    table where drafting cannot pay it now plans no draft at all: every round is the width-1
    plain step, the tokens are target-only decoding's, and the drafter never runs."""
    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=4, seed=3)[0]
    cost = CostModel({1: 1.0, 3: 1.0, 6: 2.0, 30: 20.0}, draft_ms={1: 3.0}, padded=True)
    prompts = prompts_for(t, 5, seed=26)
    kw = dict(temperature=0.0, concurrency=3, eos_token_ids=(), max_new_tokens=7, buckets=(1, 2, 4))
    base = FastEngine(t, None, **kw).generate(prompts)
    pol = build_policy("hardware_aware")
    # What it learned in an earlier generate (drafts rejected) carries over generate's reset:
    # a saturated run does not pay draft steps to learn it again.
    pol.observe_round([4, 4, 4], [0, 1, 0])
    eng = FastEngine(t, drafter, pol, cost=cost, **kw)
    calls = _spied(eng)
    res = eng.generate(prompts)
    assert [g.tokens for g in res.generations] == [g.tokens for g in base.generations]
    assert {s["drafted"] for s in res.steps} == {0} and all(r.proposed == 0 for r in res.rounds)
    assert {kind for kind, _ in calls if kind != "flush"} == {"plain"}
    assert all(s["readback_ms"] == 0 for s in res.steps)


def test_draft_aware_declines_to_draft_when_it_cannot_pay(small_target):
    """A verify step that doubles with every extra token: DraftAware runs plain decoding rounds
    (no draft step), which give target-only decoding's tokens; the steps report their timing."""
    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=4, seed=3)[0]
    cost = CostModel({1: 1.0, 2: 2.0, 3: 4.0, 4: 8.0}, draft_ms={1: 1.0})
    prompts = prompts_for(t, 3, seed=22)
    kw = dict(temperature=0.0, concurrency=1, eos_token_ids=(), max_new_tokens=9)
    base = FastEngine(t, None, buckets=(1,), **kw).generate(prompts)
    res = FastEngine(t, drafter, DraftAware(), cost=cost, buckets=(1,), **kw).generate(prompts)
    assert [g.tokens for g in res.generations] == [g.tokens for g in base.generations]
    assert {s["drafted"] for s in res.steps} == {0} and all(r.proposed == 0 for r in res.rounds)
    for s in res.steps:
        assert s["ms"] > 0 and s["host_ms"] > 0 and s["gpu_ms"] is None  # no device clock on the CPU


def test_leaving_rows_move_only_their_successors(small_target, monkeypatch):
    """Row compaction in the static caches: a finished row below the new batch size takes the last
    running row; the rows that keep their place are not copied at all."""
    import dspark.decoding.fast_engine as fe
    import dspark.decoding.static_target as st

    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=2, seed=1)[0]
    eng = FastEngine(t, drafter, concurrency=4, buckets=(4,), capacity=32)
    eng._allocate(32)
    moved = []
    for mod in (st, fe):
        inner = mod.move_rows
        monkeypatch.setattr(
            mod, "move_rows", lambda ts, d, s, _i=inner, **kw: moved.append(d.tolist()) or _i(ts, d, s, **kw)
        )
    with torch.inference_mode():
        for buf in [*eng.static.k, *eng.dcache.k]:
            buf.copy_(torch.arange(4.0).view(4, 1, 1, 1).expand_as(buf))
        eng.static.lengths.copy_(torch.tensor([10, 11, 12, 13]))
        order = retire_order([True, False, True, True])
        eng._keep_rows(torch.tensor(order), order)
    # the target's stacked caches, the lengths (one tensor for both caches), the drafter's stacked
    # caches: one call each, the moved row only
    assert order == [0, 3, 2] and moved == [[1]] * 3
    for buf in [*eng.static.k, *eng.dcache.k]:
        assert buf[:3, 0, 0, 0].tolist() == [0.0, 3.0, 2.0]
    assert eng.dcache.length is eng.static.lengths and eng.static.lengths[:3].tolist() == [10, 13, 12]
    eng._keep_rows(torch.tensor([0, 1]), [0, 1])  # the tail left: nothing moves
    assert moved == [[1]] * 3


def test_fast_engine_filtered_sampling_with_refill_matches_plain(small_target):
    """Top-k / top-p (the static sort inside the target step against the plain engine's candidate
    search) with rows leaving two at a time, with and without a drafter."""
    t = small_target
    prompts = prompts_for(t, 9, seed=19)
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [6, 19, 3, 25, 11, 2, 17, 9, 14])]
    for drafter in (None, make_drafter(t, "dspark", "rnn", gamma=4, seed=3)[0]):
        for top_k, top_p in ((0, 0.8), (30, 0.9)):
            plain, fast = _engines(t, drafter, 1.0, top_k=top_k, top_p=top_p, refill=2)
            a, b = plain.generate(reqs), fast.generate(reqs)
            assert [g.tokens for g in b.generations] == [g.tokens for g in a.generations]
            assert [r.accepted for r in b.rounds] == [r.accepted for r in a.rounds]


def test_fast_engine_refusals(small_target, monkeypatch):
    t = small_target
    eagle = make_drafter(t, "eagle3", gamma=3)[0]
    monkeypatch.setattr(type(eagle), "supports_static_cache", False)  # a drafter without a static cache
    with pytest.raises(ValueError, match="runs on engine=plain"):
        FastEngine(t, eagle)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="largest engine bucket"):
        FastEngine(t, None, concurrency=8, buckets=(1, 2, 4))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA target"):
        FastEngine(t, None, graphs=True)
    eng = FastEngine(t, None, capacity=16, max_new_tokens=20)
    with pytest.raises(ValueError, match="cache positions"):
        eng.generate([[1, 2, 3]])
    assert bucket_for(3, [1, 2, 4, 8]) == 4
    with pytest.raises(ValueError, match="largest bucket"):
        bucket_for(9, [1, 2, 4, 8])


def test_unsupported_architecture_is_refused():
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    t = Target(Phi3ForCausalLM(cfg), None, layer_ids=[0], mask_token_id=3, eos_token_ids=[], name="phi3")
    with pytest.raises(UnsupportedTarget, match="'phi3'.*engine=plain"):
        FastEngine(t, None).generate([[1, 2]])


# ----------------------------------------------------------------------------------------------
# Gemma 3: sliding / full layers, (1 + w) sandwich norms, scaled embeddings, two RoPE tables

GEMMA3_WINDOW = 4  # prompts of 5-10 tokens and decoding past them cross it


def tiny_gemma3(window: int = GEMMA3_WINDOW, **config) -> Target:
    """A random 4-layer Gemma 3 text model (sliding, full, sliding, sliding) whose options are
    all in play: q/k scale from query_pre_attn_scalar, not head_dim; local and global RoPE bases
    apart, the global one linearly scaled; a final-logit soft-cap; its (1 + w) norms drawn around
    0 rather than left at transformers' w = 0. Small embeddings (x sqrt(d) still) and an untied,
    larger LM head: the next token depends on the context (attention, hence the window), not on
    the current token's embedding alone, and is peaky (~2 nats) as the engine tests want."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        query_pre_attn_scalar=48, rope_theta=1e5, rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, final_logit_softcapping=30.0,
        max_position_embeddings=512, initializer_range=0.5, pad_token_id=0, tie_word_embeddings=False,
        **config,
    )  # fmt: skip
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.1)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    return Target(model, None, layer_ids=[-1, 0, 1, 2], mask_token_id=3, eos_token_ids=[], name="gemma3-tiny")


@pytest.fixture(scope="module")
def gemma3_target():
    return tiny_gemma3()


def test_gemma3_static_forward_matches_hugging_face(gemma3_target):
    """Ragged prompts longer than the window, then steps of widths 4, 1 and 3 (junk beyond the
    kept tokens) at later positions: final hidden states and taps (embeddings included) equal
    Hugging Face's over RaggedKV (our sliding / full masks), and the last step equals Hugging
    Face's own uncached forward of each row's committed tokens (its own masks)."""
    t = gemma3_target
    prompts = prompts_for(t, 3, seed=2, lo=5, hi=11)
    assert min(map(len, prompts)) > GEMMA3_WINDOW
    width = max(map(len, prompts))
    ids = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    static = StaticTarget(t, rows=4, capacity=48)
    kv = RaggedKV.empty(t.model.config, 3, 48, t.dtype, "cpu")
    committed = [list(p) for p in prompts]
    g = torch.Generator().manual_seed(4)
    steps = [(ids, torch.arange(width).expand(3, -1), lens)]
    for w, keep in ((4, [4, 1, 2]), (1, [1, 1, 1]), (3, [3, 3, 3])):
        steps.append((torch.randint(4, 300, (3, w), generator=g), None, keep))
    with torch.inference_mode():
        for step_ids, step_pos, keep in steps:
            keep = torch.as_tensor(keep)
            if step_pos is None:
                step_pos = kv.length[:, None] + torch.arange(step_ids.shape[1])
                for row, (tokens, n) in enumerate(zip(step_ids.tolist(), keep.tolist())):
                    committed[row] += tokens[:n]
            hidden, taps = static.forward(step_ids, step_pos, start=1)  # rows 1..3 of the static cache
            ref = t(
                step_ids, positions=step_pos, cache=kv, attention_mask=kv.plan(step_ids.shape[1], t.dtype)
            )
            kv.commit(keep)
            torch.testing.assert_close(hidden, ref.last_hidden, atol=1e-5, rtol=1e-5)
            scale = float(ref.taps.abs().max())
            torch.testing.assert_close(taps, ref.taps, atol=1e-5 * scale, rtol=1e-5)
        for row, tokens in enumerate(committed):  # the last step kept all of its 3 tokens
            own = t(torch.tensor([tokens])).last_hidden[0, -3:]
            torch.testing.assert_close(hidden[row], own, atol=1e-5, rtol=1e-5)
    assert int(kv.length.max()) > 3 * GEMMA3_WINDOW


def test_gemma3_sliding_window_is_not_vacuous(gemma3_target):
    """The same weights with a window wider than the sequence (every layer then sees the whole
    prefix): equal below the window, different at every position from the window on, so the parity
    above could not hold if the fast path ignored the window. The fast path follows each model,
    and greedy decoding differs between the two (the engine test below sees the window too)."""
    t = gemma3_target
    wide = tiny_gemma3(window=4096)
    wide.model.load_state_dict(t.model.state_dict())
    prompt = prompts_for(t, 1, seed=5, lo=14, hi=15)[0]
    ids, pos = torch.tensor([prompt]), torch.arange(len(prompt))[None]
    with torch.inference_mode():
        local, full = t(ids).last_hidden, wide(ids).last_hidden
        fast_local = StaticTarget(t, rows=1, capacity=32).forward(ids, pos)[0]
        fast_full = StaticTarget(wide, rows=1, capacity=32).forward(ids, pos)[0]
    w = GEMMA3_WINDOW
    torch.testing.assert_close(local[:, :w], full[:, :w], atol=1e-5, rtol=1e-5)
    gap = (local[0, w:] - full[0, w:]).norm(dim=-1) / full[0, w:].norm(dim=-1)
    assert float(gap.min()) > 1e-2, gap
    torch.testing.assert_close(fast_local, local, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_full, full, atol=1e-5, rtol=1e-5)
    kw = dict(temperature=0.0, concurrency=1, eos_token_ids=(), max_new_tokens=12)
    assert Engine(t, None, **kw).generate([prompt]).generations[0].tokens != (
        Engine(wide, None, **kw).generate([prompt]).generations[0].tokens
    )


@pytest.mark.parametrize("kind", ["target", "dspark-rnn"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_engine_reproduces_plain_engine_on_gemma3(gemma3_target, kind, temperature):
    """Seven requests through three slots on the Gemma 3 target (rows decode up to ~40 positions,
    ten windows): the same tokens and rounds as the plain engine, target-only and with a drafter
    reading the taps; greedy target-only decoding also equals transformers' own DynamicCache."""
    t = gemma3_target
    drafter = make_drafter(t, "dspark", "rnn", gamma=4, seed=3)[0] if kind != "target" else None
    reqs = seven_requests(t)
    plain, fast = _engines(t, drafter, temperature, seed=7)
    a, b = plain.generate(reqs), fast.generate(reqs)
    assert [g.tokens for g in b.generations] == [g.tokens for g in a.generations]
    assert [(r.request, r.accepted, r.proposed) for r in b.rounds] == [
        (r.request, r.accepted, r.proposed) for r in a.rounds
    ]
    if drafter is None and temperature == 0.0:
        assert b.generations[1].tokens == hf_greedy(t, reqs[1].prompt, 30)


@pytest.mark.parametrize(
    "option,message",
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "bidirectional attention"),
        (dict(hidden_activation="gelu"), "activation 'gelu'"),
    ],
)
def test_gemma3_options_the_fast_engine_does_not_implement_are_refused(option, message):
    """Attention-logit soft-capping (which transformers' Gemma 3 does not apply either),
    bidirectional attention, another activation: refused, not silently run differently."""
    with pytest.raises(UnsupportedTarget, match=f"{message}.*engine=plain"):
        StaticTarget(tiny_gemma3(**option), rows=1, capacity=16)


@pytest.mark.slow  # inductor's C++ build takes minutes on 2 cores
def test_compiled_gemma3_layers_match_eager(gemma3_target):
    """The torch.compile'd Gemma layer functions against the eager ones (CPU)."""
    eager = _forward_twice(gemma3_target, False, "cpu")
    fused = _forward_twice(gemma3_target, True, "cpu")
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# CUDA: graph replay == the eager static path == the plain engine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["fixed", "cycling", "draft_aware", "hardware_aware"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("pipeline", [1, 2])
def test_cuda_graphs_reproduce_eager(small_target, policy, temperature, pipeline):
    """Under every kind of choice (the whole block, draft graphs per drafted length and plain
    rounds, a width read back), one or two rounds launched ahead of the one read: graph replay ==
    the eager static path (== the plain engine at T = 0), every round is timed on the device, and
    none captures a graph or compiles a kernel."""
    t = small_target.to("cuda")
    try:
        drafter = make_drafter(t, "dspark", "rnn", gamma=4, seed=3)[0].to("cuda")
        prompts = prompts_for(t, 9, seed=13)
        reqs = [
            Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [4, 31, 12, 22, 2, 17, 26, 9, 14])
        ]

        def engine(cls, **kw):
            untimed = {"round_clock": False}  # eager and graphed rounds take different times
            pol = Cycling() if policy == "cycling" else build_policy(policy, defaults=untimed)
            gen = torch.Generator("cuda").manual_seed(7)
            common = dict(temperature=temperature, concurrency=5, eos_token_ids=(), cost=POLICY_COST)
            return cls(t, drafter, pol, generator=gen, pipeline=pipeline, **common, **kw)

        graphed_engine = engine(FastEngine, graphs=True, compile=False)
        eager_engine = engine(FastEngine, graphs=False, compile=False)
        priced = graphed_engine.cost.round_times(3, 4).tolist()  # 3 live rows run the 4-row graphs
        assert priced == POLICY_COST.round_times(4, 4).tolist() != POLICY_COST.round_times(3, 4).tolist()
        eager_engine.cost = graphed_engine.cost  # priced at the graphs' rows: the same choices
        eager = eager_engine.generate(reqs)
        # Capture every graph first (target steps before draft steps): a draft step's outputs
        # must survive the target step replayed after it (they once shared a memory pool).
        graphed_engine.prepare(reqs)
        graphed = graphed_engine.generate(reqs)
        assert len(graphed_engine.bank) > 2
        assert [g.tokens for g in graphed.generations] == [g.tokens for g in eager.generations]
        assert [r.accepted for r in graphed.rounds] == [r.accepted for r in eager.rounds]
        assert [s["drafted"] for s in graphed.steps] == [s["drafted"] for s in eager.steps]
        assert all(s["gpu_ms"] > 0 and s["ms"] >= 0.99 * s["gpu_ms"] for s in graphed.steps)
        # prepare left no first use to the rounds: no capture, no kernel compiled inside them
        first_uses = {"graph_captures", "triton_compiles"}
        assert not [s["events"] for s in graphed.steps if first_uses & set(s["events"])]
        if temperature == 0:
            plain = engine(Engine).generate(reqs)
            assert [g.tokens for g in graphed.generations] == [g.tokens for g in plain.generations]
    finally:
        small_target.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("pipeline", [1, 2])
def test_cuda_graphs_run_eagle3_as_eager(small_target, temperature, pipeline):
    """Eagle3's context written after verification in graphs of its own (per rows bucket and width,
    captured by ``prepare``) and inside the plain step's: graph replay == the eager static path
    (== the plain engine at T = 0) under varying draft lengths, no capture inside a round."""
    t = small_target.to("cuda")
    try:
        drafter = make_drafter(t, "eagle3", gamma=4, seed=3)[0].to("cuda")
        prompts = prompts_for(t, 9, seed=13)
        reqs = [
            Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [4, 31, 12, 22, 2, 17, 26, 9, 14])
        ]

        def engine(cls, **kw):
            gen = torch.Generator("cuda").manual_seed(7)
            common = dict(temperature=temperature, concurrency=5, eos_token_ids=())
            return cls(t, drafter, Cycling(), generator=gen, pipeline=pipeline, **common, **kw)

        eager = engine(FastEngine, graphs=False, compile=False).generate(reqs)
        graphed_engine = engine(FastEngine, graphs=True, compile=False)
        graphed_engine.prepare(reqs)
        graphed = graphed_engine.generate(reqs)
        assert any(key[0] == "commit" for key in graphed_engine.bank.graphs)
        assert [g.tokens for g in graphed.generations] == [g.tokens for g in eager.generations]
        assert [r.accepted for r in graphed.rounds] == [r.accepted for r in eager.rounds]
        assert not [s["events"] for s in graphed.steps if {"graph_captures"} & set(s["events"])]
        if temperature == 0:
            plain = engine(Engine).generate(reqs)
            assert [g.tokens for g in graphed.generations] == [g.tokens for g in plain.generations]
    finally:
        small_target.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_cache_stores_inside_cuda_graphs(small_target):
    """The compiled forward (its K/V stores inside the compiled input function) captured once in a
    CUDA graph and replayed at new positions: each replay's outputs and caches equal the eager
    forward's after the same steps (the graph writes the caches in place)."""
    t = small_target.to("cuda")
    try:
        g = torch.Generator().manual_seed(12)
        eager, fused = (StaticTarget(t, rows=4, capacity=32, compile=c) for c in (False, True))
        ids = torch.zeros(3, 2, dtype=torch.long, device="cuda")
        pos = torch.zeros(3, 2, dtype=torch.long, device="cuda")
        bank = GraphBank(torch.device("cuda"))
        with torch.inference_mode():
            prompt = torch.randint(4, 256, (3, 9), generator=g).to("cuda")
            for static in (eager, fused):
                static.forward(prompt, torch.arange(9, device="cuda").expand(3, -1), start=1)
            for at in ([9, 5, 7], [11, 7, 9], [13, 2, 20]):
                ids.copy_(torch.randint(4, 256, (3, 2), generator=g))
                pos.copy_(torch.tensor(at)[:, None] + torch.arange(2))
                want, _ = eager.forward(ids, pos, start=1, taps=False)
                got, _ = bank.run("step", lambda: fused.forward(ids, pos, start=1, taps=False))
                torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)
                for a, b in zip(fused.k + fused.v, eager.k + eager.v):
                    torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-5)
        assert len(bank) == 1
    finally:
        small_target.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (40, 0.9)])
def test_cuda_graphs_reproduce_eager_bulk_sampling(small_target, top_k, top_p):
    """Target-only decoding as the data pipeline runs it (top-k / top-p inside the graphs, rows
    leaving in batches, no round records): graph replay == the eager static path."""
    t = small_target.to("cuda")
    try:
        prompts = prompts_for(t, 40, seed=17)
        reqs = [Request(prompt=p, max_new_tokens=4 + (5 * i) % 23) for i, p in enumerate(prompts)]
        kw = dict(
            temperature=0.8, top_k=top_k, top_p=top_p, concurrency=16, eos_token_ids=(), refill=4,
            record_rounds=False, buckets=(1, 2, 4, 8, 16), compile=False,
        )  # fmt: skip
        gen = lambda: torch.Generator("cuda").manual_seed(9)  # noqa: E731
        eager = FastEngine(t, None, graphs=False, generator=gen(), **kw).generate(reqs)
        graphed_engine = FastEngine(t, None, graphs=True, generator=gen(), **kw)
        graphed = graphed_engine.generate(reqs)
        assert len(graphed_engine.bank) >= 2
        assert [g.tokens for g in graphed.generations] == [g.tokens for g in eager.generations]
    finally:
        small_target.to("cpu")


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs CUDA")])],
)  # fmt: skip
def test_rounds_leave_no_cyclic_garbage(small_target, device):
    """``generate`` turns the garbage collector off for its rounds, so the rounds must leave
    nothing for it: a run with plain rounds and drafts of every length, requests leaving and joining
    (and on CUDA its graphs and clocks) makes no object that only a collection would free; the
    collector is off inside the rounds and back on after them."""
    t = small_target.to(device)
    try:
        drafter = make_drafter(t, "dspark", "markov", gamma=4)[0].to(device)
        eng = FastEngine(t, drafter, Cycling(), cost=POLICY_COST, temperature=1.0, concurrency=3,
                         eos_token_ids=(), seed=3, compile=False)  # fmt: skip
        budgets = [3, 14, 7, 11, 5]
        reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts_for(t, 5, seed=8), budgets)]
        eng.prepare(reqs)
        eng.generate(reqs)  # first uses (lazy state, kernels) are not the rounds' garbage
        loop, collecting = eng._rounds_loop, []

        def rounds_loop(*args):
            collecting.append(gc.isenabled())
            return loop(*args)

        eng._rounds_loop = rounds_loop
        while gc.collect():  # until nothing is left: a pass's weakref callbacks can free more
            pass
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage, to be named
        try:
            res = eng.generate(reqs)
            found = gc.collect()
            kinds = collections.Counter(type(o).__name__ for o in gc.garbage).most_common(8)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert [len(g.tokens) for g in res.generations] == budgets
        assert {s["drafted"] for s in res.steps} > {0}  # plain rounds and drafting ones
        assert found == 0, f"the rounds left cyclic garbage: {kinds}"
        assert collecting == [False] and gc.isenabled()
    finally:
        small_target.to("cpu")


class _Launches(TorchDispatchMode):
    """Counts the operations a round's launch dispatches outside its captured steps that would put
    work on the device: not views, not conversions that return their input, not empty results;
    each replay of a step and each verification kernel counts as one (``_EagerBank``, ``verify``)."""

    def __init__(self):
        super().__init__()
        self.count, self.inside, self.counting = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting and not self.inside and not func.is_view:
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            storages = {t.untyped_storage().data_ptr() for t in ins}
            returns_input = outs and all(o.untyped_storage().data_ptr() in storages for o in outs)
            empty = outs and all(o.numel() == 0 for o in outs)
            self.count += (func._schema.is_mutable or not returns_input) and not empty
        return out

    @contextlib.contextmanager
    def one_launch(self):
        self.count += self.counting and not self.inside
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


class _EagerBank:
    """The CUDA-graph bank's interface on the CPU: each step runs eagerly where a replay would."""

    def __init__(self, launches: _Launches):
        self.launches = launches

    def run(self, key, step):
        with self.launches.one_launch():
            return step()

    def clear(self):
        pass


def test_rounds_launch_few_operations_outside_their_graphs(small_target, monkeypatch):
    """What a round launches beside its captured steps costs the host a few µs each on this CPU (about 50 on
    the H100's host: target-only rounds launched 10 in 0.54 ms at T = 1, R = 256, in session h100-…-05-d):
    a budget per kind of round. A target-only round: two staging copies of the step's inputs (the anchors
    and their positions, views of the round's tensors), the step (which also chooses the token: the
    rejection kernel of a round that drafts nothing runs inside it), at T = 1 the draw of its uniform and
    the copy into the step's buffer, the next positions, the caches' lengths (one tensor for the target's
    and the drafter's; every row keeps one token, a constant): 5 at T = 0, 7 at T = 1. A plain round of an
    engine that carries a drafter adds the ring's slot, and every 8th the ring's flush. A drafting round
    adds the draft step, its two staging copies (three at T = 1: the uniforms), the step's inputs (the
    anchors with the drafts, their positions), the tokens kept and the lengths' clamp, and at T = 0 the
    greedy comparison's six ops (equal, cast, run, count, cut at ℓ, gather). (Before the plain round's
    token moved into its step, 8 and 10 for target-only rounds; before session 2026-12-04-i, counted
    alike: 17, 20 and 31 at T = 0, 17, 20 and 27 at T = 1; before the drafter's context shared the
    target's lengths, 10 and 18 at T = 0, 12 and 16 at T = 1.)"""
    import dspark.decoding.fast_engine as fe

    t = small_target
    launches = _Launches()

    def one_kernel(inner):
        def kernel(*args, **kw):
            with launches.one_launch():
                return inner(*args, **kw)

        return kernel

    monkeypatch.setattr(fe, "rejection_verify", one_kernel(fe.rejection_verify))  # Triton on CUDA
    drafter = make_drafter(t, "dspark", "markov", gamma=7, seed=1)[0]
    budget = {  # (T, round kind): launches a round outside its steps, at most
        (0.0, "target_only"): 5, (0.0, "plain"): 6 + 1 / 8, (0.0, "fixed"): 17,
        (1.0, "target_only"): 7, (1.0, "plain"): 8 + 1 / 8, (1.0, "fixed"): 15,
    }  # fmt: skip
    policies = {"plain": Fixed(0), "fixed": Fixed(None)}  # Fixed(0): every round drafts nothing
    for (temperature, kind), most in budget.items():
        eng = FastEngine(
            t, None if kind == "target_only" else drafter, policies.get(kind),
            temperature=temperature, concurrency=4, buckets=(4,), capacity=128, max_new_tokens=24,
            eos_token_ids=(), record_confidence=False,
        )  # fmt: skip
        eng.bank = _EagerBank(launches)
        launch = eng._launch

        def counted(*args, _launch=launch, **kw):
            launches.counting = True
            try:
                return _launch(*args, **kw)
            finally:
                launches.counting = False

        eng._launch = counted
        eng.generate(prompts_for(t, 4, seed=3))  # the constants made once, out of the count
        launches.count = 0
        with launches:
            res = eng.generate(prompts_for(t, 4, seed=3))
        assert {s["drafted"] for s in res.steps} == {0 if kind != "fixed" else 7}
        per_round = launches.count / len(res.steps)
        print("COUNT", temperature, kind, per_round)
        assert per_round <= most + 1e-9, f"T = {temperature:g}, {kind}: {per_round:.2f} launches a round"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["target_only", "fixed", "draft_aware", "cycling", "threshold"])
def test_rounds_launch_without_a_host_sync(small_target, policy):
    """A round goes onto the device without the host waiting for it (CUDA's sync debug mode
    raises on any synchronising call inside ``_launch``); its outcome is read a round later.
    Plain rounds (the ring of deferred drafter context, its flush before a draft) and the
    threshold (its width bounded before drafting) included."""
    t = small_target.to("cuda")
    try:
        drafter = (
            None if policy == "target_only" else make_drafter(t, "dspark", "markov", gamma=4)[0].to("cuda")
        )
        pol = None if drafter is None else (Cycling() if policy == "cycling" else build_policy(policy))
        eng = FastEngine(
            t, drafter, pol, cost=POLICY_COST, temperature=1.0, concurrency=4, eos_token_ids=(), seed=3,
            refill=2, compile=False,
        )  # fmt: skip
        reqs = [
            Request(prompt=p, max_new_tokens=b)
            for p, b in zip(prompts_for(t, 6, seed=24), [3, 20, 9, 14, 6, 11])
        ]
        eng.prepare(reqs)
        launch = eng._launch

        def strict(*args, **kw):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(*args, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        eng._launch = strict
        res = eng.generate(reqs)
        assert [len(g.tokens) for g in res.generations] == [3, 20, 9, 14, 6, 11]
        assert all(s["gpu_ms"] > 0 for s in res.steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        small_target.to("cpu")


def _static_steps(t, impl: str, device: str) -> list[torch.Tensor]:
    """A prompt step (width 12, then 20: kernel width and SDPA width), then steps of widths 4, 1
    and 8 at ragged positions, through a fresh StaticTarget attending with ``impl``: every
    output (hidden states and taps)."""
    g = torch.Generator().manual_seed(8)
    static = StaticTarget(t, rows=5, capacity=96)
    static.attention_impl = impl
    out = []
    with torch.inference_mode():
        for start, width in ((0, 12), (3, 20)):
            ids = torch.randint(4, 256, (2, width), generator=g).to(device)
            out += static.forward(ids, torch.arange(width, device=device).expand(2, -1), start=start)
        for width in (4, 1, 8):
            at = torch.randint(20, 80, (4, 1), generator=g) + torch.arange(width)
            ids = torch.randint(4, 256, (4, width), generator=g)
            out += static.forward(ids.to(device), at.to(device), start=1)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("which", ["llama", "gemma3"])
def test_cache_attention_kernel_matches_sdpa_in_the_static_forward(small_target, gemma3_target, which):
    """On CUDA the decode and verify steps attend with the Triton kernel (float32 in IEEE
    precision): their outputs equal the SDPA reference path's (held equal to Hugging Face by the
    CPU parity tests above), sliding-window layers included."""
    t = {"llama": small_target, "gemma3": gemma3_target}[which].to("cuda")
    try:
        assert StaticTarget(t, rows=1, capacity=32).attention_impl == "auto"  # the kernel is taken
        fast, ref = _static_steps(t, "auto", "cuda"), _static_steps(t, "torch", "cuda")
        for a, b in zip(fast, ref):
            scale = float(b.abs().max())
            torch.testing.assert_close(a, b, atol=1e-5 * scale, rtol=1e-5)
    finally:
        t.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_drafter_matches_eager(small_target):
    """``compile_inference``: proposals through torch.compile'd layers equal the eager ones to
    rounding, and the fast engine runs its captured rounds with target and drafter compiled."""
    t = small_target.to("cuda")
    try:
        drafter = make_drafter(t, "dspark", "markov", gamma=4, seed=3)[0].to("cuda")
        shared, g = Shared.of(t), torch.Generator("cuda").manual_seed(5)
        cache = drafter.new_cache(3, "cuda")
        taps = torch.randn(3, 10, t.tap_dim, device="cuda", generator=g)
        nxt = torch.randint(4, 256, (3, 10), device="cuda", generator=g)
        pos = torch.arange(10, device="cuda").expand(3, -1)
        u = torch.rand(3, 4, device="cuda", generator=g)
        with torch.inference_mode():
            drafter.extend_context(
                cache, taps, pos, torch.ones(3, 10, dtype=torch.bool, device="cuda"), nxt, shared
            )
            args = (cache, nxt[:, -1], torch.full((3,), 10, device="cuda"), shared, 1.0)
            eager = drafter.propose(*args, uniforms=u)
            drafter.compile_inference()
            fused = drafter.propose(*args, uniforms=u)
        torch.testing.assert_close(fused.probs, eager.probs, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fused.confidence_logits, eager.confidence_logits, atol=1e-4, rtol=1e-4)
        prompts = prompts_for(t, 4, seed=25)
        kw = dict(temperature=0.0, concurrency=4, eos_token_ids=(), max_new_tokens=16)
        res = FastEngine(t, drafter, compile=True, **kw).generate(prompts)
        assert [len(g.tokens) for g in res.generations] == [16] * 4 and res.steps
    finally:
        small_target.to("cpu")


@pytest.mark.parametrize("kind,head", [("dspark", "rnn"), ("dflash", "none")])
def test_block_keys_written_in_place_equal_concatenated(small_target, kind, head):
    """A static cache's room for the block (DraftCache.block_slots): the draft step writes the
    block's own keys/values there instead of concatenating them after the context; its proposal
    equals the concatenating path's over the same context, whatever the room held before."""
    from dspark.core.types import DraftCache, Shared

    t = small_target
    drafter = make_drafter(t, kind, head, gamma=4, seed=5)[0]
    r, c = 3, 16
    block = drafter.block_size
    g = torch.Generator().manual_seed(6)
    cat = drafter.new_cache(r, "cpu", capacity=c)
    for buf in cat.k + cat.v:
        buf.copy_(torch.randn(buf.shape, generator=g))
    cat.length.copy_(torch.tensor([5, 16, 9]))
    room = DraftCache(
        k=[torch.cat([k, torch.randn(r, k.shape[1], block, k.shape[3], generator=g)], 2) for k in cat.k],
        v=[torch.cat([v, torch.randn(r, v.shape[1], block, v.shape[3], generator=g)], 2) for v in cat.v],
        length=cat.length.clone(),
        block_slots=block,
    )
    anchors, pos = torch.tensor([7, 8, 9]), cat.length.clone()
    u = torch.rand(r, drafter.gamma, generator=g)
    with torch.inference_mode():
        want = drafter.propose(cat, anchors, pos, Shared.of(t), 1.0, uniforms=u)
        got = drafter.propose(room, anchors, pos, Shared.of(t), 1.0, uniforms=u)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.probs, want.probs, atol=1e-6, rtol=1e-5)
        assert all(torch.equal(a[:, :, :c], b) for a, b in zip(room.k, cat.k))  # the context is untouched
        small = DraftCache(k=room.k, v=room.v, length=room.length, block_slots=block - 1)
        with pytest.raises(ValueError, match="block room"):
            drafter.propose(small, anchors, pos, Shared.of(t), 1.0, uniforms=u)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_context_write_on_cuda_matches_eager_inside_graphs(small_target):
    """The fused context write (``drafters.context_write``) compiled for CUDA: one graph for every
    rows count and width the engine meets, equal to the per-layer eager loop to bf16 rounding, and
    replayed from a captured CUDA graph (its in-place stores included) with fresh inputs."""
    from test_drafter_fast_paths import assert_same_cache, build, random_write
    from torch._dynamo.testing import CompileCounterWithBackend

    drafter = build(small_target, layers=3).to("cuda", torch.bfloat16)
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    drafter.compile_inference(compiler=lambda fn: torch.compile(fn, backend=counter))
    r_max, capacity = 8, 64
    ref = drafter.new_cache(r_max, "cuda", capacity=capacity)
    fused = drafter.new_cache(r_max, "cuda", capacity=capacity)
    g = torch.Generator().manual_seed(4)

    def inputs(r, w):
        taps, positions, rows = random_write(drafter, r_max, capacity, r, w, g)
        return taps.to("cuda", torch.bfloat16), positions.cuda(), rows.cuda()

    with torch.inference_mode():
        for r, w in [(1, 1), (1, 8), (4, 3), (8, 8), (2, 1), (8, 5)]:
            taps, positions, rows = inputs(r, w)
            drafter.write_context_reference(ref, taps, positions, rows)
            drafter.write_context(fused, taps, positions, rows)
            assert_same_cache(fused, ref, rtol=2e-2)
        static = inputs(4, 5)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            drafter.write_context(fused, *static)  # warm-up off the graph, as GraphBank does
        torch.cuda.current_stream().wait_stream(side)
        drafter.write_context_reference(ref, *static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            drafter.write_context(fused, *static)
        for _ in range(2):
            fresh = inputs(4, 5)
            for buf, new in zip(static, fresh):
                buf.copy_(new)
            graph.replay()
            drafter.write_context_reference(ref, *fresh)
            torch.cuda.synchronize()
            assert_same_cache(fused, ref, rtol=2e-2)
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "name,head,slots",
    [("dspark", "markov", "anchor"), ("dspark", "rnn", "masks"), ("dspark", "markov@2", "anchor"),
     ("dflash", "none", "anchor")],
)  # fmt: skip
def test_compiled_draft_step_on_cuda_matches_eager_inside_graphs(small_target, name, head, slots):
    """The compiled draft step on CUDA (``fullgraph``: a graph break raises; the Triton sampler
    between the graphs writing into the proposal's buffer; the layers attending with the cache
    kernel, the reference with SDPA): proposals equal the eager reference's
    for every rows count and drafted length, in two graphs per compiled function (one row, more
    rows), and a captured CUDA graph of the whole step replays them for fresh anchors, contexts
    and uniforms, as the fast engine's draft step does, sampled and greedy."""
    from test_drafter_fast_paths import (
        assert_same_proposal,
        compiled_draft_step_matches,
        compiled_graphs,
        reference_proposal,
        rows_of,
    )

    t = small_target.to("cuda")
    try:
        drafter, cache, anchors, u, shared, counter = compiled_draft_step_matches(
            t, name, head, slots, device="cuda", tol=1e-4
        )
        with torch.inference_mode():
            rows = rows_of(cache, 4)
            assert drafter._fused.attention_impl(rows) == "triton"  # the cache kernel, in the graphs
            static = (anchors.clone(), cache.length[:4].clone(), u.clone())
            for temperature in (1.0, 0.0):  # sampled, and greedy (argmax tokens, no probabilities)

                def step(temp=temperature):
                    return drafter.propose(rows, static[0], static[1], shared, temp, uniforms=static[2])

                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    step()
                    step()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = step()
                g = torch.Generator(device="cuda").manual_seed(9)
                for _ in range(3):
                    static[0].copy_(torch.randint(4, t.vocab_size, (4,), device="cuda", generator=g))
                    static[2].copy_(torch.rand(4, drafter.gamma, device="cuda", generator=g))
                    graph.replay()
                    want = reference_proposal(
                        drafter, rows, static[0], static[1], shared, temperature, uniforms=static[2]
                    )
                    assert_same_proposal(out, want, tol=1e-4, greedy=temperature == 0)
            assert counter.frame_count == compiled_graphs(name, head, "cuda")  # nothing compiled in capture
    finally:
        small_target.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stall_watch_reads_the_allocator_reserve():
    """The round's watch reads the CUDA allocator's reserve from its nested statistics (cheaper than
    torch.cuda.memory_reserved, which flattens them all): the same number, and growth shows."""
    from dspark.decoding.stall_watch import _reserved_mb

    torch.cuda.empty_cache()
    before = _reserved_mb()
    assert before == torch.cuda.memory_reserved() / 2**20
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # no free block cached: a cudaMalloc
    assert _reserved_mb() == torch.cuda.memory_reserved() / 2**20 >= before + 64
    del block


def test_greedy_steps_read_the_argmax_off_the_heads_own_logits(small_target, monkeypatch):
    """At T = 0 the target's steps take the argmax of the LM head's bf16 logits: no float32 copy of
    [rows, width, V] (at 256 x 8 rows of SmolLM2 a 402 MB write per verify step), and the tokens
    are those of the float32 logits (the upcast is exact)."""
    import copy

    from torch.profiler import profile

    from dspark.target import Target

    t = copy.deepcopy(small_target)
    t.model.to(torch.bfloat16)
    drafter = make_drafter(t, "dspark", "markov", gamma=3, seed=1)[0].to(torch.bfloat16)
    prompts = prompts_for(t, 2, seed=3)
    kw = dict(temperature=0.0, concurrency=2, buckets=(2,), eos_token_ids=(), max_new_tokens=8)
    with profile(record_shapes=True) as prof:
        res = FastEngine(t, drafter, **kw).generate(prompts)
    copies = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes]
    upcasts = [shape for shape in copies if len(shape) == 3 and shape[-1] == t.vocab_size]  # [rows, width, V]
    assert not upcasts, upcasts
    monkeypatch.setattr(t, "lm_head", lambda hidden, upcast=True: Target.lm_head(t, hidden, True))
    upcast = FastEngine(t, drafter, **kw).generate(prompts)
    assert [g.tokens for g in res.generations] == [g.tokens for g in upcast.generations]
