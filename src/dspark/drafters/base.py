"""The contract every drafter keeps (``Drafter``) and the pieces the drafters share: their layer
shape from the target's dimensions, output logits through the frozen LM head, the context cache.

A drafter never imports Lightning, the engines or the checkpoint code: training, decoding and the
checkpoints ask the interface below, never a drafter's name or its submodules."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

import torch
from torch import Tensor, nn

from ..core.errors import ConfigError
from ..core.schema import Count, Positive, Range
from ..core.types import DraftCache, DraftOutput, Proposal, Shared, TargetDims
from .layers import LayerShape


@dataclass
class ConfidenceConfig:
    enabled: bool = False
    use_prev_embedding: bool = False
    detach_features: bool = False


@dataclass
class DrafterConfig:
    """The keys of every conf/drafter/<name>.yaml (dspark.core.schema); a drafter with keys of its
    own extends it and names the result in its ``config_schema``. Null layer sizes are the target's."""

    name: str
    block_size: Count
    num_layers: Count
    hidden_size: Count | None = None
    intermediate_size: Count | None = None
    num_heads: Count | None = None
    num_kv_heads: Count | None = None
    head_dim: Count | None = None
    rope_theta: Positive | None = None
    num_anchors: Count = 512
    confidence: ConfidenceConfig = field(default_factory=ConfidenceConfig)

    def __post_init__(self):
        if self.num_heads and self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} "
                f"(grouped-query attention shares each key/value head among whole groups)"
            )


@dataclass
class HeadConfig:
    """conf/head/<name>.yaml: the sequential head and its rank (which drafters take one is theirs
    to say: ``Drafter.check_config``)."""

    name: str
    rank: Annotated[int, Range(ge=0)]
    first_position: Annotated[int, Range(ge=1)] = 1  # draft positions before it take no bias


def head_first_position(head_cfg) -> int:
    """``head.first_position`` (1 where a config predates it): the first draft position the head biases."""
    value = head_cfg.get("first_position") if head_cfg is not None else None
    return 1 if value is None else int(value)


