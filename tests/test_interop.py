"""Interop (issues 12, 21): export to the engines' layouts, import DeepSpec-format checkpoints.

Round trip export -> import must reproduce the drafter bit for bit (logits, confidences, samples),
its slot convention included; an export whose keys do not match the engine's layout is refused
before anything is written, and so is a drafter the format cannot express, with a format that does
take it; a checkpoint built here from DeepSpec's documented key names and config fields loads and
runs. (The slot conventions' acceptance and z-lab's layout: test_dflash_slots.py.)"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import load_group
from safetensors.torch import load_file, save_file

from dspark.checkpoints import export_drafter, load_drafter, read_drafter_config, refusal, save_drafter
from dspark.core.errors import DrafterCheckpointError
from dspark.core.types import Shared, TargetDims
from dspark.drafters import build_drafter
from dspark.interop import ExportError, InteropError, formats

GAMMA, RANK = 4, 16


def _save(target, folder, name="dspark", head="markov", confidence=True, with_prev=True, slots="anchor"):
    dc, hc = load_group("drafter", name), load_group("head", head)
    dc.num_layers, dc.block_size, dc.slots = 2, GAMMA, slots
    dc.confidence.enabled, dc.confidence.use_prev_embedding = confidence, with_prev
    hc.rank = RANK if head != "none" else 0
    torch.manual_seed(0)
    drafter = build_drafter(TargetDims.of(target), dc, hc)
    with torch.no_grad():  # every parameter non-trivial, so a misplaced tensor changes the outputs
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_drafter(drafter, folder, dc, hc, target.describe())
    return folder


def _outputs(drafter, target, seed=0):
    """Teacher-forced logits + confidences and a sampled proposal (the exact probabilities)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 4000, (2, 20), generator=g)
    lm = torch.ones_like(ids, dtype=torch.bool)
    step = target(ids)
    shared = Shared.of(target)
    anchors = torch.tensor([[3, 8, 12], [2, 9, 14]])
    with torch.no_grad():
        out = drafter.train_forward(step.taps, ids, lm, anchors, shared)
        logits = out.logits(shared.lm_weight)
        cache = drafter.new_cache(2, "cpu")
        pos = torch.arange(10).expand(2, -1)
        drafter.extend_context(
            cache, step.taps[:, :10], pos, torch.ones(2, 10, dtype=torch.bool), ids[:, 1:11], shared
        )
        prop = drafter.propose(
            cache, ids[:, 10], torch.tensor([10, 10]), shared, 1.0, torch.Generator().manual_seed(1)
        )
    return logits, out.confidence_logits, prop


# name: (drafter, head, confidence, confidence reads the Markov embedding, slots)
VARIANTS = {
    "dflash": ("dflash", "none", False, False, "anchor"),
    "dflash-masks": ("dflash", "none", False, False, "masks"),
    "markov": ("dspark", "markov", True, True, "anchor"),
    "markov-masks": ("dspark", "markov", True, True, "masks"),
    "gated": ("dspark", "gated", True, True, "anchor"),
    "rnn": ("dspark", "rnn", True, False, "anchor"),
    "markov-noconf": ("dspark", "markov", False, False, "anchor"),
}
# The formats that load each variant and read it as we do (docs/formats.md §3).
TAKES = {
    "dflash": ("hf",),  # the engines' DFlashDraftModel drafts from the mask slots
    "dflash-masks": ("vllm", "sglang"),  # DeepSpec's Qwen3DSparkModel drafts from the anchor's slot
    "markov": ("hf", "vllm", "sglang"),
    "markov-masks": ("vllm",),  # vLLM's DSpark with sample_from_anchor=false
    "gated": ("hf", "sglang"),  # vLLM builds only the vanilla Markov head
    "rnn": ("hf", "sglang"),
    "markov-noconf": ("hf", "vllm"),  # SGLang builds the confidence head regardless
}
CASES = [(v, f) for v in VARIANTS for f in TAKES[v]]
REFUSED = [(v, f) for v in VARIANTS for f in formats.FORMATS if f not in TAKES[v]]


