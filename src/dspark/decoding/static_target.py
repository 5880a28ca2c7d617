"""The target's forward over a preallocated (static) KV cache, for the CUDA-graph engine.

Hugging Face's forward is correct but launch-bound at serving batch sizes (≈21 ms per step on the
H200 for SmolLM2-135M whatever the batch) and allocates as it goes, so it cannot be captured in a
CUDA graph. ``StaticTarget`` re-runs the same decoder from the model's own weights (shared, never
copied: q|k|v and gate|up become one weight each whose row blocks the model's layers then view,
``fused_rows``) as two pure functions per layer (optionally ``torch.compile``d) over caches whose
addresses never change:

* K/V per layer are ``[rows, Hkv, capacity, hd]``; row r holds request r's positions at slot ==
  position, like ``RaggedKV``. A forward writes every one of its tokens at its position; the
  caller's ``lengths`` say which slots are committed, and a query at position p sees slots <= p
  only, so rejected drafts and padding are invisible and overwritten later ("crop" = set length).
* q/k/v stay in the projections' layout ([R, W, heads, hd]): the cache stores take them as they
  are, at the end of each layer's input function (``store_kv``: compiled, they are stores of the
  kernels that compute k and v, not index kernels of their own), and the decode and verify steps
  (widths up to ``KERNEL_MAX_WIDTH``) attend on CUDA with ``kernels.cache_attention`` (one launch
  a layer, the mask computed from positions, keys read only up to each row's last position);
  prompts, and the CPU, use SDPA over the capacity with the G query heads of each KV head folded
  into the query axis (each cached key read once).
* RoPE comes from the model's own rotary module(s), tabulated once for positions 0..capacity-1.

Supported decoders (``SUPPORTED``), each an ``Arch`` (its layer tensors and two layer functions):

* Llama family (llama, mistral without sliding window, qwen2, qwen3): pre-norm, SwiGLU;
* Gemma 3 text (``gemma3_text``: Gemma3ForCausalLM, e.g. gemma-3-270m; the text config of a nested
  multimodal ``gemma3`` reports it too): embeddings scaled by √d (the model's own embedding
  module), ``(1 + w)`` RMSNorms, four per layer (the attention and MLP outputs are normed before
  their residual adds), per-head q/k norms, scale ``query_pre_attn_scalar ** -0.5``, a GELU-tanh
  gated MLP, and per-layer attention types from ``config.layer_types``: sliding layers (a query at
  p sees keys in (p - window, p]) with the local RoPE table, full layers with the global one.
  Sliding layers keep full-capacity caches (slot == position, as every layer): one row layout for
  every layer, at the price of memory a ring of ``window`` slots would save.

Other architectures, and Gemma 3 with attention-logit soft-capping or bidirectional attention,
are refused with a message pointing at the plain engine. The final-logit soft-cap is not applied
here: the forward returns the final normed hidden state and the caller's ``Target.lm_head``
applies it, as for the plain engine. ``tests/test_fast_engine`` holds this forward equal to the
Hugging Face one through ``dspark.target.Target``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.compiling import EagerOnFailure
from ..kernels import cache_attention, folded_mask, triton_available
from ..kernels.cache_attention import kernel_self_check, triton_fits

__all__ = ["KERNEL_MAX_WIDTH", "SUPPORTED", "StaticTarget", "UnsupportedTarget", "move_rows", "store_kv"]

KERNEL_MAX_WIDTH = 16  # widest step that attends with the cache kernel (decode, verify); prompts use SDPA

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = (*LLAMA_FAMILY, "gemma3_text")
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types


class UnsupportedTarget(ValueError):
    pass


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + _rotate_half(x) * sin


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama/Qwen RMSNorm, in the same operation order as transformers (float32 statistics)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _gemma_rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm: weights stored around 0 and applied as ``1 + w``, and (unlike Llama) the
    scaling done in float32 before the cast back, as transformers does it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def move_rows(tensors: list[Tensor], dst: Tensor, src: Tensor, dim: int = 0) -> None:
    """In place: rows ``src`` (along ``dim``) of every tensor copied onto rows ``dst`` (disjoint),
    keeping addresses (captured CUDA graphs read these buffers). Only the rows that change place
    move: a request leaving a 256-row batch costs its successor's row, not the whole cache. Two
    kernels per tensor: callers pass every layer's cache as one stacked buffer, not one per layer."""
    for t in tensors:
        t.index_copy_(dim, dst, t.index_select(dim, src))


