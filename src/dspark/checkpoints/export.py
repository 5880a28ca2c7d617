"""Export one of our drafter checkpoints as a Hugging Face style folder (config.json +
model.safetensors) in the layout a serving engine's DSpark/DFlash loader reads.

Formats (sources and the field-by-field layout: docs/formats.md):
  hf      DeepSpec's `save_pretrained` layout (architectures=["Qwen3DSparkModel"] for DSpark and
          DFlash alike); ships the target's embed_tokens / lm_head like DeepSpec does.
  vllm    vLLM's qwen3_dspark (Qwen3DSparkModel) / qwen3_dflash (DFlashDraftModel) loaders; the
          embedding and LM head are shared from the target, so they are left out.
  sglang  SGLang's dspark (Qwen3DSparkModel) / dflash (DFlashDraftModel) loaders; likewise.

Anything the target engine cannot represent faithfully is refused with the reason and a fix.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..artifacts import DrafterFolder
from ..core.io import atomic_save_safetensors, atomic_write_json
from ..drafters.base import layer_shape
from ..interop import formats
from ..interop.formats import ExportError
from .store import load_drafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINE = {"hf": "DeepSpec (transformers from_pretrained)", "vllm": "vLLM", "sglang": "SGLang"}


def refusal(fmt: str, config: dict) -> str | None:
    """Why `config` (our checkpoint's config.json) cannot be exported as `fmt`, or None."""
    d = config["drafter"]
    head = (config.get("head") or {}).get("name", "none") or "none"
    taps = (config.get("target") or {}).get("layer_ids") or []
    if fmt not in formats.FORMATS:
        return f"format={fmt} is not one of {formats.FORMATS}"
    if d["name"] == "eagle3":
        return (
            "our Eagle3 drafter is not the Eagle3 the engines load: ours projects [norm(embed); "
            "norm(feature)] to the hidden size (in_proj) and runs a standard pre-norm layer on it, "
            "while vLLM/SGLang/DeepSpec Eagle3 feed the 2·hidden concatenation straight into q/k/v "
            "and keep the feature as the residual (and vLLM's Llama Eagle3 has no q/k norm). Export a "
            "DSpark or DFlash drafter instead, or retrain Eagle3 in the engines' layout"
        )
    if d["name"] not in formats.BLOCK_DRAFTERS:
        return f"drafter {d['name']} has no counterpart in the engines' layouts {formats.BLOCK_DRAFTERS}"
    if fmt == "vllm" and d["name"] == "dspark" and head not in ("markov",):
        return (
            f"vLLM's Qwen3DSparkModel builds only the vanilla Markov head (markov_w1/markov_w2); this "
            f"drafter uses head={head}: export format=sglang or format=hf, or train with head=markov"
        )
    if fmt == "sglang" and d["name"] == "dspark" and head == "none":
        return (
            "SGLang's DSpark loader requires markov_rank > 0 and this DSpark drafter has no sequential "
            "head: train with head=markov|gated|rnn, or use drafter=dflash"
        )
    if fmt == "sglang" and any(int(t) < 0 for t in taps):
        return (
            f"SGLang accepts target_layer_ids only in [0, num_target_layers); this drafter taps {taps} "
            "(-1 = the embeddings): retrain with non-negative target.layer_ids, or export format=hf|vllm"
        )
    if head != "none" and d["name"] == "dspark" and head not in formats.HEAD_TO_EXT:
        return f"head={head} has no counterpart in the engines' markov_head_type"
    return None


def export_drafter(
    src: str | Path,
    out: str | Path,
    fmt: str,
    target=None,
    dtype: str | None = None,
    embeddings: bool | None = None,
) -> Path:
    """Write `src` (our checkpoint, or any folder load_drafter reads) to `out` in format `fmt`.
    embeddings=None: ship the target's embed_tokens/lm_head only for format=hf (needs `target`)."""
    src, out = Path(src), Path(out)
    drafter, config = load_drafter(src, target)
    why = refusal(fmt, config)
    if why:
        raise ExportError(f"cannot export {src} as format={fmt}: {why}")
    embeddings = (fmt == "hf") if embeddings is None else bool(embeddings)
    if embeddings and target is None:
        raise ExportError(
            f"format={fmt} with embeddings ships the target's embed_tokens/lm_head ({ENGINE[fmt]} "
            "reads them from the drafter folder): pass the drafter's target (target=<name>), or "
            "embeddings=false"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype={dtype} is not one of {tuple(DTYPES)} (or null to keep the checkpoint's)")

    d, head_cfg = config["drafter"], config.get("head") or {}
    head = head_cfg.get("name", "none") or "none"
    if d["name"] == "dflash":
        head = "none"
    confidence = drafter.has_confidence
    tinfo = config.get("target") or {}
    taps = tinfo.get("layer_ids")
    if taps is None or len(taps) != drafter.dims.num_taps:
        raise ExportError(
            f"{src}/config.json records target.layer_ids={taps} for a drafter reading "
            f"{drafter.dims.num_taps} taps: the engines need the exact tap layers"
        )
    params = dict(drafter.named_parameters())
    store = next(iter(params.values())).dtype
    stored = (config.get("imported_from") or {}).get("torch_dtype")  # a foreign source's own dtype
    dtype_name = dtype or (stored if stored in DTYPES else str(store).replace("torch.", ""))
    ext = formats.build_config(
        fmt,
        shape=layer_shape(drafter.dims, d),
        dims=drafter.dims,
        taps=[int(t) for t in taps],
        num_target_layers=tinfo.get("num_layers"),
        gamma=int(drafter.gamma),
        num_layers=len(drafter.layers),
        head=head,
        rank=int(head_cfg.get("rank") or 0) if head != "none" else 0,
        confidence=confidence,
        conf_with_markov=bool(confidence and drafter.confidence.prev_dim),
        num_anchors=int(d.get("num_anchors", 512)),
        dtype=dtype_name,
        target_name=tinfo.get("name"),
    )
    ext["dspark_source"] = {k: config.get(k) for k in ("drafter", "head", "target")}
    formats.check_fields(ext, fmt)

    state = {}
    for name, tensor in drafter.state_dict().items():
        theirs = formats.to_external(name)
        if theirs is None:
            raise ExportError(f"our parameter {name} has no counterpart in the {fmt} layout")
        state[theirs] = tensor.detach()
    if embeddings:
        state["embed_tokens.weight"] = target.embedding_weight.detach()
        state["lm_head.weight"] = target.lm_head_weight.detach()
    formats.check_keys(
        state,
        formats.expected_shapes(ext, embeddings),
        f"refusing to write {out} (format={fmt}, the keys {ENGINE[fmt]} loads)",
        exc=ExportError,
    )
    cast = DTYPES.get(dtype_name, store)
    state = {k: v.to("cpu", cast).contiguous() for k, v in state.items()}
    seen: set[int] = set()
    for k, v in state.items():  # a tied target (embed_tokens is lm_head) shares storage: write two
        if v.data_ptr() in seen:
            state[k] = v.clone()
        seen.add(v.data_ptr())
    # The engines' layout, not ours: their config.json carries no dspark schema stamp.
    dst = DrafterFolder(out)
    # transformers' from_pretrained refuses safetensors files without metadata format=pt.
    atomic_save_safetensors(dst.weights_path, state, metadata={"format": "pt"})
    atomic_write_json(dst.config_path, ext)
    calibration = DrafterFolder(src).read_calibration()
    if calibration is not None:  # STS temperatures: ours, engines ignore the file
        dst.write_calibration(calibration)
    else:  # an earlier export's temperatures would be applied to these weights
        dst.file(dst.CALIBRATION).unlink(missing_ok=True)
    dst.file(dst.CALIBRATION_REPORT).unlink(missing_ok=True)  # describes other weights
    return out
