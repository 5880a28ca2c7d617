"""DFlash's two slot conventions (issue 21) and z-lab's DFlash checkpoints.

  anchor  (DeepSpec)  block slot k predicts x_{a+k+1}: the anchor's slot drafts, γ = block_size;
  masks   (z-lab)     the anchor is the bonus token, mask slot k predicts x_{a+k}, γ = block_size-1.

A drafter trained in one convention and read in the other drafts every token one position off,
which stays lossless and only shows as collapsed acceptance, so these tests measure acceptance:
tiny DFlash drafters trained here in each convention accept well, read in the other convention they
do not (the check has power), and export -> import, z-lab's own layout included, keeps every round.
The z-lab layout is built here from its published config fields and tensor names (no download) and
checked against an independent re-implementation of z-lab's draft step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import load_group
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from dspark.checkpoints import export_drafter, load_drafter, read_drafter_spec, save_drafter
from dspark.config import check_drafter
from dspark.core.errors import ConfigError
from dspark.core.types import Shared, TargetDims
from dspark.decoding.engine import Engine
from dspark.decoding.fast_engine import FastEngine
from dspark.drafters import build_drafter
from dspark.interop import InteropError

BLOCK = 4  # slots per block in every drafter here


# ---- a target whose greedy text a one-layer drafter can learn in seconds -------------------------
@pytest.fixture(scope="module")
def cycle_target():
    """A 64-token Llama whose layers add nothing, with an LM head that makes the greedy successor of
    token x a fixed permutation succ(x) of tokens 4..63 (one cycle). So x_{a+1} and x_{a+2} always
    differ, and a drafter that reads the wrong slot for a position is rejected there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.target import Target

    v, d = 64, 64
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=v, hidden_size=d, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.5,
        max_position_embeddings=512,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    order = torch.randperm(v - 4, generator=torch.Generator().manual_seed(1)) + 4
    succ = torch.arange(v)
    succ[order] = order.roll(-1)
    succ[:4] = order[0]
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = model.model.embed_tokens.weight
        normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        head = torch.zeros(v, d)
        head[succ] = normed  # logit of succ(x) after x: |norm(e_x)|², the largest by far
        model.lm_head.weight.copy_(0.3 * head + 0.02 * torch.randn(v, d))
    t = Target(model, None, layer_ids=[0, 1, 2], mask_token_id=3, eos_token_ids=[], name="cycle-v64")
    t.succ = succ
    return t


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(4, 64, (3,), generator=g).tolist() for _ in range(n)]


def _drafter_cfg(slots: str, name: str = "dflash", head: str = "none"):
    dc, hc = load_group("drafter", name), load_group("head", head)
    dc.num_layers, dc.block_size, dc.slots, dc.attention = 1, BLOCK, slots, "dense"
    hc.rank = 16 if head != "none" else 0
    return dc, hc


def _flipped(slots: str) -> str:
    return "masks" if slots == "anchor" else "anchor"


def _tau(target, drafter, engine=Engine) -> tuple[float, list[tuple[int, int]], list[list[int]]]:
    """Greedy decoding of held-out prompts: τ, every round's (proposed, accepted), the tokens."""
    kw = dict(temperature=0.0, concurrency=4, eos_token_ids=(), max_new_tokens=40, seed=0)
    if engine is FastEngine:
        kw["buckets"] = (1, 2, 4)
    res = engine(target, drafter, **kw).generate(_prompts(8, seed=99))
    return res.tau, [(r.proposed, r.accepted) for r in res.rounds], [g.tokens for g in res.generations]


def _train(t, dc, hc, loss: str = "dflash"):
    """A drafter trained 150 steps on the target's greedy text (≈3 s)."""
    from dspark.module import DraftingModule
    from dspark.objectives import LossWeights

    reqs = _prompts(16, seed=0)
    res = Engine(t, None, temperature=0.0, concurrency=16, eos_token_ids=(), max_new_tokens=44).generate(reqs)
    ids = torch.tensor([p + g.tokens for p, g in zip(reqs, res.generations)])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids).bool(),
    }
    torch.manual_seed(0)
    drafter = build_drafter(TargetDims.of(t), dc, hc)
    module = DraftingModule(t, drafter, LossWeights.from_cfg(load_group("loss", loss)), {}, num_anchors=16)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        step_loss = module._step(batch, g)["loss"]
        opt.zero_grad()
        step_loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def trained(cycle_target, tmp_path_factory):
    """One tiny DFlash trained per convention on the target's greedy text, saved."""
    root = tmp_path_factory.mktemp("trained")
    out = {}
    for slots in ("anchor", "masks"):
        dc, hc = _drafter_cfg(slots)
        save_drafter(_train(cycle_target, dc, hc), root / slots, dc, hc, cycle_target.describe())
        out[slots] = root / slots
    return out


