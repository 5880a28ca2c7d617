"""Import DeepSpec-released, z-lab-released and engine-layout DSpark/DFlash checkpoint folders into
our drafters.

A foreign folder is a Hugging Face style config.json (a Qwen3 config with `architectures` and
the drafter fields) plus model.safetensors (or a sharded index). `translate` turns its config into
ours, the slot convention included (DeepSpec's Qwen3DSparkModel drafts from the anchor's slot,
z-lab's DFlashDraftModel from the mask slots: `formats.slot_convention`); `read_state` renames the
tensors, checks them against the layout the config implies, and compares the shipped embed_tokens /
lm_head with the target's before dropping them (our drafters borrow the target's). Every difference
we cannot represent is refused, never approximated.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.io import read_json
from . import formats
from .formats import InteropError

BLOCK_ARCHS = ("Qwen3DSparkModel", "DFlashDraftModel")
EAGLE3_ARCHS = (
    "Qwen3Eagle3Model",
    "Gemma4Eagle3Model",
    "Eagle3DraftModel",
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLMEagle3",
)


def is_foreign(config: dict) -> bool:
    return "architectures" in config and "drafter" not in config


def _refuse(folder, why: str) -> InteropError:
    return InteropError(f"cannot import {folder}: {why}")


# Fields of later DFlash variants (z-lab's DFlash2 / Muse drafts, MiMo, Domino) that change the
# computation, with the value that means "off". Read in dflash_config first, then the top level.
_NEUTRAL = {
    "input_embedding_scale": 1.0,  # scales the block's token embeddings
    "output_multiplier": 1.0,  # scales the draft logits
    "logit_scale": 1.0,
    "final_logit_softcapping": None,  # soft-caps the draft logits
    "attention_sink_bias": False,  # a learned per-head attention sink
    "attention_value_scale": None,
    "partial_rotary_factor": 1.0,  # RoPE on part of each head
    "conv_kernel_size": 0,  # DFlash2's grouped dynamic convolutions
    "selector_rank": 0,  # DFlash2's candidate selector
    "projector_type": None,  # Domino and other projectors
}


def _unsupported_extras(ext: dict) -> list[str]:
    found = []
    for name, neutral in _NEUTRAL.items():
        value = formats.draft_field(ext, name)
        if value is None or value == neutral or (name == "projector_type" and value == "dflash"):
            continue
        if name == "final_logit_softcapping" and not float(value):
            continue
        found.append(f"{name}={value}")
    head_dim = ext.get("head_dim")
    if ext.get("v_head_dim") is not None and head_dim is not None and int(ext["v_head_dim"]) != int(head_dim):
        found.append(f"v_head_dim={ext['v_head_dim']}")
    return found


def translate(ext: dict, folder: str | Path = "<config>") -> dict:
    """A foreign config.json -> our checkpoint config (drafter / head / dims / target)."""
    arch = (ext.get("architectures") or [None])[0]
    if arch in EAGLE3_ARCHS:
        raise _refuse(
            folder,
            f"{arch} is an Eagle3 layout: its layer feeds [norm(embed); norm(feature)] (2·hidden) into "
            "q/k/v with the feature as residual, while our Eagle3 projects that concatenation to the "
            "hidden size first; the weights do not map. Evaluate a DSpark/DFlash release instead",
        )
    if arch not in BLOCK_ARCHS:
        hint = " (Gemma-4 drafters use sliding-window layers)" if arch and "Gemma" in arch else ""
        raise _refuse(folder, f"architecture {arch!r} is not supported{hint}; supported: {BLOCK_ARCHS}")
    if ext.get("speculators_model_type"):
        raise _refuse(
            folder,
            "a speculators-format checkpoint (speculators_model_type): its config nests the layer "
            "config and its tensor names were not mapped here; only the DeepSpec / z-lab / engine "
            "layouts (docs/formats.md) are read",
        )
    extras = _unsupported_extras(ext)
    if extras:
        raise _refuse(
            folder,
            f"{', '.join(extras)}: a DFlash variant whose computation our block drafter does not have "
            "(plain Qwen3 layers, unscaled embeddings and logits)",
        )
    dflash = ext.get("dflash_config") or {}
    if ext.get("is_causal") or dflash.get("causal") or dflash.get("use_swa"):
        raise _refuse(
            folder, "causal or sliding-window draft attention; our block attention is bidirectional"
        )
    kinds = set(ext.get("layer_types") or ["full_attention"])
    if not ext.get("layer_types") and ext.get("use_sliding_window") and ext.get("sliding_window"):
        kinds = {"sliding_attention"}  # a Qwen3 config then derives windowed layers itself
    if kinds != {"full_attention"}:
        raise _refuse(folder, f"layer_types {sorted(kinds)}: only full_attention layers are supported")
    if ext.get("attention_bias"):
        raise _refuse(folder, "attention_bias=true: our draft layers have no q/k/v/o biases")
    if ext.get("hidden_act", "silu") != "silu":
        raise _refuse(folder, f"hidden_act={ext['hidden_act']}: our MLP is SwiGLU (silu)")
    scaling = ext.get("rope_scaling") or {}
    params = ext.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" or params.get(
        "rope_type", "default"
    ) not in ("default",):
        raise _refuse(folder, f"RoPE scaling {scaling or params}: our draft layers use plain RoPE")
    if dflash.get("use_aux_hidden_state", ext.get("use_aux_hidden_state", True)) is False:
        raise _refuse(folder, "use_aux_hidden_state=false: our drafters always fuse target taps")
    vocab = int(ext["vocab_size"])
    if int(ext.get("draft_vocab_size") or vocab) != vocab:
        raise _refuse(
            folder,
            "a reduced draft vocabulary (d2t mapping) with its own trained LM head: ours draft through "
            "the target's LM head, whose rows a draft vocabulary picks when serving (draft_vocab=K)",
        )

    taps = formats.target_layer_ids(ext)
    for name in ("mask_token_id", "block_size"):  # the engines and z-lab read dflash_config first
        both = (dflash.get(name), ext.get(name))
        if None not in both and int(both[0]) != int(both[1]):
            raise _refuse(folder, f"dflash_config.{name}={both[0]} but the top-level {name}={both[1]}")
    mask, block = formats.draft_field(ext, "mask_token_id"), formats.draft_field(ext, "block_size")
    if mask is None or block is None:
        raise _refuse(folder, "config.json lacks mask_token_id or block_size")
    slots = formats.slot_convention(ext)
    if slots == "masks" and int(block) < 2:
        raise _refuse(folder, f"block_size={block} with the anchor as bonus token leaves no slot to draft")
    ours = ((ext.get("dspark_source") or {}).get("drafter") or {}).get("slots")
    if ours is not None and ours != slots:  # written by our export: the two must agree
        raise _refuse(
            folder,
            f"its config declares the {slots} slot convention (architectures / sample_from_anchor), but "
            f"the drafter it was exported from had slots={ours}: the folder was edited; re-export it",
        )
    rank = int(ext.get("markov_rank") or 0)
    head = "none"
    if rank > 0:
        kind = str(ext.get("markov_head_type", "vanilla")).lower()
        if kind not in formats.HEAD_FROM_EXT:
            raise _refuse(folder, f"markov_head_type={kind!r}: supported {tuple(formats.HEAD_FROM_EXT)}")
        head = formats.HEAD_FROM_EXT[kind]
    confidence = bool(ext.get("enable_confidence_head", False))
    with_markov = bool(ext.get("confidence_head_with_markov", False)) and confidence
    if with_markov and head == "none":
        raise _refuse(folder, "confidence_head_with_markov=true without a Markov head (markov_rank=0)")
    d = int(ext["hidden_size"])
    heads = int(ext["num_attention_heads"])
    theta = ext.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise _refuse(folder, "config.json lacks rope_theta")
    name = "dspark" if (head != "none" or confidence) else "dflash"
    return {
        "drafter": {
            "name": name,
            "block_size": int(block),  # slots, the anchor's included, in every layout
            "slots": slots,
            "num_layers": int(ext["num_hidden_layers"]),
            "hidden_size": None,
            "intermediate_size": None,
            "num_heads": None,
            "num_kv_heads": None,
            "head_dim": None,
            "rope_theta": None,
            "num_anchors": int(ext.get("num_anchors", 512)),
            "attention": "dense",
            "confidence": {"enabled": confidence, "use_prev_embedding": with_markov},
        },
        "head": {"name": head, "rank": rank if head != "none" else 0},
        "dims": {
            "hidden_size": d,
            "vocab_size": vocab,
            "num_taps": len(taps),
            "num_heads": heads,
            "num_kv_heads": int(ext.get("num_key_value_heads") or heads),
            "head_dim": int(ext.get("head_dim") or d // heads),
            "intermediate_size": int(ext["intermediate_size"]),
            "rope_theta": float(theta),
            "rms_norm_eps": float(ext.get("rms_norm_eps", 1e-6)),
            "mask_token_id": int(mask),
        },
        "target": {
            "name": ext.get("target_model_name_or_path") or "unknown",
            "layer_ids": taps,
            "num_layers": ext.get("num_target_layers", dflash.get("num_target_layers")),
            "hidden_size": d,
            "vocab_size": vocab,
            "mask_token_id": int(mask),
        },
        "imported_from": {
            "folder": str(folder),
            "architectures": ext.get("architectures"),
            "torch_dtype": ext.get("torch_dtype") or ext.get("dtype"),
        },
    }


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json names, each a file in
    ``folder`` (an index naming a path elsewhere is refused, never followed); never a pickle."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if not index.exists():
        raise InteropError(f"{folder} has config.json but no model.safetensors (or index); .bin is not read")
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InteropError(f"{index} has no weight_map: not a safetensors index")
    shards = sorted({str(v) for v in weight_map.values()})
    for name in shards:
        if Path(name).name != name or name in ("", ".", ".."):
            raise InteropError(f"{index} names the shard {name!r}, not a file in {folder}: refused")
    return [folder / name for name in shards]


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of weight_files(folder)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            state.update(load_file(path))
        except Exception as err:  # SafetensorError, or an OSError of a missing shard
            raise InteropError(f"{path} is not a readable safetensors file ({err})") from None
    return state


def _same_rows(name: str, theirs: torch.Tensor, ours: torch.Tensor, folder, target_name) -> None:
    if tuple(theirs.shape) != tuple(ours.shape):
        raise _refuse(
            folder, f"{name} has shape {tuple(theirs.shape)}, target {target_name} has {tuple(ours.shape)}"
        )
    rows = torch.linspace(0, ours.shape[0] - 1, steps=min(256, ours.shape[0])).long()
    a = theirs[rows].float()
    b = ours.detach()[rows.to(ours.device)].float().cpu()
    if (a - b).norm() > 1e-2 * b.norm() + 1e-6:  # bf16 rounding is ~4e-3 relative
        raise _refuse(
            folder,
            f"its {name} differs from target {target_name}'s: the drafter was trained for another "
            "target; evaluate it with the target it was released for",
        )


def read_state(folder: Path, config: dict, ext: dict, target=None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names, after checking them against the layout."""
    raw = read_tensors(folder)
    shipped = [k for k in formats.EMBED_KEYS if k in raw]
    shapes = formats.expected_shapes(ext, embeddings=False)
    for k in shipped:
        shapes[k] = (int(ext["vocab_size"]), int(ext["hidden_size"]))
    formats.check_keys(raw, shapes, f"cannot import {folder}: its tensors do not match its config.json")
    if target is not None:
        pairs = {"embed_tokens.weight": target.embedding_weight, "lm_head.weight": target.lm_head_weight}
        for k in shipped:
            _same_rows(k, raw[k], pairs[k], folder, target.name)
    return {formats.to_ours(k): v for k, v in raw.items() if k not in formats.EMBED_KEYS}
