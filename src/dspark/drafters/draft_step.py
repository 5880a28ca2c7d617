"""The draft step as few kernels (``BlockDrafter.compile_inference``).

The reference, ``BlockDrafter.propose`` run eagerly, launches the block's inputs, positions and
attention mask op by op, each draft layer (compiled one by one before this), the final norm op by
op, and per drafted position the head's small ops and the sampler; at R = 1 each of these tiny
kernels costs about as much as a draft layer's GEMM. Here (``FusedDraft``):
  * ``hidden``: one compiled graph from the anchors to the drafting slots' hidden states (block
    inputs, positions, the attention mask folded once, every layer with its q/k/v and gate/up
    projections stacked into one GEMM each, the final norm: ``BlockDrafter.draft_hidden``), fused
    across layer boundaries; for DSpark laid out position-major, so each position's slice is
    contiguous;
  * ``position``: one compiled graph per drafted position for the sequential head's step and its
    bias (and a soft-cap): ``DSparkDrafter.position_logits``; at T = 0 no sampler and no
    probabilities (greedy verification reads none): on CUDA ``kernels.bias_argmax`` from the
    head's features (a Markov head's gathered in the kernel, others' from ``DSparkDrafter.head_step``
    compiled alone) to the token, else ``argmax``, the same step through to the position's greedy
    token (``DSparkDrafter.position_argmax``);
  * ``confidence``: one compiled graph for the confidence head over the whole block;
  * the sampler (``kernels.sample_step``, a user Triton kernel on CUDA, its reference elsewhere)
    stays outside the graphs and writes each position's probabilities into the proposal's buffer.
On CUDA over a static cache the layers attend with ``kernels.cache_attention`` (``attention_impl``),
an operator inside the ``hidden`` graph, which reads each row's keys only up to its context: SDPA
with the mask read the cache's whole capacity and ran helper kernels (mask conversion, fills).
Dynamo specialises a size of 1, so each function compiles two graphs: one for a single row, one
for every larger row count (marked dynamic). The drafted length enters none of them (the hidden
states and the confidences cover the whole block, the head's step one position): nothing
recompiles across the engine's buckets and drafted lengths (tested)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.fx.experimental._config  # noqa: F401  (no_duck_shapes)
from torch import Tensor

from ..core.compiling import EagerOnFailure
from ..core.types import DraftCache, Proposal, Shared
from ..kernels import triton_available
from ..kernels.bias_argmax import MAX_ROWS as BIAS_KERNEL_MAX_ROWS
from ..kernels.bias_argmax import bias_argmax, bias_argmax_self_check
from ..kernels.cache_attention import kernel_self_check, triton_fits
from .derived import DerivedWeights
from .heads import MarkovHead
from .layers import FusedProjections

__all__ = ["FusedDraft", "inference_compiler", "mark_dynamic"]


def inference_compiler(fn):
    """``torch.compile`` for the fused inference paths: a graph break would split a fused path into
    several graphs and eager glue between them, so none is allowed (``fullgraph``). A function this
    torch cannot compile runs eagerly instead, with a warning (``EagerOnFailure``)."""
    return EagerOnFailure(torch.compile(fn, fullgraph=True), fn)


def mark_dynamic(t: Tensor | None, *dims: int) -> None:
    """Mark ``dims`` of ``t`` dynamic where they are above 1 (a size of 1 is specialised anyway).
    ``maybe_mark_dynamic``: a size the graph does specialise costs a graph, not an error."""
    if t is not None:
        for d in dims:
            if t.shape[d] > 1:
                torch._dynamo.maybe_mark_dynamic(t, d)


def no_duck_shapes():
    """Dynamo tracing with one symbol per size, not one per distinct value (where this torch has
    the switch; it has since 2.1)."""
    config = torch.fx.experimental._config
    return config.patch(use_duck_shape=False) if hasattr(config, "use_duck_shape") else nullcontext()


def qkv_weights(layer) -> list[Tensor]:
    a = layer.attn
    return [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]


def gate_up_weights(layer) -> list[Tensor]:
    return [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]


def stacked(sources) -> DerivedWeights:
    """The weights ``sources()`` returns, concatenated along the output features."""
    return DerivedWeights(sources, lambda *w: torch.cat(w))


class FusedDraft:
    """``propose`` of a block drafter through its fused paths, each wrapped by ``compiler``
    (None: eagerly, for tests). The drafter supplies the functions (``draft_hidden``,
    ``sample_block_fused`` and, for DSpark, ``position_logits`` and ``confidence_by_position``);
    their eager use in ``propose``/``sample_block`` is the reference."""

    attention = "auto"  # the draft step's attention (attention_impl); "torch" or "triton" force one
    greedy_kernel = "auto"  # bias_argmax in greedy_step: CUDA, compiled, <= 64 rows; "torch"/"triton" force

    def __init__(self, drafter, compiler=inference_compiler):
        self.drafter = drafter
        self.compiled = compiler is not None
        wrap = compiler if compiler is not None else (lambda fn: fn)
        self.hidden = wrap(drafter.draft_hidden)
        # Each layer's q/k/v and gate/up weights stacked: 3 GEMMs fewer per layer.
        self.projections = [
            (
                stacked(lambda i=i: qkv_weights(drafter.layers[i])),
                stacked(lambda i=i: gate_up_weights(drafter.layers[i])),
            )
            for i in range(len(drafter.layers))
        ]
        self.position = wrap(drafter.position_logits) if hasattr(drafter, "position_logits") else None
        self.argmax = wrap(drafter.position_argmax) if hasattr(drafter, "position_argmax") else None
        self.head_step = wrap(drafter.head_step) if hasattr(drafter, "head_step") else None
        self.confidence = (
            wrap(drafter.confidence_by_position) if hasattr(drafter, "confidence_by_position") else None
        )

    def mark(self, t: Tensor | None, *dims: int) -> None:
        if self.compiled:
            mark_dynamic(t, *dims)

    def step(
        self, base: Tensor, h: Tensor, prev: Tensor, state: Tensor | None, softcap, greedy=False,
        bias_weight: Tensor | None = None,
    ):  # fmt: skip
        """``position`` (``argmax`` when ``greedy``) for one drafted position; the rows of the very
        tensors passed are marked dynamic (marks live on tensors; not ``bias_weight``'s, a draft
        vocabulary's rows of W2, whose size is the vocabulary's). Its slices of the block sit at
        another storage offset for each position: duck sizing (one symbol for equal sizes) would tie
        an offset to an equal size or stride and recompile at the position where they part, so it
        is off here."""
        fn = self.argmax if greedy else self.position
        return self._marked(fn, base, h, prev, state, softcap, bias_weight=bias_weight)

    def greedy_step(
        self, base: Tensor, h: Tensor, prev: Tensor, state: Tensor | None, softcap,
        bias_weight: Tensor | None = None,
    ):  # fmt: skip
        """A position's greedy token and the head's new state. Where ``greedy_kernel`` allows (on
        CUDA, compiled, no soft-cap, up to 64 rows) ``kernels.bias_argmax`` takes the head's
        features to the token (the bias GEMM, the sum and the argmax in two kernels, no [R, V] bias
        logits): a Markov head's features (W1 at the previous tokens) it gathers itself, other
        heads' come from their step compiled alone. Else ``step(greedy=True)``, the compiled
        ``position_argmax``. The same token either way, to the bias GEMM's rounding (the kernel
        checks itself once per device). With a draft vocabulary (``bias_weight``: its rows of W2)
        the token is an index into it."""
        if not self._greedy_kernel_runs(base, h, softcap):
            return self.step(base, h, prev, state, softcap, greedy=True, bias_weight=bias_weight)
        head = self.drafter.head
        w2 = head.W2.weight if bias_weight is None else bias_weight
        if isinstance(head, MarkovHead):  # b = W1[prev]: the kernel gathers it, no step of its own
            return bias_argmax(base, w2, head.W1.weight, rows=prev, impl="triton"), state
        b, state = self._marked(self.head_step, h, prev, state)
        return bias_argmax(base, w2, b, impl="triton"), state

    def _greedy_kernel_runs(self, base: Tensor, h: Tensor, softcap) -> bool:
        head = self.drafter.head
        if self.head_step is None or head is None or softcap or self.greedy_kernel == "torch":
            return False
        if self.greedy_kernel == "auto" and not (
            self.compiled and base.is_cuda and triton_available() and base.shape[0] <= BIAS_KERNEL_MAX_ROWS
        ):  # more rows: each tile of them reads W2 again, where the compiled GEMM reads it once
            return False
        return bias_argmax_self_check(base.device, h.dtype, head.rank)

    def _marked(self, fn, *args, **unmarked):
        """``fn(*args, **unmarked)``, compiled with the rows of its positional tensor arguments
        dynamic and duck sizing off (see ``step``)."""
        if not self.compiled:
            return fn(*args, **unmarked)
        for t in args:
            if isinstance(t, Tensor):
                mark_dynamic(t, 0)
        with no_duck_shapes():
            return fn(*args, **unmarked)

    def attention_impl(self, cache: DraftCache) -> str:
        """``draft_hidden``'s ``attention``: "triton" (``kernels.cache_attention``) over a static
        cache on CUDA where the kernel takes the drafter's heads and passed its self-check on this
        device (a failed check warns once); else "torch", SDPA with the mask (the reference)."""
        if not cache.block_slots:
            return "torch"  # the block's keys are concatenated after the context, not in the cache
        if self.attention != "auto":
            return self.attention
        k, s = cache.k[0], self.drafter.layers[0].attn.s
        if not (k.is_cuda and triton_available() and triton_fits(s.head_dim)):
            return "torch"
        groups = s.num_heads // s.num_kv_heads
        return "triton" if kernel_self_check(k.device, k.dtype, s.head_dim, groups, tail=True) else "torch"

    def propose(
        self, cache: DraftCache, anchor_tokens: Tensor, anchor_pos: Tensor, shared: Shared, temperature, u
    ) -> Proposal:
        """``u`` [R, n]: the uniforms of the n positions to draft."""
        d = self.drafter
        for t in (*cache.k, *cache.v, cache.length, anchor_tokens, anchor_pos):
            self.mark(t, 0)
        fused = [FusedProjections(qkv.get(), gate_up.get()) for qkv, gate_up in self.projections]
        hidden = self.hidden(
            cache.k, cache.v, cache.length, anchor_tokens, anchor_pos, shared, cache.block_slots,
            d.position_major, fused, self.attention_impl(cache),
        )  # fmt: skip
        tokens, probs, conf = d.sample_block_fused(hidden, anchor_tokens, shared, temperature, u, self)
        return Proposal(tokens=tokens, probs=probs, confidence_logits=conf)
