"""Export one of our drafter checkpoints as a Hugging Face style folder (config.json +
model.safetensors) in the layout a serving engine's DSpark/DFlash loader reads.

Formats (sources and the field-by-field layout: docs/formats.md):
  hf      DeepSpec's `save_pretrained` layout (architectures=["Qwen3DSparkModel"] for DSpark and
          DFlash alike); ships the target's embed_tokens / lm_head like DeepSpec does. Drafts from
          the anchor's slot only (drafter.slots=anchor).
  vllm    vLLM's qwen3_dspark (Qwen3DSparkModel, either slot convention through sample_from_anchor)
          / qwen3_dflash (DFlashDraftModel: the mask slots draft, drafter.slots=masks) loaders; the
          embedding and LM head are shared from the target, so they are left out.
  sglang  SGLang's dspark (Qwen3DSparkModel, slots=anchor) / dflash (DFlashDraftModel,
          slots=masks) loaders; likewise.

Anything the target engine cannot load, or would load and read differently, is refused with the
reason, the formats that do take the drafter (if any) and what to retrain otherwise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..artifacts import DrafterFolder
from ..core.io import atomic_save_safetensors, atomic_write_json
from ..drafters.base import head_first_position, layer_shape
from ..interop import formats
from ..interop.formats import ExportError
from .store import load_drafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINE = {"hf": "DeepSpec (transformers from_pretrained)", "vllm": "vLLM", "sglang": "SGLang"}


def _cannot(fmt: str, config: dict) -> tuple[str, str | None] | None:
    """(why format `fmt` cannot express this drafter, what to retrain instead) or None."""
    d = config["drafter"]
    head = (config.get("head") or {}).get("name", "none") or "none"
    taps = (config.get("target") or {}).get("layer_ids") or []
    if d["name"] == "eagle3":
        return (
            "our Eagle3 drafter is not the Eagle3 the engines load: ours projects [norm(embed); "
            "norm(feature)] to the hidden size (in_proj) and runs a standard pre-norm layer on it, "
            "while vLLM/SGLang/DeepSpec Eagle3 feed the 2·hidden concatenation straight into q/k/v "
            "and keep the feature as the residual (and vLLM's Llama Eagle3 has no q/k norm)",
            "export a DSpark or DFlash drafter instead, or retrain Eagle3 in the engines' layout",
        )
    if d["name"] not in formats.BLOCK_DRAFTERS:
        return (
            f"drafter {d['name']} has no counterpart in the engines' layouts {formats.BLOCK_DRAFTERS}",
            None,
        )
    dspark = d["name"] == "dspark"
    slots = d.get("slots", "anchor")
    confidence = dspark and bool((d.get("confidence") or {}).get("enabled", True))
    if dspark and head != "none" and head not in formats.HEAD_TO_EXT:
        return f"head={head} has no counterpart in the engines' markov_head_type", None
    first = head_first_position(config.get("head"))
    if dspark and head != "none" and first != 1:
        return (
            f"head.first_position={first}: the engines' heads bias every draft position",
            "retrain with head.first_position=1",
        )
    if fmt == "hf":
        if slots == "masks":
            return (
                "DeepSpec's Qwen3DSparkModel drafts from the anchor's slot (block slot k predicts "
                "x_{a+k+1}), while this drafter (slots=masks) drafts from its mask slots, the anchor "
                "being the bonus token",
                "retrain with drafter.slots=anchor",
            )
        return None
    if fmt == "vllm":
        if dspark and head != "markov":
            return (
                "vLLM's Qwen3DSparkModel builds the vanilla Markov head (markov_w1/markov_w2) and no "
                f"other; this drafter has head={head}",
                "train with head=markov",
            )
        if not dspark and slots == "anchor":
            return (
                "vLLM's DFlashDraftModel treats the anchor as the bonus token and samples only the mask "
                "slots (it refuses sample_from_anchor=true), so a DFlash that drafts from the anchor's "
                "slot (slots=anchor) would draft every token one position late; its Qwen3DSparkModel, "
                "which can read the anchor's slot, always builds a Markov head",
                "retrain with drafter.slots=masks",
            )
        return None
    # sglang
    if any(int(t) < 0 for t in taps):
        return (
            f"SGLang accepts target_layer_ids only in [0, num_target_layers); this drafter taps {taps} "
            "(-1 = the embeddings)",
            "retrain with non-negative target.layer_ids",
        )
    if not dspark:
        if slots == "anchor":
            return (
                "SGLang's DFlash worker reads the mask slots (draft_hidden[:, 1:]) as x_{a+1}…, so a "
                "DFlash that drafts from the anchor's slot (slots=anchor) would draft every token one "
                "position late; its DSpark loader, which reads the anchor's slot, requires a Markov head",
                "retrain with drafter.slots=masks",
            )
        return None
    if head == "none":
        return (
            "SGLang's DSpark loader requires markov_rank > 0 and this DSpark drafter has no sequential head",
            "train with head=markov|gated|rnn, or use drafter=dflash drafter.slots=masks",
        )
    if slots == "masks":
        return (
            "SGLang's Qwen3DSparkModel reads block slot k as x_{a+k+1} (the anchor's slot drafts; it "
            "has no sample_from_anchor=false layout), while this drafter (slots=masks) drafts from its "
            "mask slots",
            "retrain with drafter.slots=anchor",
        )
    if not confidence:
        return (
            "SGLang builds the DSpark confidence head whatever enable_confidence_head says (only its "
            "static ragged-verify mode skips it) and then refuses a checkpoint without confidence_head "
            "weights; this drafter has confidence.enabled=false",
            "retrain with drafter.confidence.enabled=true",
        )
    return None


def refusal(fmt: str, config: dict) -> str | None:
    """Why `config` (our checkpoint's config.json) cannot be exported as `fmt`, or None. The reason
    names every format that does take the drafter, or says that none does and what to retrain."""
    if fmt not in formats.FORMATS:
        return f"format={fmt} is not one of {formats.FORMATS}"
    cannot = _cannot(fmt, config)
    if cannot is None:
        return None
    why, retrain = cannot
    works = [f for f in formats.FORMATS if f != fmt and _cannot(f, config) is None]
    if works:
        fix = f"export format={'|'.join(works)} instead" + (f", or {retrain}" if retrain else "")
    else:
        fix = "no export format takes this drafter" + (f": {retrain}" if retrain else "")
    return f"{why}. {fix[0].upper()}{fix[1:]}"


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
        block_size=int(drafter.block_size),
        slots=drafter.slots,
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
