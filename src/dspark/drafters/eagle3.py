"""Eagle3 (§4.1 baseline): one decoder layer over u_t = [embed(x_t); feature_{t-1}], an
autoregressive chain at inference, trained with training-time test (TTT).

TTT step i at position t drafts for anchor a = t - i: its feature is the target's fused taps at
t-1 when i = 0, else the drafter's own step-(i-1) output at t-1. It attends to step-0 keys at
positions 1..a (what the target has verified; position 0 has no feature_{-1}, hence no entry at
inference) and to the chain keys of steps 1..i at a+1..a+i, exactly the keys an inference chain
from anchor a would have. Step i predicts x_{t+1}.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.sampling import probs_from_logits, sample_from
from ..core.schema import Count
from ..core.types import DraftCache, DraftOutput, Proposal, Shared, TargetDims
from .base import (
    Drafter,
    DrafterConfig,
    append_kv,
    draft_length,
    draft_uniforms,
    empty_cache,
    layer_shape,
    output_logits,
)
from .dflash import _init_linear, block_targets
from .draft_step import inference_compiler
from .layers import DraftLayer, RMSNorm, matmul_input
from .registry import register


def ttt_mask(t: int, step: int, device) -> Tensor:
    """[T, step·T + T] keys visible to step `step` queries: step-0 keys 1 ≤ s ≤ t-step, then for
    chain steps j = 1..step the single key at s = t-step+j (the last one being the query's own).
    The step-0 key at s = 0 is no entry inference ever has: its feature_{-1} does not exist (zeros
    here), and ``extend_context`` writes the pairs (x_{p+1}, feature_p) from position 1 on. So only
    position 0's own query sees it (anchor 0, never trained on: every inference anchor has a prefix)."""
    q = torch.arange(t, device=device)[:, None]
    s = torch.arange(t, device=device)[None, :]
    if step == 0:
        return (s <= q) & ((s > 0) | (q == 0))
    blocks = [(s <= q - step) & (s > 0)] + [s == q - step + j for j in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


@dataclass
class Eagle3Config(DrafterConfig):
    ttt_steps: Count = 7  # training-time-test horizon


@register("eagle3")
class Eagle3Drafter(Drafter):
    config_schema = Eagle3Config
    # Its context is per-layer keys/values too, the entry at slot p being (x_{p+1}, feature_p):
    # static-cache ready once the round is verified (``commit_context``).
    supports_static_cache = True
    context_needs_tokens = True

    def __init__(self, dims: TargetDims, cfg, head_cfg=None):
        super().__init__()
        self.dims = dims
        self.gamma = int(cfg.block_size)
        self.ttt_steps = int(cfg.get("ttt_steps", self.gamma))
        s = layer_shape(dims, cfg)
        d = s.hidden_size
        self.fc = nn.Linear(dims.num_taps * dims.hidden_size, d, bias=False)
        self.embed_norm = RMSNorm(d, eps=s.rms_norm_eps)
        self.feature_norm = RMSNorm(d, eps=s.rms_norm_eps)
        self.in_proj = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(int(cfg.num_layers)))
        self.norm = RMSNorm(d, eps=s.rms_norm_eps)
        self.apply(_init_linear)
        # compile_inference: the static-cache paths as compiled functions (plain attributes)
        self._chain, self._commit, self._compiler = self._chain_step, self._commit_entries, None
        self._draw = self._draw_step

    def _inputs(self, tokens: Tensor, feature: Tensor, shared: Shared) -> Tensor:
        e = matmul_input(shared.embed(tokens), self.fc.weight)
        return self.in_proj(torch.cat([self.embed_norm(e), self.feature_norm(feature)], dim=-1))

    def _layers(self, x, pos, ctx_kv_per_layer, mask, tail: int | None = None):
        own = []
        for layer, ctx_kv in zip(self.layers, ctx_kv_per_layer):
            x, kv = layer(x, pos, ctx_kv, mask, tail)
            own.append(kv)
        return x, own

    # ---- training ----------------------------------------------------------------------------
    def train_forward(self, taps, input_ids, loss_mask, anchors, shared: Shared) -> DraftOutput:
        """Every position is an anchor (the `anchors` argument is ignored); rows (a, i) = step i of
        the chain from anchor a."""
        b, t = input_ids.shape
        steps = self.ttt_steps
        pos = torch.arange(t, device=input_ids.device).expand(b, -1)
        f = self.fc(matmul_input(taps, self.fc.weight))
        feature = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)  # feature_{t-1}
        lm = loss_mask.bool()
        # Position 0 is no anchor: inference always has a prefix before its anchor (see ttt_mask).
        all_anchors = torch.where(lm & (pos > 0), pos, torch.full_like(pos, -1))
        kv_steps: list[list[tuple[Tensor, Tensor]]] = []  # [step][layer] -> (k, v)
        outs = []
        for i in range(steps):
            x = self._inputs(input_ids, feature, shared)
            ctx = None
            if i:
                ctx = [
                    (
                        torch.cat([kv_steps[j][li][0] for j in range(i)], 2),
                        torch.cat([kv_steps[j][li][1] for j in range(i)], 2),
                    )
                    for li in range(len(self.layers))
                ]
            mask = ttt_mask(t, i, input_ids.device).expand(b, -1, -1)
            g, own = self._layers(x, pos, ctx or [None] * len(self.layers), mask)
            kv_steps.append(own)
            outs.append(self.norm(g))
            feature = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
        # Re-index (step i, position t) as (anchor a = t - i, k = i).
        feats = torch.stack([torch.roll(o, shifts=-i, dims=1) for i, o in enumerate(outs)], dim=2)
        pred_pos, labels, valid = block_targets(input_ids, loss_mask, all_anchors, steps)
        return DraftOutput(
            features=feats,
            bias_weight=None,
            confidence_logits=None,
            target_positions=pred_pos,
            valid=valid,
            labels=labels,
        )

    # ---- inference ---------------------------------------------------------------------------
    def new_cache(self, r: int, device, dtype=None, capacity: int = 0) -> DraftCache:
        ref = torch.zeros((), device=device, dtype=dtype or self.fc.weight.dtype)
        cache = empty_cache(self.layers, r, ref, capacity)
        cache.extra["last"] = ref.new_zeros(r, self.fc.out_features)
        return cache

    @torch.no_grad()
    def extend_context(
        self, cache: DraftCache, taps, positions, valid, next_tokens, shared: Shared | None = None
    ):
        """Committed features at positions p..p+n-1 and the tokens at p+1..p+n: step-0 entries at
        p+1..p+n, whose last output (the anchor's) seeds the next chain."""
        slots = torch.arange(cache.k[0].shape[2], device=positions.device)
        old = slots < cache.length[:, None]
        g, own = self._new_entries(cache.k, cache.v, taps, positions, next_tokens, old, shared)
        append_kv(cache, own, valid)
        cache.extra["last"] = self._last_output(g, valid.sum(1), cache.extra["last"])

    @torch.no_grad()
    def commit_context(self, cache, taps, positions, next_tokens, kept, shared: Shared) -> None:
        """``extend_context`` over a static cache: the entries written at slot == position (scratch
        past ``kept``), attending to the slots before the first new position."""
        self._commit(cache.k, cache.v, cache.extra["last"], taps, positions, next_tokens, kept, shared)

    def _commit_entries(self, ks, vs, last, taps, positions, next_tokens, kept, shared) -> None:
        slots = torch.arange(ks[0].shape[2], device=positions.device)
        g, own = self._new_entries(ks, vs, taps, positions, next_tokens, slots < positions[:, :1], shared)
        for cache_k, cache_v, (k, v) in zip(ks, vs, own):
            index = positions[:, None, :, None].expand(k.shape)
            cache_k.scatter_(2, index, k.to(cache_k.dtype))
            cache_v.scatter_(2, index, v.to(cache_v.dtype))
        last.copy_(self._last_output(g, kept, last))

    def _new_entries(self, ks, vs, taps, positions, next_tokens, old, shared):
        """The step-0 entries (x_{p+1}, feature_p) at positions [R, n], each attending to the cache's
        slots where ``old`` [R, C] and causally to the new ones: their outputs and keys/values."""
        r, n = next_tokens.shape
        feature = self.fc(matmul_input(taps, self.fc.weight))
        x = self._inputs(next_tokens, feature, shared)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = torch.cat([old[:, None, :].expand(r, n, old.shape[1]), causal.expand(r, n, n)], dim=2)
        return self._layers(x, positions + 1, list(zip(ks, vs)), mask)

    def _chain_step(self, tok, g, pos, ks, vs, mask, tail: int, shared) -> Tensor:
        """One step of the chain over a static cache: the drafted token with the output before it,
        through the layers, its keys written into the block room at ``tail``; the new output."""
        x = self._inputs(tok[:, None], g[:, None], shared)
        out, _ = self._layers(x, pos, list(zip(ks, vs)), mask, tail=tail)
        return out[:, 0]

    def _draw_step(self, g: Tensor, u: Tensor, temperature: float, shared: Shared) -> tuple[Tensor, Tensor]:
        """One position's distribution from the chain's output and its token drawn with ``u``: the
        norm, the LM head, the softmax and the inverse-CDF draw, one graph when compiled (eager, a
        dozen small kernels a position). With a draft vocabulary ``p`` covers its K tokens and the
        token is mapped back to the target's ids."""
        p = probs_from_logits(output_logits(self.norm(g), shared.lm_weight, shared.softcap), temperature)
        return p, shared.target_ids(sample_from(p, u))

    def compile_inference(self, compiler: Callable | None = inference_compiler) -> None:
        """The static-cache paths, a chain step, a commit and a position's draw, each wrapped by
        ``compiler`` (None: the eager code; tests pass their own backend). Idempotent for one
        compiler. The chain step's ``tail`` and row count vary (a few graphs: the first values
        specialised, later ones made symbolic), within the recompile limit raised here."""
        if self._compiler is compiler and compiler is not None:
            return
        self._compiler = compiler
        wrap = compiler or (lambda fn: fn)
        self._chain, self._commit = wrap(self._chain_step), wrap(self._commit_entries)
        self._draw = wrap(self._draw_step)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 4 * self.gamma)

    @staticmethod
    def _last_output(g: Tensor, count: Tensor, last: Tensor) -> Tensor:
        """Each row's output at its last committed entry (what the next chain starts from), or its
        old one where nothing was committed."""
        at = g[torch.arange(g.shape[0], device=g.device), (count - 1).clamp(min=0)]
        return torch.where((count > 0)[:, None], at, last)

    @torch.no_grad()
    def propose(
        self, cache, anchor_tokens, anchor_pos, shared: Shared, temperature, generator=None, uniforms=None,
        draft_len=None,
    ) -> Proposal:  # fmt: skip
        r = anchor_tokens.shape[0]
        n = draft_length(self.gamma, draft_len)
        device = anchor_tokens.device
        u = draft_uniforms(r, self.gamma, generator, uniforms, device)
        g = cache.extra["last"]
        if 0 < cache.block_slots < self.gamma - 1:
            room, chain = cache.block_slots, self.gamma - 1
            raise ValueError(f"the cache's block room ({room} slots) is below the chain's {chain} keys")
        # A static cache's block room takes the chain's keys in place (slot c + j for step j); else
        # they are concatenated after the context, a copy of it per layer and step.
        c = cache.k[0].shape[2] - cache.block_slots
        base_mask = torch.arange(c, device=device)[None, :] < cache.length[:, None]
        chain_k = [[] for _ in self.layers]
        chain_v = [[] for _ in self.layers]
        tokens, probs = [], []
        for j in range(n):
            p, tok = self._draw(g, u[:, j], temperature, shared)
            tokens.append(tok)
            probs.append(p)
            if j == n - 1:
                break
            pos = (anchor_pos + j + 1)[:, None]
            mask = torch.cat([base_mask, torch.ones(r, j + 1, dtype=torch.bool, device=device)], 1)[:, None]
            if cache.block_slots:
                g = self._chain(tok, g, pos, cache.k, cache.v, mask, c + j, shared)
                continue
            x = self._inputs(tok[:, None], g[:, None], shared)
            ctx = [
                (torch.cat([cache.k[li], *chain_k[li]], 2), torch.cat([cache.v[li], *chain_v[li]], 2))
                for li in range(len(self.layers))
            ]
            out, own = self._layers(x, pos, ctx, mask)
            for li, (k, v) in enumerate(own):
                chain_k[li].append(k)
                chain_v[li].append(v)
            g = out[:, 0]
        return Proposal(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1), confidence_logits=None)
