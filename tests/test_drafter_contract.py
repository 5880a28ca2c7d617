"""The drafter seam: every drafter keeps the one interface the engines, training and checkpoints
use (capabilities instead of names, one ``propose`` signature), the registry finds drafters by
name, and a checkpoint's spec says the same as the drafter it builds, without loading weights."""

from __future__ import annotations

import pytest
import torch
from conftest import load_group
from test_drafters import VARIANTS, make

from dspark.checkpoints import cast_drafter, load_drafter, read_drafter_spec, save_drafter
from dspark.core.errors import ConfigError
from dspark.core.types import Shared
from dspark.drafters import Drafter, drafter_class, drafter_names, register
from dspark.drafters.registry import static_cache_drafters

# Every registered drafter keeps the contract: the paper's three with their heads, and any added later
# (built from its conf/drafter/<name>.yaml without a head).
CASES = VARIANTS + [(name, "none") for name in drafter_names() if name not in {n for n, _ in VARIANTS}]
KNOWN = {"dflash": (False, True), "dspark": (True, True), "eagle3": (False, True)}  # confidence, static


def test_registry_finds_every_drafter_by_its_config_name():
    assert set(drafter_names()) >= {"dflash", "dspark", "eagle3"}
    for name in drafter_names():
        cls = drafter_class(name)
        assert issubclass(cls, Drafter) and cls.kind == name
    static = {n for n in drafter_names() if drafter_class(n).supports_static_cache}
    assert set(static_cache_drafters()) == static
    assert {"dflash", "dspark", "eagle3"} <= set(static_cache_drafters())
    with pytest.raises(ConfigError, match=r"drafter.name 'medusa' is not one of \("):
        drafter_class("medusa")
    with pytest.raises(TypeError, match="Drafter subclass"):
        register("plain")(torch.nn.Linear)
    with pytest.raises(ValueError, match="two drafters registered as 'dflash'"):
        register("dflash")(type("Copy", (drafter_class("dflash"),), {}))


@pytest.mark.parametrize("name,head", CASES)
def test_spec_from_config_matches_the_built_drafter(tiny_target, tmp_path, name, head):
    drafter = make(tiny_target, name, head)
    save_drafter(drafter, tmp_path, *_cfg(name, head), tiny_target.describe())
    (tmp_path / "model.safetensors").unlink()  # the spec reads the config alone
    spec = read_drafter_spec(tmp_path)
    assert (spec.kind, spec.head, spec.gamma) == (name, head, drafter.gamma)
    assert spec.has_confidence == drafter.has_confidence
    assert spec.supports_static_cache == drafter.supports_static_cache
    assert KNOWN.get(name, (spec.has_confidence, spec.supports_static_cache)) == (
        spec.has_confidence,
        spec.supports_static_cache,
    )
    assert spec.label == (name if head == "none" else f"{name}-{head}")


def _cfg(name, head):
    d, h = load_group("drafter", name), load_group("head", head)
    d.num_layers, d.block_size = 1, 4
    if head != "none":
        h.rank = 32
    return d, h


def _with_context(target, name, head, seed, r=3, ctx=6):
    """A drafter whose cache holds ``ctx`` random context positions of ``r`` requests, and the
    anchors and positions to propose from."""
    drafter = make(target, name, head).eval()
    shared, g = Shared.of(target), torch.Generator().manual_seed(seed)
    taps = torch.randn(r, ctx, target.tap_dim, generator=g)
    nxt = torch.randint(100, 5000, (r, ctx), generator=g)
    cache = drafter.new_cache(r, "cpu")
    pos = torch.arange(ctx).expand(r, -1)
    drafter.extend_context(cache, taps, pos, torch.ones(r, ctx, dtype=torch.bool), nxt, shared)
    return drafter, shared, cache, nxt[:, -1], torch.full((r,), ctx)


