"""The serving engines' drafter checkpoint layouts, written down once (sources: docs/formats.md).

All three external layouts (DeepSpec `save_pretrained`, vLLM, SGLang) share one Qwen3-style key
scheme for the DFlash/DSpark backbone; they differ in the `architectures` name, where the tap
layers and the mask token sit in config.json, whether the target's embedding / LM head are
shipped, which sequential heads the loader can build, and which block slot drafts which token
(`slot_convention`: DeepSpec's Qwen3DSparkModel drafts from the anchor's slot, the engines'
DFlashDraftModel from the mask slots). This module owns

  * the rename between our parameter names and theirs (`to_external` / `to_ours`),
  * the key list and shapes each loader requires, derived from the external config alone (so a
    wrong rename is caught, not mirrored),
  * the slot convention a config declares, and the engine-side settings a folder needs, and
  * the config.json each format writes.
"""

from __future__ import annotations

import re

from ..core.errors import DrafterCheckpointError

FORMATS = ("hf", "vllm", "sglang")
# Our drafters whose weights are the engines' Qwen3 block layout (the others are refused on export).
BLOCK_DRAFTERS = ("dspark", "dflash")

# Our head names <-> DeepSpec `markov_head_type` values.
HEAD_TO_EXT = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}
HEAD_FROM_EXT = {v: k for k, v in HEAD_TO_EXT.items()}


class InteropError(DrafterCheckpointError):
    """A checkpoint that cannot be converted faithfully; the message names the problem and the fix."""


class ExportError(InteropError):
    pass


# ---- parameter names ----------------------------------------------------------------------------
# (our suffix inside layers.{i}., their suffix inside layers.{i}.)
_LAYER = (
    ("input_norm.weight", "input_layernorm.weight"),
    ("post_norm.weight", "post_attention_layernorm.weight"),
    ("attn.q_proj.weight", "self_attn.q_proj.weight"),
    ("attn.k_proj.weight", "self_attn.k_proj.weight"),
    ("attn.v_proj.weight", "self_attn.v_proj.weight"),
    ("attn.o_proj.weight", "self_attn.o_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_norm.weight"),
    ("attn.k_norm.weight", "self_attn.k_norm.weight"),
    ("mlp.gate_proj.weight", "mlp.gate_proj.weight"),
    ("mlp.up_proj.weight", "mlp.up_proj.weight"),
    ("mlp.down_proj.weight", "mlp.down_proj.weight"),
)
_TOP = (
    ("fc.weight", "fc.weight"),
    ("hidden_norm.weight", "hidden_norm.weight"),
    ("norm.weight", "norm.weight"),
    ("head.W1.weight", "markov_head.markov_w1.weight"),
    ("head.W2.weight", "markov_head.markov_w2.weight"),
    ("head.gate.weight", "markov_head.gate_proj.weight"),
    ("head.gate.bias", "markov_head.gate_proj.bias"),
    ("head.update.weight", "markov_head.joint_proj.weight"),
    ("head.update.bias", "markov_head.joint_proj.bias"),
    ("confidence.proj.weight", "confidence_head.proj.weight"),
    ("confidence.proj.bias", "confidence_head.proj.bias"),
)
# Target parts DeepSpec's save_pretrained ships (frozen copies of the target's); we borrow them.
EMBED_KEYS = ("embed_tokens.weight", "lm_head.weight")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def _rename(name: str, table, src: int) -> str | None:
    m = _LAYER_RE.match(name)
    if m:
        for pair in _LAYER:
            if pair[src] == m.group(2):
                return f"layers.{m.group(1)}.{pair[1 - src]}"
        return None
    for pair in table:
        if pair[src] == name:
            return pair[1 - src]
    return None


def to_external(name: str) -> str | None:
    """Our parameter name -> the engines' name (None: no counterpart)."""
    return _rename(name, _TOP, 0)


def to_ours(name: str) -> str | None:
    """The engines' parameter name -> ours (None: no counterpart in our drafters)."""
    return _rename(name, _TOP, 1)