@pytest.mark.parametrize("variant,fmt", CASES)
def test_round_trip_identical(tiny_target, tmp_path, variant, fmt):
    src = _save(tiny_target, tmp_path / "ours", *VARIANTS[variant])
    out = export_drafter(src, tmp_path / fmt, fmt, target=tiny_target)
    ext = json.loads((out / "config.json").read_text())
    dspark, slots = VARIANTS[variant][0] == "dspark", VARIANTS[variant][4]
    gamma = GAMMA - (slots == "masks")
    arch = "Qwen3DSparkModel" if fmt == "hf" or dspark else "DFlashDraftModel"
    assert ext["architectures"] == [arch]
    assert ext["target_layer_ids"] == tiny_target.layer_ids and ext["block_size"] == GAMMA
    assert ext["sample_from_anchor"] == (slots == "anchor")  # the convention, stated explicitly
    if arch == "DFlashDraftModel":
        assert ext["dflash_config"]["sample_from_anchor"] is False  # where vLLM's DFlash reads it
    if fmt == "vllm":
        assert ext["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in tiny_target.layer_ids]
        # vLLM drafts num_speculative_tokens, whatever block_size says
        assert ext["dspark_serving"]["num_speculative_tokens"] == gamma
    if fmt == "sglang":  # its verify window counts the anchor
        assert ext["dspark_serving"]["speculative_num_draft_tokens"] == gamma + 1
    keys = set(load_file(out / "model.safetensors"))
    assert ("lm_head.weight" in keys) == (fmt == "hf") and "layers.1.self_attn.k_norm.weight" in keys

    a, ca = load_drafter(src, tiny_target)
    b, cb = load_drafter(out, tiny_target)
    assert cb["drafter"]["name"] == ca["drafter"]["name"]
    assert cb["head"]["name"] == (ca["head"]["name"] if dspark else "none")
    assert cb["drafter"]["slots"] == slots and b.gamma == a.gamma == gamma
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    la, conf_a, pa = _outputs(a, tiny_target)
    lb, conf_b, pb = _outputs(b, tiny_target)
    assert torch.equal(la, lb)
    assert (conf_a is None) == (not a.has_confidence) and (conf_b is None) == (conf_a is None)
    assert pa.tokens.shape == (2, gamma)
    if conf_a is not None:
        assert torch.equal(conf_a, conf_b)
        assert torch.equal(pa.confidence_logits, pb.confidence_logits)
    assert torch.equal(pa.tokens, pb.tokens) and torch.equal(pa.probs, pb.probs)


def test_round_trip_bf16_and_reexport(tiny_target, tmp_path):
    """dtype=bfloat16 stores bf16; importing and re-exporting it (hf -> sglang) changes nothing more."""
    src = _save(tiny_target, tmp_path / "ours")
    hf = export_drafter(src, tmp_path / "hf", "hf", target=tiny_target, dtype="bfloat16")
    sg = export_drafter(hf, tmp_path / "sg", "sglang")
    t_hf, t_sg = load_file(hf / "model.safetensors"), load_file(sg / "model.safetensors")
    assert t_hf["fc.weight"].dtype == torch.bfloat16 and t_sg["fc.weight"].dtype == torch.bfloat16
    for k, v in t_sg.items():
        assert torch.equal(v, t_hf[k]), k
    a, _ = load_drafter(hf, tiny_target)
    b, _ = load_drafter(sg, tiny_target)
    assert torch.equal(_outputs(a, tiny_target)[0], _outputs(b, tiny_target)[0])


def test_export_refuses_misnamed_key(tiny_target, tmp_path, monkeypatch):
    src = _save(tiny_target, tmp_path / "ours")
    bad = tuple(
        (o, "self_attn.k_layernorm.weight") if o == "attn.k_norm.weight" else (o, t)
        for o, t in formats._LAYER
    )
    monkeypatch.setattr(formats, "_LAYER", bad)
    with pytest.raises(ExportError, match=r"missing .*self_attn\.k_norm.*unexpected .*k_layernorm"):
        export_drafter(src, tmp_path / "vllm", "vllm")
    assert not (tmp_path / "vllm" / "model.safetensors").exists()

    monkeypatch.undo()
    top = tuple((o, "markov_head.w2.weight") if o == "head.W2.weight" else (o, t) for o, t in formats._TOP)
    monkeypatch.setattr(formats, "_TOP", top)
    with pytest.raises(ExportError, match=r"markov_w2"):
        export_drafter(src, tmp_path / "hf", "hf", target=tiny_target)
    assert not (tmp_path / "hf").exists()


def test_key_check_names_missing_and_misshapen(tiny_target, tmp_path):
    src = _save(tiny_target, tmp_path / "ours")
    out = export_drafter(src, tmp_path / "sg", "sglang")
    ext = json.loads((out / "config.json").read_text())
    state = load_file(out / "model.safetensors")
    shapes = formats.expected_shapes(ext, embeddings=False)
    formats.check_keys(state, shapes, "ok")  # the real export passes
    dropped = {k: v for k, v in state.items() if k != "confidence_head.proj.bias"}
    with pytest.raises(ExportError, match="missing.*confidence_head.proj.bias"):
        formats.check_keys(dropped, shapes, "x", exc=ExportError)
    state["fc.weight"] = state["fc.weight"][:, :-1]
    with pytest.raises(InteropError, match=r"wrong shape fc.weight"):
        formats.check_keys(state, shapes, "x")
    del ext["dflash_config"]
    with pytest.raises(ExportError, match="dflash_config"):
        formats.check_fields(ext, "sglang")


@pytest.mark.parametrize("variant,fmt", REFUSED)
def test_export_refuses_what_the_format_cannot_express(tiny_target, tmp_path, variant, fmt):
    """Refused before anything is written, naming the formats that do take the drafter."""
    src = _save(tiny_target, tmp_path / "ours", *VARIANTS[variant])
    with pytest.raises(ExportError, match=re.escape(f"Export format={'|'.join(TAKES[variant])} instead")):
        export_drafter(src, tmp_path / fmt, fmt, target=tiny_target)
    assert not (tmp_path / fmt).exists()


def _named_formats(message: str) -> list[str]:
    m = re.search(r"Export format=([a-z|]+) instead", message)
    return m.group(1).split("|") if m else []


def test_every_refusal_names_a_format_that_works(tiny_target, tmp_path):
    """Over every drafter the block layouts could hold (drafter × head × confidence × slots × taps):
    a refused format's message names exactly the formats that take the drafter, or says none does;
    no message ever points at a format that refuses the same drafter (issue 21: vLLM's head=none
    refusal once suggested SGLang, which refuses it too)."""
    base = read_drafter_config(_save(tiny_target, tmp_path / "base"))
    seen_none = 0
    for name in ("dflash", "dspark"):
        for head in ("none", "markov", "gated", "rnn") if name == "dspark" else ("none",):
            for conf in (True, False) if name == "dspark" else (False,):
                for slots in ("anchor", "masks"):
                    for taps in ([0, 1, 2], [-1, 1, 2]):
                        config = {
                            **base,
                            "drafter": {**base["drafter"], "name": name, "slots": slots,
                                        "confidence": {"enabled": conf, "use_prev_embedding": False}},
                            "head": {"name": head, "rank": 8 if head != "none" else 0},
                            "target": {**base["target"], "layer_ids": taps},
                        }  # fmt: skip
                        reasons = {f: refusal(f, config) for f in formats.FORMATS}
                        works = [f for f, why in reasons.items() if why is None]
                        for fmt, why in reasons.items():
                            if why is None:
                                continue
                            assert _named_formats(why) == works, (name, head, conf, slots, taps, fmt, why)
                            if not works:
                                seen_none += 1
                                assert "No export format takes this drafter" in why
    assert seen_none  # e.g. an SGLang-only DSpark (gated head, slots=masks) has nowhere to go


def test_refusals_name_the_problem(tiny_target, tmp_path):
    eagle = _save(tiny_target, tmp_path / "eagle", "eagle3", "none", False, False)
    with pytest.raises(ExportError, match="Eagle3.*No export format takes this drafter"):
        export_drafter(eagle, tmp_path / "x", "vllm")
    gated = read_drafter_config(_save(tiny_target, tmp_path / "gated", "dspark", "gated"))
    assert "head=markov" in refusal("vllm", gated) and refusal("sglang", gated) is None
    gated["target"]["layer_ids"] = [-1, 1, 2]
    assert "[0, num_target_layers)" in refusal("sglang", gated)
    headless = read_drafter_config(_save(tiny_target, tmp_path / "hl", "dspark", "none", True, False))
    assert "markov_rank > 0" in refusal("sglang", headless)
    # vLLM's refusal of the same drafter points at hf, the one format that takes it, not at sglang
    assert "Export format=hf instead" in refusal("vllm", headless)
    quiet = read_drafter_config(_save(tiny_target, tmp_path / "q", "dspark", "markov", False, False))
    assert "whatever enable_confidence_head says" in refusal("sglang", quiet)
    anchor = read_drafter_config(_save(tiny_target, tmp_path / "a", "dflash", "none", False, False))
    assert "one position late" in refusal("vllm", anchor) and "one position late" in refusal("sglang", anchor)
    assert "drafter.slots=masks" in refusal("vllm", anchor)
    late = read_drafter_config(_save(tiny_target, tmp_path / "late", "dspark", "gated"))
    late["head"]["first_position"] = 2  # no engine's head skips a position
    assert all("head.first_position=2" in refusal(f, late) for f in formats.FORMATS)
    masks = read_drafter_config(_save(tiny_target, tmp_path / "m", "dflash", "none", False, False, "masks"))
    assert "anchor's slot" in refusal("hf", masks) and "drafter.slots=anchor" in refusal("hf", masks)
    other = {**headless, "drafter": {**headless["drafter"], "name": "medusa"}}  # a drafter added later
    assert "no counterpart in the engines' layouts" in refusal("vllm", other)
    with pytest.raises(ExportError, match="target="):
        export_drafter(tmp_path / "gated", tmp_path / "y", "hf")  # hf ships embeddings: needs the target


# ---- DeepSpec layout, built from its documented names (docs/formats.md) ---------------------------
def _deepspec_folder(target, folder, head="vanilla", arch="Qwen3DSparkModel", embeddings=True, **over):
    d, v, hd = target.hidden_size, target.vocab_size, target.head_dim
    nq, nkv, inner, r = target.num_heads, target.num_kv_heads, target.intermediate_size, 8
    config = {  # what deepspec/modeling/dspark/qwen3/config.py build_draft_config writes
        "architectures": [arch],
        "model_type": "qwen3",
        "hidden_size": d,
        "intermediate_size": inner,
        "num_attention_heads": nq,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "num_hidden_layers": 2,
        "num_target_layers": target.num_layers,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "vocab_size": v,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention", "full_attention"],
        "block_size": GAMMA,
        "mask_token_id": target.mask_token_id,
        "target_layer_ids": list(target.layer_ids),
        "num_anchors": 512,
        "enable_confidence_head": head is not None,
        "markov_rank": r if head else 0,
        **({"markov_head_type": head, "confidence_head_with_markov": True} if head else {}),
        **over,
    }
    g = torch.Generator().manual_seed(3)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)

    t = {"fc.weight": rnd(d, len(target.layer_ids) * d), "hidden_norm.weight": rnd(d), "norm.weight": rnd(d)}
    for i in range(2):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": rnd(d),
            p + "post_attention_layernorm.weight": rnd(d),
            p + "self_attn.q_proj.weight": rnd(nq * hd, d),
            p + "self_attn.k_proj.weight": rnd(nkv * hd, d),
            p + "self_attn.v_proj.weight": rnd(nkv * hd, d),
            p + "self_attn.o_proj.weight": rnd(d, nq * hd),
            p + "self_attn.q_norm.weight": rnd(hd),
            p + "self_attn.k_norm.weight": rnd(hd),
            p + "mlp.gate_proj.weight": rnd(inner, d),
            p + "mlp.up_proj.weight": rnd(inner, d),
            p + "mlp.down_proj.weight": rnd(d, inner),
        }
    if head:
        t |= {"markov_head.markov_w1.weight": rnd(v, r), "markov_head.markov_w2.weight": rnd(v, r)}
        t |= {"confidence_head.proj.weight": rnd(1, d + r), "confidence_head.proj.bias": rnd(1)}
        if head == "rnn":
            t |= {
                "markov_head.joint_proj.weight": rnd(3 * r, 2 * r + d),
                "markov_head.joint_proj.bias": rnd(3 * r),
            }
    if embeddings:  # DeepSpec saves frozen copies of the target's
        t |= {
            "embed_tokens.weight": target.embedding_weight.detach().to(torch.bfloat16),
            "lm_head.weight": target.lm_head_weight.detach().to(torch.bfloat16),
        }
    folder.mkdir(parents=True)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder, t


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_deepspec_checkpoint_loads_and_runs(tiny_target, tmp_path, head):
    folder, tensors = _deepspec_folder(tiny_target, tmp_path / "ds", head)
    drafter, config = load_drafter(folder, tiny_target)
    assert config["drafter"]["name"] == "dspark" and config["head"]["name"] == formats.HEAD_FROM_EXT[head]
    ours = drafter.state_dict()
    # Where each documented tensor must land in our drafter.
    for theirs, mine in {
        "layers.1.self_attn.k_norm.weight": "layers.1.attn.k_norm.weight",
        "layers.0.post_attention_layernorm.weight": "layers.0.post_norm.weight",
        "markov_head.markov_w2.weight": "head.W2.weight",
        "confidence_head.proj.weight": "confidence.proj.weight",
        "hidden_norm.weight": "hidden_norm.weight",
    }.items():
        assert torch.equal(ours[mine], tensors[theirs].float()), theirs
    assert len(ours) == len(tensors) - 2  # everything but the target's embed_tokens / lm_head
    logits, conf, prop = _outputs(drafter, tiny_target)
    assert logits.shape[:3] == (2, 3, GAMMA) and conf.shape == (2, 3, GAMMA)
    assert prop.tokens.shape == (2, GAMMA) and prop.confidence_logits.shape == (2, GAMMA)
    assert torch.allclose(prop.probs.sum(-1), torch.ones(2, GAMMA))
    # And it exports back to an engine layout unchanged.
    out = export_drafter(folder, tmp_path / "sg", "sglang")
    back = load_file(out / "model.safetensors")
    for k, v in back.items():
        assert torch.equal(v.float(), tensors[k].float()), k