def _read_as(folder: Path, slots: str, dest: Path) -> Path:
    """A copy of our checkpoint `folder` whose config reads the same weights in `slots`."""
    dest.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["drafter"]["slots"] = slots
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    return dest


# ---- the conventions themselves ------------------------------------------------------------------
@pytest.mark.parametrize("name,head", [("dflash", "none"), ("dspark", "markov")])
def test_conventions_read_different_slots_of_one_backbone(cycle_target, name, head):
    """Same weights, same block of BLOCK slots: the masks drafter's drafts are the anchor drafter's
    slots 1.. (its anchor slot drafts nothing), and both label draft k with x_{a+k}."""
    t = cycle_target
    shared = Shared.of(t)
    drafters = {}
    for slots in ("anchor", "masks"):
        dc, hc = _drafter_cfg(slots, name, head)
        torch.manual_seed(0)
        drafters[slots] = build_drafter(TargetDims.of(t), dc, hc).eval()
    a, m = drafters["anchor"], drafters["masks"]
    m.load_state_dict(a.state_dict())
    assert (a.gamma, m.gamma, a.block_size, m.block_size) == (BLOCK, BLOCK - 1, BLOCK, BLOCK)
    ids = torch.tensor(_prompts(2, seed=4))[:, :4].repeat(1, 4)
    step = t(ids)
    lm = torch.ones_like(ids).bool()
    anchors = torch.tensor([[2, 5, 9], [1, 6, 10]])
    with torch.no_grad():
        oa = a.train_forward(step.taps, ids, lm, anchors, shared)
        om = m.train_forward(step.taps, ids, lm, anchors, shared)
    assert om.features.shape[2] == BLOCK - 1
    if name == "dflash":  # (DSpark's head features also depend on the previous token, the same)
        torch.testing.assert_close(om.features, oa.features[:, :, 1:])
    assert torch.equal(om.labels, oa.labels[..., : BLOCK - 1])  # x_{a+1}..: the same targets
    assert torch.equal(om.target_positions, oa.target_positions[..., : BLOCK - 1])
    if name == "dflash":
        props = {}
        for slots, d in drafters.items():
            cache = d.new_cache(2, "cpu")
            pos = torch.arange(8).expand(2, -1)
            d.extend_context(cache, step.taps[:, :8], pos, torch.ones(2, 8).bool(), ids[:, 1:9], shared)
            props[slots] = d.propose(cache, ids[:, 8], torch.tensor([8, 8]), shared, 1.0, torch.Generator())
        torch.testing.assert_close(props["masks"].probs, props["anchor"].probs[:, 1:])