def _no_mlp_bias(layer) -> None:
    m = layer.mlp
    if any(getattr(p, "bias", None) is not None for p in (m.gate_proj, m.up_proj, m.down_proj)):
        raise UnsupportedTarget("MLP biases are not implemented by the fast engine: use engine=plain")


# First module of a fused group -> (the fused weight, its members' data pointers when fused).
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fused_rows(modules) -> Tensor:
    """One weight whose row blocks are the given linear layers' weights (q|k|v, gate|up), so one
    GEMM computes what took several (a step at R = 1 is launch-bound: each GEMM saved is a
    kernel). The layers' weights become views of it: the model computes the same, the memory is
    not doubled, and a second call finds them fused already and returns the same tensor."""
    weights = [m.weight for m in modules]
    known = _FUSED.get(modules[0])
    if known is not None and known[1] == tuple(w.data_ptr() for w in weights):
        return known[0]
    fused = torch.cat([w.detach() for w in weights])
    row = 0
    for m, w in zip(modules, weights):
        m.weight.data = fused[row : row + w.shape[0]]
        row += w.shape[0]
    _FUSED[modules[0]] = (fused, tuple(m.weight.data_ptr() for m in modules))
    return fused


def _projections(attn) -> dict:
    """The attention's fused q|k|v weight (and bias, None without), and its o weight and bias."""
    parts = [getattr(attn, f"{n}_proj") for n in "qkv"]
    biases = [p.bias for p in parts]
    return {
        "qkv": fused_rows(parts),
        "qkv_bias": None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else p.weight.new_zeros(p.weight.shape[0]) for b, p in zip(biases, parts)]
        ),
        "o": attn.o_proj.weight,
        "o_bias": attn.o_proj.bias,
    }  # fmt: skip