def test_engine_style_dflash_loads(tiny_target, tmp_path):
    """A DFlashDraftModel folder with dflash_config (the vLLM/SGLang layout, no embeddings) reads in
    its own slot convention: the anchor is the bonus token, so a block of GAMMA slots drafts GAMMA-1
    (z-lab's exact layout: test_dflash_slots.py)."""
    folder, _ = _deepspec_folder(
        tiny_target,
        tmp_path / "zl",
        head=None,
        arch="DFlashDraftModel",
        embeddings=False,
        target_layer_ids=None,
        mask_token_id=None,
        dflash_config={
            "mask_token_id": tiny_target.mask_token_id,
            "target_layer_ids": list(tiny_target.layer_ids),
        },
    )
    drafter, config = load_drafter(folder, tiny_target)
    assert config["drafter"]["name"] == "dflash" and config["target"]["layer_ids"] == tiny_target.layer_ids
    assert config["drafter"]["slots"] == "masks" and drafter.gamma == GAMMA - 1
    _, conf, prop = _outputs(drafter, tiny_target)
    assert conf is None and prop.tokens.shape == (2, GAMMA - 1)


def test_deepspec_mismatches_are_refused(tiny_target, tmp_path):
    folder, tensors = _deepspec_folder(tiny_target, tmp_path / "a")
    other = tensors | {"lm_head.weight": tensors["lm_head.weight"] + 1.0}
    save_file(other, str(folder / "model.safetensors"))
    with pytest.raises(InteropError, match="lm_head.weight differs from target tiny"):
        load_drafter(folder, tiny_target)
    save_file(tensors | {"markov_head.extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(InteropError, match=r"unexpected \['markov_head.extra.weight'\]"):
        load_drafter(folder, tiny_target)
    shifted, _ = _deepspec_folder(
        tiny_target, tmp_path / "b", target_layer_ids=[0, 1, 3][: len(tiny_target.layer_ids)]
    )
    with pytest.raises(DrafterCheckpointError, match="set target.layer_ids"):
        load_drafter(shifted, tiny_target)
    eagle, _ = _deepspec_folder(tiny_target, tmp_path / "c", arch="Qwen3Eagle3Model")
    with pytest.raises(InteropError, match="Eagle3 layout"):
        load_drafter(eagle)
    swa, _ = _deepspec_folder(tiny_target, tmp_path / "d", layer_types=["sliding_attention"] * 2)
    with pytest.raises(InteropError, match="layer_types"):
        read_drafter_config(swa)
    reduced, _ = _deepspec_folder(tiny_target, tmp_path / "e", draft_vocab_size=tiny_target.vocab_size // 2)
    with pytest.raises(InteropError, match=r"its own trained LM head: .*\(draft_vocab=K\)"):
        read_drafter_config(reduced)


def test_evaluate_and_export_cli_accept_deepspec_folder(tiny_target, tmp_path):
    """The entry points' config checks read a DeepSpec folder through the same translation."""
    from hydra import compose, initialize_config_module

    from dspark import export as export_cli
    from dspark.config import check_export
    from dspark.evaluation import check_config

    folder, _ = _deepspec_folder(tiny_target, tmp_path / "ds")
    with initialize_config_module("dspark.conf", version_base="1.3"):
        ev = compose("evaluate", [f"drafter_dir={folder}", "target=tiny", "policy=threshold"])
        ex = compose("export", [f"drafter_dir={folder}", "format=vllm", f"out={tmp_path / 'v'}"])
        ex_hf = compose("export", [f"drafter_dir={folder}", "format=hf", f"out={tmp_path / 'h'}"])
    spec = check_config(ev)  # confidence policies are allowed: the import has a confidence head
    assert spec.gamma == GAMMA and spec.has_confidence
    out = export_cli.run(ex)  # vllm: no target needed
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    with pytest.raises(Exception, match="target="):
        check_export(ex_hf)


def test_export_warns_of_a_drafter_trained_over_a_draft_vocabulary(tiny_target, tmp_path, caplog):
    """A drafter trained with draft_vocab=K (its config records K) leaves as a whole-vocabulary one,
    with a warning naming K; one trained over the whole vocabulary leaves without it."""
    from hydra import compose, initialize_config_module

    from dspark import export as export_cli

    folder = _save(tiny_target, tmp_path / "d")
    for name, size in (("whole", None), ("reduced", 64)):
        if size:
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "draft_vocab": size}))
        with initialize_config_module("dspark.conf", version_base="1.3"):
            cfg = compose("export", [f"drafter_dir={folder}", "format=vllm", f"out={tmp_path / name}"])
        caplog.clear()
        with caplog.at_level("WARNING", logger="dspark.export"):
            export_cli.run(cfg)
        warned = [r.getMessage() for r in caplog.records if "draft_vocab" in r.getMessage()]
        assert len(warned) == (1 if size else 0)
        assert not size or "its 64 most frequent answer tokens" in warned[0]
