"""The fast engine: the same rounds as ``Engine`` over static caches, with CUDA graphs.

What changes against the plain engine (``engine.py``), and nothing else:
  * the target runs ``StaticTarget`` (its own modules over a preallocated KV cache, slot ==
    position); the drafter's context keys/values live in a static cache of the same layout,
    written for every verified position inside the target step (rejected ones are invisible
    because each row's context length only grows by the kept tokens, and are overwritten later);
  * on CUDA the draft step (backbone + sequential head + confidence + sampling) and the target
    step (forward + probabilities + drafter context) are captured once per bucket of rows
    (``buckets``) and verify width, then replayed; live requests are kept in rows 0..R-1 so the
    graphs read plain views; bucket padding rows are free rows, so their writes are harmless;
  * verification uses ``dspark.kernels.rejection_verify`` (Triton on CUDA, its reference on CPU),
    which never synchronises with the host; a round that drafts nothing runs it inside its step's
    graph (its ``u_sample`` staged before the replay); at T = 0 rounds carry tokens, not
    distributions: the target step returns its argmax tokens, a fused draft step no probabilities, and
    ``greedy_verify`` compares tokens (``verify`` on one-hot distributions: tested), so no [R, G, V]
    tensor is built and no verification uniforms are drawn;
  * top-k / top-p filtering of p_t runs inside the target step's graph in its static form (one
    topk or one full-vocabulary sort per row: ``decoding.sampling``);
  * without a drafter the prefill pads each chunk of prompts to its own longest prompt and keeps
    no tap features (the drafter's context is their only reader);
  * on CUDA the target's layer functions and the drafter's layers are ``torch.compile``d by
    default (``compile``), inside the captured graphs;
  * a round that drafts nothing runs target-only decoding's width-1 step; the tap features of its
    committed anchors go to a small ring (``deferred_context`` rounds) instead of the drafter, and
    the drafter's context gets them in one write before the next draft step or when the ring is
    full (rows that move when requests leave take their ring entries along; rows that join point
    theirs at what their prefill writes, so a join needs no write: ``_park_ring``). Until
    then no draft step reads the context (its ``length`` already counts them; the slots past what
    was written are never read);
  * a drafter whose context entry needs the token after its position (``context_needs_tokens``:
    Eagle3) gets its entries once the round's tokens are chosen: after verification, in a graph of
    its own per rows bucket and width (``_commit_context``), and inside a plain round's step.
Random numbers are drawn in the plain engine's order from the same generator (a drafting round's
in one draw and one copy: ``_propose``), so on the CPU the fast engine reproduces the plain one
token for token (tested; at T = 0 nothing random is read). What a round launches beside its
captured steps is held to a budget (tested: 8-17 operations by the kind of round). A
round reads nothing back (the engine's ``_launch`` / ``_complete``), except the verify width under
a policy whose width depends on the confidences; its graphs are keyed by rows bucket and verify
width (target) or drafted length (draft).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.types import DraftCache, Proposal
from ..drafters.context_write import stacked_kv
from ..kernels.rejection import rejection_verify
from .engine import Engine, Request, following_tokens
from .graphs import GraphBank, bucket_for
from .static_target import StaticTarget, move_rows
from .verify import VerifyResult, greedy_verify, one_hot_drafts

__all__ = ["DEFAULT_BUCKETS", "ENGINES", "FastEngine", "build_engine", "cache_capacity"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def cache_positions(tokens: int, gamma: int, pipeline: int = 1) -> int:
    """Cache positions a row needs for a request of ``tokens`` (prompt + answer budget): its last
    round may write γ + 1 positions past the budget, and each round it rides along in before its
    row is freed (``pipeline`` of them) γ + 1 more."""
    return tokens + (pipeline + 1) * (gamma + 1)


def cache_capacity(tokens: int, gamma: int, pipeline: int = 1) -> int:
    """``cache_positions`` rounded up to 128: the capacity a FastEngine sizes itself to. A caller
    that runs several engines over prompts of different lengths (an evaluation's benchmarks) passes
    one such capacity to all of them: the compiled layers see one cache shape, where a capacity of
    each call's own made every later one recompile them (a new cache length)."""
    return 128 * math.ceil(cache_positions(tokens, gamma, pipeline) / 128)


class FastEngine(Engine):
    """``Engine`` with static caches and (on CUDA) CUDA graphs.

    Extra args:
        buckets: row counts to capture graphs for; a round of R requests runs the smallest
            bucket >= R. The largest bucket must cover ``concurrency``.
        capacity: positions per request row; None sizes it from each ``generate`` call's
            longest prompt + budget (``cache_capacity``).
        graphs: capture CUDA graphs (default: when the target is on CUDA). The cost model then
            prices a round at its bucket's rows (``CostModel.at_engine_rows``), the rows it runs.
        prefill_chunk: prompts prefilled together (bounds the prefill's attention mask).
        max_width: the widest verification step (default γ + 1; the SPS benchmark asks for more).
        verify_impl: rejection-sampling backend: ``auto`` (the Triton kernel on CUDA, its
            reference elsewhere) or ``torch`` (the reference everywhere).
        compile: ``torch.compile`` the target's layer functions (fused norms / RoPE / SiLU) and the
            drafter's layers; the first steps of each new shape pay the compilation. None (the
            default): on CUDA.
        deferred_context: plain rounds (nothing drafted) whose drafter context is written
            together, later (0: each plain round writes its own, inside its target step). A
            drafter whose context needs the token after each position (``context_needs_tokens``,
            Eagle3) writes it once the round has chosen its tokens (``_commit_context``; a plain
            round inside its step): no ring.
    """

    _static_sampling = True

    def __init__(
        self,
        target,
        drafter=None,
        policy=None,
        *,
        buckets=DEFAULT_BUCKETS,
        capacity: int | None = None,
        graphs: bool | None = None,
        prefill_chunk: int = 32,
        max_width: int | None = None,
        verify_impl: str = "auto",
        compile: bool | None = None,
        deferred_context: int = 8,
        **kw,
    ):
        super().__init__(target, drafter, policy, **kw)
        if deferred_context < 0:
            raise ValueError(f"deferred_context must be >= 0, got {deferred_context}")
        self._commit_tokens = drafter is not None and drafter.context_needs_tokens
        ring = drafter is not None and not self._commit_tokens
        self.deferred_context = int(deferred_context) if ring else 0
        self._stashed = 0  # plain rounds whose context waits in the ring
        self._stash_rows = 0  # the batch's rows when they ran
        if drafter is not None and not drafter.supports_static_cache:
            raise ValueError(
                f"the fast engine drafts with drafters whose state fits a static cache; "
                f"'{drafter.kind}' runs on engine=plain"
            )
        self.buckets = sorted({int(b) for b in buckets})
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"engine buckets must be positive row counts, got {list(buckets)}")
        if self.buckets[-1] < self.concurrency:
            raise ValueError(
                f"the largest engine bucket ({self.buckets[-1]}) is below concurrency={self.concurrency}: "
                f"add a bucket >= {self.concurrency}"
            )
        self.fixed_capacity = capacity
        self.use_graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA target: set graphs=false on this device")
        if self.use_graphs and self.cost is not None:  # a round runs its bucket's rows: price those
            self.cost = self.cost.at_engine_rows(self.buckets)
        self.prefill_chunk = int(prefill_chunk)
        self.max_width = int(max_width or self._gamma + 1)
        self.verify_impl = verify_impl
        self.compile = (self.device.type == "cuda") if compile is None else bool(compile)
        if self.compile and drafter is not None:
            drafter.compile_inference()
        self.static: StaticTarget | None = None
        self.bank = GraphBank(self.device) if self.use_graphs else None
        self._round_u: tuple | None = None  # (γ_d, u_accept, u_sample) drawn by ``_propose``

    # ---- static state ---------------------------------------------------------------------
    def _check_requests(self, reqs: list[Request]) -> None:
        budget = max(self.max_new_tokens if r.max_new_tokens is None else int(r.max_new_tokens) for r in reqs)
        tokens = max(len(r.prompt) for r in reqs) + budget
        if self.fixed_capacity is not None:
            need = cache_positions(tokens, self._gamma, self.pipeline)
            if need > self.fixed_capacity:
                raise ValueError(
                    f"a request needs {need} cache positions (prompt + max_new_tokens + (pipeline + 1)"
                    f"·(gamma + 1)) but the fast engine's capacity is {self.fixed_capacity}: raise engine "
                    f"capacity or shorten it"
                )
            need = self.fixed_capacity
        else:
            need = cache_capacity(tokens, self._gamma, self.pipeline)
        if self.static is None or self.static.capacity < need:
            self._allocate(need)

    def prepare(self, requests) -> None:
        """Size the caches for ``requests`` and capture every graph a run at this concurrency can
        meet (rows buckets up to it x verify widths 1..γ+1, and drafted lengths 1..γ), so no
        capture lands in a timed round."""
        reqs = [r if isinstance(r, Request) else Request(prompt=list(r)) for r in requests]
        self._check_requests(reqs)
        if self.bank is None:
            return
        top = bucket_for(self.concurrency, self.buckets)
        with torch.inference_mode():
            for rows in (b for b in self.buckets if b <= top):
                for w in range(1, self._gamma + 2) if self.drafter is not None else ():
                    ids, pos = self.in_ids[:rows, :w].clone(), self.in_pos[:rows, :w].clone()
                    _, taps = self._target_step(ids, pos)
                    if self._commit_tokens:  # scratch entries: the lengths are reset below
                        self._commit_graph(rows, w, taps)
                self._plain_step(self.in_ids[:rows, :1].clone(), self.in_pos[:rows, :1].clone(), draw=False)
                if self.deferred_context:
                    self._flush_context()
                for drafted in range(1, self._gamma + 1):
                    self._draft_step(
                        self.in_anchor[:rows].clone(),
                        self.in_anchor_pos[:rows].clone(),
                        self.in_u[:rows].clone(),
                        drafted,
                    )
            self._warm_verify(top)
        self._reset_state()

    def _warm_verify(self, rows: int) -> None:
        """Verify once at every width 0..γ of a drafting round on the real steps' outputs: the
        rejection kernel's width is a compile-time constant, and a width first met inside a timed
        round would stall it for the kernel's compilation. Draws its uniforms apart: the engine's
        random stream is untouched. Greedy rounds do not run the kernel; a target-only engine's
        only width, 0, ran in its plain step's capture."""
        if self.greedy or self.drafter is None:  # width 0 ran in the plain step's capture
            return
        drafted = self._gamma
        anchors, anchor_pos = self.in_anchor[:rows].clone(), self.in_anchor_pos[:rows].clone()
        prop = self._draft_step(anchors, anchor_pos, self.in_u[:rows].clone(), drafted)
        for g in range(drafted + 1):
            ids, pos = self.in_ids[:rows, : g + 1].clone(), self.in_pos[:rows, : g + 1].clone()
            probs, _ = self._target_step(ids, pos)
            drafts = prop.tokens[:, :g] if g else torch.zeros(rows, 0, dtype=torch.long, device=self.device)
            draft_probs = prop.probs[:, :g] if g else one_hot_drafts(drafts, probs.shape[-1])
            lengths = torch.full((rows,), g, dtype=torch.long, device=self.device)
            u = (torch.rand(rows, g, device=self.device), torch.rand(rows, device=self.device))
            rejection_verify(
                probs, draft_probs, drafts, lengths, uniforms=u, impl=self.verify_impl,
                draft_index=self._draft_index(draft_probs, probs),
            )  # fmt: skip

    def _allocate(self, capacity: int) -> None:
        rows = self.buckets[-1]
        with torch.inference_mode():
            self.static = StaticTarget(self.target, rows, capacity, compile=self.compile)
            if self.drafter is not None:
                # The draft step attends over context + block keys (γ, or γ + 1 when the anchor
                # slot drafts nothing): keep that length a multiple of 16 (fused attention kernels
                # want aligned mask rows). The block's own keys go to the buffers' last `block`
                # slots, written in place (DraftCache.block_slots): no copy of the context per layer.
                block = int(getattr(self.drafter, "block_size", self._gamma))
                slots = capacity + (-(capacity + block)) % 16
                self.dcache = self.drafter.new_cache(rows, self.device, capacity=slots + block)
                self.dcache.block_slots = block
                # The drafter's context spans exactly the target's committed positions (a plain
                # round's deferred ones included): one lengths tensor serves both caches, so a
                # round's commit, a prefill and a row move update it once.
                self.dcache.length = self.static.lengths
            # Static inputs of the captured steps.
            width = self.max_width
            self.in_ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
            self.in_pos = torch.zeros(rows, width, dtype=torch.long, device=self.device)
            self.in_anchor = torch.zeros(rows, dtype=torch.long, device=self.device)
            self.in_anchor_pos = torch.zeros(rows, dtype=torch.long, device=self.device)
            self.in_u = torch.zeros(rows, max(self._gamma, 1), device=self.device)
            self.in_u_plain = torch.zeros(rows, device=self.device)  # a plain step's u_sample
            if self._commit_tokens:  # a verified round's tokens after each position, and its kept
                self.in_next = torch.zeros(rows, width, dtype=torch.long, device=self.device)
                self.in_kept = torch.zeros(rows, dtype=torch.long, device=self.device)
            self.no_lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
            if self.deferred_context:  # the ring of plain rounds' taps and positions
                k, dtype = self.deferred_context, self.target.dtype
                self.ring_taps = torch.zeros(k, rows, self.target.tap_dim, device=self.device, dtype=dtype)
                self.ring_pos = torch.zeros(k, rows, dtype=torch.long, device=self.device)
                self.ring_slot = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.bank is not None:
            self.bank.clear()

    @torch.inference_mode()  # the static buffers are inference tensors
    def _reset_state(self) -> None:
        self._stashed = 0  # the caches are cleared: nothing left to write
        if self.static is not None:
            self.static.lengths.zero_()  # the drafter's context lengths too (the same tensor)

    def _draft_cache(self, stop: int, start: int = 0) -> DraftCache:
        """The drafter's state of rows start..stop-1, as views of the static buffers."""
        c, rows = self.dcache, slice(start, stop)
        return DraftCache(
            k=[k[rows] for k in c.k],
            v=[v[rows] for v in c.v],
            length=c.length[rows],
            extra={key: t[rows] for key, t in c.extra.items()},
            block_slots=c.block_slots,
        )

    def _write_context(self, taps: Tensor, positions: Tensor, row0: int) -> None:
        """Drafter context of taps [R, W, m·d] at slot == position, rows row0.. (the drafter's hook)."""
        rows = torch.arange(row0, row0 + positions.shape[0], device=self.device)
        self.drafter.write_context(self.dcache, taps, positions, rows)

    # ---- Engine's cache hooks --------------------------------------------------------------
    def _prefill_forward(self, ids: Tensor, positions: Tensor, lens: Tensor, row0: int, spans: list[int]):
        n, width = ids.shape
        with_taps = self.drafter is not None  # the drafter's context takes every row at full width
        last, taps = [], []
        for s in range(0, n, self.prefill_chunk):
            e = min(s + self.prefill_chunk, n)
            w = width if with_taps else max(spans[s:e])
            h, t = self.static.forward(ids[s:e, :w], positions[s:e, :w], row0 + s, taps=with_taps)
            last.append(h[torch.arange(e - s, device=self.device), lens[s:e] - 1])
            taps.append(t)
        self.static.lengths[row0 : row0 + n] = lens
        taps = torch.cat(taps) if with_taps else None
        if self._stashed:
            self._park_ring(taps[:, 0], positions[:, 0], row0)
        return torch.cat(last), taps

    def _park_ring(self, taps: Tensor, positions: Tensor, row0: int) -> None:
        """New rows take free rows whose ring entries still hold a departed request's taps: point
        every entry of theirs at their first prompt position with its taps, which the prefill
        writes too, so the next flush rewrites the same values (the flush's own padding trick).
        Joining rows then cost no flush: with requests queued, rows join almost every round at a
        high load, and flushing at each join made every plain round pay the drafter's context write
        that deferring it saves."""
        rows = slice(row0, row0 + taps.shape[0])
        self.ring_taps[:, rows] = taps.to(self.ring_taps.dtype)
        self.ring_pos[:, rows] = positions
        self._stash_rows = max(self._stash_rows, rows.stop)

    def _extend_new_rows(self, taps, positions, valid, next_tokens, row0: int) -> None:
        # Its lengths: the prompt's, set by the prefill.
        if self._commit_tokens:
            rows = self._draft_cache(row0 + taps.shape[0], row0)
            self.drafter.commit_context(rows, taps, positions, next_tokens, valid.sum(1), self.shared)
        else:
            self._write_context(taps, positions, row0)

    def _stage(self, ids: Tensor, positions: Tensor) -> int:
        """Copy a step's inputs into the static buffers; returns the rows the step runs."""
        r, w = ids.shape
        rows = bucket_for(r, self.buckets) if self.use_graphs else r
        self.in_ids[:r, :w].copy_(ids)
        self.in_pos[:r, :w].copy_(positions)
        if rows > r:  # padding rows: free rows, harmless in-range writes
            self.in_pos[r:rows].zero_()
        return rows

    def _target_step(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        r, w = ids.shape

        def step(rows: int):
            i, p = self.in_ids[:rows, :w], self.in_pos[:rows, :w]
            hidden, taps = self.static.forward(i, p, taps=self.drafter is not None)
            choice = self._target_choice(self.target.lm_head(hidden, upcast=not self.greedy))
            if self._commit_tokens:  # the context waits for the round's tokens (_commit_context)
                return choice, taps
            if self.drafter is not None:
                self._write_context(taps, p, 0)
            return choice, None

        rows = self._stage(ids, positions)
        out = step(r) if self.bank is None else self.bank.run(("target", rows, w), lambda: step(rows))
        return out[0][:r], out[1]

    def _plain_step(self, ids: Tensor, positions: Tensor, draw: bool = True) -> tuple[VerifyResult, None]:
        """Target-only decoding's width-1 step, its token chosen inside it: the argmax, or at T > 0
        verification of no drafts (the rejection kernel on p_t with the round's ``u_sample``,
        staged before the step). Verifying beside the captured step (the kernel's launcher, the
        uniforms' copy) took the H100's host 0.20 ms a round at T = 1, R = 256 in target-only rounds
        and 0.29-0.30 ms in the draft-aware schedulers' (session ``-d``), a fifth of their host work
        where that work set the pace. With a drafter, the step's taps go to the ring (one copy)
        instead of through the drafter's context layers (without a ring: straight to the context).
        ``draw=False`` (capturing the graph) leaves the random stream alone: stale uniforms stand in."""
        r = ids.shape[0]
        ring = bool(self.deferred_context)
        if ring:
            if self._stashed == self.deferred_context or (self._stashed and r != self._stash_rows):
                self._flush_context()
            self.ring_slot.fill_(self._stashed)  # which ring entry this step writes (no host sync)
        if draw and not self.greedy:
            self._draw_into(self.in_u_plain[:r])  # ``_verify_uniforms`` of no drafts: u_sample

        def step(rows: int) -> Tensor:
            i, p = self.in_ids[:rows, :1], self.in_pos[:rows, :1]
            hidden, taps = self.static.forward(i, p, taps=self.drafter is not None)
            if ring:
                entry = taps[:, 0][None].to(self.ring_taps.dtype)
                self.ring_taps[:, :rows].index_copy_(0, self.ring_slot, entry)
                self.ring_pos[:, :rows].index_copy_(0, self.ring_slot, p[:, 0][None])
            elif self.drafter is not None and not self._commit_tokens:
                self._write_context(taps, p, 0)
            token = self._plain_token(self.target.lm_head(hidden, upcast=not self.greedy), rows)
            # Its context entry pairs these taps with the token just chosen; a finished row waiting to
            # leave (kept 0, known after the step) writes one past its length and a chain seed that
            # only its own void drafts read.
            if self._commit_tokens:
                cache, one = self._draft_cache(rows), torch.ones_like(token)
                self.drafter.commit_context(cache, taps, p, token[:, None], one, self.shared)
            return token

        rows = self._stage(ids, positions)
        if ring:
            self._stashed, self._stash_rows = self._stashed + 1, r
        if self.bank is None:
            tokens = step(r)
        else:
            # The graph's own output, valid until the target family replays: read before that by
            # this round's host copy and the next round's staging (an idle row's kept anchor may
            # read a later round's token: its tokens are void).
            tokens = self.bank.run(("target", rows, "plain"), lambda: step(rows))[:r]
        return VerifyResult(self._constant(torch.zeros, r), tokens, width=0), None

    def _plain_token(self, logits: Tensor, rows: int) -> Tensor:
        """The next token [rows] of a plain step's logits [rows, 1, V]: what ``_verify`` of no drafts
        gives (``greedy_verify``'s target token; ``rejection_verify``'s draw from p_t)."""
        if self.greedy:
            return logits[:, 0].argmax(-1)
        probs = self._target_probs(logits)
        none = self.in_ids[:rows, :0]
        u = (self.in_u[:rows, :0], self.in_u_plain[:rows])
        out = rejection_verify(
            probs, one_hot_drafts(none, probs.shape[-1]), none, self.no_lengths[:rows], uniforms=u,
            impl=self.verify_impl,
        )  # fmt: skip
        return out.next_token

    def _draw_into(self, buffer: Tensor) -> None:
        """``_uniform(*buffer.shape)`` straight into a static buffer of the engine's device: one
        copy (``_uniform`` then ``copy_`` would be two)."""
        buffer.copy_(self._drawn(*buffer.shape), non_blocking=self._pinned_draws)

    def _flush_context(self) -> None:
        """Write the ring's taps into the drafter's context, all entries at once (one graph per
        rows bucket): entries past the filled ones repeat the last filled one, the same values
        written twice at the same slots."""
        n, r = self._stashed, self._stash_rows
        if n == 0:
            return
        self._stashed = 0
        if n < self.deferred_context:
            self.ring_taps[n:] = self.ring_taps[n - 1]
            self.ring_pos[n:] = self.ring_pos[n - 1]

        def step(rows: int) -> None:
            taps = self.ring_taps[:, :rows].transpose(0, 1)  # [rows, K, m·d]
            self._write_context(taps, self.ring_pos[:, :rows].t(), 0)

        rows = bucket_for(r, self.buckets) if self.use_graphs else r
        if self.bank is None:
            step(r)
        else:
            self.bank.run(("flush", rows), lambda: step(rows))

    def _propose(self, anchors: Tensor, anchor_pos: Tensor, drafted: int) -> Proposal:
        self._flush_context()  # the draft step reads the whole context
        r = anchors.shape[0]
        if self.greedy:  # greedy rounds read no uniforms: the static buffer's stale ones stand in
            return self._draft_step(anchors, anchor_pos, None, drafted)
        # The round's uniforms in one draw and one copy, in the plain engine's order: the drafter's
        # [R, γ], then verification's u_accept [R, γ_d] and u_sample [R] (``_verify_uniforms``). A
        # CPU generator fills a tensor element by element, so one draw of the three takes the same
        # numbers as three (tested).
        g = self._gamma
        u = self._uniform(r * (g + drafted + 1))
        self._round_u = (drafted, u[r * g : r * (g + drafted)].view(r, drafted), u[r * (g + drafted) :])
        return self._draft_step(anchors, anchor_pos, u[: r * g].view(r, g), drafted)

    def _verify_uniforms(self, drafts: Tensor, drafted: int) -> tuple[Tensor, Tensor]:
        planned, u_accept, u_sample = self._round_u  # drawn with the round's draft (``_propose``)
        self._round_u = None
        assert planned == drafted, "verification's uniforms belong to this round's draft"
        return u_accept[:, : drafts.shape[1]], u_sample

    def _draft_step(self, anchors: Tensor, anchor_pos: Tensor, u: Tensor | None, drafted: int) -> Proposal:
        """The first ``drafted`` positions of each row's block (one graph per rows bucket and
        drafted length)."""
        r = anchors.shape[0]

        def step(rows: int) -> Proposal:
            return self.drafter.propose(
                self._draft_cache(rows),
                self.in_anchor[:rows],
                self.in_anchor_pos[:rows],
                self.shared,
                self.temperature,
                uniforms=self.in_u[:rows],
                draft_len=drafted,
            )

        rows = bucket_for(r, self.buckets) if self.use_graphs else r
        self.in_anchor[:r].copy_(anchors)
        self.in_anchor_pos[:r].copy_(anchor_pos)
        if rows > r:
            self.in_anchor_pos[r:rows].zero_()
        if u is not None:  # None: greedy, the buffer's stale uniforms stand in (none is read)
            self.in_u[:r].copy_(u)
        key = ("draft", rows, drafted)
        out = step(r) if self.bank is None else self.bank.run(key, lambda: step(rows))
        conf = out.confidence_logits
        probs = None if out.probs is None else out.probs[:r]  # None: a greedy fused draft step
        return Proposal(out.tokens[:r], probs, None if conf is None else conf[:r])

    @property
    def greedy(self) -> bool:
        """T = 0: rounds carry tokens, not distributions (the module docstring)."""
        return self.temperature == 0

    def _target_choice(self, logits: Tensor) -> Tensor:
        """What verification reads of the target's logits [R, w, V]: at T = 0 the argmax tokens
        [R, w] (the bf16 logits' argmax is their float32 upcast's, ties included: the one-hot the
        probabilities would hold), else the probabilities."""
        return logits.argmax(-1) if self.greedy else self._target_probs(logits)

    def _verify(self, target_probs, draft_probs, drafts, lengths, drafted: int):
        if self.greedy:  # target_probs holds the target's argmax tokens (_target_choice)
            return greedy_verify(target_probs, drafts, lengths)
        if draft_probs is None:  # a proposal without distributions: refused at T > 0
            draft_probs = self._one_hot_drafts(drafts, target_probs.shape[-1])
        return rejection_verify(
            target_probs,
            draft_probs,
            drafts,
            lengths,
            uniforms=self._verify_uniforms(drafts, drafted),
            impl=self.verify_impl,
            draft_index=self._draft_index(draft_probs, target_probs),
        )

    def _commit(self, kept: Tensor, taps, positions: Tensor, drafts: Tensor, res) -> None:
        # The drafter's context of this step was written inside it (taps None; a plain round's too);
        # the tokens after each position are its next step's inputs, not its context's, unless the
        # drafter's context needs them.
        r = kept.shape[0]
        if self._commit_tokens and taps is not None:  # a verified round (a plain one committed in its step)
            self._commit_context(kept, taps, drafts, res)
        # add_ on the views: `x[:r] += y` would also copy the sum onto itself, a launch more.
        self.static.lengths[:r].add_(kept)  # the drafter's context lengths too (the same tensor)

    def _commit_context(self, kept: Tensor, taps: Tensor, drafts: Tensor, res) -> None:
        """A verified round's entries for a ``context_needs_tokens`` drafter: the target step's taps
        (its graph's output) with the token after each position, d_1..d_n then the new token (one
        graph per rows bucket and width, fed through static buffers)."""
        r, w = kept.shape[0], drafts.shape[1] + 1
        self.in_next[:r, :w].copy_(following_tokens(drafts, res.accepted, res.next_token))
        self.in_kept[:r].copy_(kept)
        self._commit_graph(r, w, taps)

    def _commit_graph(self, r: int, w: int, taps: Tensor) -> None:
        def step(rows: int) -> None:
            self.drafter.commit_context(
                self._draft_cache(rows), taps[:rows], self.in_pos[:rows, :w], self.in_next[:rows, :w],
                self.in_kept[:rows], self.shared,
            )  # fmt: skip

        if self.bank is None:
            step(r)
        else:
            rows = bucket_for(r, self.buckets)
            self.bank.run(("commit", rows, w), lambda: step(rows))

    def _keep_rows(self, index: Tensor, order: list[int]) -> None:
        # The ring's entries are by row: they move with their rows (a flush here would write the whole
        # ring, every entry, each time a request ends), and the next flush covers the rows that stay.
        self._stash_rows = len(order)
        moves = [(new, old) for new, old in enumerate(order) if new != old]
        if not moves:
            return
        dst, src = (self._to_device(torch.tensor(rows, dtype=torch.long)) for rows in zip(*moves))
        self.static.move_rows(dst, src)  # the lengths of both caches (the same tensor) among them
        if self._stashed:
            move_rows([self.ring_taps, self.ring_pos], dst, src, dim=1)
        if self.drafter is not None:
            kv = stacked_kv(self.dcache)  # as new_cache allocates it: all layers in one buffer
            if kv is None:
                move_rows([*self.dcache.k, *self.dcache.v], dst, src)
            else:
                move_rows([kv], dst, src, dim=2)
            if self.dcache.extra:  # per-row state besides the keys/values (Eagle3's chain seed)
                move_rows(list(self.dcache.extra.values()), dst, src)


ENGINES = ("plain", "fast")


def build_engine(kind: str, target, drafter=None, policy=None, **kw) -> Engine:
    """``plain`` (Hugging Face forward, growing caches: the reference, any architecture and drafter)
    or ``fast`` (static caches, CUDA graphs on CUDA)."""
    if kind == "plain":
        return Engine(target, drafter, policy, **kw)
    if kind == "fast":
        return FastEngine(target, drafter, policy, **kw)
    raise ValueError(f"engine '{kind}' is not one of {', '.join(ENGINES)}")