@pytest.mark.parametrize("name,head", CASES)
def test_propose_takes_uniforms_in_place_of_the_generator(tiny_target, name, head):
    """One signature for all: explicit uniforms reproduce the generator's draws exactly."""
    drafter, shared, cache, anchors, apos = _with_context(tiny_target, name, head, seed=1)
    r, hot = anchors.shape[0], 50.0  # hot: flat enough that u matters
    drawn = drafter.propose(cache, anchors, apos, shared, hot, torch.Generator().manual_seed(7))
    u = torch.rand(r, drafter.gamma, generator=torch.Generator().manual_seed(7))
    given = drafter.propose(cache, anchors, apos, shared, hot, uniforms=u)
    assert torch.equal(drawn.tokens, given.tokens) and torch.equal(drawn.probs, given.probs)
    other = drafter.propose(cache, anchors, apos, shared, hot, uniforms=1 - u)
    assert not torch.equal(other.tokens, given.tokens)


@pytest.mark.parametrize("name,head", CASES)
def test_static_cache_hook_equals_the_growing_cache(tiny_target, name, head):
    """``write_context`` (``commit_context`` for a drafter whose context needs the next tokens) into a
    preallocated cache gives the proposals ``extend_context`` gives."""
    drafter = make(tiny_target, name, head).eval()
    if not drafter.supports_static_cache:
        with pytest.raises(NotImplementedError, match="engine=plain"):
            drafter.write_context(drafter.new_cache(1, "cpu"), None, None, None)
        return
    shared, r, ctx = Shared.of(tiny_target), 2, 5
    g = torch.Generator().manual_seed(2)
    taps = torch.randn(r, ctx, tiny_target.tap_dim, generator=g)
    nxt = torch.randint(100, 5000, (r, ctx), generator=g)
    pos = torch.arange(ctx).expand(r, -1)
    grown = drafter.new_cache(r, "cpu")
    drafter.extend_context(grown, taps, pos, torch.ones(r, ctx, dtype=torch.bool), nxt, shared)
    static = drafter.new_cache(r + 1, "cpu", capacity=16)
    rows = slice(1, None)  # rows 1.., as the engine's row0
    view = type(static)(
        k=[k[rows] for k in static.k],
        v=[v[rows] for v in static.v],
        length=static.length[rows],
        extra={key: t[rows] for key, t in static.extra.items()},
    )
    if drafter.context_needs_tokens:
        drafter.commit_context(view, taps, pos, nxt, torch.full((r,), ctx), shared)
        with pytest.raises(NotImplementedError, match="commit_context"):
            drafter.write_context(static, taps, pos, torch.tensor([1, 2]))
    else:
        drafter.write_context(static, taps, pos, torch.tensor([1, 2]))
    static.length[1:] = ctx
    u = torch.rand(r, drafter.gamma, generator=g)
    a = drafter.propose(grown, nxt[:, -1], torch.full((r,), ctx), shared, 1.0, uniforms=u)
    b = drafter.propose(view, nxt[:, -1], torch.full((r,), ctx), shared, 1.0, uniforms=u)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.probs, b.probs)


@pytest.mark.parametrize("name,head", CASES)
def test_draft_len_samples_the_first_positions_only(tiny_target, name, head):
    """``draft_len`` cuts a proposal to its first positions, drawn exactly as in the whole block
    (same uniforms): what an engine verifies of a shorter draft is what the drafter would have
    proposed there anyway."""
    drafter, shared, cache, anchors, apos = _with_context(tiny_target, name, head, seed=4)
    r = anchors.shape[0]
    u = torch.rand(r, drafter.gamma, generator=torch.Generator().manual_seed(5))
    full = drafter.propose(cache, anchors, apos, shared, 50.0, uniforms=u)
    for n in range(1, drafter.gamma + 1):
        cut = drafter.propose(cache, anchors, apos, shared, 50.0, uniforms=u, draft_len=n)
        assert cut.tokens.shape == (r, n) and cut.probs.shape[:2] == (r, n)
        assert torch.equal(cut.tokens, full.tokens[:, :n])
        torch.testing.assert_close(cut.probs, full.probs[:, :n])
        if full.confidence_logits is not None:
            torch.testing.assert_close(cut.confidence_logits, full.confidence_logits[:, :n])
    with pytest.raises(ValueError, match="draft_len"):
        drafter.propose(cache, anchors, apos, shared, 1.0, uniforms=u, draft_len=drafter.gamma + 1)