class Drafter(nn.Module, metaclass=abc.ABCMeta):
    """A drafter: built from ``(dims, drafter_cfg, head_cfg)`` by name (``drafters.registry``),
    trained through ``train_forward``, run by the engines through ``new_cache`` /
    ``extend_context`` / ``propose``.

    Capabilities, asked instead of names:
      ``has_confidence``         proposals carry per-position confidence logits (confidence-based
                                 policies, STS calibration);
      ``supports_static_cache``  all its state across rounds is per-layer context keys/values at
                                 slot == position, so the fast engine may hold them in a
                                 preallocated cache (``new_cache(capacity=…)``) and write them
                                 itself through ``write_context``;
      ``context_needs_tokens``   (with a static cache) an entry of its context needs the token
                                 after its position, known once the round is verified: the fast
                                 engine writes it then, through ``commit_context`` (Eagle3's entry
                                 at position p pairs the target's features at p with x_{p+1}).
    """

    kind: ClassVar[str] = "drafter"  # the registry name (conf/drafter/<kind>.yaml), set by @register
    config_schema: ClassVar[type[DrafterConfig]] = DrafterConfig  # the keys of conf/drafter/<kind>.yaml
    supports_static_cache: ClassVar[bool] = False
    context_needs_tokens: ClassVar[bool] = False
    gamma: int  # draft tokens per proposal (``config_gamma``: drafter.block_size, less an
    #             anchor slot that drafts nothing)
    dims: TargetDims

    @property
    def has_confidence(self) -> bool:
        return False

    # ---- config, before anything is built ----------------------------------------------------
    @classmethod
    def check_config(cls, drafter_cfg, head_cfg) -> None:
        """Refuse a config this drafter cannot be built from (ConfigError naming the key). The
        default: no sequential head."""
        head = head_cfg.name if head_cfg is not None else "none"
        if head != "none":
            raise ConfigError(
                f"drafter={cls.kind} has no sequential head, but head={head} was given: "
                f"use drafter=dspark head={head}, or drop the head override (head=none)"
            )

    @classmethod
    def config_has_confidence(cls, drafter_cfg) -> bool:
        """``has_confidence`` of the drafter this config builds (read from a checkpoint's
        config.json without loading it)."""
        return False

    @classmethod
    def config_gamma(cls, drafter_cfg) -> int:
        """``gamma`` (draft tokens per proposal) of the drafter this config builds, likewise."""
        return int(drafter_cfg["block_size"])

    # ---- training ----------------------------------------------------------------------------
    @abc.abstractmethod
    def train_forward(
        self, taps: Tensor, input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, shared: Shared
    ) -> DraftOutput:
        """Teacher-forced drafts of whole sequences: taps [B, T, m·d], ids / loss mask [B, T],
        anchors [B, A] (-1 = none)."""

    # ---- inference ---------------------------------------------------------------------------
    @abc.abstractmethod
    def new_cache(self, r: int, device, dtype=None, capacity: int = 0) -> DraftCache:
        """An empty per-request state for ``r`` requests (``capacity`` preallocated positions)."""

    @abc.abstractmethod
    def extend_context(
        self, cache: DraftCache, taps: Tensor, positions: Tensor, valid: Tensor, next_tokens: Tensor,
        shared: Shared,
    ) -> None:  # fmt: skip
        """Append committed target features [R, N, m·d] at positions [R, N] (``valid``: a prefix
        mask); ``next_tokens`` [R, N] is the token after each position."""

    @abc.abstractmethod
    def propose(
        self,
        cache: DraftCache,
        anchor_tokens: Tensor,
        anchor_pos: Tensor,
        shared: Shared,
        temperature: float,
        generator: torch.Generator | None = None,
        uniforms: Tensor | None = None,
        draft_len: int | None = None,
    ) -> Proposal:
        """γ draft tokens from each anchor with the exact distributions they were sampled from.
        ``uniforms`` [R, γ] replaces the draws from ``generator`` (the CUDA-graph engine feeds
        them through a static buffer). ``draft_len`` (<= γ; None = γ): only the first
        ``draft_len`` positions are sampled (no LM head or sampling for positions that will not
        be verified), the proposal is [R, draft_len]; the uniforms are still [R, γ], of which
        the first ``draft_len`` columns are used."""

    def compile_inference(self) -> None:
        """``torch.compile`` what ``propose`` runs (the fast engine asks when it compiles the
        target); default: nothing to compile."""

    def write_context(self, cache: DraftCache, taps: Tensor, positions: Tensor, rows: Tensor) -> None:
        """Static-cache hook (``supports_static_cache``): the context keys/values of taps
        [R, W, m·d] written at slot == position into cache rows ``rows`` [R]; the lengths are the
        caller's to keep."""
        if self.context_needs_tokens:
            raise NotImplementedError(f"drafter '{self.kind}' needs the next tokens: commit_context")
        raise NotImplementedError(f"drafter '{self.kind}' has no static cache: it runs on engine=plain")

    def commit_context(
        self, cache: DraftCache, taps: Tensor, positions: Tensor, next_tokens: Tensor, kept: Tensor,
        shared: Shared,
    ) -> None:  # fmt: skip
        """Static-cache hook (``context_needs_tokens``): the context of taps [R, W, m·d] at slot ==
        position, each with the token after it (``next_tokens`` [R, W]), in cache rows 0..R-1; the
        first ``kept`` [R] of each row are committed (later slots are scratch, past the length the
        caller keeps). No host sync, fixed shapes: the fast engine captures it in a graph."""
        raise NotImplementedError(f"drafter '{self.kind}' writes its context from taps alone (write_context)")


def draft_uniforms(r: int, gamma: int, generator: torch.Generator | None, uniforms: Tensor | None, device):
    """The [R, γ] uniforms of one proposal: the given ones, else drawn from ``generator`` on its own
    device (CPU by default) and moved, so every device sees the same stream."""
    if uniforms is None:
        source = "cpu" if generator is None else generator.device
        uniforms = torch.rand(r, gamma, generator=generator, device=source)
    return uniforms.to(device)