def test_masks_training_attention_flex_equals_dense(cycle_target):
    """The packed training mask covers the whole block (anchor slot included) in both backends."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    t = cycle_target
    dc, hc = _drafter_cfg("masks")
    torch.manual_seed(0)
    drafter = build_drafter(TargetDims.of(t), dc, hc).eval()
    ids = torch.tensor(_prompts(2, seed=4))[:, :4].repeat(1, 8)
    step = t(ids)
    anchors, lm, outs = torch.tensor([[3, 8, 20], [6, 11, -1]]), torch.ones_like(ids).bool(), {}
    for backend in ("dense", "flex"):
        drafter.attention = backend
        with torch.no_grad():
            outs[backend] = drafter.train_forward(step.taps, ids, lm, anchors, Shared.of(t)).features
    torch.testing.assert_close(outs["flex"], outs["dense"], rtol=1e-4, atol=1e-5)


def test_slots_config_is_checked(cycle_target, tmp_path):
    dc, hc = _drafter_cfg("bonus")
    with pytest.raises(ConfigError, match="drafter.slots=.?bonus.?: must be one of .anchor., .masks."):
        check_drafter(dc, hc)
    dc, hc = _drafter_cfg("masks")
    dc.block_size = 1
    with pytest.raises(ConfigError, match="drafts no token"):
        check_drafter(dc, hc)
    dc.block_size = BLOCK
    save_drafter(
        build_drafter(TargetDims.of(cycle_target), dc, hc), tmp_path / "m", dc, hc, {"layer_ids": [0, 1, 2]}
    )
    assert read_drafter_spec(tmp_path / "m").gamma == BLOCK - 1  # evaluate's checks see γ, not the block


# ---- trained drafters: acceptance has power over the convention ---------------------------------
def test_reading_the_other_convention_collapses_acceptance(cycle_target, trained, tmp_path):
    """Each convention, trained, accepts most of its block; the same weights read in the other
    convention (every draft one position off, as the engines read our DFlash exports before issue
    21) accept almost nothing. τ counts the bonus token, so 1.0 means nothing accepted."""
    t = cycle_target
    for slots, folder in trained.items():
        ours, _ = load_drafter(folder, t)
        other, _ = load_drafter(_read_as(folder, _flipped(slots), tmp_path / f"{slots}-flipped"), t)
        tau, _, _ = _tau(t, ours)
        tau_other, _, _ = _tau(t, other)
        print(f"{slots}: τ {tau:.2f} (of {ours.gamma + 1}), read as {_flipped(slots)}: τ {tau_other:.2f}")
        assert tau > 0.6 * (ours.gamma + 1), (slots, tau)  # measured: anchor 4.06 of 5, masks 3.17 of 4
        assert tau_other < 1.5 and tau - tau_other > 1.5, (slots, tau, tau_other)  # measured ≤ 1.27


def test_export_import_keeps_every_round(cycle_target, trained, tmp_path):
    """Every format that takes a convention gives back the same rounds (hence the same τ) on the plain
    and the fast engine; the formats that would read it shifted refuse it."""
    t = cycle_target
    takes = {"anchor": ("hf",), "masks": ("vllm", "sglang")}
    for slots, folder in trained.items():
        ours, _ = load_drafter(folder, t)
        want = _tau(t, ours)
        assert _tau(t, ours, FastEngine) == want  # the fast engine serves both conventions alike
        for fmt in ("hf", "vllm", "sglang"):
            dest = tmp_path / f"{slots}-{fmt}"
            if fmt not in takes[slots]:
                with pytest.raises(InteropError, match="one position late|anchor's slot"):
                    export_drafter(folder, dest, fmt, target=t)
                continue
            back, config = load_drafter(export_drafter(folder, dest, fmt, target=t), t)
            assert config["drafter"]["slots"] == slots
            assert _tau(t, back) == want, (slots, fmt)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_greedy_rounds_of_the_fused_draft_step_accept_as_the_plain_engine(cycle_target, trained, kind):
    """Trained drafters, so greedy rounds accept whole and partial blocks: the fast engine's greedy
    rounds (the fused draft step's argmax tokens without probabilities, the target's argmax,
    ``greedy_verify``) keep every round of the plain engine's probability verification."""
    t = cycle_target
    if kind == "dflash":
        drafter, _ = load_drafter(trained["anchor"], t)
    else:
        drafter = _train(t, *_drafter_cfg("anchor", "dspark", "markov"), loss="dspark")
    want = _tau(t, drafter)
    drafter.compile_inference(compiler=None)  # the fused paths, run eagerly
    got = _tau(t, drafter, FastEngine)
    assert got == want
    accepted = [a for _, a in want[1]]
    assert want[0] > 1.5 and max(accepted) >= 2, want[:2]  # drafts accepted, several in a round
    assert len(set(accepted)) >= 2  # rounds of different acceptance: the comparison saw more than one case


# ---- z-lab's layout ------------------------------------------------------------------------------
# z-lab/Qwen3-8B-DFlash-b16's tensor names (a Qwen3 decoder stack plus fc / hidden_norm; no
# embed_tokens or lm_head: both come from the target) against our parameter names.
ZLAB_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "norm.weight": "norm.weight",
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def _our_name(theirs: str) -> str:
    if theirs.startswith("layers."):
        i, _, rest = theirs[len("layers.") :].partition(".")
        return f"layers.{i}.{ZLAB_NAMES[rest]}"
    return ZLAB_NAMES[theirs]


