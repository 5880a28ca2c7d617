"""The batched speculative-decoding engine (plain PyTorch; the CPU reference).

One round for the R running requests:
  1. draft    ``drafter.propose`` from each anchor (the last token the target produced, not yet in
              its cache) -> γ tokens, their exact sampling distributions, confidence logits;
  2. lengths  the policy picks ℓ_r <= γ from calibrated confidences c_k = σ(z_k / T_k);
  3. verify   one target forward over [anchor, d_1..d_ℓ] per row (ragged rows padded to max ℓ + 1),
              then lossless rejection sampling (``verify``) -> n_r accepted + one new token;
  4. commit   the target cache keeps positions a..a+n, the drafter context gets their features,
              and the new token becomes the next anchor at a+n+1.
Requests stop at EOS or max_new_tokens; waiting prompts join as others finish (continuous
batching: finished rows are dropped from both caches, new rows are prefilled and appended).
Without a drafter the same loop is target-only decoding (ℓ = 0: the verifier samples from p_t),
which is the baseline and the reference of the losslessness tests. p_t is softmax(logits / T),
filtered by top-k / top-p when asked (``decoding.sampling``), for sampling and verification alike.

For bulk generation (the data pipeline) three knobs trade bookkeeping for throughput: ``refill``
(finished rows idle until that many are free, then leave together and the waiting prompts join in
one prefill: one cache compaction per batch of finished rows instead of one per row),
``record_rounds=False`` (no per-row ``RoundRecord``) and ``generate(on_result=...)`` (each request
is handed over the moment it finishes).

``FastEngine`` (fast_engine.py) runs the same rounds over static caches with CUDA graphs: it
overrides only the cache hooks (``_prefill_forward``, ``_target_step``, ``_commit``,
``_keep_rows``, ``_propose``, ``_verify`` ...). The round's host syncs are ``int(lengths.max())``
(the verify width) and the Python bookkeeping after verification.

Randomness comes from one ``torch.Generator`` (CPU by default) in a fixed order per round: the
drafter's uniforms, then verify's ``u_accept [R, G]`` and ``u_sample [R]``; prefill draws one
uniform per joining request. Uniforms are drawn on the generator's device and moved, so a CUDA
path can keep the same streams.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.progress import progress_bar
from ..core.sampling import sample_from
from ..core.types import Shared
from ..scheduling.policies import Fixed, Policy
from .kv import RaggedKV, concat_draft_caches, select_draft_cache
from .sampling import target_probs
from .verify import verify

__all__ = [
    "Engine",
    "EngineResult",
    "Generation",
    "Request",
    "RoundRecord",
    "calibration_arrays",
    "conditional_acceptance",
    "tau",
    "threshold_sweep",
]


@dataclass
class Request:
    prompt: Sequence[int]
    id: Any = None
    max_new_tokens: int | None = None  # None: the engine's default


@dataclass
class Generation:
    id: Any
    prompt_len: int
    tokens: list[int]  # generated tokens (prompt excluded), EOS included when it ended the request
    finish: str  # "eos" | "length"
    rounds: int  # verification rounds (the prefill token is not a round)
    accepted: int  # draft tokens accepted over all rounds


@dataclass
class RoundRecord:
    """One request in one round. ``accepted + 1`` tokens came out of the verifier; ``emitted`` of
    them were kept (fewer only in a request's last round, cut at EOS / max_new_tokens)."""

    request: Any
    round: int  # this request's round index (0-based)
    step: int  # engine-wide round index
    batch: int  # requests in this round
    anchor_pos: int
    drafted: int  # γ
    proposed: int  # ℓ chosen by the policy
    accepted: int  # n <= ℓ
    emitted: int
    accept_flags: list[bool]  # per verified position (length ℓ)
    confidence_logits: list[float] | None = None  # raw z_k, all γ positions
    confidence: list[float] | None = None  # σ(z_k / T_k): calibrated per-position c_k

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineResult:
    generations: list[Generation]  # in request order
    rounds: list[RoundRecord]
    steps: list[dict] = field(default_factory=list)  # per engine round: R, verified tokens, ms
    wall_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def tau(self) -> float:
        """Mean tokens per verification round, bonus/correction token included (paper's τ)."""
        return sum(r.accepted + 1 for r in self.rounds) / max(len(self.rounds), 1)


@dataclass
class _Live:
    """A running request (row i of the batch tensors)."""

    index: int  # position in the input order
    req: Request
    budget: int
    tokens: list[int]
    rounds: int = 0
    accepted: int = 0
    finish: str | None = None


class Engine:
    """Speculative decoding with ``drafter``, or target-only decoding when ``drafter`` is None.

    Args:
        target: a ``dspark.target.Target``.
        drafter: any drafter with ``new_cache / extend_context / propose`` (None = target only).
        policy: a ``scheduling.policies.Policy`` (default: verify the whole drafted block).
        temperature: sampling temperature of target and drafter (0 = greedy).
        top_k, top_p: the target's filter (0 and 1 = none): p_t keeps the k most likely tokens,
            then the top-p nucleus of their renormalised distribution (transformers' warpers).
        concurrency: requests decoded together; more prompts wait in a queue.
        max_new_tokens: default per-request budget.
        calibration: STS temperatures [γ] for the confidence logits (a list, a tensor, a
            ``Calibration``); None = raw σ(z). ``from_checkpoint`` reads ``calibration.json``.
        cost: ``CostModel`` for the load-aware policies.
        eos_token_ids: stop tokens (default: the target's); ``()`` never stops early.
        seed / generator: the random stream (see the module docstring).
        progress: show a progress bar over finished requests.
        refill: finished rows leave the batch (and waiting requests join) once at least this
            many are finished; until then they idle in their rows (1: at once).
        record_rounds: keep a ``RoundRecord`` per request per round (``EngineResult.rounds``).
    """

    _static_sampling = False  # top-p by candidates with host syncs; FastEngine sorts statically

    def __init__(
        self,
        target,
        drafter=None,
        policy=None,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        concurrency: int = 8,
        max_new_tokens: int = 256,
        calibration=None,
        cost=None,
        eos_token_ids: Iterable[int] | None = None,
        seed: int = 0,
        generator: torch.Generator | None = None,
        progress: bool = False,
        desc: str = "decode",
        refill: int = 1,
        record_rounds: bool = True,
    ):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
        self.target = target
        self.drafter = drafter
        self.temperature = float(temperature)
        self.top_k, self.top_p = int(top_k), float(top_p)
        self.concurrency = int(concurrency)
        self.refill = max(1, min(int(refill), self.concurrency))
        self.record_rounds = bool(record_rounds)
        self.max_new_tokens = int(max_new_tokens)
        self.eos = set(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.generator = generator or torch.Generator().manual_seed(int(seed))
        self.progress = progress
        self.desc = desc
        self.device = target.device
        self.shared = Shared.of(target)
        self.cost = cost
        self.has_confidence = drafter is not None and drafter.has_confidence
        self.set_policy(policy)
        self.temperatures = _temperatures(calibration, getattr(drafter, "gamma", None))

    def set_policy(self, policy: Policy | None = None) -> None:
        """Use ``policy`` for the next ``generate`` (an engine, its caches and graphs, serves many)."""
        policy = Fixed(None) if policy is None else policy
        if self.drafter is not None and policy.needs_confidence and not self.has_confidence:
            raise ValueError(
                f"policy '{policy.name}' needs per-position confidences, but drafter "
                f"'{self.drafter.kind}' has no confidence head: use policy=fixed or "
                f"policy=mtp1, or a DSpark drafter with confidence.enabled=true"
            )
        if self.drafter is not None and policy.needs_cost and self.cost is None:
            raise ValueError(
                f"policy '{policy.name}' needs a cost model (a profiled SPS table): set policy.cost_table"
            )
        self.policy = policy

    @classmethod
    def from_checkpoint(cls, target, drafter_dir: str | Path, policy=None, **kw) -> Engine:
        """Load a saved drafter; its STS temperatures (``calibration.json`` in the folder) apply
        automatically unless ``calibration`` is given."""
        from ..artifacts import DrafterFolder
        from ..checkpoints import load_drafter

        drafter, _ = load_drafter(drafter_dir, target, device=target.device)
        if "calibration" not in kw:
            kw["calibration"] = DrafterFolder(drafter_dir).read_calibration()
        return cls(target, drafter, policy, **kw)

    # ------------------------------------------------------------------------------------------
    def generate(
        self,
        requests: Iterable[Request | Sequence[int]],
        on_result: Callable[[int, Generation], None] | None = None,
    ) -> EngineResult:
        """Decode every request. ``on_result(index, generation)`` is called as each request
        finishes (completion order; ``index`` is its position in ``requests``)."""
        reqs = [r if isinstance(r, Request) else Request(prompt=list(r)) for r in requests]
        for i, r in enumerate(reqs):
            if r.id is None:
                r.id = i
            if len(r.prompt) == 0:
                raise ValueError(f"request {r.id} has an empty prompt")
        self._check_requests(reqs)
        self.policy.reset()
        queue = deque(range(len(reqs)))
        done: dict[int, Generation] = {}
        rounds: list[RoundRecord] = []
        steps: list[dict] = []
        live: list[_Live] = []
        self._reset_state()
        anchors = anchor_pos = None  # [R] long each
        start = time.perf_counter()
        bar = progress_bar(len(reqs), self.desc, self.progress, unit="req")

        def finished(items: list[_Live]) -> None:
            for item in items:
                gen = Generation(
                    id=item.req.id,
                    prompt_len=len(item.req.prompt),
                    tokens=item.tokens,
                    finish=item.finish,
                    rounds=item.rounds,
                    accepted=item.accepted,
                )
                done[item.index] = gen
                if bar is not None:
                    bar.update(1)
                if on_result is not None:
                    on_result(item.index, gen)

        step = 0
        with torch.inference_mode():  # an on_result that raises leaves state the next run resets
            while queue or live:
                if queue and len(live) < self.concurrency:
                    take = [queue.popleft() for _ in range(min(self.concurrency - len(live), len(queue)))]
                    new_live, first, pos = self._prefill([reqs[i] for i in take], take, len(live))
                    live += new_live
                    anchors = first if anchors is None else torch.cat([anchors, first])
                    anchor_pos = pos if anchor_pos is None else torch.cat([anchor_pos, pos])
                    finished([item for item in new_live if item.finish is not None])
                    anchors, anchor_pos = self._retire(live, anchors, anchor_pos)
                    continue
                t0 = time.perf_counter()
                recs, anchors, anchor_pos, verified, ended, batch = self._round(
                    live, anchors, anchor_pos, step
                )
                _sync(self.device)
                steps.append(
                    {
                        "step": step,
                        "batch": batch,
                        "verified": verified,
                        "ms": 1e3 * (time.perf_counter() - t0),
                    }
                )
                rounds += recs
                step += 1
                finished(ended)
                anchors, anchor_pos = self._retire(live, anchors, anchor_pos)
                if bar is not None and rounds:
                    bar.set_postfix(
                        tau=f"{sum(r.accepted + 1 for r in rounds) / len(rounds):.2f}", refresh=False
                    )
        if bar is not None:
            bar.close()
        self._reset_state()
        return EngineResult(
            generations=[done[i] for i in range(len(reqs))],
            rounds=rounds,
            steps=steps,
            wall_s=time.perf_counter() - start,
        )

    # ---- the caches: the plain path's; ``FastEngine`` overrides these -------------------------
    def _check_requests(self, reqs: list[Request]) -> None:
        """Refuse what cannot run before any work starts (the plain caches grow, so nothing here)."""

    def _reset_state(self) -> None:
        self._kv: RaggedKV | None = None
        self._dcache = None

    def _prefill_forward(self, ids: Tensor, positions: Tensor, lens: Tensor, row0: int):
        """Prompts [n, P] (right-padded to P; real lengths ``lens``) into new cache rows
        row0..row0+n-1. Returns the final hidden state at each prompt's last token [n, d] and
        the tap features [n, P, m·d] for the drafter's context (None without a drafter)."""
        n, width = ids.shape
        kv = RaggedKV.empty(
            self.target.model.config, n, width + self._gamma + 2, self.target.dtype, self.device
        )
        out = self.target(
            ids,
            positions=positions,
            cache=kv,
            attention_mask=kv.plan(width, self.target.dtype),
            with_logits=False,
            use_cache=True,
        )
        kv.commit(lens)
        self._kv = RaggedKV.concat(self._kv, kv)
        return out.last_hidden[torch.arange(n, device=self.device), lens - 1], out.taps

    def _target_step(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Verification forward of ids [R, G+1]: (target probabilities [R, G+1, V], taps)."""
        mask = self._kv.plan(ids.shape[1], self.target.dtype)
        out = self.target(ids, positions=positions, cache=self._kv, attention_mask=mask, use_cache=True)
        return self._target_probs(out.logits), out.taps

    def _commit(self, kept: Tensor, taps: Tensor, positions: Tensor, next_tokens: Tensor) -> None:
        """Keep kept[r] tokens of the last step in row r (the anchor and the accepted drafts) and
        give their features to the drafter."""
        self._kv.commit(kept)
        if self.drafter is not None:
            valid = torch.arange(positions.shape[1], device=self.device)[None, :] < kept[:, None]
            self.drafter.extend_context(self._dcache, taps, positions, valid, next_tokens, self.shared)

    def _keep_rows(self, index: Tensor) -> None:
        self._kv = self._kv.select(index)
        if self._dcache is not None:
            self._dcache = select_draft_cache(self._dcache, index)

    def _propose(self, anchors: Tensor, anchor_pos: Tensor):
        return self.drafter.propose(
            self._dcache, anchors, anchor_pos, self.shared, self.temperature, self.generator
        )

    def _verify(self, target_probs, draft_probs, drafts, lengths):
        r, g = drafts.shape
        return verify(
            target_probs, draft_probs, drafts, lengths, uniforms=(self._uniform(r, g), self._uniform(r))
        )

    def _target_probs(self, logits: Tensor) -> Tensor:
        return target_probs(logits, self.temperature, self.top_k, self.top_p, static=self._static_sampling)

    # ------------------------------------------------------------------------------------------
    @property
    def _gamma(self) -> int:
        return getattr(self.drafter, "gamma", 0) if self.drafter is not None else 0

    def _uniform(self, *shape: int) -> Tensor:
        return torch.rand(*shape, generator=self.generator, device=self.generator.device).to(self.device)

    def _prefill(self, reqs: list[Request], order: list[int], row0: int):
        """Run the new prompts together (right-padded), sample their first token from the target,
        and seed their drafter context with the prompt features. Returns the new live requests,
        their first tokens (the next anchors) and the anchors' positions."""
        n = len(reqs)
        width = max(len(r.prompt) for r in reqs)
        ids = torch.zeros(n, width, dtype=torch.long)  # built on the host, moved once
        for i, r in enumerate(reqs):
            ids[i, : len(r.prompt)] = torch.as_tensor(list(r.prompt), dtype=torch.long)
        ids = ids.to(self.device)
        lens = torch.tensor([len(r.prompt) for r in reqs], device=self.device)
        positions = torch.arange(width, device=self.device).expand(n, -1)
        last, taps = self._prefill_forward(ids, positions, lens, row0)
        rows = torch.arange(n, device=self.device)
        first = sample_from(self._target_probs(self.target.lm_head(last)), self._uniform(n))
        if self.drafter is not None:
            # next_tokens[r, p] = token at p + 1: the prompt shifted left, then the first sampled token.
            nxt = torch.zeros_like(ids)
            nxt[:, :-1] = ids[:, 1:]
            nxt[rows, lens - 1] = first
            self._extend_new_rows(taps, positions, positions < lens[:, None], nxt, row0)
        live = []
        for i, (r, idx) in enumerate(zip(reqs, order)):
            budget = self.max_new_tokens if r.max_new_tokens is None else int(r.max_new_tokens)
            item = _Live(index=idx, req=r, budget=budget, tokens=[])
            if budget > 0:
                self._emit(item, [int(first[i])])
            else:
                item.finish = "length"
            live.append(item)
        return live, first, lens.clone()

    def _extend_new_rows(self, taps, positions, valid, next_tokens, row0: int) -> None:
        dcache = self.drafter.new_cache(taps.shape[0], self.device)
        self.drafter.extend_context(dcache, taps, positions, valid, next_tokens, self.shared)
        self._dcache = concat_draft_caches(self._dcache, dcache)

    def _round(self, live: list[_Live], anchors: Tensor, anchor_pos: Tensor, step: int):
        r = len(live)
        device = self.device
        conf_logits = conf = None
        if self.drafter is not None:
            prop = self._propose(anchors, anchor_pos)
            gamma = prop.tokens.shape[1]
            if prop.confidence_logits is not None:
                conf_logits = prop.confidence_logits.float()
                conf = self._calibrated(conf_logits)
            scores = conf if conf is not None else torch.ones(r, gamma, device=device)
            lengths = (
                self.policy.lengths(scores, self.cost).to(device=device, dtype=torch.long).clamp(0, gamma)
            )
            g = int(lengths.max())
            drafts, draft_probs = prop.tokens[:, :g], prop.probs[:, :g]
        else:
            gamma = g = 0
            lengths = torch.zeros(r, dtype=torch.long, device=device)
            drafts = torch.zeros(r, 0, dtype=torch.long, device=device)
            draft_probs = None
        ids = torch.cat([anchors[:, None], drafts], dim=1)  # [R, G+1]; drafts past ℓ_r are padding
        positions = anchor_pos[:, None] + torch.arange(g + 1, device=device)
        target_probs, taps = self._target_step(ids, positions)
        if draft_probs is None:
            draft_probs = target_probs.new_zeros(r, 0, target_probs.shape[-1])
        res = self._verify(target_probs, draft_probs, drafts, lengths)
        n = res.accepted
        # Features of positions a..a+n; the token after each is d_1..d_n, then the new token.
        nxt = torch.cat([drafts, torch.zeros_like(anchors)[:, None]], dim=1)
        nxt[torch.arange(r, device=device), n] = res.next_token
        # Rows of finished requests (waiting for ``refill``) keep nothing and their anchor: they
        # stay in place, re-verifying the same position until they leave.
        idle = [i for i, item in enumerate(live) if item.finish is not None]
        kept, next_anchors = n + 1, res.next_token
        if idle:
            index = torch.tensor(idle, device=device)
            kept = kept.index_fill(0, index, 0)
            next_anchors = next_anchors.index_copy(0, index, anchors[index])
        self._commit(kept, taps, positions, nxt)  # the rest is overwritten next round

        # Python bookkeeping (host copies once per round, after verification).
        n_l, next_l = n.tolist(), res.next_token.tolist()
        draft_l = drafts.tolist() if g else None
        record = self.record_rounds
        if record:
            len_l, pos_l, flags_l = lengths.tolist(), anchor_pos.tolist(), res.accept_flags.tolist()
            zl = conf_logits.tolist() if conf_logits is not None else None
            cl = conf.tolist() if conf is not None else None
        recs, ended = [], []
        batch = r - len(idle)
        for i, item in enumerate(live):
            if item.finish is not None:
                continue
            emitted = self._emit(item, draft_l[i][: n_l[i]] + [next_l[i]] if g else [next_l[i]])
            if item.finish is not None:
                ended.append(item)
            if record:
                recs.append(
                    RoundRecord(
                        request=item.req.id,
                        round=item.rounds,
                        step=step,
                        batch=batch,
                        anchor_pos=pos_l[i],
                        drafted=gamma,
                        proposed=len_l[i],
                        accepted=n_l[i],
                        emitted=emitted,
                        accept_flags=flags_l[i][: len_l[i]],
                        confidence_logits=None if zl is None else zl[i],
                        confidence=None if cl is None else cl[i],
                    )
                )
            item.rounds += 1
            item.accepted += n_l[i]
        return recs, next_anchors, anchor_pos + kept, r + int(lengths.sum()), ended, batch

    def _calibrated(self, z: Tensor) -> Tensor:
        if self.temperatures is None:
            return torch.sigmoid(z)
        t = self.temperatures.to(z)
        if t.numel() != z.shape[1]:
            raise ValueError(
                f"calibration has {t.numel()} temperatures, the drafter proposes {z.shape[1]} tokens"
            )
        return torch.sigmoid(z / t)

    def _emit(self, item: _Live, new: list[int]) -> int:
        """Append tokens until EOS or the budget; returns how many were kept."""
        kept = 0
        for tok in new:
            item.tokens.append(tok)
            kept += 1
            if tok in self.eos:
                item.finish = "eos"
                break
            if len(item.tokens) >= item.budget:
                item.finish = "length"
                break
        return kept

    def _retire(self, live: list[_Live], anchors, anchor_pos):
        """Drop finished requests from the batch (both caches, anchors) once ``refill`` of them
        (or all) are finished."""
        keep = [i for i, item in enumerate(live) if item.finish is None]
        idle = len(live) - len(keep)
        if idle == 0 or (idle < self.refill and keep):
            return anchors, anchor_pos
        live[:] = [live[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._keep_rows(index)
        return anchors[index], anchor_pos[index]


def _temperatures(calibration, gamma: int | None) -> Tensor | None:
    if calibration is None:
        return None
    temps = getattr(calibration, "temperatures", calibration)
    t = torch.as_tensor(
        list(temps) if not isinstance(temps, Tensor) else temps, dtype=torch.float32
    ).flatten()
    if not bool((t > 0).all()) or not all(math.isfinite(x) for x in t.tolist()):
        raise ValueError(f"calibration temperatures must be finite and positive, got {t.tolist()}")
    if gamma is not None and t.numel() != gamma:
        raise ValueError(
            f"calibration has {t.numel()} temperatures, but the drafter proposes gamma={gamma} tokens"
        )
    return t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# Statistics over round records (RoundRecord objects or the dicts of rounds.jsonl)


def _get(rec, key):
    return rec[key] if isinstance(rec, dict) else getattr(rec, key)


def tau(records: Iterable) -> float | None:
    """Mean accepted + 1 per round (None without rounds)."""
    recs = list(records)
    return sum(_get(r, "accepted") + 1 for r in recs) / len(recs) if recs else None


def conditional_acceptance(records: Iterable, gamma: int) -> list[float | None]:
    """Paper Fig. 2: at draft position k, among rounds that verified position k with positions
    1..k-1 all accepted, the fraction where k was accepted too (None where no round qualifies)."""
    num = [0] * gamma
    den = [0] * gamma
    for r in records:
        n, ell = _get(r, "accepted"), _get(r, "proposed")
        for k in range(min(n + 1, ell, gamma)):  # 0-based k qualifies when n >= k and ell > k
            den[k] += 1
            num[k] += n > k
    return [num[k] / den[k] if den[k] else None for k in range(gamma)]


def calibration_arrays(records: Iterable) -> tuple[Tensor, Tensor, Tensor]:
    """(confidence logits [N, γ], prefix-acceptance labels y_k = 1[n >= k], valid = k <= ℓ) from the
    rounds that carry confidence logits: the rollout input of ``calibration.sts.fit_sts``."""
    z, n, ell = [], [], []
    for r in records:
        logits = _get(r, "confidence_logits")
        if logits is not None:
            z.append(logits)
            n.append(_get(r, "accepted"))
            ell.append(_get(r, "proposed"))
    if not z:
        raise ValueError("no round carries confidence logits (the drafter has no confidence head)")
    logits = torch.tensor(z, dtype=torch.float32)
    k = torch.arange(1, logits.shape[1] + 1)
    labels = (torch.tensor(n)[:, None] >= k).float()
    valid = torch.tensor(ell)[:, None] >= k
    return logits, labels, valid


def threshold_sweep(records: Iterable, thresholds: Sequence[float], calibrated: bool = True) -> list[dict]:
    """Paper Fig. 5, offline: for each threshold t, verify only the longest prefix whose cumulative
    confidence Π c_i stays >= t (what the threshold policy would do) and count its accepted and
    rejected draft tokens. Exact from recorded rounds because acceptance of position k does not
    depend on how many positions follow it; rounds are cut at their recorded ℓ (a fixed-γ run
    records the full block). ``calibrated`` uses σ(z/T) as recorded, else raw σ(z)."""
    recs = [r for r in records if _get(r, "confidence_logits") is not None]
    if not recs:
        raise ValueError("no round carries confidences: the threshold sweep needs a confidence head")
    if calibrated:
        c = torch.tensor([_get(r, "confidence") for r in recs], dtype=torch.float64)
    else:
        c = torch.sigmoid(torch.tensor([_get(r, "confidence_logits") for r in recs], dtype=torch.float64))
    a = torch.cumprod(c, dim=1)
    n = torch.tensor([_get(r, "accepted") for r in recs])
    ell = torch.tensor([_get(r, "proposed") for r in recs])
    rows = []
    for t in thresholds:
        lt = torch.minimum(torch.cumprod((a >= t).long(), dim=1).sum(1), ell)
        acc = torch.minimum(n, lt)
        verified = int(lt.sum())
        rows.append(
            {
                "threshold": float(t),
                "accepted_per_step": float(acc.float().mean()),
                "rejected_per_step": float((lt - acc).float().mean()),
                "tokens_per_step": float(lt.float().mean()),
                "acceptance_rate": float(acc.sum()) / verified if verified else None,
                "tau": float((acc + 1).float().mean()),
                "rounds": len(recs),
            }
        )
    return rows