# ---- what each loader requires ------------------------------------------------------------------
def expected_shapes(ext: dict, embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a loader of this external config reads, with its shape, from the config alone."""
    d, v = int(ext["hidden_size"]), int(ext["vocab_size"])
    nq = int(ext["num_attention_heads"])
    hd = int(ext.get("head_dim") or d // nq)
    nkv, inner = int(ext["num_key_value_heads"]), int(ext["intermediate_size"])
    taps = len(target_layer_ids(ext))
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (d, taps * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    for i in range(int(ext["num_hidden_layers"])):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (nq * hd, d),
                p + "self_attn.k_proj.weight": (nkv * hd, d),
                p + "self_attn.v_proj.weight": (nkv * hd, d),
                p + "self_attn.o_proj.weight": (d, nq * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inner, d),
                p + "mlp.up_proj.weight": (inner, d),
                p + "mlp.down_proj.weight": (d, inner),
            }
        )
    r = int(ext.get("markov_rank") or 0)
    if r > 0:
        shapes["markov_head.markov_w1.weight"] = (v, r)
        shapes["markov_head.markov_w2.weight"] = (v, r)
        kind = ext.get("markov_head_type")
        if kind == "gated":
            shapes["markov_head.gate_proj.weight"] = (r, d + r)
            shapes["markov_head.gate_proj.bias"] = (r,)
        elif kind == "rnn":
            shapes["markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
            shapes["markov_head.joint_proj.bias"] = (3 * r,)
    if ext.get("enable_confidence_head"):
        width = d + (r if ext.get("confidence_head_with_markov") else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    if embeddings:
        shapes["embed_tokens.weight"] = (v, d)
        shapes["lm_head.weight"] = (v, d)
    return shapes


def check_keys(state: dict, shapes: dict[str, tuple[int, ...]], what: str, exc=InteropError) -> None:
    """Refuse a state dict with a missing, unexpected or misshapen tensor, naming each one."""
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes))
    wrong = sorted(k for k in set(state) & set(shapes) if tuple(state[k].shape) != shapes[k])
    problems = []
    if missing:
        problems.append(f"missing {missing[:8]}{' …' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}")
    if wrong:
        problems.append(
            "wrong shape " + ", ".join(f"{k} {tuple(state[k].shape)} != {shapes[k]}" for k in wrong[:4])
        )
    if problems:
        raise exc(f"{what}: " + "; ".join(problems))


def target_layer_ids(ext: dict) -> list[int]:
    """Tap layers in DeepSpec/DFlash numbering (l = output of decoder layer l, -1 = embeddings), the
    same as ours; vLLM's `eagle_aux_hidden_state_layer_ids` are these plus one."""
    ids = ext.get("target_layer_ids")
    if ids is None:
        ids = (ext.get("dflash_config") or {}).get("target_layer_ids")
    if ids is None and ext.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = [int(i) - 1 for i in ext["eagle_aux_hidden_state_layer_ids"]]
    if not ids:
        raise InteropError(
            "config.json names no tap layers (target_layer_ids / dflash_config.target_layer_ids)"
        )
    return [int(i) for i in ids]


# ---- slot conventions ---------------------------------------------------------------------------
def draft_field(ext: dict, name: str, default=None):
    """A drafter field of a foreign config: dflash_config first, then the top level (as the engines
    and z-lab's loader read it)."""
    nested = ext.get("dflash_config") or {}
    return nested[name] if nested.get(name) is not None else ext.get(name, default)


def slot_convention(ext: dict) -> str:
    """Which block slot a foreign config drafts from: "anchor" (slot k predicts x_{a+k+1}; DeepSpec's
    Qwen3DSparkModel, vLLM's DSpark unless sample_from_anchor=false) or "masks" (the anchor is the
    bonus token and mask slot k predicts x_{a+k}; z-lab's, vLLM's and SGLang's DFlashDraftModel,
    which vLLM refuses to run with sample_from_anchor=true)."""
    arch = (ext.get("architectures") or [None])[0]
    declared = draft_field(ext, "sample_from_anchor")
    if declared is None:
        return "masks" if arch == "DFlashDraftModel" else "anchor"
    return "anchor" if bool(declared) else "masks"


def serving_settings(fmt: str, arch: str, block_size: int, gamma: int) -> dict:
    """What the engine must be told besides the folder: neither engine takes the drafted length from
    block_size alone (vLLM never does; docs/formats.md §1b)."""
    if fmt == "vllm":
        method = "dspark" if arch == "Qwen3DSparkModel" else "dflash"
        return {"method": method, "num_speculative_tokens": gamma}
    if fmt == "sglang":
        if arch == "Qwen3DSparkModel":  # its verify window counts the anchor: γ + 1
            return {"speculative_algorithm": "DSPARK", "speculative_num_draft_tokens": gamma + 1}
        return {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": block_size}
    return {}


# ---- config.json per format ---------------------------------------------------------------------
REQUIRED_FIELDS = {
    # Qwen3DSparkModel.__init__ asserts these (DeepSpec deepspec/modeling/dspark/qwen3/modeling.py).
    "hf": ("architectures", "target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head",
           "markov_rank", "block_size", "num_hidden_layers", "hidden_size", "vocab_size"),
    "vllm": ("architectures", "mask_token_id", "block_size", "num_hidden_layers", "hidden_size",
             "vocab_size", "eagle_aux_hidden_state_layer_ids"),
    "sglang": ("architectures", "dflash_config", "block_size", "num_hidden_layers", "hidden_size",
               "vocab_size"),
}  # fmt: skip


def architecture(fmt: str, dspark: bool) -> str:
    if fmt == "hf" or dspark:
        return "Qwen3DSparkModel"  # DeepSpec writes it for DFlash too (markov_rank=0, no confidence)
    return "DFlashDraftModel"


def build_config(fmt: str, *, shape, dims, taps: list[int], num_target_layers: int | None,
                 block_size: int, slots: str, num_layers: int, head: str, rank: int, confidence: bool,
                 conf_with_markov: bool, num_anchors: int, dtype: str,
                 target_name: str | None) -> dict:  # fmt: skip
    """The external config.json (a Qwen3 config plus the drafter fields its loader reads).
    block_size counts the block's slots, the anchor's included, in every format; `sample_from_anchor`
    states the slot convention explicitly (vLLM reads it; the others ignore it)."""
    dspark = head != "none" or confidence
    arch = architecture(fmt, dspark)
    gamma = block_size - (slots == "masks")
    ext = {
        "architectures": [arch],
        "model_type": "qwen3",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": dims.vocab_size,
        "draft_vocab_size": dims.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": 131072,
        "torch_dtype": dtype,
        "block_size": block_size,
        "sample_from_anchor": slots == "anchor",
        "mask_token_id": dims.mask_token_id,
        "target_layer_ids": list(taps),
        "num_anchors": num_anchors,
        "markov_rank": rank if head != "none" else 0,
        "enable_confidence_head": bool(confidence),
    }
    if num_target_layers is not None:
        ext["num_target_layers"] = int(num_target_layers)
    if head != "none":
        ext["markov_head_type"] = HEAD_TO_EXT[head]
    if confidence:
        ext["confidence_head_with_markov"] = bool(conf_with_markov)
    if target_name and target_name != "unknown":
        ext["target_model_name_or_path"] = target_name
    if fmt in ("vllm", "sglang"):
        ext["dflash_config"] = {"mask_token_id": dims.mask_token_id, "target_layer_ids": list(taps)}
        if fmt == "sglang" or arch == "DFlashDraftModel":
            ext["dflash_config"]["block_size"] = block_size
        if arch == "DFlashDraftModel":  # vLLM's DFlash speculator reads it here (and refuses true)
            ext["dflash_config"]["sample_from_anchor"] = slots == "anchor"
    if fmt == "vllm":
        ext["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in taps]
    serving = serving_settings(fmt, arch, block_size, gamma)
    if serving:  # ours, for the reader: the engine takes these on its command line, not from here
        ext["dspark_serving"] = serving
    return ext


def check_fields(ext: dict, fmt: str) -> None:
    missing = [f for f in REQUIRED_FIELDS[fmt] if ext.get(f) is None]
    if missing:
        raise ExportError(f"format={fmt}: config.json lacks {missing}, which the {fmt} loader reads")