def zlab_folder(target, folder: Path, block_size: int = 16, layers: int = 2, ours=None, **over) -> dict:
    """A checkpoint in the layout of z-lab/Qwen3-8B-DFlash-b16 (config.json fields as published for
    z-lab's Qwen3 DFlash drafters, sized to `target`; bf16 model.safetensors): random weights, or
    the state dict `ours` of one of our drafters renamed by ZLAB_NAMES. Returns the tensors."""
    d, nq, nkv, hd = target.hidden_size, target.num_heads, target.num_kv_heads, target.head_dim
    inner, taps = target.intermediate_size, list(target.layer_ids)
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block_size,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": target.mask_token_id, "target_layer_ids": taps},
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": d,
        "initializer_range": 0.02,
        "intermediate_size": inner,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": nq,
        "num_hidden_layers": layers,
        "num_key_value_heads": nkv,
        "num_target_layers": target.num_layers,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": target.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": target.vocab_size,
        **over,
    }
    shapes = {"fc.weight": (d, len(taps) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    per_layer = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (nq * hd, d),
        "self_attn.k_proj.weight": (nkv * hd, d),
        "self_attn.v_proj.weight": (nkv * hd, d),
        "self_attn.o_proj.weight": (d, nq * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (inner, d),
        "mlp.up_proj.weight": (inner, d),
        "mlp.down_proj.weight": (d, inner),
    }
    shapes |= {f"layers.{i}.{k}": s for i in range(layers) for k, s in per_layer.items()}
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name, shape in shapes.items():
        if ours is not None:
            value = ours[_our_name(name)].detach().float()
        elif name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            value = 0.3 * torch.randn(shape, generator=g) / shape[-1] ** 0.5
        assert tuple(value.shape) == shape, name
        tensors[name] = value.to(torch.bfloat16).contiguous()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def zlab_block_logits(tensors: dict, config: dict, taps: torch.Tensor, anchor: int, target) -> torch.Tensor:
    """z-lab's draft forward for one request, re-implemented from its modeling code's description:
    context = hidden_norm(fc(taps)) at positions 0..C-1, each layer's keys/values from [context;
    input_layernorm(block)] with k_norm then RoPE, the block [anchor, mask × (B-1)] at positions
    C..C+B-1 attending to everything (no mask), final norm, the target's LM head. Returns the
    logits of all B slots [B, V]; z-lab drafts x_{a+1}..x_{a+B-1} from slots 1..B-1 (`[1:]`)."""
    w = {k: v.float() for k, v in tensors.items()}
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    b, mask = config["block_size"], config["dflash_config"]["mask_token_id"]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rotate(x, pos):  # x [T, heads, hd]; the half-split rotary layout of Qwen3
        angles = pos.double()[:, None] * theta ** (-torch.arange(0, hd, 2).double() / hd)
        cos, sin = angles.cos().float().repeat(1, 2)[:, None], angles.sin().float().repeat(1, 2)[:, None]
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    c = taps.shape[0]
    context = rms(taps.float() @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = target.embedding_weight.detach().float()[[anchor] + [mask] * (b - 1)]
    q_pos, k_pos = torch.arange(c, c + b), torch.arange(c + b)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(b, nq, hd), w[p + "self_attn.q_norm.weight"])
        src = torch.cat([context, h])
        k = rms(
            (src @ w[p + "self_attn.k_proj.weight"].T).view(c + b, nkv, hd), w[p + "self_attn.k_norm.weight"]
        )
        v = (src @ w[p + "self_attn.v_proj.weight"].T).view(c + b, nkv, hd)
        q, k = rotate(q, q_pos), rotate(k, k_pos)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd**0.5, dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(b, nq * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        up = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + up @ w[p + "mlp.down_proj.weight"].T
    hidden = rms(x, w["norm.weight"])
    return hidden @ target.lm_head_weight.detach().float().T


def test_zlab_checkpoint_loads_and_drafts_in_its_convention(tiny_target, tmp_path):
    """The synthetic z-lab folder loads with no embeddings shipped, every tensor lands where its name
    says, and our draft step gives z-lab's draft distributions for the mask slots: B-1 drafts."""
    t = tiny_target
    tensors = zlab_folder(t, tmp_path / "zl", block_size=BLOCK)
    config = json.loads((tmp_path / "zl" / "config.json").read_text())
    drafter, ours = load_drafter(tmp_path / "zl", t)
    assert ours["drafter"]["name"] == "dflash" and ours["drafter"]["slots"] == "masks"
    assert ours["drafter"]["block_size"] == BLOCK and drafter.gamma == BLOCK - 1
    state = drafter.state_dict()
    assert len(state) == len(tensors)
    for theirs, value in tensors.items():
        assert torch.equal(state[_our_name(theirs)], value.float()), theirs

    ids = torch.randint(100, 4000, (1, 11), generator=torch.Generator().manual_seed(5))
    taps = t(ids).taps
    c = 10  # context 0..9, anchor ids[10] at position 10
    shared = Shared.of(t)
    cache = drafter.new_cache(1, "cpu")
    drafter.extend_context(
        cache, taps[:, :c], torch.arange(c)[None], torch.ones(1, c).bool(), ids[:, 1 : c + 1], shared
    )
    with torch.no_grad():
        prop = drafter.propose(
            cache, ids[:, c], torch.tensor([c]), shared, 1.0, torch.Generator().manual_seed(0)
        )
    block = torch.softmax(zlab_block_logits(tensors, config, taps[0, :c], int(ids[0, c]), t), dim=-1)
    assert prop.tokens.shape == (1, BLOCK - 1)
    torch.testing.assert_close(prop.probs[0], block[1:], rtol=1e-4, atol=1e-6)  # z-lab's drafts
    # The anchor convention would draft from slots 0..B-2: other distributions (the check has power).
    assert (prop.probs[0] - block[:-1]).abs().max() > 1e-2


def test_zlab_layout_of_a_trained_drafter_keeps_acceptance(cycle_target, trained, tmp_path):
    """The masks-trained drafter written in z-lab's exact layout (by the helper above, not by our
    export) gives the same rounds; the anchor-trained one written there (what our vLLM/SGLang export
    of a DFlash used to be) reads shifted, as the engines read it, and accepts almost nothing."""
    t = cycle_target
    masks, _ = load_drafter(trained["masks"], t)
    zlab_folder(t, tmp_path / "masks", block_size=BLOCK, layers=1, ours=masks.state_dict())
    back, _ = load_drafter(tmp_path / "masks", t)
    # bf16 storage moves the weights a little; the greedy rounds survive it on this target
    tau, rounds, _ = _tau(t, back)
    assert (tau, rounds) == _tau(t, masks)[:2]
    anchor, _ = load_drafter(trained["anchor"], t)
    zlab_folder(t, tmp_path / "anchor", block_size=BLOCK, layers=1, ours=anchor.state_dict())
    late, _ = load_drafter(tmp_path / "anchor", t)
    assert _tau(t, late)[0] < 1.5 < _tau(t, anchor)[0] - 1.5


@pytest.mark.parametrize("engine", ["plain", "fast"])
def test_evaluate_runs_a_zlab_checkpoint(tiny_target, tmp_path, engine):
    """python -m dspark.evaluate on the z-lab folder with the default policy: every round proposes
    and verifies the drafter's whole block, block_size-1 tokens."""
    from hydra import compose, initialize_config_module

    from dspark.evaluate import run

    zlab_folder(tiny_target, tmp_path / "zl", block_size=BLOCK)
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "gsm8k.jsonl").write_text(json.dumps({"turns": ["What is 2+3?"]}) + "\n")
    out = tmp_path / "out"
    with initialize_config_module("dspark.conf", version_base="1.3"):
        cfg = compose(
            "evaluate",
            [
                "target=tiny", f"drafter_dir={tmp_path / 'zl'}", "benchmarks=[gsm8k]",
                f"benchmark_dir={bench}",
                "max_prompts=1", "max_new_tokens=12", "concurrency=1", "temperature=0", "progress=false",
                f"engine={engine}", f"out_dir={out}",
            ],
        )  # fmt: skip
    assert OmegaConf.select(cfg, "policy.gamma") is None
    results = run(cfg)
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds and all(r["drafted"] == r["proposed"] == BLOCK - 1 for r in rounds)
    assert "gsm8k" in results["benchmarks"]


def test_zlab_variants_we_cannot_run_are_refused(tiny_target, tmp_path):
    """Later z-lab / engine DFlash variants change the computation; each is refused by name."""
    base = {"mask_token_id": 16, "target_layer_ids": [0, 1, 2]}
    cases = {
        "output_multiplier": {"dflash_config": {**base, "output_multiplier": 0.2}},
        "input_embedding_scale": {"input_embedding_scale": 2.0},
        "attention_sink_bias": {"dflash_config": {**base, "attention_sink_bias": True}},
        "final_logit_softcapping": {"final_logit_softcapping": 20.0},
        "layer_types": {"layer_types": ["sliding_attention"] * 2, "sliding_window": 2048},
        "sliding_attention": {"layer_types": None, "use_sliding_window": True, "sliding_window": 2048},
        "dflash_config.block_size": {"dflash_config": {**base, "block_size": 8}},
        "DFlash2DraftModel": {"architectures": ["DFlash2DraftModel"]},
    }
    for i, (what, over) in enumerate(cases.items()):
        folder = tmp_path / str(i)
        zlab_folder(tiny_target, folder, block_size=BLOCK, **over)
        with pytest.raises(InteropError, match=what):
            load_drafter(folder, tiny_target)


def test_an_edited_export_is_refused(cycle_target, trained, tmp_path):
    """Our export records the drafter it came from; a config whose convention was edited away from it
    (say sample_from_anchor flipped by hand) is refused rather than read shifted."""
    out = export_drafter(trained["masks"], tmp_path / "v", "vllm")
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["sample_from_anchor"] = True
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError, match="the folder was edited"):
        load_drafter(out, cycle_target)
    assert set(load_file(out / "model.safetensors")) >= {"fc.weight", "layers.0.self_attn.q_norm.weight"}