def layer_shape(dims: TargetDims, cfg) -> LayerShape:
    hidden = cfg.get("hidden_size") or dims.hidden_size
    if hidden != dims.hidden_size:
        raise ConfigError(
            f"drafter.hidden_size={hidden} differs from the target's {dims.hidden_size}: the drafter shares "
            f"the target's embedding and LM head, so leave drafter.hidden_size null"
        )
    heads, kv_heads = cfg.get("num_heads") or dims.num_heads, cfg.get("num_kv_heads") or dims.num_kv_heads
    if heads % kv_heads:
        raise ConfigError(
            f"drafter.num_heads={heads} is not a multiple of drafter.num_kv_heads={kv_heads} (null keys "
            f"are the target's): set both, e.g. num_heads={kv_heads * max(1, heads // kv_heads)}"
        )
    return LayerShape(
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size") or dims.intermediate_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or dims.head_dim,
        rope_theta=cfg.get("rope_theta") or dims.rope_theta,
        rms_norm_eps=dims.rms_norm_eps,
    )


def head_product(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., d] @ weight [V, d]ᵀ in x's dtype, as one GEMM over all of x's rows. ``x @ w.t()``
    becomes a batched GEMM that reads the weight once per batch where x's leading strides do not
    chain, as in a position-major block [n, 1, d] transposed from [1, n, d] (its size-1 dim keeps
    its old stride, so ``torch.matmul`` does not fold it): at one request the draft step read
    SmolLM2's 57 MB head seven times, 78.8 µs on the H200 against 21.6 µs as one GEMM
    (``bench.decode_kernels``, 2026-12-04)."""
    rows = x.reshape(-1, x.shape[-1])  # a view wherever the strides allow, a small copy otherwise
    return (rows @ weight.t().to(x.dtype)).view(*x.shape[:-1], weight.shape[0])


def soft_capped(logits: Tensor, softcap: float | None) -> Tensor:
    """``logits`` capped as the target caps its own (float32), or as they are where it does not."""
    return torch.tanh(logits.float() / softcap) * softcap if softcap else logits


def output_logits(x: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
    return soft_capped(head_product(x, weight).float(), softcap)


def draft_length(gamma: int, draft_len: int | None) -> int:
    """The positions a proposal samples: ``draft_len`` checked against the block (None = γ)."""
    n = gamma if draft_len is None else int(draft_len)
    if not 0 < n <= gamma:
        raise ValueError(f"draft_len must be in 1..{gamma}, got {draft_len}")
    return n


def empty_cache(layers: nn.ModuleList, r: int, ref: Tensor, capacity: int = 0) -> DraftCache:
    """Per-layer context keys/values for ``r`` requests with ``capacity`` preallocated slots (0: the
    cache grows as ``append_kv`` writes), all lengths zero. Every layer's keys and values are views
    of one buffer [2, L, R, Hkv, C, hd], so that one fused write reaches them all
    (``context_write.stacked_kv``)."""
    s = layers[0].attn.s
    kv = ref.new_zeros(2, len(layers), r, s.num_kv_heads, capacity, s.head_dim)
    return DraftCache(
        k=list(kv[0].unbind(0)),
        v=list(kv[1].unbind(0)),
        length=torch.zeros(r, dtype=torch.long, device=ref.device),
    )


def append_kv(cache: DraftCache, layer_kv: list[tuple[Tensor, Tensor]], valid: Tensor) -> None:
    """Write new keys/values [R, Hkv, N, hd] after each request's current length; `valid` [R, N] must
    be a prefix mask (request r contributes its first valid[r].sum() entries)."""
    counts = valid.sum(1)
    need = int((cache.length + counts).max()) if counts.numel() else 0
    for i, (k_new, v_new) in enumerate(layer_kv):
        if need > cache.k[i].shape[2]:
            grow = max(need, 2 * cache.k[i].shape[2]) - cache.k[i].shape[2]
            pad = cache.k[i].new_zeros(*cache.k[i].shape[:2], grow, cache.k[i].shape[3])
            cache.k[i] = torch.cat([cache.k[i], pad], dim=2)
            cache.v[i] = torch.cat([cache.v[i], pad.clone()], dim=2)
        rows, cols = valid.nonzero(as_tuple=True)
        slots = cache.length[rows] + cols
        cache.k[i][rows, :, slots] = k_new[rows, :, cols].to(cache.k[i].dtype)
        cache.v[i][rows, :, slots] = v_new[rows, :, cols].to(cache.v[i].dtype)
    cache.length += counts