@pytest.mark.parametrize("name,head", [c for c in CASES if drafter_class(c[0]).supports_static_cache])
def test_short_draft_runs_the_lm_head_as_one_gemm(tiny_target, name, head):
    """A draft of n < γ positions multiplies its rows by the LM head in one GEMM: over a strided
    [R, n, d] view matmul falls back to R batched GEMMs, each reading the whole head (on the H200
    one position at R = 256 then cost more than all seven)."""
    from torch.profiler import ProfilerActivity, profile

    drafter, shared, cache, anchors, apos = _with_context(tiny_target, name, head, seed=4)
    u = torch.rand(anchors.shape[0], drafter.gamma, generator=torch.Generator().manual_seed(5))
    ops = {}
    for n in (drafter.gamma, 2):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            drafter.propose(cache, anchors, apos, shared, 1.0, uniforms=u, draft_len=n)
        ops[n] = {e.key for e in prof.key_averages()}
    # bmm is what the strided view falls back to: absent from both, so a short draft costs no more.
    assert "aten::mm" in ops[2] and "aten::bmm" not in ops[2] - ops[drafter.gamma]


def test_a_cast_copy_of_a_drafter_serves_the_same_weights(tiny_target, tmp_path):
    """``cast_drafter``: the weights stored in bfloat16 (half the bytes to carry), every other file
    copied; loaded back, each weight is the original rounded to bfloat16, so a drafter served in a
    bf16 target's precision drafts alike from either folder."""
    from safetensors.torch import load_file

    drafter = make(tiny_target, "dspark", "markov")
    save_drafter(drafter, tmp_path / "f32", *_cfg("dspark", "markov"), tiny_target.describe())
    (tmp_path / "f32" / "calibration_report.json").write_text('{"ece": 0.01}')
    out = cast_drafter(tmp_path / "f32", tmp_path / "bf16", "bfloat16")
    assert (out / "calibration_report.json").read_text() == '{"ece": 0.01}'
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    ours, theirs = (load_drafter(tmp_path / d)[0].state_dict() for d in ("f32", "bf16"))
    assert ours.keys() == theirs.keys()
    for k, v in ours.items():
        assert torch.equal(theirs[k], v.to(torch.bfloat16).to(v.dtype)), k
    with pytest.raises(ValueError, match="dtype='int8'"):
        cast_drafter(tmp_path / "f32", tmp_path / "x", "int8")
    with pytest.raises(ValueError, match="overwrite its source"):
        cast_drafter(tmp_path / "f32", tmp_path / "f32", "bfloat16")


def test_a_checkpoint_keeps_the_head_s_first_position(tiny_target, tmp_path):
    """``head.first_position`` travels in the checkpoint's config: loaded back, the drafter leaves
    the same positions to the backbone; a config written before the key existed loads with the
    head on every position (the paper's)."""
    import json

    drafter_cfg, head_cfg = _cfg("dspark", "markov")
    head_cfg.first_position = 2
    drafter = make(tiny_target, "dspark", "markov@2")
    save_drafter(drafter, tmp_path, drafter_cfg, head_cfg, tiny_target.describe())
    assert load_drafter(tmp_path)[0].head_skip == 1
    config = json.loads((tmp_path / "config.json").read_text())
    del config["head"]["first_position"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_drafter(tmp_path)[0].head_skip == 0
