"""DFlash: the parallel block drafter (and DSpark's backbone).

Block layout (§3.1): the anchor x_a (the last token the target produced) at position a, then mask
tokens, block_size slots in all at positions a..a+block_size-1, attending bidirectionally to each
other and to the context: the fused target taps of positions < a, injected as keys/values into
every layer. Training packs many anchor blocks of one sequence into a single query sequence.

Which slot drafts which token is the drafter's ``slots`` setting (docs/formats.md, "slot
conventions"); draft k (k = 1..γ) is x_{a+k} in both:
  anchor  (DeepSpec)  slot k predicts x_{a+k+1}: the anchor's own slot drafts the next token, so
                      γ = block_size draft tokens;
  masks   (z-lab)     the anchor is the bonus token and drafts nothing; mask slot k predicts x_{a+k}
                      (the token at its own position), so γ = block_size - 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.errors import ConfigError
from ..core.phases import phase
from ..core.types import DraftCache, DraftOutput, Proposal, Shared, TargetDims
from ..kernels.cache_attention import fold_mask
from ..kernels.sample_step import sample_step
from .base import (
    Drafter,
    DrafterConfig,
    append_kv,
    draft_length,
    draft_uniforms,
    empty_cache,
    head_product,
    layer_shape,
    output_logits,
)
from .context_write import ContextWriter
from .draft_step import FusedDraft, inference_compiler
from .layers import CacheSpan, DraftLayer, FusedProjections, RMSNorm, matmul_input, rms_norm, rope, rotate
from .registry import register


def packed_block_mask(anchors: Tensor, ctx_len: int, gamma: int) -> Tensor:
    """Dense training mask [B, A·γ, C + A·γ] (γ here: slots per block, ``block_size``): block b
    sees context positions < a_b and its own γ slots (bidirectionally), never another block.
    Invalid anchors (-1) see only their block."""
    b, a = anchors.shape
    device = anchors.device
    ctx = torch.arange(ctx_len, device=device)
    sees_ctx = ctx[None, None, :] < anchors.clamp(min=0)[:, :, None]  # [B, A, C]
    sees_ctx = sees_ctx.repeat_interleave(gamma, dim=1)  # [B, Aγ, C]
    block_id = torch.arange(a * gamma, device=device) // gamma
    sees_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
    return torch.cat([sees_ctx, sees_block], dim=-1)


def packed_block_mask_mod(anchors: Tensor, ctx_len: int, gamma: int):
    """The same rule as `packed_block_mask`, as a flex-attention mask_mod (never materialised)."""
    start = anchors.clamp(min=0)

    def mask_mod(b, h, q, kv):
        block = q // gamma
        sees_ctx = kv < start[b, block]
        sees_own = (kv - ctx_len) // gamma == block
        return torch.where(kv < ctx_len, sees_ctx, sees_own)

    return mask_mod


FLEX_BLOCK = 128  # flex attention's tile: the block mask records which 128 × 128 tiles to visit


@functools.lru_cache(maxsize=1024)
@torch.inference_mode(False)  # cached: never inference tensors, whoever asks first
def _tile_layout(a: int, ctx_len: int, gamma: int, block: int, device: torch.device):
    """What `packed_block_sparsity` reads besides the anchors' positions, built once per shape (a
    run sees as many as it has batch lengths): the anchor blocks in each query tile [1, nQ, W], the
    key tiles' first and end keys with the tiles past the context moved out of any anchor's reach
    [nK], and which key tiles hold each query tile's own block keys [1, 1, nQ, nK]."""
    q_len, kv_len = a * gamma, ctx_len + a * gamma
    q0 = torch.arange(0, q_len, block, device=device)  # first row of each query tile
    lo = q0 // gamma  # first and last anchor block whose rows fall in the tile
    hi = torch.clamp((q0 + block - 1) // gamma, max=a - 1)
    span = torch.arange(block // gamma + 2, device=device)
    members = torch.minimum(lo[:, None] + span, hi[:, None])  # [nQ, W] anchor blocks in each tile
    k0 = torch.arange(0, kv_len, block, device=device)
    k1 = k0 + block
    never = torch.iinfo(k0.dtype).max  # compares as after every anchor
    k0_ctx = torch.where(k0 < ctx_len, k0, never)  # tiles starting past the context see no anchor
    k1_ctx = torch.where(k1 <= ctx_len, k1, never)  # tiles ending past it are never whole context
    own_lo, own_hi = ctx_len + gamma * lo, ctx_len + gamma * (hi + 1)  # the tile's own block keys
    own = (k0[None] < own_hi[:, None]) & (k1[None] > own_lo[:, None])  # [nQ, nK]
    return members[None], k0_ctx, k1_ctx, own[None, None]


def packed_block_sparsity(anchors: Tensor, ctx_len: int, gamma: int, block: int = FLEX_BLOCK):
    """Which [block × block] tiles of the packed layout any query sees (partial) and which every
    query sees whole (full), [B, 1, ⌈Q/block⌉, ⌈(C+Q)/block⌉] each, from the anchors alone: no
    [Q, C+Q] mask is ever built. Needs each sequence's valid anchors ascending (`sample_anchors`).
    Seven operators per call: what depends on the shapes only is `_tile_layout`'s, cached."""
    members, k0_ctx, k1_ctx, own = _tile_layout(anchors.shape[1], ctx_len, gamma, block, anchors.device)
    seen = anchors.clamp(min=0)[:, members]  # [B, 1, nQ, W] anchors of the blocks in each query tile
    a_min, a_max = torch.aminmax(seen, dim=-1, keepdim=True)
    # Context keys: a tile is seen by some query if it starts before the largest anchor, by all
    # queries (whole) if it ends inside the context before the smallest anchor.
    ctx_part = k0_ctx < a_max  # [B, 1, nQ, nK]
    full = k1_ctx <= a_min
    # = (ctx_part | own) & ~full: the whole tiles are context tiles seen (full ⊆ ctx_part) and never
    # a query tile's own block tiles, which lie past the context.
    return (ctx_part ^ full) | own, full


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """Flex attention's ordered layout of boolean tiles [..., rows, cols]: each row's count of True
    tiles (int32) and their column indices first, ascending (int32), as torch's own
    ``_dense_to_ordered`` builds it."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return count, order.to(torch.int32, memory_format=torch.contiguous_format)


def flex_block_mask(anchors: Tensor, ctx_len: int, gamma: int):
    """The packed training mask as a flex-attention BlockMask, its tiles from
    `packed_block_sparsity` and the element rule inside partial tiles from `packed_block_mask_mod`.
    The same BlockMask as ``BlockMask.from_kv_blocks`` of the key-major tiles, but the query-major
    ones (the backward pass's) come straight from the dense tiles, partial and full sorted together:
    ~20 host operators instead of ~90 (from_kv_blocks rebuilds the dense tiles from the ordered ones
    under vmap first)."""
    from torch.nn.attention.flex_attention import BlockMask

    tiles = torch.stack(packed_block_sparsity(anchors, ctx_len, gamma))  # [2: partial, full; B, 1, nQ, nK]
    kv_num, kv_idx = _ordered(tiles)
    q_num, q_idx = _ordered(tiles.transpose(-2, -1))
    (kv_num, full_kv_num), (kv_idx, full_kv_idx) = kv_num.unbind(0), kv_idx.unbind(0)
    (q_num, full_q_num), (q_idx, full_q_idx) = q_num.unbind(0), q_idx.unbind(0)
    q_len = anchors.shape[1] * gamma
    return BlockMask(
        seq_lengths=(q_len, ctx_len + q_len),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
        mask_mod=packed_block_mask_mod(anchors, ctx_len, gamma),
    )


def compile_for_training(layer: nn.Module, **options) -> nn.Module:
    """``torch.compile`` a draft layer for training batches of any context length: sizes are
    symbolic from the first call, so one graph serves every batch (specialising on the first
    shape and then recompiling for the next ones cost ~10 s per recompilation on the H200)."""
    return torch.compile(layer, dynamic=True, **options)


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def block_targets(input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, gamma: int):
    """For anchors [B, A]: the label positions a+k+1, the positions whose target distribution
    predicts them (a+k), and the eval mask: inside the sequence and loss_mask holding contiguously
    from a+1 to a+k+1."""
    t = input_ids.shape[1]
    k = torch.arange(gamma, device=anchors.device)
    pred_pos = anchors.clamp(min=0)[..., None] + k  # [B, A, γ]
    label_pos = pred_pos + 1
    inside = (label_pos < t) & (anchors[..., None] >= 0)
    at = label_pos.clamp(max=t - 1).flatten(1)
    gathered = torch.gather(loss_mask.long(), 1, at).view_as(label_pos)
    valid = (gathered.bool() & inside).long().cumprod(-1).bool()
    labels = torch.gather(input_ids, 1, at).view_as(label_pos)
    return pred_pos.clamp(max=t - 1), labels, valid


def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: torch.Generator | None = None) -> Tensor:
    """[B, num_anchors]: up to `num_anchors` positions a per sequence with loss_mask[a] and
    loss_mask[a+1], sorted, padded with -1. Uniform without replacement. Always `num_anchors`
    columns, however short the batch: the compiled training step then sees one query length."""
    lm = loss_mask.bool()
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:]
    # Drawn where the generator lives (the GPU in training: no host round trip per step).
    scores = torch.rand(ok.shape, generator=generator, device=generator.device if generator else ok.device)
    scores = torch.where(ok, scores, -1.0)
    if ok.shape[1] < num_anchors:  # fewer positions than anchors: pad with never-valid ones
        scores = F.pad(scores, (0, num_anchors - ok.shape[1]), value=-1.0)
    top = scores.topk(num_anchors, dim=1)
    anchors = torch.where(top.values >= 0, top.indices, -1)
    # Sort valid anchors ascending, invalid (-1) last.
    key = torch.where(anchors >= 0, anchors, ok.shape[1] + 1)
    return anchors.gather(1, key.argsort(dim=1))


# The slot conventions (module docstring): which block slot drafts the first token.
SLOTS = {"anchor": 0, "masks": 1}


def check_slots(drafter_cfg) -> None:
    """Refuse an unknown ``slots`` value, or a masks block with no mask slot to draft from."""
    slots = drafter_cfg.get("slots", "anchor")
    if slots not in SLOTS:
        raise ConfigError(
            f"drafter.slots={slots} is not one of {tuple(SLOTS)} (anchor: DeepSpec's layout, the anchor's "
            f"slot drafts the next token; masks: z-lab's, the anchor is the bonus token)"
        )
    if int(drafter_cfg["block_size"]) - SLOTS[slots] < 1:
        raise ConfigError(
            f"drafter.block_size={drafter_cfg['block_size']} with drafter.slots={slots} drafts no token: "
            f"the block needs at least {SLOTS[slots] + 1} slots"
        )


@dataclass
class BlockDrafterConfig(DrafterConfig):
    attention: Literal["auto", "dense", "flex"] = "auto"  # training attention (see BlockDrafter)
    compile: Literal["auto", True, False] = "auto"  # torch.compile the draft layers for training
    slots: Literal["anchor", "masks"] = "anchor"  # which block slot drafts the first token (SLOTS)


@register("dflash")
class BlockDrafter(Drafter):
    """DFlash: parallel backbone only; the draft distribution at k is softmax(lm_head(h_k))."""

    supports_static_cache = True  # all its state is context keys/values at slot == position
    config_schema = BlockDrafterConfig

    def __init__(self, dims: TargetDims, cfg, head_cfg=None):
        super().__init__()
        check_slots(cfg)
        self.dims = dims
        self.slots = str(cfg.get("slots", "anchor"))
        self.block_size = int(cfg.block_size)  # slots per block, the anchor's included
        self.first_draft = SLOTS[self.slots]  # the slot that drafts x_{a+1}
        self.gamma = self.block_size - self.first_draft
        self.num_anchors = int(cfg.get("num_anchors", 512))
        # Training attention: "dense" (boolean mask, SDPA), "flex" (block-sparse, compiled on CUDA;
        # it has no CPU backward) or "auto" (flex on CUDA, dense elsewhere). Flex is tested equal to
        # dense (CPU forward, GPU tests); on the H200 it is the faster one once the layers are
        # compiled (docs/results, train_step).
        self.attention = cfg.get("attention", "auto")
        # torch.compile the draft layers for training: true, false, or "auto" (on CUDA). Inference
        # and CPU runs stay eager either way.
        self.compile_training = cfg.get("compile", "auto")
        self._compiled_layers = None
        self._rope_tables: dict = {}  # device -> (cos, sin) of positions 0..n-1 (rope_table; not registered)
        # compile_inference: the fused write_context and propose (plain attributes: not registered)
        self._context_writer: ContextWriter | None = None
        self._fused: FusedDraft | None = None
        self._fused_compiler = None
        s = layer_shape(dims, cfg)
        self.fc = nn.Linear(dims.num_taps * dims.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(int(cfg.num_layers)))
        self.norm = RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.apply(_init_linear)

    @classmethod
    def check_config(cls, drafter_cfg, head_cfg) -> None:
        super().check_config(drafter_cfg, head_cfg)
        check_slots(drafter_cfg)

    @classmethod
    def config_gamma(cls, drafter_cfg) -> int:
        return int(drafter_cfg["block_size"]) - SLOTS[drafter_cfg.get("slots", "anchor")]

    # ---- shared pieces -----------------------------------------------------------------------
    def context(self, taps: Tensor) -> Tensor:
        return self.hidden_norm(self.fc(matmul_input(taps, self.fc.weight)))

    def backbone(
        self,
        x: Tensor,
        positions: Tensor,
        ctx_kv_per_layer,
        mask: Tensor,
        layers=None,
        tail: int | None = None,
        fused: list[FusedProjections] | None = None,
    ) -> Tensor:
        """``tail``: see ``Attention.forward`` (a static cache's room for the block's own keys);
        ``fused``: each layer's stacked projections (``DraftLayer.forward``)."""
        fused = fused or [None] * len(self.layers)
        for layer, ctx_kv, projections in zip(layers or self.layers, ctx_kv_per_layer, fused):
            x, _ = layer(x, positions, ctx_kv, mask, tail, projections)
        return self.norm(x)

    def training_layers(self, device) -> list:
        """The draft layers as the training step runs them: compiled wrappers (sharing the
        parameters, kept out of the module tree) when `compile` is set and the step is on CUDA and
        builds a graph for backward. Validation (no grad) runs the layers eagerly, their flex
        attention compiled alone: no-grad graphs of whole layers were two more compilations in the
        sanity check (which took 166 s of an H200 session, 2026-12-05, the GPU tests beside it) and
        one more for the last, partial validation batch inside the training clock, to serve ~40
        batches a validation."""
        if self.compile_training in (False, "false") or device.type != "cuda" or not torch.is_grad_enabled():
            return list(self.layers)
        if self._compiled_layers is None:
            self._compiled_layers = [compile_for_training(layer) for layer in self.layers]  # not registered
        return self._compiled_layers

    def compile_inference(self, compiler: Callable | None = inference_compiler) -> None:
        """The fused inference paths, each function wrapped by ``compiler`` (tests pass a counting
        backend, or None to run the fused code eagerly): ``write_context`` through
        ``ContextWriter``, ``propose`` through ``FusedDraft``. Idempotent for one compiler (every
        fast engine asks): the paths, and the tensors they derive, stay those earlier engines'
        captured graphs read; another compiler replaces them (graphs captured through the old
        ones must not replay after that)."""
        if self._fused is not None and self._fused_compiler is compiler:
            return
        self._fused_compiler = compiler
        self._context_writer = ContextWriter(self, compiler)
        self._fused = FusedDraft(self, compiler)

    def block_inputs(self, anchor_tokens: Tensor, shared: Shared) -> Tensor:
        """[anchor, mask, …, mask] (block_size slots) embedded, for anchors of any shape."""
        ids = anchor_tokens[..., None].expand(*anchor_tokens.shape, self.block_size).clone()
        ids[..., 1:] = self.dims.mask_token_id
        return matmul_input(shared.embed(ids), self.fc.weight)

    def drafting_slots(self, hidden: Tensor) -> Tensor:
        """The hidden states [..., block_size, d] of the slots that draft x_{a+1}..x_{a+γ}."""
        return hidden if self.first_draft == 0 else hidden[..., self.first_draft :, :].contiguous()

    # ---- hooks a sequential head overrides ---------------------------------------------------
    def head_features(self, hidden: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced: hidden [N, γ, d], prev [N, γ] -> (features [N, γ, K], confidence logits)."""
        return hidden, None

    def bias_weight(self) -> Tensor | None:
        """The trainable columns appended to the frozen LM head (None: logits = h @ W_lmᵀ)."""
        return None

    def sample_block(self, hidden: Tensor, anchor: Tensor, shared: Shared, temperature: float, u: Tensor):
        """hidden [R, n, d] and uniforms [R, n] -> tokens [R, n], probs [R, n, V], confidences (over a
        draft vocabulary where ``shared`` has one: probs [R, n, K], the tokens mapped to target ids)."""
        r, n, _ = hidden.shape
        step = sample_step(self.block_logits(hidden, shared).flatten(0, 1), None, temperature, u.flatten())
        return shared.target_ids(step.tokens.view(r, n)), step.probs.view(r, n, -1), None

    @staticmethod
    def block_logits(hidden: Tensor, shared: Shared) -> Tensor:
        """The LM head's logits of hidden [..., d]; soft-capped where the target caps them."""
        if shared.softcap:
            return output_logits(hidden, shared.lm_weight, shared.softcap)
        # The sampler upcasts the logits itself: the same float32 values, without a copy.
        return head_product(hidden, shared.lm_weight)

    position_major = False  # the layout of draft_hidden's output that sample_block_fused takes

    def sample_block_fused(
        self, hidden: Tensor, anchor: Tensor, shared: Shared, temperature: float, u, fused
    ):
        """``sample_block`` of the first n positions of ``hidden`` [R, γ, d] (``FusedDraft``); at
        T = 0 the argmax tokens alone (probabilities None: greedy verification reads tokens only)."""
        first = hidden[:, : u.shape[1]].contiguous()  # one GEMM for the LM head (see propose)
        if temperature == 0:
            return shared.target_ids(self.block_logits(first, shared).argmax(-1)), None, None
        return self.sample_block(first, anchor, shared, temperature, u)

    # ---- training ----------------------------------------------------------------------------
    def train_forward(
        self, taps: Tensor, input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, shared: Shared
    ) -> DraftOutput:
        b, t = input_ids.shape
        a = anchors.shape[1]
        with phase("context_kv"):  # the target's taps as every layer's context keys and values
            ctx_kv = self.training_context_kv(taps)
        anchor_tokens = torch.gather(input_ids, 1, anchors.clamp(min=0))
        x = self.block_inputs(anchor_tokens, shared).flatten(1, 2)  # [B, A·block, d]
        if torch.is_grad_enabled() and not x.requires_grad:
            # The first layer's input then requires grad as every later layer's does, so one compiled
            # graph serves them all (the H200, 2026-12-05: a second graph for the first layer; the
            # ten steps that compiled both took 50 s of the training clock).
            x = x.detach().requires_grad_()
        pos = (anchors.clamp(min=0)[..., None] + torch.arange(self.block_size, device=x.device)).flatten(1)
        with phase("block_mask"):
            mask = self.training_mask(anchors, t, x.device)
        with phase("draft_layers"):
            hidden = self.backbone(x, pos, ctx_kv, mask, self.training_layers(x.device)).view(
                b, a, self.block_size, -1
            )
        hidden = self.drafting_slots(hidden)  # [B, A, γ, d]: row k drafts x_{a+k+1} in both conventions
        with phase("heads"):
            pred_pos, labels, valid = block_targets(input_ids, loss_mask, anchors, self.gamma)
            # Teacher forcing: the token before draft k is the anchor (k=0) or the true x_{a+k}.
            prev = torch.cat([anchor_tokens[..., None], labels[..., :-1]], dim=-1)
            feats, conf = self.head_features(hidden.flatten(0, 1), prev.flatten(0, 1))
        return DraftOutput(
            features=feats.view(b, a, self.gamma, -1),
            bias_weight=self.bias_weight(),
            confidence_logits=None if conf is None else conf.view(b, a, self.gamma),
            target_positions=pred_pos,
            valid=valid,
            labels=labels,
        )

    def training_context_kv(self, taps: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every layer's context keys and values [B, Hkv, T, hd] of taps [B, T, m·d] at positions
        0..T-1: ``DraftLayer.context_kv`` of ``context(taps)``, layer by layer's arithmetic, but for
        all layers at once (as ``context_write.write_layers`` does for the inference cache): one GEMM
        against the layers' k/v weights concatenated, k_norm and the rotation on every layer
        together, the RoPE table from ``rope_table``. ~55 host operators (and fewer autograd nodes)
        where the per-layer loop ran ~40 per layer; the same numbers but for the GEMM's rounding."""
        ctx = self.context(taps)
        b, t, _ = ctx.shape
        attn = [layer.attn for layer in self.layers]
        s, n = attn[0].s, len(attn)
        weight = torch.cat([a.k_proj.weight for a in attn] + [a.v_proj.weight for a in attn])
        kv = F.linear(ctx, weight).view(b, t, 2, n, s.num_kv_heads, s.head_dim)
        k, v = kv.unbind(2)  # [B, T, L, Hkv, hd]
        k = rms_norm(k, torch.stack([a.k_norm.weight for a in attn])[:, None], attn[0].k_norm.eps)
        cos, sin = self.rope_table(t, ctx.device)
        k = rotate(k, cos[:, None, None].to(k.dtype), sin[:, None, None].to(k.dtype))
        k, v = k.permute(2, 0, 3, 1, 4), v.permute(2, 0, 3, 1, 4)  # [L, B, Hkv, T, hd]
        # Each layer's own contiguous tensors, as the per-layer path made them: views into the stack
        # would add their base's sizes, strides and offsets to the guards of the compiled layers
        # (more host time per call, and recompiles when two of those sizes happen to coincide).
        return [(kl.contiguous(), vl.contiguous()) for kl, vl in zip(k.unbind(0), v.unbind(0))]

    def rope_table(self, length: int, device) -> tuple[Tensor, Tensor]:
        """cos/sin [length, hd] (float32) of positions 0..length-1, sliced from a table kept per device
        and grown by doubling: the reference ``rope``'s numbers, computed once rather than per step
        and layer."""
        key = torch.device(device)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < length:
            size = max(length, 2 * table[0].shape[0] if table is not None else 0)
            s = self.layers[0].attn.s
            # Never inference tensors (a first call under inference mode would make them): autograd
            # saves cos/sin for the rotation's backward in the training steps that reuse them.
            with torch.inference_mode(False):
                table = rope(torch.arange(size, device=device), s.head_dim, s.rope_theta)
            self._rope_tables[key] = table
        return table[0][:length], table[1][:length]

    def training_mask(self, anchors: Tensor, ctx_len: int, device):
        use_flex = self.attention == "flex" or (
            self.attention == "auto" and torch.device(device).type == "cuda"
        )
        if not use_flex or not flex_available():
            return packed_block_mask(anchors, ctx_len, self.block_size)
        return flex_block_mask(anchors, ctx_len, self.block_size)

    # ---- inference ---------------------------------------------------------------------------
    def new_cache(self, r: int, device, dtype=None, capacity: int = 0) -> DraftCache:
        ref = torch.zeros((), device=device, dtype=dtype or self.fc.weight.dtype)
        return empty_cache(self.layers, r, ref, capacity)

    @torch.no_grad()
    def extend_context(
        self, cache: DraftCache, taps: Tensor, positions: Tensor, valid: Tensor, next_tokens=None, shared=None
    ):
        """Append committed target features [R, N, m·d] at positions [R, N] (valid: prefix mask)."""
        ctx = self.context(taps)
        append_kv(cache, [layer.context_kv(ctx, positions) for layer in self.layers], valid)

    @torch.no_grad()
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
        """γ tokens from each anchor (see ``Drafter.propose``); the backbone always runs the whole
        block (its positions attend to each other), the heads only the first ``draft_len``. After
        ``compile_inference`` the fused paths (``draft_step.FusedDraft``) run it; the code below is
        their reference."""
        r = anchor_tokens.shape[0]
        n = draft_length(self.gamma, draft_len)
        if cache.block_slots and cache.block_slots < self.block_size:
            raise ValueError(
                f"the cache's block room ({cache.block_slots} slots) is below the block ({self.block_size})"
            )
        u = draft_uniforms(r, self.gamma, generator, uniforms, anchor_tokens.device)
        if self._fused is not None:
            return self._fused.propose(cache, anchor_tokens, anchor_pos, shared, temperature, u[:, :n])
        c = cache
        hidden = self.draft_hidden(c.k, c.v, c.length, anchor_tokens, anchor_pos, shared, c.block_slots)
        # Contiguous: the LM head over a strided [R, n < γ, d] view would run as R batched GEMMs
        # (matmul cannot fold the rows), each reading the whole head: slower than all γ positions.
        first = hidden[:, :n].contiguous()
        tokens, probs, conf = self.sample_block(first, anchor_tokens, shared, temperature, u[:, :n])
        return Proposal(tokens=tokens, probs=probs, confidence_logits=conf)

    def draft_hidden(
        self,
        k: list[Tensor],
        v: list[Tensor],
        length: Tensor,
        anchor_tokens: Tensor,
        anchor_pos: Tensor,
        shared: Shared,
        block_slots: int,
        position_major: bool = False,
        fused: list[FusedProjections] | None = None,
        attention: str = "torch",
    ) -> Tensor:
        """The backbone over each anchor's block: the hidden states of the slots that draft
        x_{a+1}..x_{a+γ}, [R, γ, d] ([γ, R, d] when ``position_major``). ``k``/``v``: the cache's
        per-layer context keys/values, ``length`` [R] the context each row sees, ``block_slots``:
        the cache's room for the block (``DraftCache.block_slots``), ``fused``: each layer's
        stacked projections (``FusedProjections``: fewer GEMMs), ``attention``: see
        ``draft_mask``."""
        device = anchor_tokens.device
        x = self.block_inputs(anchor_tokens, shared)  # [R, block, d]
        pos = anchor_pos[:, None] + torch.arange(self.block_size, device=device)
        c = k[0].shape[2] - block_slots  # context slots; the block's own keys follow
        mask = self.draft_mask(length, c, block_slots, attention)
        tail = c if block_slots else None
        hidden = self.drafting_slots(self.backbone(x, pos, list(zip(k, v)), mask, None, tail, fused))
        return hidden.transpose(0, 1).contiguous() if position_major else hidden

    def draft_mask(self, length: Tensor, c: int, block_slots: int, attention: str = "torch"):
        """What the block's queries see, built once for every layer: each row's first ``length``
        of the ``c`` context slots and the whole block (bidirectionally). ``attention`` "torch":
        a bool mask over context + block for SDPA, folded for grouped-query attention (the
        reference, and the only way when the block's keys are concatenated: no ``block_slots``);
        else, over a static cache, a ``CacheSpan`` for ``kernels.cache_attention`` with that
        ``impl``, whose reads stop at each row's context."""
        r, width = length.shape[0], self.block_size
        if attention != "torch" and block_slots:
            last = (length.clamp(max=c) - 1)[:, None].expand(r, width).contiguous()
            return CacheSpan(last, attention)
        sees_ctx = torch.arange(c, device=length.device)[None, :] < length[:, None]
        mask = torch.cat([sees_ctx, torch.ones(r, width, dtype=torch.bool, device=length.device)], dim=1)
        s = self.layers[0].attn.s
        return fold_mask(mask[:, None, :].expand(r, width, -1), s.num_heads // s.num_kv_heads)

    @torch.no_grad()
    def write_context(self, cache: DraftCache, taps: Tensor, positions: Tensor, rows: Tensor) -> None:
        """Static-cache hook (see ``Drafter.write_context``). After ``compile_inference``, one
        compiled function writes every layer (``context_write``); the loop below is its reference."""
        if self._context_writer is None or not self._context_writer.write(cache, taps, positions, rows):
            self.write_context_reference(cache, taps, positions, rows)

    def write_context_reference(self, cache: DraftCache, taps: Tensor, positions: Tensor, rows: Tensor):
        """``write_context`` layer by layer, eagerly: the reference of the fused write."""
        r, w = positions.shape
        ctx = self.context(taps)
        rows = rows[:, None].expand(r, w)
        for layer, k_store, v_store in zip(self.layers, cache.k, cache.v):
            k, v = layer.context_kv(ctx, positions)  # [R, Hkv, W, hd]
            k_store[rows, :, positions] = k.transpose(1, 2).to(k_store.dtype)
            v_store[rows, :, positions] = v.transpose(1, 2).to(v_store.dtype)


def _init_linear(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