def _qkv(h: Tensor, w, heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q [R, W, H, hd], k/v [R, W, Hkv, hd] of the normed input ``h`` [R, W, d], from one GEMM:
    the projections' own layout, which the cache stores and the attention kernel read as they are."""
    r, t, _ = h.shape
    y = F.linear(h, w.qkv, w.qkv_bias).view(r, t, heads + 2 * kv_heads, -1)
    q, k, v = y.split([heads, kv_heads, kv_heads], dim=2)
    return q, k, v


def store_kv(k_cache: Tensor, v_cache: Tensor, rows: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
    """This step's keys/values k, v [R, W, Hkv, hd] into the caches at rows ``rows`` ([R, 1],
    broadcast over the width) and slots ``positions`` ([R, W]; slot == position): advanced indices
    around a slice, so cache[rows, :, slots] is [R, W, Hkv, hd], the projections' own layout,
    written in place."""
    k_cache[rows, :, positions] = k.to(k_cache.dtype)
    v_cache[rows, :, positions] = v.to(v_cache.dtype)


def _gated(h: Tensor, w, act) -> Tensor:
    """The gated MLP's inner activation act(h W_gateᵀ) ⊙ h W_upᵀ from one GEMM over gate|up."""
    gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
    return act(gate) * up


# Dynamo keeps its graphs per function code, whichever wrapper calls it, and sizes of 1 get graphs of
# their own (one row or more, one token or more, a one-row engine's caches), as do equal sizes and
# stride patterns: a process that builds engines of several row counts (bench.e2e: R = 1, 16, 64,
# 256), each with its own wrappers, once spent dynamo's default budget of 8, and the later engines'
# layers ran eagerly, silently (the H200's rounds at R >= 16 paid ~1.5 ms for it). Now one wrapper
# serves the process, ``forward`` passes one layout (contiguous positions, row indices broadcast),
# which keeps the classes few (6 and 4 over the tests' shapes), and LAYER_GRAPHS leaves room.
LAYER_GRAPHS = 64


@functools.cache
def compiled_layer_function(fn: Callable) -> Callable:
    """``fn`` compiled once a process: every StaticTarget shares the wrapper (a new one would
    compile every shape again against the same per-code graph budget). Automatic dynamic shapes:
    the first shape compiles as constants, and a size that later changes (rows, width, cache
    capacity) becomes symbolic in the recompile, while the weights' sizes stay constants. Not
    ``dynamic=True``: the weights enter as plain tensors (stacked q|k|v, gate|up), so their sizes
    were symbolic too, and every fused kernel divided its indices by run-time sizes (on the H200
    99.5 against 60.7 µs a layer at 256 x 8 rows, 29.8 against 26.1 at 1 x 8: bench.layer_compile)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, LAYER_GRAPHS)
    return torch.compile(fn, dynamic=None)


# ---- Llama family -----------------------------------------------------------------------------
@dataclass
class LayerWeights:
    """One decoder layer as plain tensors (shared with the model, never copied): the layer
    functions take tensors, not modules, so one compiled graph serves every layer."""

    ln1: Tensor
    qkv: Tensor  # q|k|v rows (``fused_rows``)
    o: Tensor
    ln2: Tensor
    gate_up: Tensor  # gate|up rows
    down: Tensor
    qkv_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_norm: Tensor | None = None  # qwen3
    k_norm: Tensor | None = None

    @classmethod
    def of(cls, layer) -> LayerWeights:
        a, m = layer.self_attn, layer.mlp
        _no_mlp_bias(layer)
        return cls(
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            gate_up=fused_rows([m.gate_proj, m.up_proj]), down=m.down_proj.weight, **_projections(a),
            q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
            k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
        )  # fmt: skip


def attention_inputs(
    x: Tensor, w: LayerWeights, cos: Tensor, sin: Tensor, eps: float, heads: int, kv_heads: int,
    k_cache: Tensor, v_cache: Tensor, rows: Tensor, positions: Tensor,
) -> Tensor:  # fmt: skip
    """Pre-norm, q/k/v projections, (qwen3) per-head q/k norm, RoPE; k/v [R, W, Hkv, hd] stored
    into the caches (``store_kv``); returns q [R, W, H, hd]."""
    q, k, v = _qkv(_rms(x, w.ln1, eps), w, heads, kv_heads)
    if w.q_norm is not None:
        q, k = _rms(q, w.q_norm, eps), _rms(k, w.k_norm, eps)
    store_kv(k_cache, v_cache, rows, positions, _rope(k, cos, sin), v)
    return _rope(q, cos, sin)


def layer_output(x: Tensor, attn: Tensor, w: LayerWeights, eps: float) -> Tensor:
    """Output projection + residual, then the SwiGLU MLP + residual."""
    x = x + F.linear(attn, w.o, w.o_bias)
    h = _rms(x, w.ln2, eps)
    return x + F.linear(_gated(h, w, F.silu), w.down)


# ---- Gemma 3 ----------------------------------------------------------------------------------
@dataclass
class GemmaLayerWeights:
    """A Gemma 3 layer's tensors: Llama's plus the per-head q/k norms and the norms around the
    MLP (``ln_attn_out`` norms the attention output, ``ln_mlp_in`` / ``ln_mlp_out`` the MLP's
    input and output)."""

    ln1: Tensor
    qkv: Tensor  # q|k|v rows (``fused_rows``)
    o: Tensor
    q_norm: Tensor
    k_norm: Tensor
    ln_attn_out: Tensor
    ln_mlp_in: Tensor
    ln_mlp_out: Tensor
    gate_up: Tensor  # gate|up rows
    down: Tensor
    qkv_bias: Tensor | None = None
    o_bias: Tensor | None = None

    @classmethod
    def of(cls, layer) -> GemmaLayerWeights:
        a, m = layer.self_attn, layer.mlp
        _no_mlp_bias(layer)
        return cls(
            ln1=layer.input_layernorm.weight, q_norm=a.q_norm.weight, k_norm=a.k_norm.weight,
            ln_attn_out=layer.post_attention_layernorm.weight,
            ln_mlp_in=layer.pre_feedforward_layernorm.weight,
            ln_mlp_out=layer.post_feedforward_layernorm.weight,
            gate_up=fused_rows([m.gate_proj, m.up_proj]), down=m.down_proj.weight, **_projections(a),
        )  # fmt: skip


def gemma_attention_inputs(
    x: Tensor, w: GemmaLayerWeights, cos: Tensor, sin: Tensor, eps: float, heads: int, kv_heads: int,
    k_cache: Tensor, v_cache: Tensor, rows: Tensor, positions: Tensor,
) -> Tensor:  # fmt: skip
    """Gemma pre-norm, q/k/v projections, per-head q/k norms, RoPE (the layer type's table); k/v
    stored into the caches (``store_kv``); returns q."""
    q, k, v = _qkv(_gemma_rms(x, w.ln1, eps), w, heads, kv_heads)
    q, k = _gemma_rms(q, w.q_norm, eps), _gemma_rms(k, w.k_norm, eps)
    store_kv(k_cache, v_cache, rows, positions, _rope(k, cos, sin), v)
    return _rope(q, cos, sin)


def gemma_layer_output(x: Tensor, attn: Tensor, w: GemmaLayerWeights, eps: float) -> Tensor:
    """Sandwich norms: the attention output and the GELU-tanh gated MLP's output are each normed
    before their residual add; the MLP reads its own pre-norm."""
    x = x + _gemma_rms(F.linear(attn, w.o, w.o_bias), w.ln_attn_out, eps)
    h = _gemma_rms(x, w.ln_mlp_in, eps)
    h = F.linear(_gated(h, w, lambda g: F.gelu(g, approximate="tanh")), w.down)
    return x + _gemma_rms(h, w.ln_mlp_out, eps)


# ---- what differs per architecture ------------------------------------------------------------
@dataclass(frozen=True)
class Arch:
    """A decoder family: its layer tensors, its two layer functions, and how its config is
    checked and read (``check`` raises UnsupportedTarget; ``layer_types`` says, per layer,
    FULL or SLIDING; ``typed_rope``: one RoPE table per layer type, from the rotary module)."""

    weights: Callable
    inputs: Callable
    output: Callable
    check: Callable[[object, str], None]
    layer_types: Callable[[object], list[str]]
    typed_rope: bool = False


def _refuse(name: str, why: str) -> NoReturn:
    raise UnsupportedTarget(
        f"target {name} {why}, which the fast engine does not implement: use engine=plain"
    )


def _check_llama(cfg, name: str) -> None:
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        _refuse(name, "uses sliding-window attention")
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        _refuse(name, f"uses activation '{cfg.hidden_act}' (SiLU MLPs only)")


def _check_gemma3(cfg, name: str) -> None:
    if getattr(cfg, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        _refuse(name, f"uses activation '{cfg.hidden_activation}' (GELU-tanh only)")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        # transformers' Gemma 3 (5.x) stores it but does not apply it: refuse rather than pick.
        _refuse(name, "sets attn_logit_softcapping")
    if getattr(cfg, "use_bidirectional_attention", False):
        _refuse(name, "uses bidirectional attention")
    types = set(_gemma3_layer_types(cfg))
    if not types <= {FULL, SLIDING}:
        _refuse(name, f"has layer types {sorted(types)}")
    if SLIDING in types and not getattr(cfg, "sliding_window", None):
        _refuse(name, "has sliding layers without a sliding_window")


def _gemma3_layer_types(cfg) -> list[str]:
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:  # configs from before layer_types: every pattern-th layer is global
        pattern = int(getattr(cfg, "sliding_window_pattern", 6))
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(cfg.num_hidden_layers)]
    return types


LLAMA = Arch(
    LayerWeights.of, attention_inputs, layer_output, _check_llama, lambda cfg: [FULL] * cfg.num_hidden_layers
)
GEMMA3 = Arch(
    GemmaLayerWeights.of, gemma_attention_inputs, gemma_layer_output, _check_gemma3, _gemma3_layer_types,
    typed_rope=True,
)  # fmt: skip
ARCHS = {**dict.fromkeys(LLAMA_FAMILY, LLAMA), "gemma3_text": GEMMA3}


def _rope_table(base, layer_type: str, typed: bool, probe: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [capacity, hd] from the model's own rotary module: Llama's one table, or a Gemma 3
    layer type's (transformers 5: one module keyed by layer type; 4.x: ``rotary_emb_local``)."""
    if not typed:
        cos, sin = base.rotary_emb(probe, position_ids=pos)
    elif hasattr(base, "rotary_emb_local"):
        module = base.rotary_emb_local if layer_type == SLIDING else base.rotary_emb
        cos, sin = module(probe, pos)
    else:
        cos, sin = base.rotary_emb(probe, pos, layer_type)
    return cos[0], sin[0]


class StaticTarget:
    """Forward of ``target`` (a ``dspark.target.Target``) over static caches of ``rows`` requests
    and ``capacity`` positions each."""

    def __init__(self, target, rows: int, capacity: int, compile: bool = False):
        model = target.model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        kind = getattr(cfg, "model_type", "?")
        if kind not in SUPPORTED:
            raise UnsupportedTarget(
                f"the fast engine runs {', '.join(SUPPORTED)} targets; target {target.name} is "
                f"'{kind}': evaluate it with engine=plain"
            )
        arch = ARCHS[kind]
        arch.check(cfg, target.name)
        self.target = target
        # A multimodal wrapper (Gemma3ForConditionalGeneration) keeps its text decoder under
        # language_model; dspark.target.Target itself wraps text-only models today.
        self.base = getattr(model.base_model, "language_model", model.base_model)
        self.weights = [arch.weights(layer) for layer in self.base.layers]
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.layer_types = arch.layer_types(cfg)
        self.window = int(cfg.sliding_window) if SLIDING in self.layer_types else None
        # torch.compile fuses the norms, RoPE and the gated activation around the GEMMs (fewer
        # kernels per step); tensors in, tensors out, so one graph serves every layer. The K/V
        # cache stores are part of the inputs' graph: inductor emits them as stores of the kernels
        # that compute k and v (RoPE) instead of two generic index kernels a layer, in place (the
        # caches keep their addresses, which the captured graphs write). The attention stays eager.
        self._inputs, self._output = arch.inputs, arch.output
        if compile:  # a layer function this torch cannot compile runs eagerly, with a warning
            self._inputs = EagerOnFailure(compiled_layer_function(arch.inputs), arch.inputs)
            self._output = EagerOnFailure(compiled_layer_function(arch.output), arch.output)
        self.rows, self.capacity = int(rows), int(capacity)
        self.num_heads = target.num_heads
        self.num_kv_heads = target.num_kv_heads
        self.head_dim = target.head_dim
        self.groups = self.num_heads // self.num_kv_heads
        self.scale = float(getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.taps = target.layer_ids
        device, dtype = target.device, target.dtype
        shape = (self.rows, self.num_kv_heads, self.capacity, self.head_dim)
        # Every layer's keys and values are views of one buffer [2, L, R, Hkv, C, hd]: moving rows
        # (continuous batching) is then two kernels, not two per layer and tensor.
        self.kv = torch.zeros(2, len(self.weights), *shape, device=device, dtype=dtype)
        self.k, self.v = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))
        self.lengths = torch.zeros(self.rows, dtype=torch.long, device=device)  # committed per row
        pos = torch.arange(self.capacity, device=device)[None]
        probe = torch.zeros(1, 1, self.head_dim, device=device, dtype=dtype)
        self.rope = {t: _rope_table(self.base, t, arch.typed_rope, probe, pos) for t in set(self.layer_types)}
        # The decode and verify steps attend with the Triton kernel on CUDA; prompts (wider than
        # KERNEL_MAX_WIDTH) and the CPU with SDPA, the kernel's reference.
        cuda_kernel = device.type == "cuda" and triton_available() and triton_fits(self.head_dim)
        if cuda_kernel:  # a kernel this device cannot build or run costs a warning, not the run
            cuda_kernel = kernel_self_check(device, dtype, self.head_dim, self.groups)
        self.attention_impl = "auto" if cuda_kernel else "torch"

    # ---------------------------------------------------------------------------------------
    def forward(
        self, ids: Tensor, positions: Tensor, start: int = 0, taps: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """Tokens ``ids`` [R, W] at ``positions`` [R, W] for cache rows start..start+R-1.
        Returns (final normed hidden [R, W, d], concatenated tap features [R, W, m·d], or None
        when ``taps`` is false). Writes the K/V of every token; does not touch ``lengths``.
        Shapes only: no host synchronisation."""
        r, w = ids.shape
        x = self.base.embed_tokens(ids)  # Gemma's module scales by √d itself
        tapped = {-1: x} if -1 in self.taps else {}
        # Per layer type: cos/sin [R, W, 1, hd]; the attention's window; and, where SDPA runs (the
        # reference: prompts, the CPU), the mask of the slots each query reads, built once a step.
        rope = {t: (c[positions][:, :, None], s[positions][:, :, None]) for t, (c, s) in self.rope.items()}
        impl = self.attention_impl if w <= KERNEL_MAX_WIDTH else "torch"
        windows = {t: self.window if t == SLIDING else None for t in self.rope}
        masks = dict.fromkeys(self.rope)
        if impl == "torch":
            masks = {t: folded_mask(positions, self.capacity, self.groups, windows[t]) for t in self.rope}
        positions = positions.contiguous()  # one layout for the compiled layers: no stride variants
        row_index = torch.arange(start, start + r, device=ids.device)[:, None]  # broadcast over W
        for i, (weights, kind) in enumerate(zip(self.weights, self.layer_types)):
            cos, sin = rope[kind]
            # This step's keys/values go into the caches at their positions, then q attends.
            q = self._inputs(
                x, weights, cos, sin, self.eps, self.num_heads, self.num_kv_heads, self.k[i], self.v[i],
                row_index, positions,
            )  # fmt: skip
            attn = cache_attention(
                q, self.k[i], self.v[i], positions, scale=self.scale, row0=start, window=windows[kind],
                mask=masks[kind], impl=impl,
            )  # fmt: skip
            x = self._output(x, attn.reshape(r, w, -1), weights, self.eps)
            if i in self.taps:
                tapped[i] = x
        hidden = self.base.norm(x)
        return hidden, torch.cat([tapped[i] for i in self.taps], dim=-1) if taps else None

    # ---- rows (continuous batching) -----------------------------------------------------------
    def move_rows(self, dst: Tensor, src: Tensor) -> None:
        """Rows ``src`` (requests still running) onto rows ``dst`` (finished ones)."""
        move_rows([self.kv], dst, src, dim=2)
        move_rows([self.lengths], dst, src)
